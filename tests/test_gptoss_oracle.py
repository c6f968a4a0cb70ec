"""The NVFP4 oracle for gpt-oss's stacked experts: requant's output against ModelOpt's own cast.

What "bytes equal to ModelOpt's own lossless cast" means for a stacked expert tensor
(gate_up_proj_blocks U8 [E, 2I, H/32, 16] + gate_up_proj_scales U8 [E, 2I, H/32]; down_proj the same
with [E, H, I/32, ...]):

- ModelOpt's MXFP4 -> NVFP4 cast works per SOURCE TENSOR: `mxfp4_to_nvfp4_global_amax` takes "the
  E8M0 scales for one MXFP4 source layer" and pins weight_scale_2 = 2^(k_max - 8) over all of
  them (modelopt 0.47.0, torch/quantization/utils/numeric_utils.py; shard_cast_utils.py
  quantize_mxfp4_to_nvfp4_lossless / mxfp4_kmax). For gpt-oss one source tensor holds every expert
  of the layer, gate and up interleaved, so ModelOpt gives ONE global scale per layer and
  projection: shared by all E experts and by gate and up. ModelOpt's HF export of GptOssExperts
  agrees: one weight quantizer per stacked weight (quantization/plugins/huggingface.py
  _QuantGptOssExperts: gate_up_proj_weight_quantizer, down_proj_weight_quantizer), exported as a
  scalar <proj>_weight_scale_2 (export/unified_export_hf.py _export_quantized_weight).
- requant's NVFP4 bytes for a stacked tensor must therefore equal, byte for byte,
  quantize_mxfp4_to_nvfp4_lossless(blocks viewed [E, rows, K/2], scales, k_max of the WHOLE stacked
  tensor): the E2M1 codes [E, rows, K/2], the E4M3 block scales [E, rows, K/16] and the global scale,
  written into every per-expert slot of whatever global-scale parameter the output layout has
  (vLLM's ModelOptNvFp4FusedMoE registers w13_weight_scale_2 [E, 2] and w2_weight_scale_2 [E]).
  A layout that stores the (E, in, out) orientation (ModelOpt's own export) is compared after
  transposing back: orientation is a permutation, not a different cast.
- A per-expert global scale would be a different cast (still exact inside each expert's window):
  it changes the block-scale bytes of every expert whose own k_max is below the layer's, so it
  is not "ModelOpt's own" and would fail this oracle. The test below shows both facts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.formats import mxfp4, nvfp4
from requant.io.checkpoint import Checkpoint

shard_cast_utils = pytest.importorskip("modelopt.torch.export.shard_cast_utils")

E, ROWS, K = 4, 32, 64   # a tiny gate_up_proj: 4 experts, 2I = 32 interleaved rows, hidden 64


def stacked_source(seed: int):
    """gate_up_proj_blocks / _scales of one layer, expert e's exponents lowered by 3e octaves so
    the experts' own k_max differ (as trained experts' do)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, ROWS, K // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 124, (E, ROWS, K // 32), generator=g, dtype=torch.uint8)
    scales -= (3 * torch.arange(E, dtype=torch.uint8)).view(E, 1, 1)
    return blocks, scales


def modelopt_stacked(blocks, scales):
    """ModelOpt's lossless cast of the stacked tensor, one k_max for the whole tensor."""
    k_max = shard_cast_utils.mxfp4_kmax(scales.view(torch.float8_e8m0fnu))
    q, ws, ws2, n_blocks, n_lossless = shard_cast_utils.quantize_mxfp4_to_nvfp4_lossless(
        blocks.reshape(E, ROWS, K // 2).view(torch.int8), scales.view(torch.float8_e8m0fnu), k_max, "cpu")
    return q.view(torch.uint8), ws.view(torch.uint8), float(ws2), n_blocks == n_lossless


def requant_cast(blocks, scales, k_max):
    cast = nvfp4.cast_from_mxfp4(blocks.reshape(E * ROWS, K // 2).numpy(), scales.reshape(E * ROWS, -1).numpy(), k_max)
    return (torch.from_numpy(cast.weight).view(E, ROWS, -1), torch.from_numpy(cast.weight_scale).view(E, ROWS, -1),
            cast.weight_scale_2)


@pytest.mark.parametrize("seed", range(3))
def test_stacked_cast_with_one_global_scale_equals_modelopt(seed):
    blocks, scales = stacked_source(seed)
    ref_w, ref_s, ref_s2, lossless = modelopt_stacked(blocks, scales)
    assert lossless
    w, s, s2 = requant_cast(blocks, scales, mxfp4.max_exponent(scales.numpy()))
    assert torch.equal(w, ref_w) and torch.equal(s, ref_s) and s2 == ref_s2
    # gate (even rows) and up (odd rows) are one tensor: nothing to pair up, one scale by construction
    decoded = nvfp4.decode(w.reshape(E * ROWS, -1), s.reshape(E * ROWS, -1), s2)
    assert torch.equal(decoded, mxfp4.decode(blocks.reshape(E * ROWS, -1), scales.reshape(E * ROWS, -1)))


def test_per_expert_global_scale_is_a_different_cast():
    blocks, scales = stacked_source(0)
    ref_w, ref_s, ref_s2, _ = modelopt_stacked(blocks, scales)
    for e in range(E):
        k_e = mxfp4.max_exponent(scales[e].numpy())
        cast = nvfp4.cast_from_mxfp4(blocks[e].reshape(ROWS, K // 2).numpy(), scales[e].numpy(), k_e)
        same_codes = np.array_equal(cast.weight, ref_w[e].numpy())
        same_scales = np.array_equal(cast.weight_scale, ref_s[e].numpy())
        assert same_codes   # both casts keep every code: all blocks are inside both windows here
        # expert 0 holds the layer's k_max; the others' block scales and global scale differ
        assert same_scales == (e == 0) and (cast.weight_scale_2 == ref_s2) == (e == 0), e


def test_converted_gpt_oss_equals_modelopt_cast_in_modelopt_layout(tmp_path):
    """`requant convert --out nvfp4 --force` on a synthetic gpt-oss: every stacked projection's
    codes, block scales and global scale equal ModelOpt's lossless cast of the same source tensor,
    stored as ModelOpt's export stores them ((E, in, out), `<proj>`, `<proj>_weight_scale[_2]`);
    biases pass through; config.json and hf_quant_config.json say modelopt / NVFP4."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    synth.write_checkpoint(src, synth.Dims("gpt-oss-20b", layers=2, experts=4, hidden=128, intermediate=256),
                           hard=synth.HardCases(out_of_window=2, zero_blocks=1, neg_zero_blocks=1))
    result = CliRunner().invoke(cli, ["convert", src, dst, "--out", "nvfp4", "--force"])
    assert result.exit_code == 0, result.output
    compared = 0
    with Checkpoint.open(src) as source, Checkpoint.open(dst) as out:
        for layer in range(2):
            module = f"model.layers.{layer}.mlp.experts"
            for proj in ("gate_up_proj", "down_proj"):
                blocks = source.tensor(f"{module}.{proj}_blocks").view(torch.uint8)
                scales = source.tensor(f"{module}.{proj}_scales").view(torch.uint8)
                experts, rows, groups, _ = blocks.shape
                k_max = shard_cast_utils.mxfp4_kmax(scales.view(torch.float8_e8m0fnu))
                q, ws, ws2, _, _ = shard_cast_utils.quantize_mxfp4_to_nvfp4_lossless(
                    blocks.reshape(experts, rows, groups * 16).view(torch.int8), scales.view(torch.float8_e8m0fnu),
                    k_max, "cpu")
                weight = out.tensor(f"{module}.{proj}").view(torch.uint8)
                weight_scale = out.tensor(f"{module}.{proj}_weight_scale").view(torch.uint8)
                assert weight.shape == (experts, groups * 16, rows)        # (E, in/2, out)
                assert weight_scale.shape == (experts, groups * 2, rows)   # (E, in/16, out)
                assert torch.equal(weight.transpose(1, 2), q.view(torch.uint8))
                assert torch.equal(weight_scale.transpose(1, 2), ws.view(torch.uint8))
                assert float(out.tensor(f"{module}.{proj}_weight_scale_2")) == float(ws2)
                assert torch.equal(out.tensor(f"{module}.{proj}_bias"), source.tensor(f"{module}.{proj}_bias"))
                compared += 1
        assert not any(n.endswith(("_blocks", "_scales")) for n in out.names)
        config = out.config["quantization_config"]
    assert compared == 4
    assert (config["quant_method"], config["quant_algo"]) == ("modelopt", "NVFP4")
    hf_quant = json.load(open(tmp_path / "dst" / "hf_quant_config.json"))["quantization"]
    assert hf_quant["quant_algo"] == "NVFP4" and hf_quant["exclude_modules"] == config["ignore"]
