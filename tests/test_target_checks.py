"""A target checks what it writes: its config writer and its config checker read one set of
constants (Target.config, Target.check_config), and convert and `requant verify` reach the same
check. A config the target would not write is refused by convert before writing anything (the
plan's check), after writing the shards (check_written) and by `requant verify`, with one message."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

import requant.verify
from requant import synth
from requant.cli import cli
from requant.convert import convert
from requant.targets import Options, get_target
from requant.errors import RequantError

DIMS = synth.Dims(layers=2, experts=6, hidden=256, intermediate=128, hash_layers=1)

# (output format, what is changed in the quantization_config it writes, the finding's code)
CASES = {
    "nvfp4-group-size": ("nvfp4", lambda qc: qc.update(group_size=32), "group-size"),
    "nvfp4-moe-quant-algo": ("nvfp4", lambda qc: qc.update(moe_quant_algo="MXFP4"), "moe-quant-algo"),
    "nvfp4-layer-entry": ("nvfp4", lambda qc: next(iter(qc["quantized_layers"].values())).update(quant_algo="FP8"),
                          "quantized-layers"),
    "nvfp4-ignore-over-experts": ("nvfp4", lambda qc: qc["ignore"].append("*.experts"), "ignored-nvfp4"),
    "w4a16-group-size": ("w4a16", lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=64),
                         "group-size"),
    "w4a16-quant-method": ("w4a16", lambda qc: qc.update(quant_method="modelopt"), "quant-method"),
    "w4a16-scheme": ("w4a16", lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False),
                     "zero-point"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("target-checks") / "src")
    synth.write_checkpoint(src, DIMS, seed=5)
    return src


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """Each output format as convert writes it, once."""
    root = tmp_path_factory.mktemp("target-checks-out")
    outputs = {}
    for fmt in ("nvfp4", "w4a16"):
        outputs[fmt] = str(root / fmt)
        convert(source, outputs[fmt], fmt, Options(), progress=False)
    return outputs


def _writing(monkeypatch, fmt, change):
    """Make the target write its config with `change` applied to quantization_config."""
    target = get_target(fmt)
    written = target.config

    def config(self, blocks, stats):
        out = written(self, blocks, stats)
        change(out["quantization_config"])
        return out
    monkeypatch.setattr(target, "config", config)


def _first_error(result: dict) -> str:
    error = next(f for f in result["findings"] if f["severity"] == "error")
    return f"{error['code']}: {error['message']}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_convert_and_verify_refuse_a_config_the_target_would_not_write(case, source, converted, tmp_path,
                                                                       monkeypatch):
    fmt, change, code = CASES[case]

    # `requant verify` on the output as written, its config.json then edited
    edited = str(tmp_path / "edited")
    shutil.copytree(converted[fmt], edited)
    path = os.path.join(edited, "config.json")
    config = json.load(open(path))
    change(config["quantization_config"])
    json.dump(config, open(path, "w"))
    run = CliRunner().invoke(cli, ["verify", edited, "--json"])
    assert run.exit_code == 1, run.output
    result = json.loads(run.stdout)
    line = _first_error(result)
    assert line.startswith(f"{code}: "), result["findings"]

    # convert, writing that config: refused by the plan's check before anything is written ...
    _writing(monkeypatch, fmt, change)
    with pytest.raises(RequantError, match="refused before writing anything") as before:
        convert(source, str(tmp_path / "out"), fmt, Options(), progress=False)
    assert not os.path.exists(tmp_path / "out" / "config.json")
    # ... and, that check skipped, by the check after the shards are written, config.json unwritten
    monkeypatch.setattr(requant.verify, "check_conversion_plan", lambda plan: None)
    with pytest.raises(RequantError, match="fails `requant verify`") as after:
        convert(source, str(tmp_path / "out2"), fmt, Options(), progress=False)
    assert not os.path.exists(tmp_path / "out2" / "config.json")

    # the same first error, word for word, in all three
    codes = {f["code"] for f in result["findings"] if f["severity"] == "error"}
    for refusal in (before, after):
        message = str(refusal.value)
        first = min((message.find(f"{c}: ") for c in codes if f"{c}: " in message), default=-1)
        assert first >= 0 and message[first:].startswith(line), (message, line)


@pytest.mark.parametrize("fmt", ["nvfp4", "w4a16"])
def test_what_a_target_writes_passes_its_own_check(fmt, converted):
    result = requant.verify.verify(converted[fmt], progress=False)
    config_codes = {"no-quantization-config", "quant-method", "expert-dtype", "moe-quant-algo", "group-size",
                    "quant-algo", "quantized-layers", "ignore", "ignored-nvfp4", "config-groups", "hf-quant-config",
                    "config-disagreement", "zero-point", "strategy", "ct-format", "quantization-status"}
    assert result["ok"], result["findings"]
    assert not [f for f in result["findings"] if f["code"] in config_codes], result["findings"]
