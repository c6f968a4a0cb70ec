"""Compile the MoE kernel for sm_90 without a GPU and print what its K loop costs (SASS).

Device time is scarce; most questions about a kernel change (are the weight loads 16 bytes wide,
does the dequantized tile pass through shared memory, are the wgmmas waited for one by one, how
many instructions per K tile) are answered by the compiler's output. This compiles
`_kernels.moe_gemm_kernel` for a few configs with the installed Triton and its bundled ptxas and
cuobjdump, then reports registers, stack, shared memory and the instruction mix of the innermost
loop (the longest backward branch).

Use the device's Triton version (3.6.0 on the H200 machines of docs/kernel-notes.md), for example:

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python benchmarks/bench_moe_asm.py [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from requant.kernels import fused_moe as fm  # noqa: E402
from requant.kernels._details import _kernels, layout  # noqa: E402
from requant.kernels._details._decode import INT4, MXFP4, NVFP4  # noqa: E402

SCALE_TYPES = {"nvfp4": ("*u8", 16), "mxfp4": ("*u8", 32), "int4": ("*bf16", 128), "int4g32": ("*bf16", 32)}
FORMAT_CODES = {"nvfp4": NVFP4, "mxfp4": MXFP4, "int4": INT4, "int4g32": INT4}
# Arguments that are multiples of 16 at run time for this model's shapes (Triton specializes on it).
DIVISIBLE = {"stride_am", "stride_we", "stride_wt", "stride_se", "stride_sn", "stride_om", "stride_os", "stride_og",
             "N", "K"}
COUNTED = ("HGMMA", "WARPGROUP", "LDSM", "STS", "LDS", "BAR", "LDGSTS", "PRMT", "LOP3", "SHF", "HMUL2", "HFMA2", "IMAD",
           "LDL", "STL")


def compile_gemm(fmt: str, gated: bool, cfg: fm.KernelConfig, even_k: bool = True):
    """even_k False: a K off whole tiles, as gpt-oss's 2880 (rows of 90 MXFP4 scale bytes, no
    multiple of 16, so Triton does not specialize the scales' row stride; the words' blocks are
    whole tiles whatever K is). cfg.gate_up_apart: w1/w3 by separate programs (the gated launch's
    APART)."""
    kernel = _kernels.moe_gemm_kernel
    scale_type, group = SCALE_TYPES[fmt]
    scale_bytes = 2 if fmt.startswith("int4") else 1
    signature = {name: "i32" for name in kernel.arg_names}
    for name in kernel.arg_names:
        if name.endswith("_ptr"):
            signature[name] = "*fp32"
    scales = layout.scale_layout(cfg, group, scale_bytes, 4096 if even_k else 2880)
    if scales == layout.SCALES_WORDS:
        scale_type = "*i32"
    apart = gated and cfg.gate_up_apart
    partials = cfg.split_k > 1 or apart
    signature.update({"a_ptr": "*bf16", "out_ptr": "*fp32" if partials else "*bf16", "w_ptr": "*i32",
                      "w3_ptr": "*i32", "z_ptr": "*i32", "z3_ptr": "*i32", "sorted_ids_ptr": "*i32",
                      "block_expert_ptr": "*i32", "s_ptr": scale_type, "s3_ptr": scale_type})
    constants = dict(A_ROW_DIV=6 if gated else 1, FMT=FORMAT_CODES[fmt].value, GROUP=group, HAS_ZP=False,
                     HAS_GLOBAL=fmt == "nvfp4", HAS_BIAS=False, GATED=gated and not apart, ROUTE_WEIGHT=not gated,
                     ACTIVATION=0, LIMIT=10.0, ALPHA=1.0, COMPUTE=tl.bfloat16, ASM=True, DOT_PRECISION="tf32",
                     PERM_OUT=gated and not partials,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                     EVEN_K=even_k, APART=apart, PDL=True,
                     PIPELINED_SCALES=cfg.pipelined_scales and scales != layout.SCALES_ROWS,
                     ROUTING_READY=not gated, SCALE_LAYOUT=scales,
                     ROW_SCALES=layout.row_scaled(cfg, FORMAT_CODES[fmt].value, group, scales))
    signature.update({name: "constexpr" for name in constants})
    divisible = DIVISIBLE if even_k else DIVISIBLE - {"stride_sn"}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in kernel.arg_names
             if signature[name].startswith("*") or name in divisible}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                                   "launch_pdl": True, "maxnreg": cfg.max_registers})
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options.__dict__)


def cuobjdump(args: list[str]) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcode mix of the K loop: between the longest backward branch whose
    body holds the MMAs (the longest of any, where none does) and its target."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(addr - int(m.group(1), 16), int(m.group(1), 16), addr) for addr, text in lines
             if (m := re.search(r"\bBRA (0x[0-9a-f]+)", text)) and int(m.group(1), 16) < addr]
    with_mma = [loop for loop in loops if any(loop[1] <= a <= loop[2] and "HGMMA" in t for a, t in lines)]
    _, start, end = max(with_mma or loops)
    ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for addr, text in lines if start <= addr <= end]
    return len(ops), collections.Counter(ops)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for each kernel's TTGIR, PTX and SASS")
    ap.add_argument("--only", help="compile only the variants whose tag contains this (e.g. w13_decode)")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="folder for <YYYY-MM-DD>-sm90-asm.json, every variant's figures")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, target sm_90")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    results = {"benchmark": "benchmarks/bench_moe_asm.py", "date": date, "target": "sm_90",
               "triton": triton.__version__, "variants": []}
    decode = fm.KernelConfig(16, 64, 128, 4, 4)
    prefill = fm.KernelConfig(128, 128, 128, 8, 3)  # as default_config's, except pipelined_scales (per format)
    shapes = [(gated, name, cfg) for gated in (True, False) for name, cfg in (("decode", decode), ("prefill", prefill))]
    shapes.insert(1, (True, "decode_apart", dataclasses.replace(decode, gate_up_apart=True)))
    shapes.insert(2, (True, "decode_apart_r80", dataclasses.replace(decode, gate_up_apart=True, max_registers=80)))
    shapes.insert(-1, (False, "decode_r80", dataclasses.replace(decode, max_registers=80)))
    token1 = fm.default_config(6, 256)  # one token of top-6: both GEMMs' own configs
    shapes += [(True, "token1", token1), (False, "token1", token1.down or token1)]
    variants = [(fmt, *shape, True) for fmt in SCALE_TYPES for shape in shapes]
    variants += [("mxfp4", *shape, False) for shape in shapes]
    for fmt, gated, name, cfg, even_k in variants:
        if name == "prefill":
            cfg = fm.default_config(6 * 16384, 256, FORMAT_CODES[fmt].value)
        tag = f"{fmt}_{'w13' if gated else 'w2'}_{name}{'' if even_k else '_2880'}"
        if args.only and args.only not in tag:
            continue
        compiled = compile_gemm(fmt, gated, cfg, even_k)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.out, f"{tag}.{ext}"), "w") as f:
                    f.write(compiled.asm[ext])
        cubin = os.path.join(args.out or "/tmp", f"{tag}.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = cuobjdump(["--dump-sass", cubin])
        usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(["--dump-resource-usage", cubin]))
        if args.out:
            with open(os.path.join(args.out, f"{tag}.sass"), "w") as out:
                out.write(sass)
        count, mix = loop_mix(sass)
        print(f"{tag:30s} regs {usage[1]:>3s} stack {usage[2]:>3s} smem {compiled.metadata.shared:6d}  "
              f"K loop {count} instructions: " + ", ".join(f"{op} {mix[op]}" for op in COUNTED if mix[op]),
              flush=True)
        results["variants"].append({"tag": tag, "config": cfg.to_dict(), "registers": int(usage[1]),
                                    "stack": int(usage[2]), "shared": compiled.metadata.shared,
                                    "k_loop_instructions": count, "k_loop_mix": dict(mix.most_common())})
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"{date}-sm90-asm.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
