"""The tier's checkpoints: a synthetic source and requant's outputs of it, made once per module."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from requant import synth
from requant.convert import convert, plan_conversion
from requant.errors import UnsupportedError
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.targets import Options

# the shape the start-up and kernel-table tests use: one hash-routed layer, one compressed one, MTP
SMALL = synth.Dims(layers=3, hash_layers=2)


def source_and_outputs(root: Path, dims: synth.Dims, seed: int, outputs: dict[str, tuple[str, Options]],
                       source_name: str = "mxfp4") -> dict[str, str]:
    """{source_name: the synthetic source, name: its conversion} for each name -> (format, options)."""
    paths = {source_name: str(root / "src")}
    synth.write_checkpoint(paths[source_name], dims, seed=seed)
    for name, (fmt, options) in outputs.items():
        paths[name] = str(root / name)
        convert(paths[source_name], paths[name], fmt, options, progress=False)
    return paths


# small checkpoints of each model with a DSpark drafter (the DSpark files of the tier)
DSPARK_MODELS = {"v4-0731": synth.Dims("deepseek-v4-flash-0731", layers=3, experts=6),
                 "v4-pro-0813": synth.Dims("deepseek-v4-pro-0813", layers=3, experts=6),
                 "v41": synth.Dims("deepseek-v4.1-flash"),
                 "v4-vision": synth.Dims("deepseek-v4-flash-vision-exp", layers=3, hash_layers=2, experts=6)}


def dspark_source_and_outputs(root: Path, model: str, engine: str, version: str, seed: int,
                              outputs: dict[str, tuple[str, Options]],
                              w4a16_outputs: dict[str, tuple[str, Options]]) -> dict[str, str]:
    """source_and_outputs of DSPARK_MODELS[model], with `w4a16_outputs` only where `engine` `version`'s
    rules serve W4A16 for it (V4.1's refuse it), drafter_mode_outputs, and under DONOR the checkpoint
    of the same model whose drafter --drafter graft takes (another seed: other drafter bytes)."""
    dims = DSPARK_MODELS[model]
    served = dims.spec.engine(engine, version).refusal("w4a16") is None
    synth.write_checkpoint(str(root / DONOR), dims, seed=seed + 1)
    return {DONOR: str(root / DONOR),
            **source_and_outputs(root, dims, seed, {**outputs, **(w4a16_outputs if served else {}),
                                                    **drafter_mode_outputs(dims, engine, version, root / DONOR)})}


# convert --drafter: the modes that re-encode nothing but the drafter's routed experts (graft: the
# donor's drafter, kept as it stores it)
DRAFTER_MODES = ("keep", "convert", "graft")
DONOR = "donor"   # beside the source ("src"): the checkpoint --drafter graft takes the drafter of
DRAFTER_MODE_CASES = [(fmt, mode) for fmt in ("nvfp4", "w4a16") for mode in DRAFTER_MODES]


def drafter_written(fmt: str, mode: str) -> str:
    """The format the drafter's experts are written in by --out `fmt` --drafter `mode` (an MXFP4 source)."""
    return fmt if mode == "convert" else "mxfp4"


def drafter_mode_name(fmt: str, mode: str) -> str:
    return f"{fmt}-drafter-{mode}"


def drafter_mode_options(engine: str, version: str, mode: str, donor: Path) -> Options:
    return Options(engine=f"{engine}=={version}", mtp=mode, donor=str(donor) if mode == "graft" else None)


def drafter_mode_outputs(dims: synth.Dims, engine: str, version: str, donor: Path) -> dict[str, tuple[str, Options]]:
    """One output per (format, drafter mode) that `engine` `version`'s rules let convert write without
    --force; the tier checks that convert refuses the others in one line."""
    rules = dims.spec.engine(engine, version)
    return {drafter_mode_name(fmt, mode): (fmt, drafter_mode_options(engine, version, mode, donor))
            for fmt, mode in DRAFTER_MODE_CASES
            if rules.refusal(fmt) is None and rules.mtp_loads(fmt, drafter_written(fmt, mode))}


def drafter_mode_refusal(src: str, engine: str, version: str, fmt: str, mode: str) -> str:
    """The one-line message convert's planning refuses --out `fmt` --drafter `mode` with."""
    try:
        plan_conversion(src, fmt, drafter_mode_options(engine, version, mode, Path(src).parent / DONOR))
    except UnsupportedError as refused:
        return str(refused)
    raise AssertionError(f"--out {fmt} --drafter {mode} for {engine} {version} was planned, not refused")


def graft_differences(output: str, donor: str) -> list[str]:
    """The donor's drafter tensors (under a drafter block of its recipe) that a --drafter graft
    output lacks or holds with other dtype, shape or bytes; empty when it has each byte for byte."""
    with Checkpoint.open(output) as out, Checkpoint.open(donor) as given:
        spec = ModelSpec.for_checkpoint(given)
        drafter = [n for n in given.names if spec.drafter_block_of(n)]
        assert drafter, donor
        return [n for n in drafter if n not in out.locations or out.info(n).spec != given.info(n).spec
                or not torch.equal(out.tensor(n).view(-1).view(torch.uint8), given.tensor(n).view(-1).view(torch.uint8))]


def per_format(engine: str) -> dict[str, tuple[str, Options]]:
    """One output of each format requant writes, laid out for `engine` with default options."""
    return {fmt: (fmt, Options(engine=engine)) for fmt in ("nvfp4", "w4a16")}


def with_ignore(src: str, dst: Path, ignore: list[str]) -> str:
    """A copy of output `src` whose quantization_config.ignore is `ignore` (shards linked)."""
    dst.mkdir()
    for entry in Path(src).iterdir():
        if entry.name != "config.json":
            (dst / entry.name).symlink_to(entry)
    config = json.loads((Path(src) / "config.json").read_text())
    config["quantization_config"]["ignore"] = ignore
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)
