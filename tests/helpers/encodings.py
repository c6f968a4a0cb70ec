"""Encodings compared field by field."""

from __future__ import annotations

import torch


def same_encoding(a, b) -> bool:
    """Two int4_search.Encoded alike: packed codes, scale bits, zero points and both energies."""
    zero_points = (a.zero_point is None and b.zero_point is None) or torch.equal(a.zero_point, b.zero_point)
    return (torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.int16), b.scale.view(torch.int16))
            and zero_points and (a.signal_energy, a.error_energy) == (b.signal_energy, b.error_energy))
