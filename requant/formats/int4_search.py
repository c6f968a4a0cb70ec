"""The data-free INT4 encoder from MXFP4: per group of K elements it searches the stored BF16 scale
(and, asymmetric, the zero point) that minimises the squared error against the MXFP4 source. The
stored layout it writes is int4's; on a CPU the search runs as one C pass where it is built
(int4_search_c), else as the torch passes below.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from dataclasses import dataclass

import torch

from requant.errors import FormatError
from requant.formats import e2m1, int4_search_c, mxfp4
from requant.formats.int4 import QMAX, QMIN, check_shape, pack_zero_point


@dataclass
class Encoded:
    packed: torch.Tensor              # int32 [out, K/8]
    scale: torch.Tensor               # bfloat16 [out, K/group]
    zero_point: torch.Tensor | None   # int32 [out/8, K/group], asymmetric only
    signal_energy: float              # sum of squared source values
    error_energy: float               # sum of squared error of the decoded weights vs the source


# the search ---------------------------------------------------------------------------------
# Every nonzero MXFP4 |value| m * 2^e is 2^k or 1.5 * 2^k. Normalised by 2^R, R the exponent of
# the group's largest |value|, the group's top is exactly 1 or 1.5 and every element is one of the
# signed levels +-1.5, +-1, +-0.75, +-0.5, ... (_LEVELS). Levels below half the smallest candidate
# scale round to 0 under every candidate, so their error is their energy whatever is chosen. A
# group is thus fully described by its counts over at most 2 * n_bins signed levels, and its
# squared error under a candidate scale s' * 2^R (and zero point z) is counts . (per-level error
# at s', z): one matrix product covers many groups and candidates. The candidates are BF16 values
# s': 2^R being a power of two, s' * 2^R is exactly the stored BF16 scale. Codes are
# round-to-nearest, optimal once the scale is fixed; they come from byte tables, so the encoder
# never materialises float weights.
#
# The search is exact integer arithmetic: every candidate s' is a BF16 value >= 2^-5 (a multiple
# of 2^-12) and every binned level a multiple of 2^-6, so each per-level error ((q - z) s' - x)^2
# is a whole number of 2^-24 units and a group's error (at most 128 such terms) a whole number
# below 2^33. Products run in float64 on those integers, exact in any summation order: BLAS on the
# CPU and cuBLAS on a GPU pick the same candidates. Ties go to the lowest candidate index, made
# explicit (errors are scaled by _TIE and one more row adds the candidate's index), so no kernel's
# argmin convention matters. Each level's error is stored less its energy (x^2, what the level
# costs when it decodes to 0): the same shift for every candidate of a group, so the same pick,
# and the minimum then carries both the candidate and the group's error beyond its binned
# energy, which is all the energy sums need (_search).
#
# The exhaustive search (every BF16 s' in range, times every zero point) is exact but costs
# [groups x candidates x levels]; it stays as the test oracle. The default search is coarse to
# fine: every _COARSE-th scale (with every zero point), then every BF16 scale within _RADIUS of
# each group's winner, with the winner's zero point and its two neighbours.
_SCALE_RANGE = {"sym": (0.1, 0.5), "asym": (0.05, 0.5)}  # s' for a normalised max of 1 or 1.5
_ZERO_POINTS = range(-3, 4)        # asym offsets searched; E2M1 is symmetric, the best is near 0
_D_MAX = 8                         # blocks 2^-8 below the group's top round to 0 under any s'
_LEVELS = torch.tensor([(1.5 if i % 2 == 0 else 1.0) * 2.0 ** -(i // 2) for i in range(2 * _D_MAX)])
_UNIT = 2.0**-24                   # errors and energies are whole numbers of these
_TIE = 1 << 12                     # above any candidate index
# Coarse-to-fine, per scheme: BF16 steps between coarse scales, then the radius (in BF16 steps)
# searched around each group's coarse winner. Chosen on DeepSeek-V4-size synthetic experts: vs the
# exhaustive search they lose about 0.001 dB (sym) and 0.03 dB (asym); benchmarks/bench_w4a16.py.
_COARSE = {"sym": 8, "asym": 16}
_RADIUS = {"sym": 4, "asym": 8}
_Z_RADIUS = 1                      # asym: the winner's zero point and its neighbours
# Groups per matrix product: on a CPU few enough that a chunk's [groups, candidates] errors stay in
# cache, on a GPU many, for few launches (a chunk's gathered tables stay around 100 MiB per scheme
# option).
_CHUNK_GROUPS = {"cpu": 1 << 13, "cuda": 1 << 16}
_CPU_PIECE_BLOCKS = 1 << 16        # MXFP4 blocks per _search call on a CPU (_search_on_cpu, torch passes)
# Group exponents R lie in [-128, 129] (E8M0 exponents -127 .. 127, tops up to 6 * 2^e): per-R
# bins, offset to start at 0.
_R_OFFSET, _R_BINS = 128, 258
# A block's counts are kept as one int64 word per sign, byte lane j counting magnitude 6, 4, 3, 2,
# 1.5, 1, 0.75 (never an E2M1 value) or 0.5 for j = 0 .. 7: half-octave levels 5 - j, in order, so
# the block's counts at its group's levels are that word shifted by whole lanes (_window). Per
# pair of source bytes (4 codes), the words of its positive codes and of its negative ones (+-0
# are not counted): a block's are the sums over its 8 pairs, lanes <= 32.
_LANE_OF = {7: 0, 6: 1, 5: 2, 4: 3, 3: 4, 2: 5, 1: 7}      # E2M1 magnitude code (6 .. 0.5) -> lane
_CODE_LANES = torch.tensor([[1 << 8 * _LANE_OF[c & 7] if c & 7 and c >> 3 == sign else 0 for c in range(16)]
                            for sign in (0, 1)])                                  # [sign, code]
_PAIR_LANES = sum(_CODE_LANES[:, (torch.arange(1 << 16) >> 4 * j) & 15] for j in range(4))   # [sign, pair]
_LANE_SQUARED_X4 = torch.tensor([144, 64, 36, 16, 9, 4, 0, 1], dtype=torch.float64)   # 4 * (6 .. 0.5)^2
_EMPTY = -(10**6)                  # the top level of an all-zero block: far below anything


def _bf16_between(lo: float, hi: float) -> torch.Tensor:
    """Every positive BF16 value in [lo, hi], as float32."""
    values = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return values[(values >= lo) & (values <= hi)]


class _Tables:
    """Error per (signed level, candidate) and output byte per (block shift, candidate, source
    byte), on one device. Candidate c is scale s[c % n_s] with zero point z[c // n_s]."""

    def __init__(self, scheme: str, device: torch.device):
        self.scheme, self.device = scheme, device
        s = _bf16_between(*_SCALE_RANGE[scheme])
        zs = list(_ZERO_POINTS) if scheme == "asym" else [0]
        self.n_s, self.n_z = len(s), len(zs)
        self.z = torch.tensor(zs, dtype=torch.float32).repeat_interleave(self.n_s)
        self.s = s.repeat(self.n_z)
        n = len(self.s)
        assert n < _TIE and float(s[0]) >= 2.0**-5
        assert e2m1.MAX * 2.0**-_D_MAX < float(s[0]) / 2   # deeper blocks are all "tiny"
        self.n_bins = int((_LEVELS >= s[0] / 2).sum())
        x = torch.cat([_LEVELS[: self.n_bins], -_LEVELS[: self.n_bins]])[:, None]
        q = torch.clamp(torch.round(x / self.s) + self.z, QMIN, QMAX)
        error = ((q - self.z) * self.s - x).double().square() / _UNIT               # [2 bins, C]
        assert torch.equal(error, error.round()) and float(error.max()) * 128 * _TIE < 2.0**53
        # Levels that never clamp cost the same for +v and -v: one row counts both signs, which
        # shrinks every product below. Only the top `split` levels can clamp: rows are levels
        # 0 .. n_bins-1 (the first `split` of the positive codes, the rest of both signs), then
        # levels 0 .. split-1 of the negative codes (the lanes _search reads them from).
        merged = (error[: self.n_bins] == error[self.n_bins:]).all(1)
        self.split = int((~merged).sum())
        assert not merged[: self.split].any() and self.split < 8 and self.n_bins <= 16   # _search's lanes
        kept = torch.cat([torch.ones(self.n_bins, dtype=torch.bool), ~merged])
        self.rows = self.n_bins + self.split
        # Each level's error less its energy (see the section comment); the last row the candidate
        # index, matched by the counts' last column, all ones.
        excess = error[kept] - x.double().square()[kept] / _UNIT
        assert float(excess.abs().max()) * 128 * _TIE < 2.0**53
        table = torch.cat([excess * _TIE, torch.arange(n, dtype=torch.float64)[None]])
        self.error = table.to(device)                                               # [rows + 1, C]
        self.error_t = self.error.t().contiguous()                                  # [C, rows + 1]
        d = torch.arange(-1, _D_MAX + 1, dtype=torch.float32)
        v = e2m1.signed_values()[None, :, None] * torch.exp2(-d)[:, None, None]      # [d, 16, 1]
        nibble = (torch.clamp(torch.round(v / self.s) + self.z, QMIN, QMAX) - QMIN).to(torch.uint8)
        nibble = nibble.transpose(1, 2)                                              # [d, C, 16]
        byte = torch.arange(256)
        self.bytes = (nibble[..., byte & 15] | (nibble[..., byte >> 4] << 4)).reshape(-1).to(device)
        self.zero_index = int((self.z == 0).nonzero()[0])
        self.s_dev, self.z_dev = self.s.to(device), self.z.to(device)
        self.pair_lanes = _PAIR_LANES.to(device)
        self.lane_squared = _LANE_SQUARED_X4.to(device)
        coarse = torch.arange(0, self.n_s, _COARSE[scheme]) + self.n_s * torch.arange(self.n_z)[:, None]
        self.coarse = coarse.flatten().to(device)

    def exhaustive(self, counts: torch.Tensor) -> torch.Tensor:
        return self._best(counts, torch.arange(len(self.s), device=self.device))

    def coarse_to_fine(self, counts: torch.Tensor) -> torch.Tensor:
        """Per group: excess error * _TIE + candidate of the best candidate (see the section comment)."""
        pick = (self._best(counts, self.coarse) % _TIE).long()
        return self._best_each(counts, pick) if counts.is_cuda else self._best_by_centre(counts, pick)

    @functools.cached_property
    def native(self) -> int4_search_c.Prepared:
        """These tables laid out for the C pass (CPU tables only)."""
        return int4_search_c.Prepared(self, radius=_RADIUS[self.scheme], z_radius=_Z_RADIUS, tie=_TIE,
                                    code_lanes=_CODE_LANES, d_max=_D_MAX, empty=_EMPTY, e8m0_bias=mxfp4.E8M0_BIAS,
                                    r_offset=_R_OFFSET)

    def _neighbours(self, centres: torch.Tensor) -> torch.Tensor:
        """[n, options]: each centre's scale +- the radius (zero point +-1 for asym), clipped to the
        edges (a repeated candidate is harmless)."""
        radius = _RADIUS[self.scheme]
        ds = torch.arange(-radius, radius + 1, device=self.device)
        dz = (torch.arange(-_Z_RADIUS, _Z_RADIUS + 1, device=self.device) if self.n_z > 1
              else torch.zeros(1, dtype=torch.long, device=self.device))
        s = (centres % self.n_s)[:, None, None] + ds[None, None, :]
        z = (centres // self.n_s)[:, None, None] + dz[None, :, None]
        return (z.clamp(0, self.n_z - 1) * self.n_s + s.clamp(0, self.n_s - 1)).flatten(1)

    def _best(self, counts, options):
        """Best among the same `options` for every group (one matrix product per chunk)."""
        table = self.error[:, options].t()
        return torch.cat([(table @ counts[part].double().t()).amin(0) for part in _chunks(counts)])

    def _best_by_centre(self, counts, pick):
        """Best among each group's own options, one matrix product per distinct coarse winner
        (groups sorted by it, so each winner's groups are one slice): the CPU's way."""
        per_pick = torch.bincount(pick, minlength=len(self.s))
        centres = per_pick.nonzero().squeeze(1)
        order = torch.sort(pick.to(torch.int16)).indices
        cells = counts.index_select(0, order).split(per_pick[centres].tolist())
        keys = torch.empty(len(pick), dtype=torch.float64)
        # [options, groups] products: the minimum then runs along contiguous rows.
        keys[order] = torch.cat([(self.error_t[o] @ cell.double().t()).amin(0)
                                 for cell, o in zip(cells, self._neighbours(centres))])
        return keys

    def _best_each(self, counts, pick):
        """The same result as _best_by_centre, gathering each group's table columns: a few large
        kernels rather than one small product per winner (the GPU's way)."""
        return torch.cat([torch.bmm(self.error_t[self._neighbours(pick[part])],
                                    counts[part].double()[:, :, None]).squeeze(2).amin(1)
                          for part in _chunks(counts)])


def _chunks(counts: torch.Tensor) -> list[slice]:
    """Slices of `counts`' groups, one per matrix product (see _CHUNK_GROUPS)."""
    n = _CHUNK_GROUPS[counts.device.type]
    return [slice(g0, g0 + n) for g0 in range(0, len(counts), n)]


def _per_block(per_group: torch.Tensor, blocks_per_group: int) -> torch.Tensor:
    """Each group's value repeated for each of its blocks (no output size for a GPU to read back)."""
    return per_group[:, None].expand(-1, blocks_per_group).reshape(-1)


_TABLES: dict[tuple[str, torch.device], _Tables] = {}


def ready_cpu(scheme: str) -> str:
    """Build the CPU encoder's tables and C pass for `scheme` now; say which encoder runs
    (int4_search_c.status)."""
    _tables(scheme, torch.device("cpu")).native
    return int4_search_c.status()


def _tables(scheme: str, device: torch.device) -> _Tables:
    key = (scheme, device)
    if key not in _TABLES:
        tables = _Tables(scheme, device)
        if device.type == "cuda":   # built on this thread's stream, used on every thread's
            torch.cuda.current_stream(device).synchronize()
        _TABLES[key] = tables
    return _TABLES[key]


def _block_lanes(blocks: torch.Tensor, tables: _Tables) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [n, 16] packed MXFP4 blocks -> int64 [n] lane words (see _LANE_OF) of the positive
    codes and of the negative ones."""
    n = len(blocks)
    pairs = blocks.view(torch.uint16).int().view(-1)                 # int32 indices: the fast gathers
    plus, minus = (table.index_select(0, pairs).view(n, 8).sum(1) for table in tables.pair_lanes)
    return plus, minus


def _window(words: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Lane words moved so that lane `first` (per word, any integer) lands in lane 0: the lanes of
    a 64-bit window that starts at lane `first`, zero where none. Every shift stays below 64 bits:
    no device's convention for larger ones matters."""
    moved = (words >> 8 * first.clamp(0, 7)) << 8 * (-first).clamp(0, 7)
    return torch.where(first.abs() < 8, moved, 0)


def _exact_sum(by_exponent: torch.Tensor, offset: int, scale: float) -> float:
    """sum_i by_exponent[i] * 2^(2 (i - offset)) * scale, correctly rounded: the same float
    whatever device summed the (whole-number) bins."""
    return math.fsum(c * 2.0 ** (2 * (i - offset)) * scale for i, c in enumerate(by_exponent.tolist()) if c)


def encode_mxfp4(weight: torch.Tensor, scale: torch.Tensor, group_size: int = 128, scheme: str = "sym",
                 exhaustive: bool = False) -> Encoded:
    """Quantize one MXFP4 tensor (packed uint8 [out, K/2], E8M0 [out, K/32]) to INT4 groups along K,
    on the inputs' device (see encode_many)."""
    return encode_many({"": (weight, scale)}, group_size, scheme, weight.device, exhaustive)[""]


def encode_many(sources: dict[str, tuple[torch.Tensor, torch.Tensor]], group_size: int = 128,
                scheme: str = "sym", device: torch.device | str = "cpu",
                exhaustive: bool = False) -> dict[str, Encoded]:
    """Quantize MXFP4 tensors (name -> (packed uint8 [out, K/2], E8M0 [out, K/32])) to INT4 groups
    along K on `device` (CPU or CUDA); CPU tensors come back, the same bytes and energies on any
    device. A bad input raises FormatError naming it. exhaustive=True evaluates every candidate:
    the exact optimum, many times slower (a test oracle).

    No group straddles two tensors, so on a GPU the tensors are encoded as one run of groups: one
    set of kernels for an expert's projections, where a GPU pays per launch. On a CPU one at a
    time: an expert's three full-size projections together outgrow the caches (1.6x slower)."""
    checked = {}   # name -> (weight, scale) as bytes, shapes checked
    for name, (weight, scale) in sources.items():
        weight, scale = weight.view(torch.uint8), scale.view(torch.uint8)
        try:
            mxfp4.check_shapes(tuple(weight.shape), tuple(scale.shape))
            if scale.numel() and bool((scale == mxfp4.E8M0_NAN).any()):   # checked where it is: no GPU wait
                mxfp4.check_scales(scale.cpu().numpy())
            check_shape(weight.shape[0], weight.shape[1] * 2, group_size, scheme)
        except FormatError as e:
            raise FormatError(str(e), tensor=name or None) from None
        checked[name] = weight, scale
    if torch.device(device).type == "cpu":
        return {name: _encode({name: pair}, group_size, scheme, device, exhaustive)[name]
                for name, pair in checked.items()}
    return _encode(checked, group_size, scheme, device, exhaustive)


def _encode(sources: dict[str, tuple[torch.Tensor, torch.Tensor]], group_size: int, scheme: str,
            device: torch.device | str, exhaustive: bool) -> dict[str, Encoded]:
    """encode_many on checked uint8 inputs, as one run of groups. CPU inputs in pinned memory
    reach a GPU without blocking this thread; the one wait is for the results."""
    shapes = tuple((w.shape[0], w.shape[1] * 2) for w, _ in sources.values())   # (rows, K) of each tensor
    args = shapes, group_size, scheme, exhaustive
    device = torch.device(device)
    if device.type == "cuda":
        results = _on_gpu(sources, device, args)
    else:
        results = _search_on_cpu(sources, args)
    # To the host in one go (pinned memory from a GPU), then one wait.
    codes, scale_out, zero, signal_bins, excess_bins = (t.to("cpu", non_blocking=True) for t in results)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    out = {}
    per_group = group_size // mxfp4.BLOCK
    for i, (name, (rows, k), (b0, b1)) in enumerate(zip(sources, shapes, _spans(shapes))):
        groups = slice(b0 // per_group, b1 // per_group)
        packed = codes[b0 * mxfp4.BLOCK // 2:b1 * mxfp4.BLOCK // 2].view(rows, k // 2).view(torch.int32)
        zero_point = pack_zero_point(zero[groups].view(rows, k // group_size)) if scheme == "asym" else None
        signal = _exact_sum(signal_bins[i], mxfp4.E8M0_BIAS, 0.25)
        error = math.fsum([signal, _exact_sum(excess_bins[i], _R_OFFSET, _UNIT)])
        out[name] = Encoded(packed, scale_out[groups].view(rows, k // group_size), zero_point, signal, error)
    return out


def _spans(shapes: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """(first, end) MXFP4 block of each tensor of these (rows, K) in one run."""
    ends = list(itertools.accumulate(rows * k // mxfp4.BLOCK for rows, k in shapes))
    return list(zip([0] + ends[:-1], ends))


def _search_on_cpu(sources: dict[str, tuple[torch.Tensor, torch.Tensor]], args: tuple) -> tuple[torch.Tensor, ...]:
    """_search's results on the CPU, tensor by tensor: in one C pass each (int4_search_c, the same
    bytes) where it is there and the search is coarse to fine; else the torch passes, in pieces of
    whole rows, about _CPU_PIECE_BLOCKS blocks each: a piece's intermediates (a few MiB) stay below
    the sizes that malloc hands back to the kernel (pools.worker_settings; a full-size
    projection's would reach 40 MiB), and a worker's peak memory stays small. Codes, scales and
    zero points concatenate; energy bins (whole numbers) add up exactly."""
    shapes, group_size, scheme, exhaustive = args
    parts, bins = [], []
    for (weight, scale), (rows, k) in zip(sources.values(), shapes):
        native = None if exhaustive else int4_search_c.encode(weight.reshape(-1), scale.reshape(-1),
                                                            group_size // mxfp4.BLOCK,
                                                            _tables(scheme, torch.device("cpu")).native, _R_BINS)
        step = max(1, _CPU_PIECE_BLOCKS * mxfp4.BLOCK // k)
        pieces = [native] if native is not None else [
            _search(weight[r0:r0 + step].reshape(-1), scale[r0:r0 + step].reshape(-1), ((min(step, rows - r0), k),),
                    *args[1:]) for r0 in range(0, rows, step)]
        parts.append([torch.cat(field) for field in list(zip(*pieces))[:3]])
        bins.append([sum(field) for field in list(zip(*pieces))[3:]])
    return (*(torch.cat(field) for field in zip(*parts)), *(torch.cat(field) for field in zip(*bins)))


class _Captured:
    """_search for one set of shapes and options recorded as a CUDA graph, with its input and
    output tensors: a replay launches its few hundred kernels at once, where running them from
    Python costs ~12 ms of a CPU thread per full-size expert (the GPU's own work is a fraction of
    that) and, from many threads, contends for the interpreter."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, args: tuple):
        self.weight, self.scale = weight, scale
        self.graph = torch.cuda.CUDAGraph()
        # One capture at a time, in thread-local mode: other threads may allocate and wait on their
        # streams meanwhile. On a high-priority stream, from a pool apart from the normal-priority
        # streams threads launch work on (workers.py): none of them can be queueing on it. A
        # replay runs on whatever stream is current.
        stream = torch.cuda.Stream(weight.device, priority=-1)
        with _CAPTURE_LOCK, torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.results = _search(weight, scale, *args)


_CAPTURE_LOCK = threading.Lock()
# (thread, device, args) -> _Captured: each thread replays graphs of its own (a graph's tensors are
# its own). Not thread-local storage: a graph freed by its thread's exit aborted the process (an
# H100, a conversion's thread pool shutting down); release_graphs frees them once threads are done.
_captured: dict[tuple, _Captured] = {}


def release_graphs() -> None:
    """Free every thread's captured graphs; call once the threads that replay them have stopped."""
    if _captured:
        torch.cuda.synchronize()
        _captured.clear()


def _on_gpu(sources: dict, device: torch.device, args: tuple) -> tuple[torch.Tensor, ...]:
    """_search's results for these inputs on a CUDA device, from this thread's graph for their
    shapes; the first time, run as it is (which also readies tables and libraries) and captured."""
    key = threading.get_ident(), device, args
    graph = _captured.get(key)
    if graph is None:
        weight = torch.cat([w.reshape(-1).to(device, non_blocking=True) for w, _ in sources.values()])
        scale = torch.cat([s.reshape(-1).to(device, non_blocking=True) for _, s in sources.values()])
        results = _search(weight, scale, *args)
        _captured[key] = _Captured(weight, scale, args)
        return results
    for (w, s), (b0, b1) in zip(sources.values(), _spans(args[0])):
        graph.weight[b0 * mxfp4.BLOCK // 2:b1 * mxfp4.BLOCK // 2].copy_(w.reshape(-1), non_blocking=True)
        graph.scale[b0:b1].copy_(s.reshape(-1), non_blocking=True)
    graph.graph.replay()
    return graph.results


def _search(weight: torch.Tensor, scale: torch.Tensor, shapes: tuple[tuple[int, int], ...], group_size: int,
            scheme: str, exhaustive: bool) -> tuple[torch.Tensor, ...]:
    """The encoding of a run of tensors (packed bytes and E8M0 scales, flat, one after the other),
    on their device: (codes uint8, scales bf16, zero points int8 per group; signal and excess
    energy bins per tensor). Launches kernels only: no value is read back, so it can be captured."""
    device = weight.device
    tables = _tables(scheme, device)
    per_group = group_size // mxfp4.BLOCK
    blocks = weight.view(-1, mxfp4.BLOCK // 2)
    plus, minus = _block_lanes(blocks, tables)
    both = plus + minus

    # Level of each block's top |value|, counted in half octaves (level 2e+1 is 1.5 * 2^e): 5 minus
    # the lane of the lowest set bit (frexp of a power of two: exact), none in an all-zero block.
    exps = scale.int() - mxfp4.E8M0_BIAS
    lane = (torch.frexp((both & -both).double()).exponent - 1) >> 3
    block_top = torch.where(lane < 0, _EMPTY, 5 - lane)
    group_top = (block_top + 2 * exps).view(-1, per_group).amax(1)
    empty = group_top < _EMPTY // 2
    r = torch.where(empty, 0, group_top >> 1)                         # 2^R <= top < 2^(R+1)
    shift = (_per_block(r, per_group) - exps).clamp(-1, _D_MAX)       # block values are m * 2^-shift

    # Counts per group over the table's rows: a block's lane j lands at group level 2 * shift - 4 + j,
    # so levels 0-7 and 8-15 are lane windows starting at 4 - 2 * shift and 12 - 2 * shift, summed
    # over the group's blocks (lanes <= 128).
    first = (4 - 2 * shift).long()
    top_rows = _window(torch.stack([plus, minus, both]), first)      # [+/-/both, blocks], levels 0-7
    deep_rows = _window(both, first + 8)                              # levels 8-15, merged rows only
    words = torch.stack([*top_rows, deep_rows])
    words = words if per_group == 1 else words.view(4, -1, per_group).sum(2)
    # The table's rows: levels 0 .. n_bins-1, the first `split` of them (the ones clamping makes
    # sign-dependent) from the positive codes and the rest from both signs, then those first levels
    # again from the negative codes; last a 1 (the lane after those), matched by the table's
    # candidate-index row. counts: uint8 [groups, rows + 1], made float64 chunk by chunk.
    mask = (1 << 8 * tables.split) - 1
    merged = torch.stack([(words[0] & mask) | (words[2] & ~mask), words[3], (words[1] & mask) | mask + 1], 1)
    lanes = merged.view(torch.uint8)                                  # [groups, 24], little-endian
    counts = torch.cat([lanes[:, :tables.n_bins], lanes[:, 16:17 + tables.split]], 1)

    key = tables.exhaustive(counts) if exhaustive else tables.coarse_to_fine(counts)
    excess = torch.floor(key * (1 / _TIE))     # error beyond the binned energy; exact: _TIE is 2^12
    pick = torch.where(empty, tables.zero_index, (key - excess * _TIE).long())   # all-zero groups: q = z = 0
    norm = torch.exp2(r.double().clamp(min=-126))
    scale_out = torch.where(empty, 1.0, tables.s_dev[pick].double() * norm).to(torch.bfloat16)
    zero = torch.where(empty, 0.0, tables.z_dev[pick]).to(torch.int8)

    # Codes: one table lookup per source byte, keyed by (block shift, chosen candidate).
    code_key = (shift + 1) * len(tables.s) + _per_block(pick.int(), per_group)
    index = blocks.int()
    index += (code_key << 8)[:, None]
    codes = tables.bytes.index_select(0, index.view(-1))

    # Energies per tensor: whole numbers of units summed per exponent (exact on any device, in any
    # order), scaled on the host. Error = the searched error per group plus the energy of the
    # levels left out (they decode to 0) = all energy + per group (searched - binned energy), the
    # last term being what the search's minimum carries.
    block_energy = both.view(torch.uint8).view(-1, 8).double() @ tables.lane_squared   # 4x, whole numbers
    excess = torch.where(empty, 0.0, excess)
    signal_bins = torch.zeros(len(shapes), 256, dtype=torch.float64, device=device)
    excess_bins = torch.zeros(len(shapes), _R_BINS, dtype=torch.float64, device=device)
    for i, (b0, b1) in enumerate(_spans(shapes)):
        groups = slice(b0 // per_group, b1 // per_group)
        signal_bins[i].index_add_(0, scale[b0:b1].long(), block_energy[b0:b1])
        excess_bins[i].index_add_(0, (r[groups] + _R_OFFSET).long(), excess[groups])
    return codes, scale_out, zero, signal_bins, excess_bins
