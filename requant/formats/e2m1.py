"""E2M1 (FP4) element grid shared by MXFP4 and NVFP4.

A nibble is sign (bit 3) and a 3-bit magnitude index into MAGNITUDES. Two nibbles pack into one
byte along K: the low nibble holds the even element.
"""

from __future__ import annotations

import numpy as np
import torch

from requant.formats import CodeTables, Nibbles, byte_pairs

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MAX = 6.0
# Midpoints between neighbouring magnitudes; index i lies between magnitude i and i+1.
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def signed_values(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16 nibble values, indexed by the nibble."""
    mags = torch.tensor(MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


_PAIRS = torch.stack([signed_values()[torch.arange(256) & 0x0F], signed_values()[torch.arange(256) >> 4]], dim=1)


# Sixteen packed nibbles as one uint64: their magnitude bits and their sign bits. Adding
# MAGNITUDE_BITS to a word's magnitude bits carries into a nibble's sign bit exactly when its
# magnitude is non-zero, and never into the next nibble.
MAGNITUDE_BITS = np.uint64(0x7777777777777777)
SIGN_BITS = np.uint64(0x8888888888888888)


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two packed arrays (uint8, same shape) hold the same values: nibble for nibble equal,
    or both zero (nibble 0x8 is -0). Eight bytes at a time where the size allows."""
    width = np.uint64 if a.size % 8 == 0 else np.uint8
    return not differing_words(a.reshape(-1).view(width), b.reshape(-1).view(width)).any()


def differing_words(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per word of packed nibbles (any unsigned width): non-zero where the values differ. A nibble's
    magnitude bits, and its sign bit where either magnitude is non-zero, must agree."""
    mags, signs = (x.dtype.type(int(m) >> (64 - 8 * x.dtype.itemsize)) for m in (MAGNITUDE_BITS, SIGN_BITS))
    must = x | y
    must &= mags
    must += mags      # bit 3 of a nibble set where its magnitude (in either) is non-zero, no carry out
    must &= signs
    must |= mags
    differ = x ^ y
    differ &= must
    return differ


TABLES = CodeTables(
    same_values=same_values,
    squares=np.add.outer(*[(_PAIRS.numpy() ** 2).sum(1)] * 2).reshape(-1).astype(np.float32),
)


def nibbles(packed: torch.Tensor, factors: torch.Tensor, block: int) -> Nibbles:
    """A packed E2M1 projection with one float32 factor per block, as Nibbles."""
    rows = factors.shape[0]
    return Nibbles(packed.contiguous().view(torch.uint8).view(rows, -1), factors, None, signed_values(), block)


def decode_packed(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 values [..., K] (into `out` when given): one table lookup per
    byte yields both elements."""
    return byte_pairs(_PAIRS, packed, out)


def round_to_nibbles(x: np.ndarray) -> np.ndarray:
    """Round float32 values onto the E2M1 grid: round-half-to-even, saturating at 6.

    The sign bit is taken from `x < 0`, so a negative value that rounds to zero gives -0 (0x8) and
    -0.0 gives +0: the convention of NVIDIA's quantizer, which the NVFP4 bytes must reproduce.
    """
    a = np.abs(x)
    index = np.searchsorted(_MIDPOINTS, a, side="left")  # midpoints strictly below a
    # A value exactly on a midpoint went to the lower neighbour; ties go to the even index.
    on_midpoint = _MIDPOINTS[np.minimum(index, len(_MIDPOINTS) - 1)] == a
    index += on_midpoint & (index % 2 == 1)
    return index.astype(np.uint8) | ((x < 0).astype(np.uint8) << 3)
