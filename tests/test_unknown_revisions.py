"""A revision a recipe knows only by name (recipe `unknown_revisions`: DeepSeek-V4.1-Flash-1017, whose
config no public source gives): a checkpoint that names itself so, by its Hub repository, config.json's
`_name_or_path` or its model card, is refused in one line by convert, verify and advise, and inspect
says why it reads no recipe; --model reads it as the model named (convert converts it so, and the
output verifies). A checkpoint of the same layout that names nothing of the kind is read as before."""

from __future__ import annotations

import json
import os

import pytest

from requant import synth
from requant.errors import UnsupportedCheckpoint
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec, load_recipes, refuse_unknown_revision
from requant.recipe import RecipeError, parse
from tests.helpers.cli import run_cli

V41 = "deepseek-v4.1-flash"
REVISION = "DeepSeek-V4.1-Flash-1017"


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("v41") / "v41")
    synth.write_checkpoint(path, synth.Dims(V41), seed=3)
    return path


def _named(v41: str, where: str, name_or_path: str | None = None, card: str | None = None) -> str:
    """A copy of the V4.1 checkpoint (shards hard-linked) that names itself as given."""
    os.makedirs(where)
    for name in os.listdir(v41):
        if name != "config.json":
            os.link(os.path.join(v41, name), os.path.join(where, name))
    with open(os.path.join(v41, "config.json")) as f:
        config = json.load(f)
    if name_or_path is not None:
        config["_name_or_path"] = name_or_path
    with open(os.path.join(where, "config.json"), "w") as f:
        json.dump(config, f)
    if card is not None:
        with open(os.path.join(where, "README.md"), "w") as f:
            f.write(card)
    return where


def _refusal(place: str, seen: str) -> str:
    return (f"{seen} ({place}): no public config of {REVISION} was found (docs/models/deepseek-v4-family.md, "
            f"section 7.4), so requant has no recipe for it; if it matches {V41}, --model {V41} reads it as that")


@pytest.mark.parametrize("name_or_path, card, place, seen", [
    (f"deepseek-ai/{REVISION}", None, "config.json _name_or_path", f"deepseek-ai/{REVISION}"),
    (None, f"---\nlicense: mit\nbase_model: deepseek-ai/{REVISION}\n---\n# Something\n", "README.md front matter",
     f"base_model: deepseek-ai/{REVISION}"),
    (None, f"---\nlicense: mit\n---\n\n# {REVISION}\n\ntext\n", "README.md title", REVISION),
])
def test_a_checkpoint_naming_the_revision_is_refused_in_one_line(v41, tmp_path, name_or_path, card, place, seen):
    path = _named(v41, str(tmp_path / "named"), name_or_path, card)
    line = f"requant: error: {path}: {_refusal(place, seen)}"
    for args in (["convert", path, str(tmp_path / "out"), "--out", "nvfp4"], ["advise", path, "--gpu", "sm_100"]):
        result = run_cli(*args)
        assert (result.returncode, result.stderr.strip()) == (1, line), args
    assert not os.path.exists(tmp_path / "out")
    verified = run_cli("verify", path)
    assert verified.returncode == 1 and _refusal(place, seen) in verified.stderr
    inspected = run_cli("inspect", path)
    assert inspected.returncode == 0 and f"no recipe      {path}: {_refusal(place, seen)}" in inspected.stdout


def test_a_hub_snapshot_of_the_revision_is_refused(v41, tmp_path):
    """The Hugging Face cache's folder names the repository a snapshot is of."""
    path = _named(v41, str(tmp_path / f"models--deepseek-ai--{REVISION}" / "snapshots" / "0123abcd"))
    with pytest.raises(UnsupportedCheckpoint) as e:
        with Checkpoint.open(path) as ck:
            ModelSpec.for_checkpoint(ck, identify=True)
    assert str(e.value) == f"{path}: {_refusal('Hub repository id', f'deepseek-ai/{REVISION}')}"


def test_model_reads_it_as_that_in_verify_advise_and_inspect(v41, tmp_path):
    from click.testing import CliRunner

    from requant.cli import cli

    path = _named(v41, str(tmp_path / "named"), f"deepseek-ai/{REVISION}")
    for args in (["verify", path], ["advise", path, "--gpu", "sm_100"], ["inspect", path]):
        result = CliRunner().invoke(cli, [*args, "--model", V41, "--json"])
        assert result.exit_code == 0, (args, result.output)
        info = json.loads(result.stdout)
        assert info.get("recipe", "deepseek_v41") == "deepseek_v41" and info.get("ok", True), (args, info)
    result = CliRunner().invoke(cli, ["inspect", path, "--model", "deepseek-v4-flash"])
    assert result.exit_code == 0 and "--model deepseek-v4-flash is a deepseek_v4 model, but this checkpoint is not" \
        in result.stdout


def test_model_converts_it_as_that_and_the_output_verifies(v41, tmp_path):
    path = _named(v41, str(tmp_path / "named"), f"deepseek-ai/{REVISION}")
    out = str(tmp_path / "out")
    result = run_cli("convert", path, out, "--out", "nvfp4", "--model", V41, "--quiet")
    assert result.returncode == 0, result.stderr
    with open(os.path.join(out, "requant.json")) as f:
        assert json.load(f)["model"] == V41
    # the output keeps the source's _name_or_path; its requant.json says what it was read as
    verified = run_cli("verify", out)
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.parametrize("name_or_path", ["deepseek-ai/DeepSeek-V4.1-Flash", "deepseek-ai/DeepSeek-V4.1-Flash-10170"])
def test_a_checkpoint_naming_another_release_is_read_as_before(v41, tmp_path, name_or_path):
    path = _named(v41, str(tmp_path / "named"), name_or_path, card="# DeepSeek-V4.1-Flash\n")
    with Checkpoint.open(path) as ck:
        assert ModelSpec.for_checkpoint(ck, identify=True).name == "deepseek_v41"
    result = run_cli("convert", path, str(tmp_path / "out"), "--out", "nvfp4", "--dry-run")
    assert result.returncode == 0, result.stderr


def test_the_match_is_the_whole_name_in_any_case():
    (recipe,) = [r for r in load_recipes() if r.unknown_revisions]
    refuse_unknown_revision(recipe, "x", [("DeepSeek-V4.1-Flash", "a"), ("DeepSeek-V4.1-Flash-10170", "b"),
                                          ("my-DeepSeek-V4.1-Flash-1017x", "c")])
    for text in ("nvidia/deepseek-v4.1-flash-1017-NVFP4", f"{REVISION}@0123", f"[{REVISION}]"):
        with pytest.raises(UnsupportedCheckpoint, match=r"^x: "):
            refuse_unknown_revision(recipe, "x", [(text, "somewhere")])


def test_an_unknown_revision_must_name_a_model_of_its_recipe():
    raw = {p: json.loads(open(os.path.join("recipes", p)).read()) for p in ("deepseek_v4.json", "deepseek_v41.json")}
    raw["deepseek_v41.json"]["unknown_revisions"][0]["like"] = "deepseek-v4-flash"
    with pytest.raises(RecipeError, match=r"^recipe deepseek_v41.json: unknown_revisions\[0\].like: 'deepseek-v4-flash' "
                                          r"is not one of models$"):
        parse(raw["deepseek_v41.json"], "deepseek_v41.json", raw)
