"""Compare the routed experts of two checkpoints, one expert at a time, into report.json's dict.

Schema: docs/report-schema.md. Each expert's projections are read from both checkpoints; stored
codes that show equal values settle a projection on the CPU; others are compared on the GPU when
there is one (decoded to float32), else in one C pass over the codes (c_compare.py; torch passes where
it does not build); only sums (weights.ErrorSums) outlive the expert, so
memory stays at a few experts whatever the checkpoint size. Experts are spread over workers:
forked processes on the CPU (the torch passes are many short torch calls, and threads contending
for the GIL ran 1.3x slower on 2 cores), one comparing per core while spares read the next
experts; threads feeding a GPU, one per core.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tqdm import tqdm

from requant import __version__, formats, pools
from requant.compute import compute_device, default_workers, torch_threads
from requant.errors import UnsupportedCheckpoint
from requant.experts import ExpertIndex, model_difference
from requant.io.checkpoint import Checkpoint
from requant.model import Expert, ModelSpec
from requant.report import c_compare, weights
from requant.report.weights import ErrorSums, compare_chunks, hist_edges_log10, identical

SCHEMA = "requant.report/1"


def _codecs(src: ExpertIndex, dst: ExpertIndex, a: Expert, b: Expert, proj: str):
    """The two sides' codecs of one projection; a one-line error when either is not recognised."""
    ca, cb = src.codec_of(a, proj), dst.codec_of(b, proj)
    if ca is None or cb is None:
        raise UnsupportedCheckpoint(f"{src.where(a, proj)}: format not recognised "
                                    f"({ca.name if ca else 'unknown'} vs {cb.name if cb else 'unknown'})")
    return ca, cb


def _named(codec: formats.Codec, ck: Checkpoint, parts: dict[str, str], work: Callable):
    """work(), its FormatErrors naming the projection's scale tensor and its file."""
    with ck.naming(parts[codec.part(formats.SCALE).suffix]):
        return work()


def _decode(codec: formats.Codec, tensors: dict, ck: Checkpoint, parts: dict[str, str], out=None):
    return _named(codec, ck, parts, lambda: codec.decode(tensors, out))


def _compare(ca: formats.Codec, ta: dict, src: Checkpoint, pa: dict[str, str],
             cb: formats.Codec, tb: dict, dst: Checkpoint, pb: dict[str, str], device: str) -> ErrorSums:
    """One projection's sums (its parts as read, on the CPU): from the stored codes when they show
    equal values, which costs less than the copies to a GPU; on a CPU, in one C pass over the codes
    where both formats are nibble-coded (c_compare.py); else decoded and compared on `device`."""
    block = ca.block_size(ca.params_from_shapes({p: tuple(t.shape) for p, t in ta.items()}))
    energy = formats.identical_energy(ca, ta, cb, tb)
    if energy is not None:
        out, packed = ta[ca.weight.suffix].shape
        n = out * packed * ca.elements_per_word
        return identical(n, n // block, energy)
    if device == "cpu" and ca.nibbles and cb.nibbles and c_compare.available():
        sums = c_compare.compare(_named(ca, src, pa, lambda: ca.nibbles(ta)), _named(cb, dst, pb, lambda: cb.nibbles(tb)),
                              block)
        if sums is not None:
            return sums
    ta, tb = ({p: t.to(device) for p, t in ts.items()} for ts in (ta, tb))
    chunks = weights.decoded_row_chunks(ca, ta, cb, tb, lambda t, out: _decode(ca, t, src, pa, out),
                                        lambda t, out: _decode(cb, t, dst, pb, out))
    return compare_chunks(chunks, block)


def compare_unit(src: ExpertIndex, dst: ExpertIndex, a: Expert, b: Expert, projections,
                 device: str = "cpu") -> dict[int, dict[str, ErrorSums]]:
    """expert -> proj -> ErrorSums of dst's decoding against src's, for every expert of unit `a`
    (one expert, or a block's stacked experts) and its counterpart `b`."""
    read = []
    for proj in projections:
        ca, cb = _codecs(src, dst, a, b, proj)
        pairs = zip(src.blocks[a.block].matrices(a, proj, ca), dst.blocks[b.block].matrices(b, proj, cb))
        read += [(e, proj, ca, ta, cb, tb) for (e, ta), (_, tb) in pairs]
    out: dict[int, dict[str, ErrorSums]] = {}
    with pools.compute_slot():   # the reads done: compare while another worker reads
        for e, proj, ca, ta, cb, tb in read:
            out.setdefault(e, {})[proj] = _compare(ca, ta, src.ck, a.parts[proj], cb, tb, dst.ck, b.parts[proj], device)
    return out


def _compare_item(context: tuple, key: tuple) -> dict:
    """compare_unit of the units named `key` in both checkpoints."""
    src, dst, projections, device = context
    return compare_unit(src, dst, src.unit(*key), dst.unit(*key), projections, device)


def _compare_forked(key: tuple) -> dict:
    return _compare_item(pools.inherited(), key)


def _collect(per: dict, key: tuple, result: dict) -> None:
    """Record one unit's comparison (expert -> proj -> sums) by (block, expert)."""
    per.update({(key[0], e): stats for e, stats in result.items()})


def _readers(workers: int) -> int:
    """Spare processes reading while `workers` compare: the C pass compares an expert faster than
    it is read, so two per comparing process (one layer of a 2-vCPU machine: 10.3-10.5 s against
    13.7-14.6 s with one per two), at most 16 (more queue no faster on one disk)."""
    return min(2 * workers, 16)


def _default_device() -> str | None:
    """The CPU where the C comparison builds, even with a GPU present: on the H200 machine (16
    cores) it compared 3 full-size W4A16 blocks in 11.3 s against 19.6 s for the CUDA path (its
    decode launches and host-to-device copies); it needs ~11 ms a projection and core. Else None
    (compute_device's choice)."""
    return "cpu" if c_compare.available() else None


def build(src_path: str, dst_path: str, layers: str | None = None, workers: int | None = None,
          progress: bool = True, device: str | None = None) -> dict:
    started = time.monotonic()
    device = compute_device(device or _default_device())
    with Checkpoint.open(src_path) as src, Checkpoint.open(dst_path) as dst:
        model = ModelSpec.for_checkpoint(src)
        src_index, dst_index = ExpertIndex(model, src), ExpertIndex(model, dst)
        differs = model_difference(src_index, ExpertIndex(ModelSpec.for_checkpoint(dst), dst))
        if differs:
            raise UnsupportedCheckpoint(f"{src_path} and {dst_path} are not the same model: {differs}")
        common = [src_index.key(u) for u in src_index.units if dst_index.unit(*src_index.key(u))]
        unmatched = sorted({src_index.where(u) for u in src_index.units if not dst_index.unit(*src_index.key(u))}
                           | {dst_index.where(u) for u in dst_index.units if not src_index.unit(*dst_index.key(u))})
        blocks = model.select_blocks(layers, list(dict.fromkeys(b for b, _ in common)))
        selected = [k for k in common if k[0] in blocks]
        if not selected:
            raise UnsupportedCheckpoint(f"{src_path} and {dst_path} share no routed experts to compare")
        projections = model.projections
        per = {}   # (block, expert) -> {proj: ErrorSums}
        nbytes = sum(ck.info(n).nbytes for index, ck in ((src_index, src), (dst_index, dst)) for k in selected
                     for p in index.unit(*k).parts.values() for n in p.values())
        workers = workers or default_workers()
        # built (or found) before the workers fork, which share it
        comparison = c_compare.status() if device == "cpu" else f"torch ({device})"
        context = (src_index, dst_index, projections, device)
        with contextlib.ExitStack() as stack:
            if device == "cpu":   # forked before the progress bar starts its thread
                # `workers` compare at once and spares read meanwhile (pools.compute_slot)
                pool = stack.enter_context(pools.forked_pool(workers, context, spares=_readers(workers)))
                task = _compare_forked
            else:
                pool = stack.enter_context(ThreadPoolExecutor(workers))
                stack.enter_context(torch_threads(1))   # the pool is the parallelism
                task = functools.partial(_compare_item, context)
            bar = stack.enter_context(tqdm(total=len(selected), unit="expert", desc="report", disable=not progress,
                                           dynamic_ncols=True))
            window = 2 * (pool.processes if device == "cpu" else workers)   # experts in flight: bounds memory
            pending = {}
            for key in selected:
                pending[key] = pool.submit(task, key)
                if len(pending) >= window:
                    done = next(iter(pending))
                    _collect(per, done, pending.pop(done).result())
                    bar.update(1)
            for key, fut in pending.items():
                _collect(per, key, fut.result())
                bar.update(1)
        codec_names = {b: {side: codec.name if (codec := index.blocks[b].codec) else None
                           for side, index in (("source", src_index), ("candidate", dst_index))} for b in blocks}
        n_experts = {b: int(model.value("num_experts", b)) for b in blocks}   # a drafter's may differ (V4.1)
        dst_config = dst.config
    report = _assemble(src_path, dst_path, model, blocks, per, codec_names, unmatched, n_experts,
                       layers, time.monotonic() - started, nbytes)
    report["timing"]["comparison"] = comparison
    report["candidate"].update(format_params(dst_config))
    return report


def _assemble(src_path, dst_path, model, blocks, per, codec_names, unmatched, n_experts, layers, seconds, nbytes):
    projections = model.projections
    overall, by_proj = ErrorSums(), {p: ErrorSums() for p in projections}
    by_layer = []
    exact_map = []
    columns = max(n_experts.values())   # a block with fewer experts leaves its last cells null
    for block in blocks:
        layer, layer_proj = ErrorSums(), {p: ErrorSums() for p in projections}
        row = [None] * columns
        for (b, e), stats in per.items():
            if b != block:
                continue
            expert_total = ErrorSums()
            for proj, s in stats.items():
                layer_proj[proj].add(s)
                expert_total.add(s)
            layer.add(expert_total)
            if e < n_experts[block]:
                row[e] = expert_total.exact_blocks / expert_total.blocks if expert_total.blocks else None
        for proj in projections:
            by_proj[proj].add(layer_proj[proj])
        overall.add(layer)
        exact_map.append(row)
        by_layer.append({"block": block, "source_format": codec_names[block]["source"],
                         "candidate_format": codec_names[block]["candidate"],
                         "experts": sum(1 for (b, _) in per if b == block),
                         "metrics": layer.metrics(),
                         "by_projection": {p: s.metrics() for p, s in layer_proj.items()}})
    return {
        "schema": SCHEMA,
        "generated_by": {"name": "requant", "version": __version__},
        "source": {"path": os.path.abspath(src_path), "format": _main_format(by_layer, "source_format")},
        "candidate": {"path": os.path.abspath(dst_path), "format": _main_format(by_layer, "candidate_format")},
        "selection": {"layers": layers, "blocks": blocks, "experts_compared": len(per),
                      "unmatched_experts": unmatched},
        "overall": overall.metrics(),
        "by_projection": {p: s.metrics() for p, s in by_proj.items()},
        "by_layer": by_layer,
        "exact_block_map": {"blocks": blocks, "experts": columns, "fraction": exact_map},
        "error_histogram": {
            "log10_abs_error_edges": hist_edges_log10(),
            "by_projection": {p: s.hist for p, s in by_proj.items()},
            "zero_error_elements": {p: s.zero_error for p, s in by_proj.items()},
        },
        "forward": None,
        "timing": {"weights_seconds": seconds, "expert_bytes_read": nbytes},
    }


def format_params(config: dict) -> dict:
    """A lossy-by-design candidate's parameters its headline is judged by: W4A16's group size and
    scheme (from config.json's INT4 config group); {} for the others."""
    from requant.targets.w4a16 import expert_groups, group_scheme

    qc = config.get("quantization_config") if isinstance(config, dict) else None
    for group in expert_groups(qc if isinstance(qc, dict) else {}).values():
        weights = group.get("weights") or {}
        if isinstance(weights.get("group_size"), int):
            return {"group_size": weights["group_size"], "scheme": group_scheme(group)}
    return {}


def _main_format(by_layer, key):
    found = [layer[key] for layer in by_layer]
    return max(set(found), key=found.count) if found else None
