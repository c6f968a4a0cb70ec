"""Expert weights as the MoE kernel and the torch reference take them: one projection of every
expert of a layer, stacked as stored. Kept apart from the kernel so that the CPU paths (validate's
torch reference, the Marlin emulation) need no triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from requant.errors import FormatError

FORMATS = ("nvfp4", "mxfp4", "int4")
NIBBLES_PER_WORD = {"nvfp4": 2, "mxfp4": 2, "int4": 8}
FIXED_GROUP = {"nvfp4": 16, "mxfp4": 32}


@dataclass
class ExpertWeights:
    """One projection of every expert of a layer, stacked on dim 0 exactly as stored."""

    format: str                               # "nvfp4" | "mxfp4" | "int4"
    packed: torch.Tensor                      # uint8 [E, N, K/2] (FP4) | int32 [E, N, K/8] (INT4, q+8)
    scale: torch.Tensor                       # uint8 E4M3 [E, N, K/16] | uint8 E8M0 [E, N, K/32] | bf16 [E, N, K/g]
    global_scale: torch.Tensor | None = None  # float32 [E], NVFP4 only
    zero_point: torch.Tensor | None = None    # int32 [E, N/8, K/g] packed along N, INT4 asymmetric only

    def __post_init__(self):
        if self.format not in FORMATS:
            raise FormatError(f"unknown expert weight format {self.format!r}")
        int4 = self.format == "int4"
        want = torch.int32 if int4 else torch.uint8
        if self.packed.dtype != want or self.packed.dim() != 3:
            raise FormatError(f"{self.format} weights must be {want} [E, N, K/{NIBBLES_PER_WORD[self.format]}], "
                              f"got {self.packed.dtype} {list(self.packed.shape)}")
        e, n, _ = self.packed.shape
        if tuple(self.scale.shape[:2]) != (e, n) or self.scale.dim() != 3 or self.k % self.scale.shape[2]:
            raise FormatError(f"scale shape {list(self.scale.shape)} does not fit weights {list(self.packed.shape)}")
        if self.format in FIXED_GROUP and self.group != FIXED_GROUP[self.format]:
            raise FormatError(f"{self.format} needs one scale per {FIXED_GROUP[self.format]} elements, got {self.group}")
        if (self.format == "nvfp4") != (self.global_scale is not None):
            raise FormatError("a global scale per expert is required for nvfp4 and only for it")
        if self.global_scale is not None and tuple(self.global_scale.shape) != (e,):
            raise FormatError(f"global scale must be [E]={e}, got {list(self.global_scale.shape)}")
        if self.zero_point is not None:
            if not int4 or tuple(self.zero_point.shape) != (e, -(-n // 8), self.scale.shape[2]):
                raise FormatError(f"zero point shape {list(self.zero_point.shape)} does not fit weights")

    @property
    def experts(self) -> int:
        return self.packed.shape[0]

    @property
    def n(self) -> int:
        return self.packed.shape[1]

    @property
    def k(self) -> int:
        return self.packed.shape[2] * NIBBLES_PER_WORD[self.format]

    @property
    def group(self) -> int:
        return self.k // self.scale.shape[2]

    def to(self, device) -> "ExpertWeights":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ExpertWeights(self.format, move(self.packed), move(self.scale), move(self.global_scale),
                             move(self.zero_point))
