"""Launch configs: what a launch is given (`KernelConfig`) and which config a layer's
launch takes (`launch_config`). No triton.

Lookup, in order (documented in docs/kernel-notes.md, "Launch configs"):
1. Under Triton's interpreter: few, large programs (`default_config`), whatever the device.
2. The device's file `requant/kernels/configs/<config_name>.json` (`device.config_name`: "h200"
   for an NVIDIA H200), written by `benchmarks/bench_moe.py --tune`: under the layer's `Problem.key`
   (format, group, experts, hidden, intermediate, top-k), the config tuned at the token count
   nearest the call's on a log scale.
3. Otherwise (no file for the device, no entry for the layer's shape): `default_config`, a rule
   by pairs per expert taken from H200 sweeps of DeepSeek-V4-Flash's shape.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

from requant import formats
from requant.formats import nvfp4
from requant.kernels._details.device import interpreting

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

# The kernel's code for each activation kind it fuses (requant.moe.Activation, built from the recipe).
ACTIVATION_CODES = {"swiglu_clamp": 0, "swiglu_oai": 1}


@dataclass(frozen=True)
class KernelConfig:
    block_m: int      # pairs per program (the MMA's N dimension)
    block_n: int      # weight rows per program (the MMA's M dimension: 64 per warpgroup on Hopper)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # programs per output tile along K, FP32 partial sums combined afterwards
    # w1 and w3 by separate programs, their FP32 outputs gated afterwards: half the registers of
    # a program holding both, so more programs fit an SM
    gate_up_apart: bool = False
    max_registers: int | None = None  # per thread (ptxas's maxnreg): fewer let more programs share an SM
    # Block scales fetched stages ahead with the words, where a row's scales per K tile are 4 bytes
    # or more (`layout.scale_layout`); off, they are loaded one tile ahead by hand
    pipelined_scales: bool = True
    # Where a group spans the K tile (INT4 g128): the tile's codes go to the MMA unscaled and each
    # row's scale multiplies the tile's FP32 product, one FFMA per accumulator element instead of
    # one HMUL2 per pair of weights. Fewer instructions at 16 pairs a program; at prefill sizes
    # more, and the MMA could no longer run ahead of the next tile's dequantization
    scale_after_dot: bool = False
    # The down GEMM's own config, where it differs (`down`); the same block_m, since both GEMMs
    # take one alignment of the pairs
    down: KernelConfig | None = None

    def __post_init__(self):
        if self.down is not None and (self.down.block_m != self.block_m or self.down.down is not None):
            raise ValueError(f"the down GEMM's config must have block_m={self.block_m} and no down config of its own")

    def to_dict(self) -> dict:
        """The fields that differ from their defaults (`down` as a dict of its own)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.default is dataclasses.MISSING or v != f.default:
                out[f.name] = v.to_dict() if isinstance(v, KernelConfig) else v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> KernelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if set(d) - known:
            raise ValueError(f"unknown launch-config keys {sorted(set(d) - known)}")
        down = d.get("down")
        return cls(**{**d, "down": None if down is None else cls.from_dict(down)})


@dataclass(frozen=True)
class Problem:
    """What a launch config is tuned for: one layer's routed experts."""

    format: str        # the codec's name (ExpertWeights.format)
    group: int
    experts: int
    hidden: int
    intermediate: int
    top_k: int

    @property
    def key(self) -> str:
        return (f"{self.format} g{self.group} experts={self.experts} hidden={self.hidden} "
                f"intermediate={self.intermediate} top_k={self.top_k}")


def default_config(pairs: int, experts: int, kernel_code: int | None = None) -> KernelConfig:
    """The built-in config for `pairs` (token, expert) pairs over `experts` experts, in the format with
    this kernel code (None: any). The reasons are in docs/kernel-notes.md under the headings named."""
    if interpreting():
        # Few, large programs: the interpreter's cost is per program and per op, not per element.
        return KernelConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=1)
    per_expert = pairs / experts
    # BLOCK_K 128 beat 256 at decode sizes ("Tile shapes").
    if per_expert <= 16:
        if pairs <= 8:
            # One token touches top_k experts only: two K slices give every SM weights to stream
            # ("Split-K at decode sizes"). w1 and w3 in one program ("w1 and w3 by separate programs",
            # dropped); the down GEMM in 128-row programs, 3 stages ("Each GEMM's own decode config");
            # INT4 g128's scales after the MMA in w2 only ("INT4 g128's scales after the MMA").
            return KernelConfig(16, 64, 128, num_warps=4, num_stages=3, split_k=2,
                                down=KernelConfig(16, 128, 128, num_warps=4, num_stages=3, split_k=2,
                                                  scale_after_dot=True))
        # From 4 tokens on no split; w1/w3 together and 128-row down programs ("Each GEMM's own
        # decode config"); INT4 g128's scales after the MMA in both GEMMs.
        return KernelConfig(16, 64, 128, num_warps=4, num_stages=4, scale_after_dot=True,
                            down=KernelConfig(16, 128, 128, num_warps=4, num_stages=4, scale_after_dot=True))
    # NVFP4's scales by hand at prefill sizes, every other format's pipelined ("Block scales in the
    # pipeline"); no format named: by hand.
    pipelined = kernel_code is not None and kernel_code != nvfp4.CODEC.kernel_code
    if per_expert <= 32:
        return KernelConfig(32, 64, 128, num_warps=4, num_stages=4, pipelined_scales=pipelined)
    if per_expert <= 64:
        return KernelConfig(64, 128, 128, num_warps=8, num_stages=4, pipelined_scales=pipelined)
    return KernelConfig(128, 128, 128, num_warps=8, num_stages=3, pipelined_scales=pipelined)


def config_path(name: str) -> str:
    """The launch-config file of device `name` (`device.config_name`)."""
    return os.path.join(CONFIG_DIR, f"{name}.json")


@functools.cache
def device_table(name: str) -> dict[str, dict[int, KernelConfig]]:
    """The tuned configs of device `name` (`device.config_name`): {Problem.key: {tokens: config}};
    empty where the device has no file."""
    path = config_path(name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    try:
        return {key: {int(t): KernelConfig.from_dict(c) for t, c in by_tokens.items()}
                for key, by_tokens in data["configs"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a launch-config file ({e})") from None


def nearest(by_tokens: dict[int, KernelConfig], tokens: int) -> KernelConfig:
    """The config tuned at the token count nearest `tokens` on a log scale (the smaller on a tie)."""
    return by_tokens[min(by_tokens, key=lambda t: (abs(math.log(t) - math.log(max(tokens, 1))), t))]


def launch_config(problem: Problem, tokens: int, device_name: str | None) -> KernelConfig:
    """The config of a launch of `tokens` tokens on device `device_name` (None: no device file
    applies), in the order of this module's docstring."""
    code = formats.get(problem.format).kernel_code
    if not interpreting() and device_name is not None:
        by_tokens = device_table(device_name).get(problem.key)
        if by_tokens:
            return nearest(by_tokens, tokens)
    return default_config(tokens * problem.top_k, problem.experts, code)


def save_tuned(path: str, device: str, problem: Problem, tuned: dict[int, KernelConfig], written_by: str) -> None:
    """Merge `tuned` ({tokens: config}) for `problem` into the config file at `path`, keeping other
    problems' entries and other token counts of this one."""
    data = {"device": device, "written_by": written_by, "configs": {}}
    if os.path.exists(path):
        with open(path) as f:
            data = {**data, "configs": json.load(f).get("configs", {})}
    entry = data["configs"].setdefault(problem.key, {})
    entry.update({str(t): c.to_dict() for t, c in tuned.items()})
    data["configs"][problem.key] = dict(sorted(entry.items(), key=lambda kv: int(kv[0])))
    data["configs"] = dict(sorted(data["configs"].items()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    device_table.cache_clear()
