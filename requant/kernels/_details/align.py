"""Pairs (token, k) sorted by expert and padded per expert to the M tile, as serving engines align
them: the sizes both ways of aligning share, and the torch way. Up to ALIGN_PAIRS pairs one
program of the prologue launch aligns them (`_kernels.align`, same result); beyond, `align_torch`.
Plain torch, no triton.
"""

from __future__ import annotations

import torch

ALIGN_PAIRS = 2048  # pairs up to which one program aligns them (`_kernels.align`); beyond, torch's sort


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """The most M blocks `pairs` pairs can fill: at most n = min(num_experts, pairs) experts get
    pairs, expert e takes ceil(c_e / block_m) <= (c_e + block_m - 1) / block_m blocks, and the sum is
    a whole number <= (pairs + n (block_m - 1)) / block_m. Reached when every expert but one has one
    pair. (cdiv(pairs, block_m) + n gives a block to spare at one token: 7 for 6 pairs, so 128 of
    each GEMM's 896 programs would find no expert.)"""
    n = min(num_experts, pairs)
    return n + (pairs - n) // block_m


def align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sorted_ids` (pair index = token * top_k + k, or the pair count as padding; each expert's run
    padded to a multiple of block_m) and `block_expert` (expert of each block of block_m rows, -1
    for unused blocks), `max_blocks` of them, in a dozen torch operations."""
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (block_end - blocks)[expert_of] * block_m + rank
    n_blocks = max_blocks(pairs, num_experts, block_m)
    sorted_ids = torch.full((n_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(n_blocks, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert
