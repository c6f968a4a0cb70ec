"""Synthetic DeepSeek-V4-Flash checkpoints at any scale.

The layout (names, dtypes, shapes, shard placement, order) follows the public release; at full
scale it reproduces it tensor for tensor. Routed experts are MXFP4 encodings of continuous weights
whose block exponents spread as a trained model's do; flags inject the hard cases for the cast.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from requant.formats import fp8_block, mxfp4
from requant.io.fsutil import atomic_write_json
from requant.io.safetensors import DTYPES, ShardWriter, TensorSpec


@dataclass(frozen=True)
class Dims:
    layers: int = 5
    experts: int = 8
    hidden: int = 256
    intermediate: int = 128
    vocab: int = 512
    heads: int = 4
    head_dim: int = 128
    q_lora_rank: int = 128
    o_lora_rank: int = 128
    o_groups: int = 2
    index_heads: int = 4
    index_head_dim: int = 64
    top_k: int = 6
    hash_layers: int = 3
    mtp_layers: int = 1
    hc_mult: int = 4
    shared_experts: int = 1

    def check(self) -> None:
        if self.layers < 1 or self.experts < self.top_k:
            raise ValueError(f"need at least 1 layer and {self.top_k} experts")
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % 128:
                raise ValueError(f"--{name} must be a multiple of 128 (FP8 blocks, W4A16 groups)")
        if self.heads % self.o_groups:
            raise ValueError("heads must be a multiple of o_groups")


FULL_SCALE = Dims(layers=43, experts=256, hidden=4096, intermediate=2048, vocab=129280, heads=64,
                  head_dim=512, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, index_heads=64,
                  index_head_dim=128)


def compress_ratios(d: Dims) -> list[int]:
    """0 for the first two layers and the MTP blocks, then alternating 4 and 128."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(d.layers)] + [0] * d.mtp_layers


def make_config(d: Dims) -> dict:
    """config.json of the release, with the dimensions of `d`."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
        "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": d.hc_mult, "hc_sinkhorn_iters": 20,
        "head_dim": d.head_dim, "hidden_act": "silu", "hidden_size": d.hidden,
        "index_head_dim": d.index_head_dim, "index_n_heads": d.index_heads, "index_topk": 512,
        "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
        "moe_intermediate_size": d.intermediate, "n_routed_experts": d.experts,
        "n_shared_experts": d.shared_experts, "norm_topk_prob": True, "num_attention_heads": d.heads,
        "num_experts_per_tok": d.top_k, "num_hidden_layers": d.layers, "num_hash_layers": d.hash_layers,
        "num_key_value_heads": 1, "num_nextn_predict_layers": d.mtp_layers, "o_groups": d.o_groups,
        "o_lora_rank": d.o_lora_rank, "q_lora_rank": d.q_lora_rank, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                         "original_max_position_embeddings": 65536, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "vocab_size": d.vocab, "compress_rope_theta": 160000,
        "compress_ratios": compress_ratios(d),
    }


def _inference_config(d: Dims) -> dict:
    """inference/config.json: the reference code's own names for the same dimensions."""
    return {
        "vocab_size": d.vocab, "dim": d.hidden, "moe_inter_dim": d.intermediate, "n_layers": d.layers,
        "n_hash_layers": d.hash_layers, "n_heads": d.heads, "n_routed_experts": d.experts,
        "n_shared_experts": d.shared_experts, "n_activated_experts": d.top_k,
        "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0,
        "q_lora_rank": d.q_lora_rank, "head_dim": d.head_dim, "rope_head_dim": 64, "o_groups": d.o_groups,
        "o_lora_rank": d.o_lora_rank, "window_size": 128, "original_seq_len": 65536, "rope_theta": 10000,
        "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": d.index_heads,
        "index_head_dim": d.index_head_dim, "index_topk": 512, "hc_mult": d.hc_mult,
        "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
        "compress_rope_theta": 160000, "compress_ratios": compress_ratios(d),
    }


GENERATION_CONFIG = {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
                     "temperature": 1.0, "top_p": 1.0, "transformers_version": "4.46.3"}


def _fp8(name: str, rows: int, cols: int) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.weight", "F8_E4M3", (rows, cols)),
            TensorSpec(f"{name}.scale", "F8_E8M0", fp8_block.scale_shape((rows, cols)))]


def block_layout(d: Dims, block: str, ratio: int, routing: str) -> list[TensorSpec]:
    """Tensors of one transformer block (`layers.L` or `mtp.N`), in the release's order."""
    hc = d.hc_mult
    mix = (2 + hc) * hc
    specs = []
    for site in ("attn", "ffn"):
        specs += [TensorSpec(f"{block}.hc_{site}_fn", "F32", (mix, hc * d.hidden)),
                  TensorSpec(f"{block}.hc_{site}_base", "F32", (mix,)),
                  TensorSpec(f"{block}.hc_{site}_scale", "F32", (3,))]
    a = f"{block}.attn"
    specs += [TensorSpec(f"{block}.attn_norm.weight", "BF16", (d.hidden,)),
              TensorSpec(f"{block}.ffn_norm.weight", "BF16", (d.hidden,)),
              TensorSpec(f"{a}.attn_sink", "F32", (d.heads,)),
              TensorSpec(f"{a}.q_norm.weight", "BF16", (d.q_lora_rank,)),
              TensorSpec(f"{a}.kv_norm.weight", "BF16", (d.head_dim,))]
    specs += _fp8(f"{a}.wq_a", d.q_lora_rank, d.hidden)
    specs += _fp8(f"{a}.wq_b", d.heads * d.head_dim, d.q_lora_rank)
    specs += _fp8(f"{a}.wkv", d.head_dim, d.hidden)
    specs += _fp8(f"{a}.wo_a", d.o_groups * d.o_lora_rank, d.heads * d.head_dim // d.o_groups)
    specs += _fp8(f"{a}.wo_b", d.hidden, d.o_groups * d.o_lora_rank)
    if ratio:
        overlap = 2 if ratio == 4 else 1  # the ratio-4 compressor keeps overlapping windows
        specs += _compressor(f"{a}.compressor", ratio, overlap, d.head_dim, d.hidden)
        if ratio == 4:
            specs += _compressor(f"{a}.indexer.compressor", ratio, overlap, d.index_head_dim, d.hidden)
            specs += [TensorSpec(f"{a}.indexer.weights_proj.weight", "BF16", (d.index_heads, d.hidden))]
            specs += _fp8(f"{a}.indexer.wq_b", d.index_heads * d.index_head_dim, d.q_lora_rank)
    f = f"{block}.ffn"
    specs += [TensorSpec(f"{f}.gate.weight", "BF16", (d.experts, d.hidden))]
    specs += [TensorSpec(f"{f}.gate.tid2eid", "I64", (d.vocab, d.top_k)) if routing == "hash"
              else TensorSpec(f"{f}.gate.bias", "F32", (d.experts,))]
    shared = d.intermediate * d.shared_experts
    specs += _fp8(f"{f}.shared_experts.w1", shared, d.hidden)
    specs += _fp8(f"{f}.shared_experts.w3", shared, d.hidden)
    specs += _fp8(f"{f}.shared_experts.w2", d.hidden, shared)
    for e in range(d.experts):
        for proj, rows, k in (("w1", d.intermediate, d.hidden), ("w3", d.intermediate, d.hidden),
                              ("w2", d.hidden, d.intermediate)):
            specs += [TensorSpec(f"{f}.experts.{e}.{proj}.weight", "I8", (rows, k // 2)),
                      TensorSpec(f"{f}.experts.{e}.{proj}.scale", "F8_E8M0", (rows, k // mxfp4.BLOCK))]
    return specs


def _compressor(name, ratio, overlap, head_dim, hidden) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.ape", "F32", (ratio, overlap * head_dim)),
            TensorSpec(f"{name}.norm.weight", "BF16", (head_dim,)),
            TensorSpec(f"{name}.wkv.weight", "BF16", (overlap * head_dim, hidden)),
            TensorSpec(f"{name}.wgate.weight", "BF16", (overlap * head_dim, hidden))]


def layout(d: Dims) -> list[list[TensorSpec]]:
    """All tensors, shard by shard: embedding, one shard per layer, head, one per MTP block."""
    d.check()
    ratios = compress_ratios(d)
    shards = [[TensorSpec("embed.weight", "BF16", (d.vocab, d.hidden))]]
    for i in range(d.layers):
        shards.append(block_layout(d, f"layers.{i}", ratios[i], "hash" if i < d.hash_layers else "bias"))
    hc = d.hc_mult
    shards.append([TensorSpec("head.weight", "BF16", (d.vocab, d.hidden)),
                   TensorSpec("norm.weight", "BF16", (d.hidden,)),
                   TensorSpec("hc_head_fn", "F32", (hc, hc * d.hidden)),
                   TensorSpec("hc_head_base", "F32", (hc,)),
                   TensorSpec("hc_head_scale", "F32", (1,))])
    for j in range(d.mtp_layers):
        b = f"mtp.{j}"
        specs = block_layout(d, b, ratios[d.layers + j], "bias")
        specs += _fp8(f"{b}.e_proj", d.hidden, d.hidden) + _fp8(f"{b}.h_proj", d.hidden, d.hidden)
        specs += [TensorSpec(f"{b}.{n}.weight", "BF16", (d.hidden,)) for n in ("enorm", "hnorm", "norm")]
        specs += [TensorSpec(f"{b}.hc_head_fn", "F32", (hc, hc * d.hidden)),
                  TensorSpec(f"{b}.hc_head_base", "F32", (hc,)),
                  TensorSpec(f"{b}.hc_head_scale", "F32", (1,))]
        shards.append(specs)
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
            w, s = fp8_block.encode(torch.from_numpy(self.normal(shape, 0.02)))
            siblings[name[: -len(".weight")] + ".scale"] = s
            return w.view(torch.float8_e4m3fn)
        if spec.dtype == "F8_E8M0" and name in siblings:
            return siblings.pop(name).view(torch.float8_e8m0fnu)
        if spec.dtype == "I64":  # tid2eid: distinct experts per token
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


def write_checkpoint(dest: str, dims: Dims = Dims(), seed: int = 0, hard: HardCases = HardCases(),
                     sparse: bool = False, data_shards: set[int] | None = None, progress=None) -> list[str]:
    """Write a synthetic checkpoint; return its shard names.

    `sparse` leaves tensor data as holes (a full-scale layout then costs almost no disk);
    `data_shards` fills only those shard indices (0-based) and leaves the rest as holes.
    """
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
        weight_map.update({s.name: name for s in specs})
        if progress:
            progress(i + 1, len(shards))
    total = sum(s.nbytes for specs in shards for s in specs)
    atomic_write_json(os.path.join(dest, "model.safetensors.index.json"),
                      {"metadata": {"total_size": total}, "weight_map": weight_map})
    atomic_write_json(os.path.join(dest, "config.json"), make_config(dims))
    atomic_write_json(os.path.join(dest, "generation_config.json"), GENERATION_CONFIG)
    os.makedirs(os.path.join(dest, "inference"), exist_ok=True)
    atomic_write_json(os.path.join(dest, "inference", "config.json"), _inference_config(dims))
    _write_tokenizer(dest)
    return names


def _fill(writer: ShardWriter, specs, values: _Values, dims: Dims, pooled: bool) -> None:
    siblings = {"__experts": dims.experts}
    for spec in specs:
        if spec.dtype == "I8":  # routed expert weight; its scale follows it
            rows, half_k = spec.shape
            w, s = values.expert(rows, half_k * 2, pooled)
            writer.write(spec.name, w)
            siblings[spec.name[: -len(".weight")] + ".scale"] = s
        else:
            writer.write(spec.name, values.tensor(spec, siblings))


def _write_tokenizer(dest: str) -> None:
    """A tiny byte-level tokenizer so the directory carries the files a real release does."""
    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1}
    vocab.update({chr(c): i + 2 for i, c in enumerate(range(32, 127))})
    tokenizer = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": None,
                 "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<｜end▁of▁sentence｜>"}}
    atomic_write_json(os.path.join(dest, "tokenizer.json"), tokenizer)
    atomic_write_json(os.path.join(dest, "tokenizer_config.json"),
                      {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                       "model_max_length": 1048576, "tokenizer_class": "PreTrainedTokenizerFast"})


def dims_with(base: Dims, **overrides) -> Dims:
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})

