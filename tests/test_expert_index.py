"""requant.experts.ExpertIndex: one view of a checkpoint's routed experts, whatever their layout,
and the rule that keeps layout branches inside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from requant import synth
from requant.errors import FormatError
from requant.experts import MAIN_KIND, ExpertIndex
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.targets import Options

REQUANT = Path(__file__).resolve().parent.parent / "requant"


@pytest.fixture(scope="module")
def per_expert(checkpoints):
    """DeepSeek-V4 (one tensor per expert and projection), 8 experts, an MTP block; and its NVFP4
    output for SGLang, which keeps the MTP block MXFP4."""
    src = checkpoints.source(synth.Dims(experts=8))
    return src, checkpoints.converted(src, "nvfp4", Options(mtp="keep", engine="sglang"))


@pytest.fixture(scope="module")
def stacked(checkpoints):
    """gpt-oss (every expert of a block in one tensor per part)."""
    return checkpoints.source(synth.Dims("gpt-oss-20b", experts=4))


def _index(path):
    ck = Checkpoint.open(path)
    return ck, ExpertIndex(ModelSpec.for_config(ck.config), ck)


def test_per_expert_blocks_kinds_formats_and_reads(per_expert):
    src, dst = per_expert
    ck, index = _index(src)
    with ck:
        model = index.model
        layers = model.value("num_layers")
        assert [b for b in index.in_order() if index.blocks[b].main] == [f"layers.{i}" for i in range(layers)]
        assert index.drafter_blocks() == ["mtp.0"] and index.blocks["mtp.0"].kind == "mtp"
        assert index.main_codec.name == "mxfp4"
        block = index.blocks["layers.1"]
        assert block.count == 8 and block.indices == list(range(8)) and len(block.units) == 8
        assert block.missing(10) == [8, 9] and block.extra(6) == [6, 7] and block.missing(8) == []
        # [E, rows, columns]: each listed expert's stored matrix, in the order asked
        weight = block.read("w1", "weight", [5, 2], "mxfp4")
        for row, e in zip(weight, (5, 2)):
            assert torch.equal(row, ck.tensor(f"layers.1.ffn.experts.{e}.w1.weight"))
        assert block.read("w1", "input_scale", [0], "mxfp4") is None   # a part the source does not store
        with pytest.raises(FormatError, match=r"^layers\.1\.ffn\.experts\.9: routed expert has no tensors"):
            block.read("w1", "weight", [0, 9], "mxfp4")
        unit = block.unit_of(3)
        assert index.where(unit, "w2") == "layers.1.ffn.experts.3.w2"
        assert index.unit(*index.key(unit)) is unit and block.unit_of(8) is None
        [(e, parts)] = block.matrices(unit, "w2", index.codec_of(unit, "w2"))
        assert e == 3 and torch.equal(parts["scale"], ck.tensor("layers.1.ffn.experts.3.w2.scale"))
    ck, out = _index(dst)
    with ck:
        assert out.main_codec.name == "nvfp4"
        assert {b: c.name for b, c in out.codec_by_block().items()}["mtp.0"] == "mxfp4"
        scales = out.blocks["layers.0"].read("w3", "weight_scale_2", [0, 1, 2], "nvfp4")
        assert scales.shape[0] == 3


def test_stacked_blocks_read_as_the_same_matrices(stacked):
    ck, index = _index(stacked)
    with ck:
        model = index.model
        assert index.drafter_blocks() == [] and all(b.main for b in index.blocks.values())
        name = index.in_order()[1]
        block = index.blocks[name]
        assert len(block.units) == 1 and block.count == 4 and block.indices == [0, 1, 2, 3]
        assert block.missing(6) == [4, 5] and block.extra(2) == [2, 3]
        proj = model.interleaved_gate_up
        stored = ck.tensor(block.part_names(proj)["weight"])          # [E, out, K/32, 16]
        picked = block.read(proj, "weight", [3, 0], "mxfp4")          # [2, out, K/2]
        assert picked.shape == (2, stored.shape[1], stored.shape[2] * stored.shape[3])
        assert torch.equal(picked[0], stored[3].reshape(stored.shape[1], -1))
        assert torch.equal(picked[1], stored[0].reshape(stored.shape[1], -1))
        assert block.read(proj, "bias", [1], "mxfp4").shape == (1, stored.shape[1])
        unit = block.units[0]
        assert index.where(unit) == model.experts_module(name) and block.unit_of(2) is unit
        by_expert = block.matrices(unit, proj, index.codec_of(unit, proj))
        assert [e for e, _ in by_expert] == [0, 1, 2, 3]
        assert torch.equal(by_expert[2][1]["weight"], stored[2].reshape(stored.shape[1], -1))


def test_reader_by_expert_reads_a_stacked_block_once_and_per_expert_blocks_lazily(stacked, per_expert):
    for path, expected_loads in ((stacked, [[0, 1, 2, 3]]), (per_expert[0], [[2], [1]])):
        ck, index = _index(path)
        with ck:
            block = index.blocks[index.in_order()[0]]
            loads = []

            def load(chosen):
                loads.append(list(chosen))
                return torch.tensor(chosen)

            get = block.reader_by_expert(load, lambda t, i: int(t[i]))
            assert [get(2), get(1)] == [2, 1]
            assert loads == expected_loads


def test_a_drafter_kind_is_data(per_expert):
    """Main or drafter follows the recipe's block kind, not the block's name."""
    ck, _ = _index(per_expert[0])
    with ck:
        model = ModelSpec.for_config(ck.config)
        kind = model.block_kind
        model.block_kind = lambda block: "draft" if block == "layers.2" else kind(block)
        index = ExpertIndex(model, ck)
        assert index.blocks["layers.2"].kind == "draft" and not index.blocks["layers.2"].main
        assert index.drafter_blocks() == ["layers.2", "mtp.0"]
        assert index.blocks["layers.0"].kind == MAIN_KIND


# The layout branches: `x.expert is None` (a stacked unit), `(block, None) in ...`, `key[1] is None`,
# a look at the recipe's expert_layout, the layout readers' classes.
_READERS = {"StackedReader", "PerExpertReader"}
# Modules that define a layout rather than read experts through one: the readers of each layout, the
# recipe schema (which keys a layout requires) and synth (which writes each layout's tensors).
_DEFINE_LAYOUTS = {"experts.py", "sources.py", "recipe.py", "synth.py"}


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _named_expert(node) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "expert")
            or (isinstance(node, ast.Attribute) and node.attr == "expert")
            or (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == 1))


def layout_branches(source: str) -> list[int]:
    """Line numbers of layout branches in Python `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(map(_is_none, sides)) \
                    and any(map(_named_expert, sides)):
                found.append(node.lineno)
            elif any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and isinstance(node.left, ast.Tuple) \
                    and any(map(_is_none, node.left.elts)):
                found.append(node.lineno)
            elif any(isinstance(s, ast.Attribute) and s.attr == "expert_layout" for s in sides):
                found.append(node.lineno)
        elif isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) in _READERS:
            found.append(node.lineno)
    return sorted(set(found))


def test_the_detector_sees_each_kind_of_layout_branch():
    assert layout_branches("if e.expert is None: pass") == [1]
    assert layout_branches("x = 1\nif expert is not None: pass") == [2]
    assert layout_branches("ok = (block, None) in side.experts") == [1]
    assert layout_branches("work = a if key[1] is not None else b") == [1]
    assert layout_branches("stacked = model.expert_layout == 'stacked'") == [1]
    assert layout_branches("s = isinstance(r, sources.StackedReader)") == [1]
    assert layout_branches("if expert.block is None or parts is None: pass\nx = key[0] is None") == []


def test_layout_branches_only_in_the_expert_view():
    offenders = {}
    for path in sorted(REQUANT.rglob("*.py")):
        if path.parent == REQUANT and path.name in _DEFINE_LAYOUTS:
            continue
        lines = layout_branches(path.read_text())
        if lines:
            offenders[str(path.relative_to(REQUANT.parent))] = lines
    assert not offenders, f"layout branches outside requant/experts.py (ask its ExpertIndex instead): {offenders}"
    assert layout_branches((REQUANT / "experts.py").read_text()), "the expert view itself tells the layouts apart"
