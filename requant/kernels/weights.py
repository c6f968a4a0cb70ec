"""Expert weights as the MoE kernel and the torch reference take them: one projection of every
expert of a layer, stacked as stored. Kept apart from the kernel so that the CPU paths (validate's
torch reference, the Marlin emulation) need no triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from requant import formats
from requant.errors import FormatError


@dataclass
class ExpertWeights:
    """One projection of every expert of a layer, stacked on dim 0 exactly as stored."""

    format: str                               # the codec's name: any the kernel reads (kernel_code)
    packed: torch.Tensor                      # uint8 [E, N, K/2] (FP4) | int32 [E, N, K/8] (INT4, q+8)
    scale: torch.Tensor                       # uint8 E4M3 [E, N, K/16] | uint8 E8M0 [E, N, K/32] | bf16 [E, N, K/g]
    global_scale: torch.Tensor | None = None  # float32 [E], formats with a global scale only (NVFP4)
    zero_point: torch.Tensor | None = None    # int32 [E, N/8, K/g] packed along N, INT4 asymmetric only

    def __post_init__(self):
        codec = next((c for c in formats.codecs() if c.name == self.format), None)
        if codec is None or codec.kernel_code is None:
            raise FormatError(f"unknown expert weight format {self.format!r}")
        want = codec.packed_dtype
        if self.packed.dtype != want or self.packed.dim() != 3:
            raise FormatError(f"{self.format} weights must be {want} [E, N, K/{codec.elements_per_word}], "
                              f"got {self.packed.dtype} {list(self.packed.shape)}")
        e, n, _ = self.packed.shape
        if tuple(self.scale.shape[:2]) != (e, n) or self.scale.dim() != 3 or self.k % self.scale.shape[2]:
            raise FormatError(f"scale shape {list(self.scale.shape)} does not fit weights {list(self.packed.shape)}")
        if codec.fixed_group and self.scale.shape[2] * codec.fixed_group != self.k:
            raise FormatError(f"{self.format} needs one scale per {codec.fixed_group} elements, "
                              f"got {self.k // self.scale.shape[2]}")
        if (codec.part(formats.GLOBAL_SCALE) is not None) != (self.global_scale is not None):
            raise FormatError(f"a global scale per expert is required for {self.format} and only for "
                              "formats that store one")
        if self.global_scale is not None and tuple(self.global_scale.shape) != (e,):
            raise FormatError(f"global scale must be [E]={e}, got {list(self.global_scale.shape)}")
        if self.zero_point is not None:
            if codec.part(formats.ZERO_POINT) is None or tuple(self.zero_point.shape) != (e, -(-n // 8), self.scale.shape[2]):
                raise FormatError(f"zero point shape {list(self.zero_point.shape)} does not fit weights")

    @property
    def codec(self) -> formats.Codec:
        return formats.get(self.format)

    @property
    def experts(self) -> int:
        return self.packed.shape[0]

    @property
    def n(self) -> int:
        return self.packed.shape[1]

    @property
    def k(self) -> int:
        return self.packed.shape[2] * self.codec.elements_per_word

    @property
    def group(self) -> int:
        codec = self.codec
        return codec.params_from_shapes({codec.weight.suffix: tuple(self.packed.shape),
                                         codec.part(formats.SCALE).suffix: tuple(self.scale.shape)}).group_size

    def to(self, device) -> "ExpertWeights":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ExpertWeights(self.format, move(self.packed), move(self.scale), move(self.global_scale),
                             move(self.zero_point))
