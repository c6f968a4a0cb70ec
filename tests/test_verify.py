"""requant verify: clean on requant's own output, and each planted fault found by name."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from requant.cli import cli
from requant.convert import convert
from requant.io.checkpoint import Checkpoint
from requant.io.safetensors import save_file
from requant.synth import Dims, HardCases, write_checkpoint
from requant.targets import TARGETS, Options
from requant.engines.check import marlin_flush_threshold
from requant.verify import verify
from tests.factory import converted_pair

from requant import engines as _engines  # noqa: E402

VLLM = f"vLLM {_engines.releases('vllm')[-1]}"   # the release a bare --engine vllm means here (none installed)

DIMS = Dims(layers=2, experts=6, hidden=256, intermediate=128, hash_layers=1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return converted_pair(tmp_path_factory.mktemp("verify"), DIMS, 3)


@pytest.fixture
def nv(pair, tmp_path):
    """A private copy of the NVFP4 output to corrupt."""
    dst = str(tmp_path / "ck")
    shutil.copytree(pair[1], dst)
    return dst


def codes(result, severity="error"):
    return {f["code"] for f in result["findings"] if f["severity"] == severity}


def finding(result, code):
    return next(f for f in result["findings"] if f["code"] == code)


def run_cli(*args):
    return CliRunner().invoke(cli, ["verify", "--quiet", *args])


def poke(path, name, value: torch.Tensor):
    """Overwrite tensor `name` in place with `value` (same dtype and size)."""
    with Checkpoint.open(path) as ck:
        info = ck.info(name)
        file = ck.shard_path(ck.locations[name])
    raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert len(raw) <= info.nbytes
    with open(file, "r+b") as f:
        f.seek(info.start)
        f.write(raw)


def drop(path, name):
    """Remove tensor `name` from its shard and from the index, as a careless tool would."""
    with Checkpoint.open(path) as ck:
        shard = ck.locations[name]
        tensors = {n: ck.tensor(n).clone() for n in ck.headers[shard].tensors if n != name}
        total = ck.tensor_bytes - ck.info(name).nbytes
    save_file(os.path.join(path, shard), tensors)
    edit_json(path, "model.safetensors.index.json",
              lambda o: (o["weight_map"].pop(name), o["metadata"].update(total_size=total)))


def edit_json(path, name, fn):
    file = os.path.join(path, name)
    obj = json.load(open(file))
    fn(obj)
    json.dump(obj, open(file, "w"))


E = "layers.1.ffn.experts.2"


def test_clean_on_requants_output(pair):
    result = verify(pair[1], progress=False)
    assert result["ok"], result["findings"]
    assert result["format"] == "nvfp4"
    assert result["experts_checked"] == (DIMS.layers + DIMS.mtp_layers) * DIMS.experts
    cli_run = run_cli(pair[1])
    assert cli_run.exit_code == 0, cli_run.output
    assert "OK: 0 errors" in cli_run.output


def test_clean_on_the_mxfp4_source(pair):
    result = verify(pair[0], progress=False)
    assert result["ok"] and result["format"] == "mxfp4"


def test_missing_input_scale(nv):
    drop(nv, f"{E}.w3.input_scale")
    result = verify(nv, progress=False)
    f = finding(result, "missing-input-scale")
    assert f["severity"] == "error" and f["examples"] == [f"{E}.w3.input_scale"]
    run = run_cli(nv)
    assert run.exit_code == 1 and "missing-input-scale" in run.output


@pytest.mark.parametrize("value,why", [(math.nan, "NaN"), (0.0, "zero"), (-0.5, "negative"), (math.inf, "infinite")])
def test_bad_input_scale(nv, value, why):
    poke(nv, f"{E}.w2.input_scale", torch.tensor(value, dtype=torch.float32))
    result = verify(nv, progress=False)
    assert finding(result, "bad-input-scale")["examples"] == [f"{E}.w2.input_scale: {why}"]
    assert not result["ok"]


def test_bad_global_scale(nv):
    poke(nv, f"{E}.w2.weight_scale_2", torch.tensor(0.0))
    assert finding(verify(nv, progress=False), "bad-global-scale")["examples"] == [f"{E}.w2.weight_scale_2: zero"]


def test_nan_and_negative_block_scales(nv):
    poke(nv, f"{E}.w1.weight_scale", torch.tensor([0x7F, 0x7F], dtype=torch.uint8))
    poke(nv, f"{E}.w2.weight_scale", torch.tensor([0xB8], dtype=torch.uint8))   # -1.0 in E4M3
    result = verify(nv, progress=False)
    assert finding(result, "nan-block-scale")["examples"] == [f"{E}.w1.weight_scale: 2 blocks"]
    assert finding(result, "negative-block-scale")["examples"] == [f"{E}.w2.weight_scale: 1 blocks"]


def test_unequal_fused_global_scales(nv):
    with Checkpoint.open(nv) as ck:
        g = float(ck.tensor(f"{E}.w3.weight_scale_2"))
    poke(nv, f"{E}.w3.weight_scale_2", torch.tensor(g * 2, dtype=torch.float32))
    result = verify(nv, progress=False)
    f = finding(result, "fused-global-scale-mismatch")
    assert f["severity"] == "error" and f["examples"][0].startswith(E + ":")


def test_wrong_total_size(nv):
    edit_json(nv, "model.safetensors.index.json", lambda o: o["metadata"].update(total_size=o["metadata"]["total_size"] + 8))
    result = verify(nv, progress=False)
    assert codes(result) == {"total-size"}
    assert run_cli(nv).exit_code == 1


def test_hf_quant_config_disagrees_with_config(nv):
    edit_json(nv, "hf_quant_config.json", lambda o: o["quantization"]["exclude_modules"].remove("head"))
    result = verify(nv, progress=False)
    assert codes(result) == {"config-disagreement"}
    assert "exclude_modules" in finding(result, "config-disagreement")["message"]


def test_dispatch_fields(nv):
    def break_config(c):
        c["quantization_config"]["quant_method"] = "modelopt"
        del c["quantization_config"]["moe_quant_algo"]
        c["expert_dtype"] = "fp8"
        c["quantization_config"]["quantized_layers"].pop("layers.0.ffn.experts")
    edit_json(nv, "config.json", break_config)
    result = verify(nv, progress=False)
    assert {"quant-method", "moe-quant-algo", "expert-dtype", "quantized-layers"} <= codes(result)
    assert finding(result, "quantized-layers")["examples"] == ["layers.0.ffn.experts"]


def test_truncated_shard(nv):
    with Checkpoint.open(nv) as ck:
        shard = ck.locations[f"{E}.w1.weight"]
    path = os.path.join(nv, shard)
    os.truncate(path, os.path.getsize(path) - 100)
    result = verify(nv, progress=False)
    f = finding(result, "shard-unreadable")
    assert f["severity"] == "error" and f["examples"][0].startswith(shard)
    # the other shards are still checked, and the layer lost with the shard is named
    assert "missing-layers" in codes(result) and result["experts_checked"] == (DIMS.layers - 1 + DIMS.mtp_layers) * DIMS.experts
    assert run_cli(nv).exit_code == 1


def test_leftover_source_scale_is_an_error(nv):
    with Checkpoint.open(nv) as ck:
        shard = ck.locations[f"{E}.w1.weight"]
        tensors = {n: ck.tensor(n).clone() for n in ck.headers[shard].tensors}
    tensors[f"{E}.w1.scale"] = torch.zeros(DIMS.intermediate, DIMS.hidden // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file(os.path.join(nv, shard), tensors)
    edit_json(nv, "model.safetensors.index.json", lambda o: (o["weight_map"].update({f"{E}.w1.scale": shard}),
                                                            o["metadata"].update(total_size=o["metadata"]["total_size"] + DIMS.intermediate * DIMS.hidden // 32)))
    result = verify(nv, progress=False)
    assert finding(result, "unexpected-part")["examples"] == [f"{E}.w1.scale"]
    assert codes(result) == {"unexpected-part"}


def test_marlin_flush_threshold():
    # vLLM 0.33.0: factor 2^floor(log2(448 / largest)), then scale * factor * 2^7 < 2 is zero.
    assert marlin_flush_threshold(256.0) == 2.0**-6           # lossless cast: largest block scale 2^8
    assert marlin_flush_threshold(32.0) == 2.0**-9            # headroom 3 moves the whole window down
    assert marlin_flush_threshold(448.0) == 2.0**-6 and marlin_flush_threshold(300.0) == 2.0**-6
    assert marlin_flush_threshold(2.0**-9) == 2.0**-23        # factor 2^17


def test_hopper_flush_counted_against_an_independent_decode(tmp_path):
    """vLLM 0.33.0 on Hopper zeroes the blocks more than 14 octaves under the layer's largest
    scale; verify counts exactly those, per layer and fused group, as a warning."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "plain")
    write_checkpoint(src, DIMS, seed=5, hard=HardCases(out_of_window=2))
    convert(src, dst, "nvfp4", Options(), progress=False)
    result = verify(dst, progress=False, engine="vllm")
    f = finding(result, "marlin-flush")
    assert f["severity"] == "warning" and VLLM in f["message"] and result["ok"]
    expected = 0
    with Checkpoint.open(dst) as ck:
        for block in [f"layers.{i}" for i in range(DIMS.layers)] + ["mtp.0"]:
            for group in (("w1", "w3"), ("w2",)):
                scales = torch.cat([ck.tensor(f"{block}.ffn.experts.{e}.{p}.weight_scale").view(torch.float8_e4m3fn)
                                    .float().reshape(-1) for e in range(DIMS.experts) for p in group])
                top = scales.max().item()
                factor = 2.0 ** math.floor(math.log2(448 / top))
                expected += int(((scales > 0) & (scales * factor * 128 < 2)).sum())
    assert expected >= 2 * 3 * DIMS.experts * DIMS.layers   # the planted blocks at least
    assert result["engines"]["vllm"]["marlin_flushed_blocks"] == expected
    assert "marlin-flush" not in codes(verify(dst, progress=False, engine="vllm", gpu="sm_100"), "warning")


def test_mtp_layout_is_judged_per_engine(pair, tmp_path):
    """SGLang 0.5.23 loads MTP experts as MXFP4 only; vLLM 0.33.0 on CUDA as the output's
    quantization_config.ignore says (MXFP4 where it lists mtp.0.ffn.experts, else NVFP4). vLLM's
    layout (MTP converted) is an error for SGLang; SGLang's (kept, listed in ignore) loads in both,
    and the same bytes with ignore emptied draft garbage in vLLM."""
    assert verify(pair[1], progress=False)["ok"]              # vLLM's layout (the default)
    bad = verify(pair[1], progress=False, engine="sglang")
    assert not bad["ok"] and finding(bad, "mtp-format")["examples"] == ["mtp.0.ffn.experts"]
    assert "SGLang 0.5.23" in finding(bad, "mtp-format")["message"]
    nvidia_like = str(tmp_path / "sglang")
    convert(pair[0], nvidia_like, "nvfp4", Options(engine="sglang"), progress=False)
    assert verify(nvidia_like, progress=False)["ok"]          # requant.json: made for SGLang
    assert verify(nvidia_like, progress=False, engine="vllm")["ok"]
    os.remove(os.path.join(nvidia_like, "requant.json"))      # as NVIDIA's release: no record of an engine
    unknown = verify(nvidia_like, progress=False)
    assert unknown["ok"] and "mtp-format" not in codes(unknown, "warning")
    assert unknown["engines"]["sglang"]["loads"] and unknown["engines"]["vllm"]["loads"]
    edit_config(nvidia_like, lambda qc: qc.update(ignore=[p for p in qc["ignore"] if not p.startswith("mtp.")]))
    m4 = verify(nvidia_like, progress=False, engine="vllm")
    assert not m4["ok"] and "garbage drafts" in finding(m4, "mtp-format")["message"]


def test_deep_against_source_counts_exact_blocks(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_checkpoint(src, DIMS, seed=7, hard=HardCases(out_of_window=3))
    stats = convert(src, dst, "nvfp4", Options(), progress=False).stats
    result = verify(dst, deep=True, source=src, progress=False)
    assert sum(s["blocks"] for s in result["deep"].values()) == stats.blocks
    assert sum(s["exact_blocks"] for s in result["deep"].values()) == stats.exact_blocks
    assert set(result["deep"]) == {"layers.0", "layers.1", "mtp.0"}


@pytest.mark.parametrize("native", ["1", "0"])   # compare.c's pass, and the torch passes
def test_deep_names_the_file_and_tensor_of_an_invalid_source_scale(pair, tmp_path, monkeypatch, native):
    import requant.c_helpers
    from requant.report import c_compare

    src, dst = str(tmp_path / "src"), str(tmp_path / "w4a16")
    shutil.copytree(pair[0], src)
    convert(src, dst, "w4a16", Options(), progress=False)
    with Checkpoint.open(src) as ck:
        name = sorted(n for n in ck.names if ".ffn.experts.3.w2.scale" in n)[0]
        file = ck.shard_path(ck.locations[name])
    poke(src, name, torch.tensor([0xFF], dtype=torch.uint8))   # E8M0 NaN: no valid file holds it
    monkeypatch.setenv("REQUANT_NATIVE", native)
    requant.c_helpers.load.cache_clear()
    c_compare._library.cache_clear()
    try:
        run = run_cli(dst, "--deep", "--source", src)
    finally:
        monkeypatch.undo()
        requant.c_helpers.load.cache_clear()
        c_compare._library.cache_clear()
    assert run.exit_code == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"file {file}, tensor {name}: E8M0 scale is NaN" in lines[0], lines


@pytest.mark.skipif("w4a16" not in TARGETS, reason="the W4A16 target (requant/targets/w4a16.py) has not landed")
def test_clean_on_w4a16_output(pair, tmp_path):
    out = str(tmp_path / "w4a16")
    convert(pair[0], out, "w4a16", Options(), progress=False)
    result = verify(out, deep=True, progress=False)
    assert result["format"] == "w4a16"
    assert result["ok"], result["findings"]


def edit_config(path, fn):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    fn(config["quantization_config"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_w4a16_layouts_are_judged_per_engine(pair, tmp_path):
    """Each engine's W4A16 layout passes for it and fails for the other (FP8 linears described the
    other way); the expert target the last round wrote (gate/up/down names under .ffn.) fails both
    (vLLM 0.33.0 probes .ffn.experts.0.w1, SGLang 0.5.23 .mlp.experts.0.gate_proj)."""
    for engine, other in (("vllm", "sglang"), ("sglang", "vllm")):
        out = str(tmp_path / engine)
        convert(pair[0], out, "w4a16", Options(engine=engine), progress=False)
        assert verify(out, progress=False)["ok"] and verify(out, progress=False, engine=engine)["ok"]
        wrong = verify(out, progress=False, engine=other)
        assert not wrong["ok"] and codes(wrong) == {"w4a16-fp8-linears"}, wrong["findings"]
        old = str(tmp_path / f"{engine}-old-target")
        shutil.copytree(out, old)
        edit_config(old, lambda qc: qc["config_groups"]["group_0"].update(
            targets=[r"re:.*\.ffn\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"]))
        broken = verify(old, progress=False, engine="vllm")
        assert "w4a16-targets" in codes(broken) and "model.layers.0.ffn.experts.0.w1" in finding(broken, "w4a16-targets")["examples"][0]
        broken = verify(old, progress=False, engine="sglang")
        assert "w4a16-targets" in codes(broken) and "model.layers.0.mlp.experts.0.gate_proj" in finding(broken, "w4a16-targets")["examples"][0]
    mixed = str(tmp_path / "mixed")
    shutil.copytree(str(tmp_path / "sglang"), mixed)
    edit_config(mixed, lambda qc: qc.update(format="mixed-precision"))
    assert "pack-quantized" in finding(verify(mixed, progress=False, engine="sglang"), "w4a16-fp8-linears")["message"]


def test_kernel_named_per_gpu_family(pair):
    """The question requant exists for, answered offline from the engines' own selection rules."""
    src = verify(pair[0], progress=False, engine="vllm", gpu="sm_120")
    assert src["engines"]["vllm"]["kernel"]["method"] == "Mxfp4MoEMethod"
    assert "Marlin" in src["engines"]["vllm"]["kernel"]["backend"]       # MXFP4 source: no FP4 tensor cores there
    out = verify(pair[1], progress=False, engine="vllm", gpu="sm_120")
    assert "FP4 tensor cores" in out["engines"]["vllm"]["kernel"]["backend"] and out["ok"]
    hopper = verify(pair[1], progress=False, engine="sglang", gpu="sm_90")
    k = hopper["engines"]["sglang"]["kernel"]
    assert k["flags"] == "--moe-runner-backend marlin" and k["runs"]   # SGLang starts NVFP4 on Hopper only so
    result = run_cli(pair[1], "--engine", "vllm", "--gpu", "sm_100")
    assert result.exit_code == 0 and "FlashInfer TRT-LLM FP4" in result.output



@pytest.fixture(scope="module")
def layouts(pair, tmp_path_factory):
    """Each engine's own output of each format, and the broken layouts of issue 9 (M1-M5)."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for fmt in ("nvfp4", "w4a16"):
        for engine in ("vllm", "sglang"):
            out[fmt, engine] = str(root / f"{fmt}-{engine}")
            convert(pair[0], out[fmt, engine], fmt, Options(engine=engine), progress=False)
    out["old-target"] = str(root / "old-target")
    shutil.copytree(out["w4a16", "vllm"], out["old-target"])
    edit_config(out["old-target"], lambda qc: qc["config_groups"]["group_0"].update(
        targets=[r"re:.*\.ffn\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"]))
    out["mxfp4-mtp-unlisted"] = str(root / "mxfp4-mtp-unlisted")
    shutil.copytree(out["nvfp4", "sglang"], out["mxfp4-mtp-unlisted"])
    edit_config(out["mxfp4-mtp-unlisted"], lambda qc: qc.update(
        ignore=[p for p in qc["ignore"] if not p.startswith("mtp.")]))
    return out


@pytest.mark.parametrize("case, engine, code", [
    ("old-target", "vllm", 1),                # M1: vLLM probes .ffn.experts.0.w1
    ("old-target", "sglang", 1),              # M2: SGLang probes .mlp.experts.0.gate_proj
    (("w4a16", "vllm"), "sglang", 1),         # M3: attention scales as .weight_scale, no linear_fp8_config
    ("mxfp4-mtp-unlisted", "vllm", 1),        # M4: MXFP4 MTP experts ignore does not list: vLLM's NVFP4 method
    (("nvfp4", "sglang"), "vllm", 0),         # ... listed (SGLang's layout): vLLM's MXFP4 method
    (("nvfp4", "vllm"), "sglang", 1),         # M5: NVFP4 NextN experts under SGLang's MXFP4 method
    (("nvfp4", "vllm"), "vllm", 0),
    (("nvfp4", "sglang"), "sglang", 0),
    (("w4a16", "vllm"), "vllm", 0),
    (("w4a16", "sglang"), "sglang", 0),
])
def test_verify_engine_exit_status(layouts, case, engine, code):
    result = run_cli(layouts[case], "--engine", engine)
    assert result.exit_code == code, result.output
    assert ("FAILED" if code else "OK") in result.stdout.splitlines()[-1]
