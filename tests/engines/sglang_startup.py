"""Does SGLang start a DeepSeek-V4 checkpoint with these serve flags? `sglang_accepts` runs the
release's own server-args code on CPU, then its MoE start-up (sglang_harness), then asks the
pinned FlashInfer wheel whether the selected kernels are built for the GPU (sglang_kernels).

Executed from the sglang wheel, in the order arg_groups/pipeline.py runs them:
- the command line: an argparse parser holding every option SGLang declares (the `A[...]` fields
  of arg_groups/fields/*.py: name, aliases, choices from arg_groups/choices.py, bool flags as
  store_true, list fields nargs="+"), built the way arg_utils.add_cli_args_from_dataclass builds
  it (prefix abbreviations allowed, as argparse's default in server_args.prepare_server_args);
- model_hook.handle_model_specific_adjustments' DeepSeek-V4 part: the model override
  (model_overrides/deepseek_v4.py _deepseek_v4_overrides) and apply_deepseek_v4_defaults
  (deepseek_v4_hook.py), the speculative-algorithm assertion included;
- speculative_hook.handle_speculative_decoding's algorithm part: upper-casing,
  _resolve_speculative_algorithm_alias (NEXTN -> EAGLE), then _handle_eagle_family or
  _handle_dspark for the resolved algorithm.
Stand-ins: the resolving view is one namespace holding the parsed values (declare_resolution
writes into it); the model config is the checkpoint's config.json; attention backends are
("dsv4", "dsv4") (the override's choice); no DP attention, no disaggregation, no adaptive or
rejection sampling; platform probes answer for `gpu`. Any other name the executed code reads
raises (sglang_harness.Missing), so an unmodelled path fails loudly.
Not executed: the ~80 other hooks of the pipeline (memory, CUDA graphs, hicache, ...).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import traceback
from pathlib import Path
from types import SimpleNamespace as NS

from tests.engines import sglang_harness as H
from tests.engines import sglang_kernels as K
from tests.engines import wheels

FIELDS = "arg_groups/fields/"
LAUNCH = ("python", "python3", "-m", "sglang.launch_server", "sglang", "serve")


class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _ParseError(message)


def _choices_ns() -> dict:
    src = wheels.source("sglang", H.SRT + "arg_groups/choices.py")
    names = [t.id for n in ast.parse(src).body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name) and t.id.isupper()]
    ns = {}
    for name in names:
        try:
            H.ext("arg_groups/choices.py", [name], ns)
        except Exception:   # computed constants the parser does not need
            ns.pop(name, None)
    return ns


def parser() -> argparse.ArgumentParser:
    """The options SGLang declares, from the `A[type, meta] = default` fields of arg_groups/fields."""
    choices = _choices_ns()
    p = _Parser(prog="sglang serve", add_help=False)
    z = wheels._zip("sglang")
    for rel in sorted(n for n in z.namelist() if n.startswith(H.SRT + FIELDS) and n.endswith(".py")):
        for node in ast.walk(ast.parse(z.read(rel).decode())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(node.annotation, ast.Subscript) and getattr(node.annotation.value, "id", "") == "A"):
                continue
            typ, meta = node.annotation.slice.elts[:2]
            kw = {k.arg: k.value for k in meta.keywords} if isinstance(meta, ast.Call) else {}
            lit = lambda v, d=None: ast.literal_eval(v) if v is not None else d  # noqa: E731
            if lit(kw.get("no_cli"), False):
                continue
            name = node.target.id
            names = [lit(kw.get("cli_name")) or "--" + name.replace("_", "-")] + list(lit(kw.get("aliases"), []) or [])
            t = ast.unparse(typ)
            opts = {"dest": name}
            if "action" in kw:
                opts["nargs"] = "?"
            elif t in ("bool", "Optional[bool]"):
                opts["action"] = "store_true"
            elif t.startswith(("List[", "list[", "Optional[List[", "Optional[list[")):
                opts["nargs"] = "+"
            else:
                opts["type"] = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float}.get(t, str)
                c = kw.get("choices")
                if isinstance(c, ast.Name) and c.id in choices:
                    opts["choices"] = choices[c.id]
                elif t.startswith(("Literal[", "Optional[Literal[")):
                    sub = typ if t.startswith("Literal") else typ.slice
                    vals = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
                    opts["choices"] = [v.value for v in vals if isinstance(v, ast.Constant)]
            try:
                opts["default"] = ast.literal_eval(node.value) if node.value is not None else None
            except ValueError:
                opts["default"] = None
            try:
                p.add_argument(*names, **opts)
            except argparse.ArgumentError:   # an option two field classes declare: the first is kept
                pass
    return p


class _Args:
    """The resolving view: parsed values; what the executed code reads and the parser lacks raises."""

    def __init__(self, values: dict):
        self.__dict__.update(values)

    def __getattr__(self, name):
        raise RuntimeError(f"SGLang code read server_args.{name}, which the harness does not stand in for")


def _declare(server_args, _who, **values):
    server_args.__dict__.update(values)


class _SpecAlgo:
    """speculative/spec_info.py SpeculativeAlgorithm.from_string for the builtins (the enum's
    members are read from the file); supports_mixed_chunk is only asked when --enable-mixed-chunk."""

    def __init__(self, name):
        self.name = name

    @classmethod
    def from_string(cls, name):
        src = wheels.source("sglang", H.SRT + "speculative/spec_info.py")
        enum = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeAlgorithm")
        members = {t.id for s in enum.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
        if name is None or name.upper() not in members:
            raise ValueError(f"Unknown speculative algorithm name: {name}")
        return cls(name.upper())


def _hook_ns(server_args, hf_config, gpu):
    cap = H.GPU_CAPABILITY[gpu]
    ns = H._base_ns(
        resolving_view=lambda sa: sa, resolved_view=lambda sa: sa, declare_resolution=_declare,
        model_config_of=lambda sa: sa.model_config, run_post_process_pass=lambda sa, fn: None,
        attention_backends_of=lambda view: ("dsv4", "dsv4"), attn_dp_enabled_of=lambda view: False,
        derive_attn_tp_size=lambda tp_size, attn_cp_size, attn_dp_size: tp_size // max(attn_cp_size, 1) // max(attn_dp_size, 1),
        is_npu=lambda: False, is_gfx95_supported=lambda: False,
        current_platform=NS(is_out_of_tree=lambda: False),   # the in-tree CUDA platform
        Backend=H.Missing("Backend"), Optional=__import__("typing").Optional)
    ns["logger"] = logging.getLogger("sglang_accepts")
    H.Ctx.gpu = gpu
    is_sm100 = lambda: cap[0] == 10  # noqa: E731   utils/common.py is_sm100_supported: majors [10]
    H.wheels.fake_module("sglang.srt.utils.common", is_sm100_supported=is_sm100)
    H.wheels.fake_module("sglang.srt.speculative.spec_info", SpeculativeAlgorithm=_SpecAlgo)
    H.wheels.fake_module("sglang.srt.speculative.spec_registry", CustomSpecAlgo=type("CustomSpecAlgo", (), {}))
    # imported by _handle_iquest_q1_mtp_draft before it returns for any other architecture
    H.wheels.fake_module("sglang.srt.configs.iquest_q1", IQuestQ1MTPConfig=H.Missing("IQuestQ1MTPConfig"))
    H.wheels.fake_module("sglang.srt.utils.hf_transformers_utils", get_config=H.Missing("get_config"))
    return ns


def _strip_launcher(argv: list[str]) -> list[str]:
    argv = list(argv)
    while argv and (argv[0] in LAUNCH or argv[0].endswith("/python")):
        argv.pop(0)
    return argv


def _server_args(argv, checkpoint_dir: Path, gpu: str) -> _Args:
    raw = vars(parser().parse_args(_strip_launcher(argv)))
    hf = H.hf_config(checkpoint_dir)
    mc = H._model_config(H.engine(), checkpoint_dir)   # ModelConfig's quantization statements, executed
    raw.update(model_config=mc, device=raw.get("device") or "cuda")
    raw["model_path"] = str(checkpoint_dir)
    return _Args(raw), NS(**hf)


def _speculative(sa, ns):
    """handle_speculative_decoding's algorithm part, then the per-algorithm handler."""
    if sa.speculative_algorithm is None:
        return
    _declare(sa, "handle_speculative_decoding", speculative_algorithm=sa.speculative_algorithm.upper())
    _declare(sa, "handle_speculative_decoding", speculative_algorithm=ns["_resolve_speculative_algorithm_alias"](
        sa.speculative_algorithm, sa.speculative_draft_model_path, trust_remote_code=sa.trust_remote_code))
    _SpecAlgo.from_string(sa.speculative_algorithm)
    if sa.speculative_algorithm == "EAGLE":
        ns["_handle_eagle_family"](sa)
    elif sa.speculative_algorithm == "DSPARK":
        ns["_handle_dspark"](sa)


def _unread_draft_config(*, server_args):
    """dspark_config.py read_draft_checkpoint_config: it parses the draft's config through
    msgspec structs, which are not modelled here. _handle_dspark catches its failure and then
    takes gamma from --speculative-dspark-block-size, else DEFAULT_DSPARK_GAMMA, as SGLang does
    when the draft config cannot be read: the flags' acceptance is checked, not the gamma a
    real draft config would give."""
    raise NotImplementedError("the DSpark draft config is not read by this harness")


def _engine_fns(ns):
    H.ext("arg_groups/deepseek_v4_hook.py", ["_attention_is_tensor_parallel", "_default_dsv4_attention_backend",
                                              "apply_deepseek_v4_defaults"], ns)
    H.ext("arg_groups/speculative_hook.py", [
        "_should_auto_enable_hip_rejection_sampling", "_disable_overlap_schedule_for_cpu",
        "_resolve_speculative_algorithm_alias", "_check_oot_speculative_algorithm", "_handle_iquest_q1_mtp_draft",
        "_auto_choose_speculative_params", "_handle_eagle_family", "_DSPARK_DRAFT_SUBFOLDER",
        "_target_checkpoint_bundles_dspark_draft", "_target_checkpoint_dspark_subfolder", "_handle_dspark"], ns)
    dspark = H.ext("speculative/dspark_components/dspark_config.py", ["checkpoint_bundles_dspark_draft", "_cfg_get"],
                   H._base_ns())
    gamma = H.ext("speculative/dspark_components/dspark_config.py", ["DEFAULT_DSPARK_GAMMA"], {})
    H.wheels.fake_module("sglang.srt.speculative.dspark_components.dspark_config",
                         checkpoint_bundles_dspark_draft=dspark["checkpoint_bundles_dspark_draft"],
                         DEFAULT_DSPARK_GAMMA=gamma["DEFAULT_DSPARK_GAMMA"],
                         read_draft_checkpoint_config=_unread_draft_config)
    # environ.py: SGLANG_RAGGED_VERIFY_MODE defaults to "static"
    ragged = H.ext("speculative/ragged_verify.py", ["RaggedVerifyMode", "read_ragged_verify_mode"],
                   H._base_ns(envs=NS(SGLANG_RAGGED_VERIFY_MODE=H._Flag("static"))))
    H.wheels.fake_module("sglang.srt.speculative.ragged_verify", RaggedVerifyMode=ragged["RaggedVerifyMode"],
                         read_ragged_verify_mode=ragged["read_ragged_verify_mode"])
    return ns


def _where(e: BaseException) -> str:
    """file:line of the engine statement that raised (the innermost frame executed from the wheel)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith("sglang/")]
    return f"{frames[-1].filename.removeprefix('sglang/')}:{frames[-1].lineno}" if frames else "?"


def sglang_accepts(argv: list[str], checkpoint_dir, gpu: str, kernels: bool = True) -> tuple[bool, str]:
    """(ok, message): whether SGLang starts DeepSeek-V4 checkpoint `checkpoint_dir` on GPU family
    `gpu` (sm_80, sm_90, sm_100, sm_120) with serve command `argv` (the flags, or the whole
    `python -m sglang.launch_server ...` command split into words; `{path}` is replaced by the
    checkpoint). Stages, each SGLang's own code: the option parser, the DeepSeek-V4 model override
    and hook, the speculative-decoding hook, the MoE layers' construction (main model, and the
    NextN draft when a speculative algorithm is on). With `kernels`, a selected MoE kernel that the
    pinned FlashInfer does not build for `gpu` is a failure too (a runtime failure inferred from
    code, not run). The message names the stage and SGLang's words."""
    checkpoint_dir = Path(checkpoint_dir)
    argv = [str(checkpoint_dir) if a == "{path}" else a for a in argv]
    H.engine()   # the stand-in sglang.* modules the hooks import
    try:
        sa, hf = _server_args(argv, checkpoint_dir, gpu)
    except _ParseError as e:
        return False, f"argument parser: {e}"
    ns = _engine_fns(_hook_ns(sa, hf, gpu))
    model_arch = hf.architectures[0]
    try:
        overrides = H.engine().override_ns["_deepseek_v4_overrides"](sa, sa.model_config.hf_config)
        # the model override's values take effect where the user left the option at its default
        for k, v in overrides.items():
            if k != "moe_runner_backend" or sa.moe_runner_backend == "auto":
                _declare(sa, "model_override", **{k: v})
        ns["apply_deepseek_v4_defaults"](sa, model_arch)
    except (AssertionError, ValueError) as e:
        return False, f"DeepSeek-V4 hook ({_where(e)}): {type(e).__name__}: {e}"
    try:
        if sa.speculative_moe_runner_backend is None:   # overrides.py _speculative_moe_runner_default
            _declare(sa, "handle_speculative_decoding", speculative_moe_runner_backend=sa.moe_runner_backend)
        _speculative(sa, ns)
    except (AssertionError, ValueError, NotImplementedError) as e:
        return False, f"speculative hook ({_where(e)}): {type(e).__name__}: {e}"
    report = H.sglang_load_report(checkpoint_dir, gpu, sa.moe_runner_backend, load=False)
    drafting = sa.speculative_algorithm is not None
    refusals = [p for p in report.problems if "refuses to start" in p and (drafting or p.startswith("model.layers."))]
    if refusals:
        return False, f"MoE layer construction: {refusals[0]}"
    summary = (f"accepted: moe_runner_backend={report.backend}, speculative_algorithm={sa.speculative_algorithm}"
               + (f" (steps {sa.speculative_num_steps}, topk {sa.speculative_eagle_topk}, "
                  f"draft tokens {sa.speculative_num_draft_tokens})" if drafting else ""))
    if kernels:
        for nextn in (False, True) if drafting else (False,):
            method = next(iter(report.method(nextn)))
            _, lib, needs, _ = K.arithmetic(method, report.backend, gpu)
            built = False if lib == "none" else K.kernel_built(lib, gpu, needs)
            if built is False:
                return False, (f"kernel: {'NextN' if nextn else 'main'} experts' {method} on {report.backend} has no "
                               f"kernel for {gpu} in flashinfer {K.flashinfer_pin()} (from code, not run)")
    return True, summary
