"""Compare two decodings of one routed-expert projection (report).

Statistics are kept as sums (float64) so per-projection numbers compose exactly into per-layer
and overall numbers, whatever order experts are read in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from requant.errors import FormatError

# |error| histogram: one bin per power of two, [2^i, 2^(i+1)), which is the float's exponent field:
# read off the bits exactly, with no logarithm per element. Values beyond the ends are clamped into
# the end bins; histograms from separate experts simply add up.
HIST_MIN_EXPONENT, HIST_MAX_EXPONENT = -40, 4      # 2^-40 ~ 9.1e-13 .. 2^4 = 16
HIST_BINS = HIST_MAX_EXPONENT - HIST_MIN_EXPONENT
_F32_BIAS = 127
# Rows compared per step: a chunk's float32 values (~1 MiB) stay in a core's L2 cache across the
# dozen passes below, which memory bandwidth would otherwise pay for.
_CHUNK_ELEMENTS = 1 << 18


def hist_edges_log10() -> list[float]:
    return [(HIST_MIN_EXPONENT + i) * math.log10(2) for i in range(HIST_BINS + 1)]


@dataclass
class ErrorSums:
    """Sums over compared weights: reference a, candidate b, error e = b - a."""

    n: int = 0
    blocks: int = 0
    exact_blocks: int = 0
    sum_a2: float = 0.0
    sum_b2: float = 0.0
    sum_e_apb: float = 0.0
    sum_e2: float = 0.0
    max_abs: float = 0.0
    nonfinite: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * HIST_BINS)
    zero_error: int = 0   # elements whose error is exactly zero (outside the log histogram)

    def add(self, other: "ErrorSums") -> None:
        self.n += other.n
        self.blocks += other.blocks
        self.exact_blocks += other.exact_blocks
        self.sum_a2 += other.sum_a2
        self.sum_b2 += other.sum_b2
        self.sum_e_apb += other.sum_e_apb
        self.sum_e2 += other.sum_e2
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nonfinite += other.nonfinite
        self.zero_error += other.zero_error
        self.hist = [x + y for x, y in zip(self.hist, other.hist)]

    def metrics(self) -> dict:
        """The derived numbers; SQNR is null when the error is exactly zero (infinite SQNR)."""
        na, nb = math.sqrt(self.sum_a2), math.sqrt(self.sum_b2)
        # 1 - cos = (|e|^2 - (|a| - |b|)^2) / (2 |a| |b|), with |a| - |b| = -sum(e (a + b)) / (|a| + |b|)
        diff = -self.sum_e_apb / (na + nb) if na + nb > 0 else 0.0
        one_minus_cos = max(0.0, self.sum_e2 - diff * diff) / (2 * na * nb) if na * nb > 0 else None
        return {
            "elements": self.n,
            "blocks": self.blocks,
            "exact_blocks": self.exact_blocks,
            "exact_block_fraction": self.exact_blocks / self.blocks if self.blocks else None,
            "sqnr_db": 10 * math.log10(self.sum_a2 / self.sum_e2) if self.sum_e2 > 0 and self.sum_a2 > 0 else None,
            "rel_rmse": math.sqrt(self.sum_e2 / self.sum_a2) if self.sum_a2 > 0 else None,
            "max_abs_error": self.max_abs,
            "cosine": 1 - one_minus_cos if one_minus_cos is not None else None,
            "nonfinite": self.nonfinite,
        }


def _dot(x: torch.Tensor, y: torch.Tensor) -> float:
    """sum(x * y) over a chunk: one BLAS dot (float32, its SIMD lanes summing apart), 3.5x faster
    than a product pass and a sum; chunks add up in float64. On a full-size W4A16 projection's
    2^18-element chunks, sum(a^2) came within 2e-8 of the float64 sum and sum(e^2) within 5e-5."""
    return float(torch.dot(x.reshape(-1), y.reshape(-1)))


def _all_per_block(mask: torch.Tensor, block: int) -> torch.Tensor:
    """[rows, K] bool -> [rows, K/block]: whether each block is all True."""
    if block % 8 == 0 and mask.is_contiguous():
        # eight bools per int64 word: a block is all True when its words are all 0x0101...01
        words = mask.view(torch.uint8).view(torch.int64).view(mask.shape[0], -1, block // 8)
        return (words == 0x0101010101010101).all(dim=-1)
    return mask.view(mask.shape[0], -1, block).all(dim=-1)


def chunk_rows(k: int, device) -> int:
    """Rows of K elements compared per step on `device` (a GPU takes a projection whole)."""
    return 1 << 62 if torch.device(device).type != "cpu" else max(1, _CHUNK_ELEMENTS // max(k, 1))


def decoded_row_chunks(ca, ta: dict, cb, tb: dict, decode_a: Callable, decode_b: Callable):
    """(a rows, b rows) of two stored projections (codecs ca, cb; parts ta, tb), decoded a chunk
    of rows at a time, so that each chunk is compared while it is still in cache; decoded whole
    (then compared by chunks) where a codec's parts are not laid out by rows. decode_a/decode_b
    take (parts, out): every chunk is decoded into the same two buffers, so a chunk is only valid
    until the next one is asked for (and its consumer may overwrite it: `compare_chunks`)."""
    weight, other = ta[ca.weight.suffix], tb[cb.weight.suffix]
    rows, k = weight.shape[0], weight.shape[-1] * ca.elements_per_word
    other_shape = [other.shape[0], other.shape[-1] * cb.elements_per_word]
    if other_shape != [rows, k]:
        raise FormatError(f"decoded shapes differ: {[rows, k]} vs {other_shape}")
    step = chunk_rows(k, weight.device)
    if step >= rows or ca.rows(ta, 0, 1) is None or cb.rows(tb, 0, 1) is None:
        a, b = decode_a(ta, None), decode_b(tb, None)
        for r in range(0, rows, step):
            yield a[r:r + step], b[r:r + step]
        return
    buffers = torch.empty(2, step, k, dtype=torch.float32, device=weight.device)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        yield decode_a(ca.rows(ta, r, r + n), buffers[0, :n]), decode_b(cb.rows(tb, r, r + n), buffers[1, :n])


def identical(n: int, blocks: int, energy: float) -> ErrorSums:
    """The sums of a candidate equal to its reference everywhere (sum(a^2) = energy)."""
    return ErrorSums(n=n, blocks=blocks, exact_blocks=blocks, sum_a2=energy, sum_b2=energy, zero_error=n)


def exactness(chunks, block: int) -> tuple[int, int, int]:
    """(blocks, blocks of b equal to a's, non-finite values of b) over (a, b) row chunks: all that
    verify --deep counts."""
    blocks = exact = nonfinite = 0
    for a_, b_ in chunks:
        same = _all_per_block(a_ == b_, block)
        blocks += same.numel()
        exact += int(same.sum())
        nonfinite += int((~torch.isfinite(b_)).sum())
    return blocks, exact, nonfinite


def compare_chunks(chunks, block: int) -> ErrorSums:
    """Statistics of b against reference a over their (a, b) row chunks (float32 [rows, in]);
    exactness per K block. b is overwritten: it becomes the error, in place (pass copies of
    tensors still needed).

    The CPU time of a report is these passes: a chunk stays in cache across them, and each pass
    works in place or only reads (a pass writing a third buffer ran 3x slower: the chunk's buffers
    no longer fit a core's L2).
    """
    sums = ErrorSums()
    exponents = None
    scratch = np.empty(0, dtype=np.uint8)   # the chunk's exponents, sized at the first (largest) chunk
    for a_, err in chunks:
        if exponents is None:
            exponents = _ExponentCounts(a_.device)
        err.sub_(a_)
        sum_e2 = _dot(err, err)
        if not math.isfinite(sum_e2):   # NaN/inf in b: only then pay for a mask
            finite = torch.isfinite(err)   # a is a reference decoding: finite
            sums.nonfinite += int(finite.numel() - finite.sum())
            torch.where(finite, err, a_.neg(), out=err)   # as if b were 0 there
            sum_e2 = _dot(err, err)
        sum_a2, sum_ea = _dot(a_, a_), _dot(err, a_)
        sums.sum_a2 += sum_a2
        sums.sum_e2 += sum_e2
        # b = a + e: sum(b^2) = sum(a^2) + 2 sum(e a) + sum(e^2), and sum(e (a + b)) = 2 sum(e a) +
        # sum(e^2) is sum(b^2 - a^2) without the cancellation, which keeps 1 - cosine accurate
        sums.sum_e_apb += 2 * sum_ea + sum_e2
        sums.sum_b2 += sum_a2 + 2 * sum_ea + sum_e2
        if not err.numel():
            continue
        # |e| >= 0 orders as its bits do: integer passes on them (a count of non-zero floats costs 4x)
        bits = err.abs_().view(torch.int32)
        block_max = bits.view(bits.shape[0], -1, block).amax(-1)   # 0: the block is exact
        largest = float(block_max.max().view(torch.float32))
        sums.max_abs = max(sums.max_abs, largest)
        sums.blocks += block_max.numel()
        sums.exact_blocks += int((block_max == 0).sum())
        sums.n += err.numel()
        if bits.device.type == "cpu":   # numpy's count and shift into bytes: 2x and 3x torch's on the CPU
            flat = bits.contiguous().numpy().reshape(-1)
            zero = flat.size - int(np.count_nonzero(flat))
            if scratch.size < flat.size:
                scratch = np.empty(flat.size, dtype=np.uint8)
            exponent = torch.from_numpy(np.right_shift(flat, 23, out=scratch[:flat.size], casting="unsafe"))
        else:
            zero = err.numel() - int(torch.count_nonzero(bits))
            exponent = bits.bitwise_right_shift(23).to(torch.uint8).view(-1)
        sums.zero_error += zero
        exponents.zeros -= zero   # exact zeros are counted apart
        exponents.add(exponent, pairs=largest < 2.0)
    if exponents is not None:
        sums.hist = fold_exponents(exponents.total())
    return sums


def fold_exponents(counts: list[int]) -> list[int]:
    """The histogram's bins from counts per biased float32 exponent of |e| (exact zeros left out)."""
    low, high = HIST_MIN_EXPONENT + _F32_BIAS, HIST_MAX_EXPONENT + _F32_BIAS - 1
    return [sum(counts[:low + 1])] + counts[low + 1:high] + [sum(counts[high:])]


class _ExponentCounts:
    """How often each biased exponent (uint8, 0 for zeros and subnormals) occurs, over many chunks.

    A bincount is a scalar loop, the largest pass of a comparison: with `pairs` (every exponent
    below 128, |e| < 2) two neighbours are counted as one int16, half the loop. Those [2^15] counts
    accumulate as they are and are folded to 256 once, in `total`: their [odd, even] counts add up
    both ways."""

    def __init__(self, device):
        self.single = torch.zeros(256, dtype=torch.int64, device=device)
        self.pairs: torch.Tensor | None = None
        self.zeros = 0   # added to exponent 0's count

    def add(self, exponent: torch.Tensor, pairs: bool) -> None:
        if not pairs or exponent.numel() % 2:
            self.single += torch.bincount(exponent, minlength=256)
            return
        counts = torch.bincount(exponent.view(torch.int16), minlength=1 << 15)
        self.pairs = counts if self.pairs is None else self.pairs.add_(counts)

    def total(self) -> list[int]:
        counts = self.single.clone()
        if self.pairs is not None:
            both = self.pairs.view(128, 256)
            counts += both.sum(0)
            counts[:128] += both.sum(1)
        counts[0] += self.zeros
        return counts.tolist()
