"""verify --deep: decode every expert (on a pool, while the scale checks read on), count non-finite
weights and, given the source checkpoint, the scale blocks whose decoded values are unchanged."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from requant import formats, sources, workers as worker_pools
from requant.compute import compute_device, default_workers
from requant.errors import UnsupportedError
from requant.io.checkpoint import Checkpoint
from requant.model import Expert
from requant.report import native
from requant.report.weights import decoded_row_chunks, exactness
from requant.verify.context import Context


class DeepCompare:
    """Decodes submitted experts on a pool and records what it finds, in submission order."""

    def __init__(self, ctx: Context, source: str | None, device: str | None):
        self.ctx = ctx
        self.source = Checkpoint.open(source) if source else None
        self.source_experts = ({(e.block, e.expert): e for e in sources.reader(ctx.model).experts(self.source.names)}
                               if self.source else {})
        # Decodes on the GPU when there is one (threads feeding it), else in a forked process per
        # core (decoding is many short torch calls: threads would contend for the GIL).
        self.device = compute_device(device)
        self.workers = default_workers()
        if self.device == "cpu":
            native.available()   # the C comparison built before the workers fork, which share it
            self.pool, self._task = worker_pools.forked_pool(self.workers, self), _measure_forked
        else:
            self.pool, self._task = ThreadPoolExecutor(self.workers), self._measure
        self.pending: deque = deque()
        self.by_block: dict[str, list[int]] = {}   # block -> [blocks, exact blocks, non-finite values]

    def submit(self, expert: Expert, readable: dict[str, formats.Codec]) -> None:
        # codecs by name: a codec holds functions, which do not pickle
        names = {proj: codec.name for proj, codec in readable.items()}
        self.pending.append((expert, self.pool.submit(self._task, expert, names)))
        while len(self.pending) > 2 * self.workers:   # bounded: decoded experts are large
            self._record(*self.pending.popleft())

    def finish(self) -> None:
        while self.pending:
            self._record(*self.pending.popleft())

    def close(self) -> None:
        for _, future in self.pending:
            future.cancel()
        self.pool.shutdown(wait=True)
        if self.source is not None:
            self.source.close()

    def summary(self) -> dict:
        return {b: {"blocks": s[0], "exact_blocks": s[1], "nonfinite": s[2]} for b, s in self.by_block.items()}

    def _measure(self, expert: Expert, readable: dict[str, str]) -> list[tuple]:
        """Per projection (proj -> codec name) ("skipped", why), ("no-source", proj) or ("ok", proj,
        blocks, exact blocks, non-finite)."""
        found = []
        src = self.source_experts.get((expert.block, expert.expert))
        for proj, codec_name in readable.items():
            codec = formats.get(codec_name)
            tensors = self._tensors(self.ctx.ck, expert.parts[proj], codec)
            scale_name = expert.parts[proj][codec.part(formats.SCALE).suffix]   # named by invalid bytes
            if self.source is None:
                try:
                    with self.ctx.ck.naming(scale_name):
                        values = codec.decode(tensors)
                except UnsupportedError as e:
                    return found + [("skipped", str(e))]
                found.append(("ok", proj, 0, 0, int((~torch.isfinite(values)).sum())))
                continue
            if src is None or proj not in src.parts:
                found.append(("no-source", proj))
                continue
            src_parts = src.parts[proj]
            src_codec = formats.identify({p: self.source.info(n).spec.dtype for p, n in src_parts.items()})
            if src_codec is None:
                raise UnsupportedError(f"{self.ctx.where(src, proj)}: the --source projection is in no format "
                                       "requant decodes")
            src_tensors = self._tensors(self.source, src_parts, src_codec)
            params = src_codec.params_from_shapes({p: tuple(t.shape) for p, t in src_tensors.items()})
            block = src_codec.block_size(params)
            if formats.identical_energy(src_codec, src_tensors, codec, tensors) is not None:
                blocks = src_tensors[src_codec.weight.suffix].numel() * src_codec.elements_per_word // block
                found.append(("ok", proj, blocks, blocks, 0))   # the same values, seen on the stored bytes
                continue
            src_scale_name = src_parts[src_codec.part(formats.SCALE).suffix]   # named by invalid bytes
            if self.device == "cpu" and src_codec.nibbles and codec.nibbles and native.available():
                with self.source.naming(src_scale_name):
                    a = src_codec.nibbles(src_tensors)
                with self.ctx.ck.naming(scale_name):
                    b = codec.nibbles(tensors)
                sums = native.compare(a, b, block)
                if sums is not None:
                    found.append(("ok", proj, sums.blocks, sums.exact_blocks, sums.nonfinite))
                    continue

            def decode_source(t, out):
                with self.source.naming(src_scale_name):
                    return src_codec.decode(t, out)

            def decode_own(t, out):
                with self.ctx.ck.naming(scale_name):
                    return codec.decode(t, out)
            try:
                found.append(("ok", proj, *exactness(
                    decoded_row_chunks(src_codec, src_tensors, codec, tensors, decode_source, decode_own), block)))
            except UnsupportedError as e:
                return found + [("skipped", str(e))]
        return found

    def _tensors(self, ck: Checkpoint, parts: dict[str, str], codec: formats.Codec) -> dict[str, torch.Tensor]:
        return {p: ck.tensor(n).to(self.device) for p, n in parts.items() if p in codec.decoded_parts}

    def _record(self, expert: Expert, future) -> None:
        acc = self.by_block.setdefault(expert.block, [0, 0, 0])
        where = self.ctx.where(expert)
        out = self.ctx.out
        for kind, *detail in future.result():
            if kind == "skipped":
                out.add("info", "deep-skipped", "not decoded", detail=detail[0])
            elif kind == "no-source":
                out.add("warning", "deep-no-source", "projection absent from --source", f"{where}.{detail[0]}")
            else:
                proj, blocks, exact, bad = detail
                acc[0] += blocks
                acc[1] += exact
                acc[2] += bad
                if bad:
                    out.add("error", "nonfinite-weights", "decoded weights are not finite", f"{where}.{proj}",
                            f"{bad} values")


def _measure_forked(expert: Expert, readable: dict[str, str]) -> list[tuple]:
    """DeepCompare._measure in a worker forked by it."""
    return worker_pools.inherited()._measure(expert, readable)
