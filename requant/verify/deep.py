"""verify --deep: decode every expert (on a pool, while the scale checks read on), count non-finite
weights and, given the source checkpoint, the scale blocks whose decoded values are unchanged."""

from __future__ import annotations

import functools
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from requant import formats, pools
from requant.compute import compute_device, default_workers
from requant.errors import UnsupportedError
from requant.experts import ExpertIndex
from requant.io.checkpoint import Checkpoint
from requant.model import Expert
from requant.report import c_compare
from requant.report.weights import decoded_row_chunks, exactness
from requant.verify.context import Context


class DeepCompare:
    """Decodes submitted experts on a pool and records what it finds, in submission order."""

    def __init__(self, ctx: Context, source: str | None, device: str | None):
        self.ctx = ctx
        self.source = Checkpoint.open(source) if source else None
        self.source_experts = ExpertIndex(ctx.model, self.source) if self.source else None
        # Decodes on the GPU when there is one (threads feeding it), else in a forked process per
        # core (decoding is many short torch calls: threads would contend for the GIL).
        self.device = compute_device(device)
        self.workers = default_workers()
        if self.device == "cpu":
            c_compare.available()   # the C comparison built before the workers fork, which share it
            self.pool, self._task = pools.forked_pool(self.workers, self), _measure_forked
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
        blocks, exact blocks, non-finite), summed over the experts the unit holds."""
        found = []
        src = self.source_experts.unit(*self.ctx.experts.key(expert)) if self.source else None
        block = self.ctx.experts.blocks[expert.block]
        for proj, codec_name in readable.items():
            codec = formats.get(codec_name)
            scale_name = expert.parts[proj][codec.part(formats.SCALE).suffix]   # named by invalid bytes
            own = functools.partial(block.matrices, expert, proj, codec)
            if self.source is None:
                def counted():
                    return 0, 0, sum(self._nonfinite(codec, tensors, scale_name) for _, tensors in own())
            elif src is None or proj not in src.parts:
                found.append(("no-source", proj))
                continue
            else:
                src_codec = self.source_experts.codec_of(src, proj)
                if src_codec is None:
                    raise UnsupportedError(f"{self.ctx.where(src, proj)}: the --source projection is in no format "
                                           "requant decodes")
                theirs = functools.partial(self.source_experts.blocks[src.block].matrices, src, proj, src_codec)

                def counted():
                    per_expert = [self._exactness(src_codec, src_tensors, src.parts[proj], codec, tensors, scale_name)
                                  for (_, src_tensors), (_, tensors) in zip(theirs(), own())]
                    return tuple(sum(column) for column in zip(*per_expert))
            try:
                found.append(("ok", proj, *counted()))
            except UnsupportedError as e:
                return found + [("skipped", str(e))]
        return found

    def _nonfinite(self, codec: formats.Codec, tensors: dict, scale_name: str) -> int:
        """Non-finite values of one expert's projection, decoded."""
        with self.ctx.ck.naming(scale_name):
            if codec.count_nonfinite is not None:
                return codec.count_nonfinite(tensors)
            return int((~torch.isfinite(codec.decode(self._on_device(tensors)))).sum())

    def _exactness(self, src_codec: formats.Codec, src_tensors: dict, src_parts: dict[str, str],
                   codec: formats.Codec, tensors: dict, scale_name: str) -> tuple[int, int, int]:
        """(blocks, exact blocks, non-finite values) of one expert's projection against the source's,
        its parts as read (on the CPU): stored codes that show equal values settle it before any copy
        to a GPU; on a CPU, one C pass over the codes where both are nibble-coded; else decoded."""
        params = src_codec.params_from_shapes({p: tuple(t.shape) for p, t in src_tensors.items()})
        block = src_codec.block_size(params)
        if formats.identical_energy(src_codec, src_tensors, codec, tensors) is not None:
            blocks = src_tensors[src_codec.weight.suffix].numel() * src_codec.elements_per_word // block
            return blocks, blocks, 0   # the same values, seen on the stored bytes
        src_scale_name = src_parts[src_codec.part(formats.SCALE).suffix]   # named by invalid bytes
        if self.device == "cpu" and src_codec.nibbles and codec.nibbles and c_compare.available():
            with self.source.naming(src_scale_name):
                a = src_codec.nibbles(src_tensors)
            with self.ctx.ck.naming(scale_name):
                b = codec.nibbles(tensors)
            sums = c_compare.compare(a, b, block)
            if sums is not None:
                return sums.blocks, sums.exact_blocks, sums.nonfinite

        def decode_source(t, out):
            with self.source.naming(src_scale_name):
                return src_codec.decode(t, out)

        def decode_own(t, out):
            with self.ctx.ck.naming(scale_name):
                return codec.decode(t, out)
        return exactness(decoded_row_chunks(src_codec, self._on_device(src_tensors), codec, self._on_device(tensors),
                                            decode_source, decode_own), block)

    def _on_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {p: t.to(self.device) for p, t in tensors.items()}

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
    return pools.inherited()._measure(expert, readable)
