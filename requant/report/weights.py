"""Compare two decodings of one routed-expert projection (report).

Statistics are kept as sums (float64) so per-projection numbers compose exactly into per-layer
and overall numbers, whatever order experts are read in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from requant.errors import FormatError

# |error| histogram: fixed log10 bins so histograms from separate experts simply add up.
HIST_LOG10_MIN, HIST_LOG10_MAX, HIST_BINS = -12.0, 1.0, 52


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
    """sum(x * y): float32 per row (BLAS), float64 across rows; accurate to ~1e-7 relative."""
    return float(torch.einsum("ij,ij->i", x, y).double().sum())


def exactness(a: torch.Tensor, b: torch.Tensor, block: int) -> tuple[int, int, int]:
    """(blocks, blocks of b equal to a's, non-finite values of b): all that verify --deep counts,
    in two passes."""
    if a.shape != b.shape:
        raise FormatError(f"decoded shapes differ: {list(a.shape)} vs {list(b.shape)}")
    rows, k = a.shape
    exact = (a == b).view(rows, k // block, block).all(dim=-1)
    return exact.numel(), int(exact.sum()), int((~torch.isfinite(b)).sum())


def compare(a: torch.Tensor, b: torch.Tensor, block: int) -> ErrorSums:
    """Statistics of b against reference a (both float32 [out, in]); exactness per K block.

    Written for few passes over memory: the CPU time of a report is these passes.
    """
    if a.shape != b.shape:
        raise FormatError(f"decoded shapes differ: {list(a.shape)} vs {list(b.shape)}")
    err = b - a
    abs_err = err.abs()
    max_abs = float(abs_err.max()) if abs_err.numel() else 0.0
    nonfinite = 0
    if not math.isfinite(max_abs):   # NaN/inf propagate into the max: only then pay for a mask
        finite = torch.isfinite(b)
        nonfinite = int(finite.numel() - finite.sum())
        b = torch.where(finite, b, torch.zeros_like(b))
        err = b - a
        abs_err = err.abs()
        max_abs = float(abs_err.max())
    rows, k = a.shape
    zero = abs_err == 0
    exact = zero.view(rows, k // block, block).all(dim=-1)
    zeros = int(zero.sum())
    sum_a2, sum_b2, sum_e2 = _dot(a, a), _dot(b, b), _dot(err, err)
    # sum(e * (a + b)) = sum(b^2 - a^2) without the cancellation: keeps 1 - cosine accurate
    sum_e_apb = _dot(err, a + b) if sum_e2 > 0 else 0.0
    # Histogram bin of log10|e| for every element, in place; exact zeros (log10 = -inf) land in
    # bin 0 and are taken out again (they are counted apart).
    bins = abs_err.log10_().clamp_(HIST_LOG10_MIN, HIST_LOG10_MAX - 1e-9).sub_(HIST_LOG10_MIN)
    bins = bins.mul_(HIST_BINS / (HIST_LOG10_MAX - HIST_LOG10_MIN)).to(torch.int64).view(-1)
    hist = torch.bincount(bins, minlength=HIST_BINS).tolist() if bins.numel() else [0] * HIST_BINS
    hist[0] -= zeros
    return ErrorSums(
        n=a.numel(), blocks=exact.numel(), exact_blocks=int(exact.sum()),
        sum_a2=sum_a2, sum_b2=sum_b2, sum_e2=sum_e2, sum_e_apb=sum_e_apb,
        max_abs=max_abs, nonfinite=nonfinite, hist=hist, zero_error=zeros,
    )
