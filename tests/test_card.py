"""Every output carries its own model card and provenance record, made for one engine."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from requant import synth
from requant.card import CARD_MARK
from requant.convert import convert
from requant.targets import Options
from requant.verify import verify
from tests.helpers.cli import run_cli

from requant import engines as _engines  # noqa: E402

VLLM = f"vLLM {_engines.releases('vllm')[-1]}"   # the release a bare --engine vllm means here (none installed)

DIMS = synth.Dims(layers=2, experts=6, hash_layers=1)
UPSTREAM = "# DeepSeek-V4-Flash\n\nThe upstream card, with its license.\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("card") / "src")
    synth.write_checkpoint(src, DIMS, seed=2)
    with open(os.path.join(src, "README.md"), "w") as f:
        f.write(UPSTREAM)
    return src


def read(path, name):
    with open(os.path.join(path, name)) as f:
        return f.read()


@pytest.mark.parametrize("args, engine, mtp_row", [
    (["--out", "nvfp4"], VLLM, "| routed experts (MTP block) | NVFP4"),
    (["--out", "nvfp4", "--engine", "sglang"], "SGLang 0.5.23", "| routed experts (MTP block) | MXFP4 (kept"),
    (["--out", "w4a16", "--group-size", "32"], VLLM, "| routed experts (MTP block) | INT4 W4A16"),
    (["--out", "w4a16", "--group-size", "32", "--engine", "sglang"], "SGLang 0.5.23", "| routed experts (MTP block) | INT4 W4A16"),
])
def test_card_and_record(source, tmp_path, args, engine, mtp_row):
    dst = str(tmp_path / "out")
    result = run_cli("convert", source, dst, *args, "--quiet")
    assert result.returncode == 0, result.stderr
    card, record = read(dst, "README.md"), json.loads(read(dst, "requant.json"))
    assert read(dst, "README.source.md") == UPSTREAM          # kept, under another name
    assert CARD_MARK in card and UPSTREAM not in card
    assert f"for {engine}" in card and mtp_row in card and f"`{source}`" in card
    other = "SGLang" if engine.startswith("vLLM") else "vLLM"
    assert f"Made for **{other}" not in card and f"for {other}" not in card.split("## Serve it")[0]
    assert record["engine"]["name"] == engine.split()[0].lower() and record["engine"]["version"] == engine.split()[1]
    assert record["source"] == source and record["target_format"] == args[1] and record["engine"]["forced"] == []
    if args[1] == "nvfp4":
        acc = record["accuracy"]
        assert acc["exact_blocks"] == acc["blocks"] > 0 and f"{acc['blocks']:,} of {acc['blocks']:,}" in card
    else:
        assert record["options"]["group_size"] == 32 and "SQNR" in card and "dB" in card
    assert "## Serve it" in card and "Hopper" in card and "Blackwell" in card


def test_a_layout_for_one_engine_is_refused_by_the_other(source, tmp_path):
    """The default (vLLM) layout converts the MTP experts; SGLang 0.5.23 loads them as MXFP4."""
    dst = str(tmp_path / "vllm")
    convert(source, dst, "nvfp4", Options(), progress=False)
    assert verify(dst, progress=False)["ok"]
    assert not verify(dst, progress=False, engine="sglang")["ok"]
    assert read(dst, "requant.json").count("sglang") == 0


def test_force_writes_the_refused_layout_and_says_so(source, tmp_path):
    dst = str(tmp_path / "forced")
    refused = run_cli("convert", source, dst, "--out", "nvfp4", "--engine", "sglang", "--mtp", "convert", "--quiet")
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
    assert "garbage" in refused.stderr and "--force" in refused.stderr and not os.path.exists(dst)
    forced = run_cli("convert", source, dst, "--out", "nvfp4", "--engine", "sglang", "--mtp", "convert", "--force",
                     "--quiet")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(read(dst, "requant.json"))["engine"]["forced"]
    assert "converted with --force" in read(dst, "README.md")
    assert not verify(dst, progress=False)["ok"]               # requant.json names SGLang: an error there


def test_in_place_sets_the_source_card_aside_once(source, tmp_path):
    work = str(tmp_path / "ip")
    shutil.copytree(source, work)
    convert(work, None, "nvfp4", Options(), progress=False)
    assert read(work, "README.source.md") == UPSTREAM and CARD_MARK in read(work, "README.md")
