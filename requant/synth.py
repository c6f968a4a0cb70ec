"""Synthetic checkpoints of any recipe's named models, at any scale.

The layout (names, dtypes, shapes, shard placement, order) and the metadata files come from the
recipe's `synth` section: a template over the named model's dimensions (recipe `models`), which
this module interprets without knowing any model. At full scale DeepSeek-V4-Flash reproduces the
release tensor for tensor (tests/fixtures). Routed experts are MXFP4 encodings of continuous weights
whose block exponents spread as a trained model's do; flags inject the hard cases for the cast.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass

import numpy as np
import torch

from requant import expressions, formats, model as model_lib, sources
from requant.errors import RequantError, UnsupportedError, UsageError
from requant.formats import fp8_block, mxfp4
from requant.io.fsutil import atomic_write_json, free_bytes
from requant.io.names import INDEX_NAME
from requant.io.safetensors import DTYPES, ShardWriter, TensorSpec, write_tensors
from requant.recipe import TensorEntry, Tokenizer

log = logging.getLogger(__name__)


class Dims:
    """A named model's dimensions (recipe `models.NAME.dims`): its own at full scale, else the
    recipe's reduced ones, then `overrides`. Read them as attributes (`dims.experts`)."""

    def __init__(self, model: str | None = None, full_scale: bool = False, **overrides):
        self.model = model or model_lib.default_model_name()
        models = model_lib.named_models()
        if self.model not in models:
            raise UnsupportedError(f"no recipe names a model {self.model!r} (known: {', '.join(models)})")
        recipe, entry = models[self.model]
        self.spec = model_lib.ModelSpec(recipe, {})
        self.template = self.spec.synth_template
        self.full_scale = full_scale
        self.overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(self.overrides) - set(entry.dims)
        if unknown:
            raise UnsupportedError(f"{self.model} has no dimension {sorted(unknown)[0]!r}")
        values = {**entry.dims, **({} if full_scale else self.template.reduced), **self.overrides}
        values.update({k: self._evaluate(expr, values) for k, expr in self.template.fit.items()})
        self.values = values

    def _evaluate(self, expr, values: dict, bound: dict | None = None):
        return expressions.evaluate(expr, {**self.template.derived, **values}, bound)

    def evaluate(self, expr, bound: dict | None = None):
        """An expression of the recipe's synth template over these dimensions."""
        return self._evaluate(expr, self.values, bound)

    def __getattr__(self, name: str):
        values = self.__dict__.get("values", {})
        if name not in values:
            raise AttributeError(name)
        return values[name]

    def __repr__(self) -> str:
        return f"Dims({self.model!r}, {self.values})"

    def check(self) -> None:
        for condition, message in self.template.checks:
            if not self.evaluate(condition):
                raise ValueError(message.format(**self.values))


def dims_with(base: Dims, **overrides) -> Dims:
    return Dims(base.model, base.full_scale, **{**base.overrides, **overrides})


def metadata_files(d: Dims) -> dict[str, dict]:
    """The JSON files beside the shards (config.json, ...), by path, with the dimensions of `d`."""
    return {path: model_lib.expand_template(template, d.evaluate) for path, template in d.template.files.items()}


def make_config(d: Dims) -> dict:
    """config.json of the release, with the dimensions of `d`."""
    return metadata_files(d)["config.json"]


def _quantized(codec_name: str, name: str, shape, block) -> list[TensorSpec]:
    """Tensors of a quantized linear layer as its codec declares them (first dtype, shapes from the
    logical [out, in]); `block` chooses among a codec's block sizes (default: its fixed or first)."""
    codec = formats.get(codec_name)
    params = formats.Params(block or codec.fixed_group or codec.group_sizes[0])
    return [TensorSpec(f"{name}.{p.suffix}", p.dtypes[0], p.shape(shape[0], shape[1], params))
            for p in codec.written_parts(params)]


def _tensors(d: Dims, entries: list[TensorEntry], bound: dict) -> list[TensorSpec]:
    """The tensors a list of template entries gives, in order, with the names `bound`."""
    specs = []
    for entry in entries:
        if entry.if_ is not None and not d.evaluate(entry.if_, bound):
            continue
        if entry.group is not None:
            inner = {**bound, **{k: d.evaluate(v, bound) for k, v in entry.with_.items()}}
            specs += _tensors(d, d.template.groups[entry.group], inner)
        elif entry.for_ is not None:
            for i in range(d.evaluate(entry.count, bound)):
                specs += _tensors(d, entry.tensors, {**bound, entry.for_: i})
        else:
            name = entry.name.format(**bound)
            shape = tuple(d.evaluate(x, bound) for x in entry.shape)
            specs += _quantized(entry.format, name, shape, entry.block) if entry.format is not None else \
                [TensorSpec(name, entry.dtype, shape)]
    return specs


def layout(d: Dims) -> list[list[TensorSpec]]:
    """All tensors, shard by shard, as the recipe's template lays them out (DeepSeek-V4: embedding,
    one shard per layer, head, one per MTP block)."""
    d.check()
    shards = []
    for entry in d.template.shards:
        if entry.count is None:
            shards.append(_tensors(d, entry.shard, {}))
            continue
        for index in range(d.evaluate(entry.count)):   # one shard each: per block of a kind, or per index
            bound = {"index": index}
            if entry.blocks is not None:
                bound["block"] = d.spec.block_name(entry.blocks, index)
            bound.update({k: d.evaluate(v, bound) for k, v in entry.with_.items()})
            shards.append(_tensors(d, entry.shard, bound))
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class HardCases:
    """Blocks to plant in every routed expert projection, to exercise the cast's edge cases."""

    out_of_window: int = 0     # blocks whose exponent sits 18-24 below the projection's largest
    zero_blocks: int = 0       # all-zero blocks (scale byte 0)
    neg_zero_blocks: int = 0   # blocks of -0 codes under a normal scale


class _Values:
    """Realistic tensor contents from one seeded generator."""

    def __init__(self, seed: int, hard: HardCases):
        self.rng = np.random.default_rng(seed)
        self.hard = hard
        self._pools: dict[tuple, list] = {}

    def normal(self, shape, std=1.0, mean=0.0) -> np.ndarray:
        return (self.rng.standard_normal(shape, dtype=np.float32) * std + mean).astype(np.float32)

    def tensor(self, spec: TensorSpec, siblings: dict) -> torch.Tensor:
        name, shape = spec.name, spec.shape
        if spec.dtype == "F8_E4M3":
            scale = _scale_name(name)
            block = fp8_block.block_of(shape, siblings["__shapes"][scale])
            w, s = fp8_block.encode(torch.from_numpy(self.normal(shape, 0.02)), block)
            siblings[scale] = s
            return w.view(torch.float8_e4m3fn)
        if name in siblings:
            return siblings.pop(name).view(DTYPES[spec.dtype][1])
        if spec.dtype == "I64":  # a token -> expert ids table (hash routing): distinct experts per token
            ids = np.argsort(self.rng.random((shape[0], siblings["__experts"])), axis=1)[:, : shape[1]]
            return torch.from_numpy(ids.astype(np.int64))
        if name.endswith("norm.weight"):
            return torch.from_numpy(np.abs(self.normal(shape, 0.15, 1.0))).to(torch.bfloat16)
        if spec.dtype == "BF16":
            return torch.from_numpy(self.normal(shape, 0.02)).to(torch.bfloat16)
        return torch.from_numpy(self.normal(shape, 0.05)).to(DTYPES[spec.dtype][1])

    def expert(self, rows: int, k: int, pooled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One MXFP4 projection: heavy-tailed weights with per-row spread, like a trained layer."""
        if pooled:  # full-size layers: derive from a few encoded matrices instead of encoding each
            if (rows, k) not in self._pools:
                self._pools[(rows, k)] = [self._encode_expert(rows, k) for _ in range(4)]
            pool = self._pools[(rows, k)]
            w, s = pool[int(self.rng.integers(len(pool)))]
            shift = int(self.rng.integers(rows))
            w, s = np.roll(w, shift, axis=0), np.roll(s, shift, axis=0)
            s = np.where(s > 0, s.astype(np.int16) + int(self.rng.integers(-1, 2)), 0).astype(np.uint8)
        else:
            w, s = self._encode_expert(rows, k)
        w, s = self._plant(w.copy(), s.copy())
        return torch.from_numpy(w).view(torch.int8), torch.from_numpy(s).view(torch.float8_e8m0fnu)

    def _encode_expert(self, rows, k):
        std = 0.008 * math.exp(self.rng.normal(0, 0.2))
        x = self.rng.standard_t(5, (rows, k)).astype(np.float32) * std
        x *= np.exp(self.rng.normal(0, 0.35, (rows, 1))).astype(np.float32)
        return mxfp4.encode(x)

    def _plant(self, w, s):
        rows, nblocks = s.shape
        picks = self.rng.choice(rows * nblocks, size=min(rows * nblocks, sum(asdict(self.hard).values())), replace=False)
        at = iter(divmod(int(p), nblocks) for p in picks)
        codes = w.reshape(rows, nblocks, mxfp4.BLOCK // 2)
        k_max = int(s.max())
        for _ in range(self.hard.out_of_window):
            r, b = next(at)
            s[r, b] = max(1, k_max - int(self.rng.integers(18, 25)))
        for _ in range(self.hard.zero_blocks):
            r, b = next(at)
            s[r, b], codes[r, b] = 0, 0
        for _ in range(self.hard.neg_zero_blocks):
            r, b = next(at)
            codes[r, b] = 0x88
        return w, s


# Bounds on the dimensions synth accepts (the largest named model is well inside them): past them a
# layout alone would take minutes and gigabytes of memory to plan.
DIM_LIMITS = {"layers": 1024, "experts": 4096, "hidden": 65536, "intermediate": 65536}
MAX_ROUTED_EXPERTS = 1 << 18   # layers x experts


def blocks_per_projection(d: Dims) -> int:
    """MXFP4 scale blocks in the smallest routed-expert projection (hidden x intermediate)."""
    return d.hidden * d.intermediate // mxfp4.BLOCK


def check_request(d: Dims, hard: HardCases) -> None:
    """Refuse, as a usage error naming the option, dimensions or hard cases that cannot be built."""
    try:
        d.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    for name, limit in DIM_LIMITS.items():
        if not 1 <= getattr(d, name) <= limit:
            raise UsageError(f"--{name} must be between 1 and {limit}, got {getattr(d, name)}")
    if d.layers * d.experts > MAX_ROUTED_EXPERTS:
        raise UsageError(f"--layers x --experts is {d.layers * d.experts:,} routed experts; synth writes at most "
                         f"{MAX_ROUTED_EXPERTS:,}")
    for name, n in asdict(hard).items():
        if n < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be 0 or more, got {n}")
    planted, room = sum(asdict(hard).values()), blocks_per_projection(d)
    if planted > room:
        raise UsageError(f"--out-of-window, --zero-blocks and --neg-zero-blocks plant {planted:,} blocks in each expert "
                         f"projection, which has {room:,} (hidden {d.hidden} x intermediate {d.intermediate} / "
                         f"{mxfp4.BLOCK})")


def write_new_checkpoint(dest: str, dims: Dims, seed: int = 0, hard: HardCases = HardCases(), sparse: bool = False,
                         progress=None) -> list[str]:
    """write_checkpoint() for the command line: options checked first, the checkpoint written into a
    hidden sibling of `dest` and renamed onto it at the end, so a failure (or Ctrl-C) leaves no
    partial directory that would block the same command's rerun. `dest` must be absent or empty."""
    check_request(dims, hard)
    dest = os.path.abspath(dest)
    if os.path.lexists(dest) and not (os.path.isdir(dest) and not os.path.islink(dest) and not os.listdir(dest)):
        raise RequantError(f"{dest} exists and is not an empty directory")
    if not sparse:
        need = sum(s.nbytes for specs in layout(dims) for s in specs)
        have = free_bytes(os.path.dirname(dest))
        if need > have:
            raise RequantError(f"not enough free space for {dest}: the checkpoint needs {need:,} bytes, {have:,} "
                               "available (--sparse writes the layout alone)")
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dest)}.synth-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        names = write_checkpoint(tmp, dims, seed, hard, sparse, progress=progress)
        os.replace(tmp, dest)   # onto an absent or empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names


def write_checkpoint(dest: str, dims: Dims | None = None, seed: int = 0, hard: HardCases = HardCases(),
                     sparse: bool = False, data_shards: set[int] | None = None, progress=None) -> list[str]:
    """Write a synthetic checkpoint (default: the default model's reduced dimensions); return its
    shard names.

    `sparse` leaves tensor data as holes (a full-scale layout then costs almost no disk);
    `data_shards` fills only those shard indices (0-based) and leaves the rest as holes.
    """
    dims = dims or Dims()
    check_request(dims, hard)
    shards = layout(dims)
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    os.makedirs(dest, exist_ok=True)
    weight_map = {}
    values = _Values(seed, hard)
    pooled = dims.hidden * dims.intermediate >= 1 << 22
    for i, (name, specs) in enumerate(zip(names, shards)):
        writer = ShardWriter(os.path.join(dest, name), specs)
        try:
            if not sparse and (data_shards is None or i in data_shards):
                _fill(writer, specs, values, dims, pooled)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        log.info("wrote %s: %d tensors, %d bytes%s", name, len(specs), sum(s.nbytes for s in specs),
                 " (holes)" if sparse or (data_shards is not None and i not in data_shards) else "")
        weight_map.update({s.name: name for s in specs})
        if progress:
            progress(i + 1, len(shards))
    total = sum(s.nbytes for specs in shards for s in specs)
    atomic_write_json(os.path.join(dest, INDEX_NAME),
                      {"metadata": {"total_size": total}, "weight_map": weight_map})
    for path, content in metadata_files(dims).items():
        os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
        atomic_write_json(os.path.join(dest, path), content)
    _write_tokenizer(dest, dims.template.tokenizer)
    return names


def _scale_name(weight_name: str) -> str:
    """The scale tensor of a DeepSeek-layout quantized `<module>.weight` (`<module>.scale`)."""
    return weight_name[: -len(".weight")] + ".scale"


def _fill(writer: ShardWriter, specs, values: _Values, dims: Dims, pooled: bool) -> None:
    siblings = {"__experts": dims.experts, "__shapes": {s.name: s.shape for s in specs}}
    reader = sources.reader(dims.spec)
    for spec in specs:
        ref = dims.spec.expert_tensor(spec.name)
        if spec.dtype == "I8":  # a routed expert's MXFP4 weight; its scale follows it
            rows, half_k = spec.shape
            w, s = values.expert(rows, half_k * 2, pooled)
            writer.write(spec.name, w)
            siblings[_scale_name(spec.name)] = s
        elif ref and ref.expert is None and ref.part == dims.spec.stacked_parts["weight"]:
            # every expert of a block in one MXFP4 tensor; the scales tensor comes later
            rows, words = reader.matrix_shape(spec.shape)
            encoded = [values.expert(rows, words * mxfp4.CODEC.elements_per_word, pooled) for _ in range(spec.shape[0])]
            writer.write(spec.name, torch.stack([w.view(torch.uint8) for w, _ in encoded]).reshape(spec.shape))
            scale_name = reader.tensor_name(ref.block, None, ref.proj, "scale")
            siblings[scale_name] = torch.stack([s.view(torch.uint8) for _, s in encoded])
        elif spec.dtype == "F8_E4M3" and spec.nbytes > _PIECE_BYTES:
            _fill_fp8_in_pieces(writer, spec, siblings, values)
        elif spec.name not in siblings.get("__written", ()):
            writer.write(spec.name, values.tensor(spec, siblings))


# A block-FP8 tensor larger than this (an Engram table: ~100 GB in one tensor) is encoded and written
# a band of rows at a time, with its scale, so synth's memory stays bounded at any size.
_PIECE_BYTES = 64 << 20


def _fill_fp8_in_pieces(writer: ShardWriter, spec: TensorSpec, siblings: dict, values: _Values) -> None:
    scale_name = _scale_name(spec.name)
    rows, cols = spec.shape
    block_rows, block_cols = fp8_block.block_of(spec.shape, siblings["__shapes"][scale_name])
    scale_cols = -(-cols // block_cols)
    band = max(block_rows, _PIECE_BYTES // 4 // cols // block_rows * block_rows)   # float32 rows, whole blocks
    for start in range(0, rows, band):
        stop = min(rows, start + band)
        codes, scale = fp8_block.encode(torch.from_numpy(values.normal((stop - start, cols), 0.02)),
                                        (block_rows, block_cols))
        write_tensors(writer.fd, [
            (TensorSpec(spec.name, spec.dtype, tuple(codes.shape)), codes, writer.offsets[spec.name] + start * cols),
            (TensorSpec(scale_name, "F8_E8M0", tuple(scale.shape)), scale,
             writer.offsets[scale_name] + start // block_rows * scale_cols)])
    siblings.setdefault("__written", set()).add(scale_name)


def _write_tokenizer(dest: str, spec: Tokenizer) -> None:
    """A tiny byte-level tokenizer with the model's special tokens (recipe `synth.tokenizer`), so the
    directory carries the files a real release does."""
    vocab = {spec.bos: 0, spec.eos: 1}
    vocab.update({chr(c): i + 2 for i, c in enumerate(range(32, 127))})
    tokenizer = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": None,
                 "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": spec.eos}}
    atomic_write_json(os.path.join(dest, "tokenizer.json"), tokenizer)
    atomic_write_json(os.path.join(dest, "tokenizer_config.json"),
                      {"bos_token": spec.bos, "eos_token": spec.eos,
                       "model_max_length": spec.model_max_length, "tokenizer_class": "PreTrainedTokenizerFast"})

