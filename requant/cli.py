"""Command line: parses arguments and calls the library; nothing else happens here."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shlex
import signal
import sys
import time

import click

from requant import __version__, formats
from requant import engines
from requant.engines import GPU_FAMILIES
from requant.errors import (EXIT_BUG, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_SHORT_OF_SPACE, EXIT_USAGE, RequantError,
                            UsageError, describe_os_error)
from requant.engines.serve import HELP as SERVE_HELP
from requant.targets import TARGETS

INPUT_SCALE_HELP = (
    "Activation scale (input_scale) written for every converted projection. Default: a data-free "
    "bound from the checkpoint itself (MoE input <= sqrt(hidden) * max|ffn_norm|; down-projection "
    "input <= 1.5 * 10 * silu(10)), divided by 6 * 448, so no activation can overflow a W4A4 kernel. "
    "NVIDIA's calibration-free policy is 1.0. Weight-only (W4A16/Marlin) engines ignore it."
)


ENGINE_HELP = (
    "Serving engine the output is laid out for, NAME or NAME==VERSION "
    f"(e.g. vllm=={engines.releases('vllm')[-1]}; default: "
    "the release installed here, else the newest requant has checked): engines disagree about the MTP "
    "block's experts (vLLM loads them as NVFP4, SGLang as MXFP4) and about W4A16's FP8 attention, so "
    "one directory cannot serve both. Default vllm."
)

# the vLLM releases whose Marlin takes one factor per layer from the largest block scale
_LARGEST_RULE = engines.releases_with_marlin_rule("vllm", "largest")


class EngineSpec(click.ParamType):
    """--engine NAME or NAME==VERSION: checked here, so a typo is click's usage error (exit 2)."""

    name = "vllm|sglang[==VERSION]"

    def convert(self, value, param, ctx):
        try:
            name, version = engines.parse_spec(value)
        except RequantError as e:
            self.fail(str(e), param, ctx)
        return f"{name}=={version}" if version else name


class DrafterMode(click.ParamType):
    """--drafter keep, convert, or graft PATH, which the command (GraftOperand) hands over joined as
    graft=PATH (a spelling taken as it is too, so the resume command, which prints it so, parses)."""

    name = "keep|convert|graft PATH"

    def convert(self, value, param, ctx):
        mode, _, donor = value.partition("=")
        if mode in ("keep", "convert") and not donor or mode == "graft" and donor:
            return value
        if mode == "graft":
            self.fail("graft takes the checkpoint whose drafter it attaches: --drafter graft PATH", param, ctx)
        self.fail(f"{value!r} is not keep, convert or graft PATH", param, ctx)


class GraftOperand(click.Command):
    """`--drafter graft PATH`: an option takes one word, so the mode's operand is joined to it
    (graft=PATH) before click parses the line."""

    options = ("--drafter", "--mtp")

    def parse_args(self, ctx, args):
        joined, i = [], 0
        while i < len(args):
            word = args[i]
            if word == "--":
                joined += args[i:]
                break
            graft_next = (word in self.options and args[i + 1:i + 2] == ["graft"]
                          and i + 2 < len(args) and not args[i + 2].startswith("-"))
            if graft_next:
                joined += [word, "graft=" + args[i + 2]]
                i += 3
                continue
            if word in {f"{o}=graft" for o in self.options} and i + 1 < len(args) and not args[i + 1].startswith("-"):
                joined.append(f"{word}={args[i + 1]}")
                i += 2
                continue
            joined.append(word)
            i += 1
        return super().parse_args(ctx, joined)


SOURCE_FORMATS = sorted({source for name in TARGETS for source in formats.encoder_sources(name)})
# The group sizes of the targets that take --group-size.
GROUP_SIZES = [str(g) for g in sorted({g for t in TARGETS.values() for g in t.codec.group_sizes
                                       if "group_size" in {f.name for f in dataclasses.fields(t.options_type)}})]


def _model_names() -> list[str]:
    from requant.model import named_models

    return sorted(named_models())


def _reduced_default(dim: str) -> str:
    """synth's default for one dimension, per model where the recipes differ (e.g. "5; gpt-oss-*: 2")."""
    from requant.model import named_models

    by_value: dict = {}
    for name, (recipe, _) in sorted(named_models().items()):
        by_value.setdefault(recipe.synth.reduced.get(dim), []).append(name)
    if len(by_value) == 1:
        return str(next(iter(by_value)))
    default = next(v for v, names in by_value.items() if _default_model_name() in names)
    others = "; ".join(f"{', '.join(names)}: {v}" for v, names in by_value.items() if v != default)
    return f"{default}; {others}"


def _reads_as_model(what: str):
    """--model for a command that reads checkpoint `what` as it is."""
    return click.option("--model", "model_name", type=click.Choice(_model_names()), default=None,
                        help=f"The named model {what} is read as; default: detected from config.json and the tensor "
                             "names. A checkpoint that names itself a revision requant knows only by name needs it; a "
                             "model of another kind than the checkpoint's is refused.")


def _default_model_name() -> str:
    from requant.model import default_model_name

    return default_model_name()


DRY_RUN_SHORT_OF_SPACE = EXIT_SHORT_OF_SPACE   # convert --dry-run: the plan is fine, the disk is too small

# One text for the README's table and every command's --help.
EXIT_STATUS_HELP = f"""\b
Exit status: 0 done; {EXIT_INPUT} bad input or I/O (a checkpoint or file requant cannot use, a
failed read or write; verify and validate: checks failed); {EXIT_USAGE} bad usage (an option
value or combination refused, a missing pip extra); {EXIT_SHORT_OF_SPACE} convert --dry-run: too
little free disk; {EXIT_BUG} a bug in requant (REQUANT_DEBUG=1 prints the traceback);
{EXIT_INTERRUPTED} interrupted (Ctrl-C, SIGTERM or SIGHUP) before the command finished. An error
is one line on stderr; with --json it is also printed on stdout as {{"error": {{"code": N,
"message": "..."}}}}.
-q/--quiet: no progress bars, library warnings off; -v/--verbose: log requant's steps (-vv its debug lines).
Progress bars are drawn only when stderr is a terminal."""

# Set by main(): the command runs as its own process (not in a test's CliRunner), so once it has
# finished a late Ctrl-C may be ignored instead of turning a finished job into "interrupted".
_OWN_PROCESS = False


def _fail(message: str, code: int, as_json: bool = False) -> None:
    """One line on stderr (and, with --json, the error as a JSON object on stdout); exit `code`."""
    message = " ".join(str(message).split()) or "error"
    if as_json:
        click.echo(json.dumps({"error": {"code": code, "message": message}}))
    click.echo(f"requant: error: {message}", err=True)
    sys.exit(code)


# Ctrl-C, `kill PID` and a closed terminal all ask the command to stop: each is answered alike
# (a conversion keeps its work and says how to resume; exit 130).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop_requested(signum, frame) -> None:
    raise KeyboardInterrupt


def _finished_quietly() -> None:
    """The command's work is done: a stop request from now on must not turn it into a failure."""
    if _OWN_PROCESS:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


class _StderrHandler(logging.StreamHandler):
    """Log records to whatever sys.stderr is when they are emitted (a test's CliRunner swaps it)."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


_LOG_HANDLER = _StderrHandler()
_LOG_HANDLER.setFormatter(logging.Formatter("requant: %(levelname)s: %(name)s: %(message)s"))
log = logging.getLogger("requant.cli")


def _set_verbosity(quiet: bool, verbose: int) -> None:
    """-v/-vv: requant's own steps (the 'requant' loggers) at INFO/DEBUG. Other libraries stay at
    WARNING (ERROR with -q) whatever -v says: matplotlib's font search and urllib3's requests are
    not requant's steps."""
    others = logging.ERROR if quiet else logging.WARNING
    root = logging.getLogger()
    if _LOG_HANDLER not in root.handlers:
        root.addHandler(_LOG_HANDLER)
    root.setLevel(others)
    logging.getLogger("requant").setLevel(others if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)])


def progress_shown(quiet: bool) -> bool:
    """Progress bars only for a person watching: never with --quiet, never into a pipe or a log."""
    return not quiet and sys.stderr.isatty()


def reports_errors(fn):
    """Turn library failures into one line on stderr and the exit status of the table above;
    apply -q/-v."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        _set_verbosity(kwargs.get("quiet", False), kwargs.pop("verbose", 0))
        started = time.monotonic()
        try:
            result = fn(*args, **kwargs)
        except RequantError as e:
            _fail(str(e), e.exit_code, as_json)
        except KeyboardInterrupt:
            _fail("interrupted; no finished output was left behind", EXIT_INTERRUPTED, as_json)
        except OSError as e:
            _fail(describe_os_error(e), EXIT_INPUT, as_json)
        except click.ClickException:
            raise
        except Exception as e:   # a bug: still one line, with the way to the traceback
            if os.environ.get("REQUANT_DEBUG"):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _fail(f"internal error ({type(e).__name__}: {first}); please report it, with the traceback that "
                  "REQUANT_DEBUG=1 prints", EXIT_BUG, as_json)
        _finished_quietly()
        log.info("%s finished in %.2f s", fn.__name__, time.monotonic() - started)
        return result
    return wrapper


def verbosity_options(fn):
    """-q/--quiet and -v/--verbose, the same on every command."""
    fn = click.option("-v", "--verbose", count=True, help="Log requant's steps to stderr: -v INFO (plan, shards, "
                      "timings), -vv DEBUG; other libraries stay quiet.")(fn)
    return click.option("-q", "--quiet", is_flag=True, help="No progress bar; library warnings off.")(fn)


class RequantGroup(click.Group):
    """click's own usage errors (exit 2) follow requant's error format: with --json, also a JSON
    object on stdout; Ctrl-C outside a command is 130, as inside."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name, complete_var, False, **extra)
        except click.ClickException as e:   # one line, as requant's own errors
            if type(e).__name__ == "NoArgsIsHelpError":   # a bare `requant`: the help, as click shows it
                e.show()
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if isinstance(e, click.UsageError) and ctx else ""
            _fail(e.format_message() + hint, e.exit_code, "--json" in argv)
        except click.Abort:
            _fail("interrupted", EXIT_INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=RequantGroup, epilog=EXIT_STATUS_HELP,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="requant")
def cli():
    """requant: convert mixture-of-experts checkpoints between 4-bit formats, offline, on a CPU.

    \b
    Typical use:
      requant synth demo-src                         # a small synthetic DeepSeek-V4-Flash
      requant convert demo-src demo-nvfp4 --in mxfp4 --out nvfp4
      requant inspect demo-nvfp4
    """


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--model", "model_name", type=click.Choice(_model_names()), default=_default_model_name(),
              show_default=True, help="Named model (from the recipes) whose layout and dimensions to build.")
@click.option("--layers", type=click.IntRange(1, 1024),
              help=f"Transformer layers (default {_reduced_default('layers')}; the model's own at full scale).")
@click.option("--experts", type=click.IntRange(1, 4096),
              help=f"Routed experts per layer (default {_reduced_default('experts')}; the model's own at full scale).")
@click.option("--hidden", type=click.IntRange(1, 65536),
              help=f"hidden_size, a multiple of the model's quantization block, which an error names (default "
                   f"{_reduced_default('hidden')}; the model's own at full scale).")
@click.option("--intermediate", type=click.IntRange(1, 65536),
              help=f"moe_intermediate_size, a multiple of the model's quantization block, which an error names "
                   f"(default {_reduced_default('intermediate')}; the model's own at full scale).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Random seed; same seed, same bytes.")
@click.option("--full-scale", is_flag=True, help="The named model's own dimensions, as released "
              "(hundreds of GB; --sparse writes the layout alone).")
@click.option("--sparse", is_flag=True, help="Leave tensor data as holes (zeros): the layout costs almost no disk.")
@click.option("--out-of-window", type=click.IntRange(0), default=0, show_default=True,
              help="Per expert projection, scale blocks whose exponent lies below NVFP4's lossless window.")
@click.option("--zero-blocks", type=click.IntRange(0), default=0, show_default=True,
              help="Per projection, all-zero scale blocks.")
@click.option("--neg-zero-blocks", type=click.IntRange(0), default=0, show_default=True,
              help="Per projection, scale blocks made only of -0 codes. The three together fit in a projection's "
                   "hidden x intermediate / 32 blocks.")
@verbosity_options
@reports_errors
def synth(dest, model_name, layers, experts, hidden, intermediate, seed, full_scale, sparse, out_of_window,
          zero_blocks, neg_zero_blocks, quiet):
    """Write a synthetic checkpoint of a named model (MXFP4 experts) to DEST.

    The layout is the release's, from the model's recipe: tensor names, dtypes, shapes, shard and
    index layout, config.json and the other metadata files, a tokenizer. Expert weights are MXFP4
    encodings of heavy-tailed continuous weights, so block exponents spread as in a trained model.
    DEST must be absent or empty; it is written under a hidden name and renamed at the end, so a
    failure leaves nothing behind.
    """
    from tqdm import tqdm

    from requant import synth as synth_lib

    dims = synth_lib.Dims(model_name, full_scale, layers=layers, experts=experts, hidden=hidden,
                          intermediate=intermediate)
    hard = synth_lib.HardCases(out_of_window, zero_blocks, neg_zero_blocks)
    synth_lib.check_request(dims, hard)
    with tqdm(total=len(synth_lib.layout(dims)), unit="shard", desc="synth", disable=not progress_shown(quiet)) as bar:
        shards = synth_lib.write_new_checkpoint(dest, dims, seed, hard, sparse,
                                                progress=lambda done, total: bar.update(1))
    click.echo(f"wrote {dest}: {dims.model}, {len(shards)} shards, {dims.layers} layers x {dims.experts} experts, "
               f"hidden {dims.hidden}, intermediate {dims.intermediate}{' (sparse)' if sparse else ''}")


@cli.command(epilog=EXIT_STATUS_HELP, cls=GraftOperand)
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path(), required=False)
@click.option("--in", "in_format", type=click.Choice(SOURCE_FORMATS), default=None,
              help="Format of SRC's routed experts, checked against SRC (default: whatever SRC stores).")
@click.option("--out", "out_format", type=click.Choice(sorted(TARGETS)), required=True,
              help="nvfp4: NVIDIA's ModelOpt layout (Blackwell W4A4; Hopper via Marlin W4A16). "
                   "w4a16: INT4 experts in compressed-tensors pack-quantized form (Marlin MoE, "
                   "Ampere/Hopper); lossy, the summary reports SQNR vs the source. The output's README.md "
                   "says how to serve it.")
@click.option("--engine", type=EngineSpec(), default=None, help=ENGINE_HELP)
@click.option("--model", "model_name", type=click.Choice(_model_names()), default=None,
              help="The named model SRC is; default: detected from config.json and the tensor names. A model of "
                   "another kind than the checkpoint's is refused.")
@click.option("--drafter", "--mtp", "mtp", type=DrafterMode(), default=None,
              help="The drafter's routed experts (its MTP block or draft stages). keep: they stay MXFP4, listed "
                   "in the output's ignore; convert: they become --out's format as the main experts do, ignore "
                   "leaving them out; graft PATH: the drafter of checkpoint PATH (a directory, or a Hub "
                   "repository of which only the drafter's shards are downloaded; another checkpoint of the same "
                   "model) replaces SRC's own, its tensors byte for byte and kept as it stores them, its "
                   "config.json fields taken over, each check refused in one line; not with --in-place. "
                   "Default: what --engine's release loads them as (requant.engines: formats.<fmt>.mtp_experts). "
                   "A choice the release would load wrongly is refused unless --force. --mtp is the same option.")
@click.option("--force", is_flag=True, help="Write a layout that --engine would load wrongly or cannot serve (MTP "
              "experts in the other format than it loads them as, or an output format that release cannot serve "
              "for the model); the card and requant.json record why.")
@click.option("--input-scale", type=float, default=None, help=INPUT_SCALE_HELP)
@click.option("--scale-headroom", type=click.IntRange(0, 8), default=0, show_default=True,
              help="NVFP4: place the largest block scale at 2^(8-N) instead of 2^8, at the cost of an N-step "
                   "narrower lossless window, for an engine that caps block scales lower. No release requant "
                   f"has checked needs it (vLLM {_LARGEST_RULE[0]}-{_LARGEST_RULE[-1]} derive Marlin's factor "
                   "from the largest scale).")
@click.option("--group-size", type=click.Choice(GROUP_SIZES), default=None,
              help="w4a16: K elements sharing one INT4 scale. 32 is the most accurate (about 3 dB over "
                   "128), 128 the smallest; Marlin runs all three. Default 128.")
@click.option("--scheme", type=click.Choice(["sym", "asym"]), default=None,
              help="w4a16: sym (scale only, default) or asym (scale and zero point per group: 1-2.5 dB "
                   "more accurate; needs a vLLM whose Marlin MoE loads zero points).")
@click.option("--workers", type=click.IntRange(1, 256),
              help="Experts encoded at once (default: one per core, at most 32): processes for w4a16 "
                   "on a CPU (~400 MiB peak each; about half as many more read and write meanwhile), "
                   "threads otherwise.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]),
              help="Where w4a16 encodes (default: cuda when available); the bytes are the same on either.")
@click.option("--in-place", is_flag=True, help="Convert SRC inside its own directory (no DST), shard by shard: "
              "needs free space for one output shard plus the format's growth, not a second copy.")
@click.option("--copy-all", is_flag=True, help="Copy into DST the shards that hold nothing to convert (their bytes "
              "stay the source's) instead of hard-linking them to SRC's files; links, the default where SRC and "
              "DST share a filesystem, take no disk.")
@click.option("--resume", is_flag=True, help="Continue the unfinished conversion journaled in DST (or SRC with "
              "--in-place), or start one if there is none; the options must be the ones it started with.")
@click.option("--abort", is_flag=True, help="Give up the unfinished conversion journaled in DST (or SRC with "
              "--in-place) instead of resuming it: out of place, what it wrote into DST is removed; in place, "
              "while no shard is converted yet, the source comes back as it was (config.json and the index from "
              "the journal); once a shard is converted nothing is changed and it says which, since only "
              "--resume then leads to a checkpoint that loads.")
@click.option("--revision", help="SRC as a Hub repository (owner/name): branch, tag or commit to convert.")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="SRC as a Hub repository: the Hugging Face cache to "
              "download into and read from (default: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).")
@click.option("--token", help="SRC as a Hub repository: access token (default: HF_TOKEN, else the saved login).")
@click.option("--stream-source", is_flag=True, help="SRC as a Hub repository: fetch one shard at a time and delete "
              "it once converted, so the disk never holds the whole source.")
@click.option("--dry-run", is_flag=True, help="Read headers only and print the plan; write nothing. Exits 3 when the "
              "target's disk lacks the free space the plan needs.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary (or plan) as JSON.")
@verbosity_options
@reports_errors
def convert(src, dst, in_format, out_format, engine, model_name, mtp, force, input_scale, scale_headroom, group_size,
            scheme, workers, device, in_place, copy_all, resume, abort, revision, cache_dir, token, stream_source, dry_run,
            as_json, quiet):
    """Convert checkpoint SRC (a directory or a Hub repository id) into a new directory DST, or in
    place with --in-place.

    SRC is a local directory when one exists; otherwise `owner/name` is a Hub repository (unless
    `owner/` is a local directory: then a mistyped path), and `hf://owner/name` always is. A Hub
    source is downloaded into the Hugging Face cache, or read from it offline (HF_HUB_OFFLINE=1, or
    the Hub unreachable). Honoured: HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN.

    Routed experts are re-encoded; every other tensor is copied byte for byte; the index,
    config.json (quantization_config) and format side files are rewritten; tokenizer, generation
    config and other files are copied. A journal in the target makes the conversion resumable
    (--resume) after a crash or Ctrl-C; until it finishes the target has no config.json and no
    index, so nothing loads a half-converted directory.
    """
    from requant import convert as convert_lib
    from requant.targets import Options
    from requant.compute import compute_device

    # Stored as FP32, and divided by: a normal FP32 number, so neither it nor its reciprocal overflows.
    if input_scale is not None and not (1.1754943508222875e-38 <= input_scale <= 3.4028234663852886e38):
        raise UsageError(f"--input-scale must be a positive number an FP32 scale can hold (1.2e-38 to 3.4e38), "
                         f"got {input_scale}")
    given = {"scale_headroom": scale_headroom, "group_size": group_size and int(group_size), "scheme": scheme}
    target_options = TARGETS[out_format].options_from({k: v for k, v in given.items() if v})
    if in_place == (dst is not None):
        raise UsageError("give DST, or --in-place to convert SRC inside its own directory (not both)")
    if copy_all and in_place:
        raise UsageError("--copy-all is for a new directory DST; in place the shards with nothing to convert stay")
    if abort:
        if resume or dry_run:
            raise UsageError("--abort ends an unfinished conversion: not with --resume or --dry-run")
        done = convert_lib.abort(src, dst, _resume_command(click.get_current_context()))
        click.echo(json.dumps({"aborted": True, "message": done}, indent=2) if as_json else done)
        return
    # Only the heavy encoders (the W4A16 search) are worth a GPU.
    mtp, _, donor = (mtp or "").partition("=")
    options = Options(mtp=mtp or None, donor=donor or None, input_scale=input_scale, target=target_options, engine=engine, model=model_name,
                      force=force, device=compute_device(device) if TARGETS[out_format].cpu_heavy else "cpu")
    if dry_run:
        plan = convert_lib.plan_conversion(src, out_format, options, in_format, in_place, revision, token, cache_dir,
                                           dst, copy_all)
        summary = convert_lib.describe_plan(plan, dst, in_place, source=src)
        short = None
        if summary["free_bytes_available"] < summary["free_bytes_needed"]:
            short = (f"not enough free space for this conversion: need {summary['free_bytes_needed']:,} bytes, "
                     f"{summary['free_bytes_available']:,} available")
            summary["error"] = {"code": DRY_RUN_SHORT_OF_SPACE, "message": short}   # one JSON document
        click.echo(json.dumps(summary, indent=2) if as_json else convert_lib.format_plan(summary))
        if short:
            _fail(short, DRY_RUN_SHORT_OF_SPACE)
        return
    target = src if in_place else dst
    try:
        result = convert_lib.convert(src, dst, out_format, options, in_format, workers, progress=progress_shown(quiet),
                                     resume=resume, resume_hint=_resume_command(click.get_current_context()),
                                     revision=revision, stream=stream_source, token=token, cache_dir=cache_dir,
                                     copy_all=copy_all)
    except convert_lib.AlreadyFinished as e:   # --resume after the end: nothing to do
        _finished_quietly()
        click.echo(json.dumps({"finished": True, "message": str(e)}, indent=2) if as_json else f"requant: {e}")
        return
    except (KeyboardInterrupt, RequantError) as e:
        # Ctrl-C after the last step (the journal removed, config.json and the index written): the
        # output is finished and valid, so the command succeeded.
        if (isinstance(e, KeyboardInterrupt) or e.exit_code == EXIT_INTERRUPTED) and _finished(target, e):
            _finished_quietly()
            click.echo(f"requant: note: interrupted after the conversion had finished; {target} is complete "
                       f"(requant verify {shlex.quote(target)} checks it)", err=True)
            return
        raise
    _finished_quietly()
    summary = convert_lib.describe_result(result)
    click.echo(json.dumps(summary, indent=2) if as_json else convert_lib.format_result(summary))


def _finished(target: str, e: BaseException) -> bool:
    """Whether the conversion into `target` that `e` interrupted had finished: it had journaled
    (a Stopped error, not a bare interrupt from before anything was written) and the journal is
    gone, config.json and the index in place."""
    from requant.io import journal

    return isinstance(e, RequantError) and not journal.exists(target) and journal.has_metadata(target)


def _resume_command(ctx: click.Context) -> str:
    """This convert command as the user would retype it to resume: arguments and the options
    that shape the output."""
    args = ["requant", "convert", ctx.params["src"]] + ([ctx.params["dst"]] if ctx.params["dst"] else [])
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if (not isinstance(param, click.Option)
                or param.name in ("resume", "abort", "dry_run", "as_json", "quiet", "verbose", "token")
                or value in (None, False) or value == param.default):
            continue
        args += [param.opts[0]] if param.is_flag else [param.opts[0], str(value)]
    return shlex.join(args + ["--resume"])


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("path", type=click.Path())
@_reads_as_model("PATH")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@verbosity_options
@reports_errors
def inspect(path, model_name, as_json, quiet):
    """Describe checkpoint PATH: model, expert format, tensors per dtype, shards, quantization."""
    from requant.describe import format_report, inspect_checkpoint

    info = inspect_checkpoint(path, model_name)
    click.echo(json.dumps(info, indent=2) if as_json else format_report(info))


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("path", type=click.Path())
@click.option("--deep", is_flag=True, help="Also decode every scale block (reads all expert bytes).")
@click.option("--source", type=click.Path(), help="With --deep: count exact vs re-quantized scale blocks against this checkpoint.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]),
              help="Where --deep decodes (default: cuda when available, else every core).")
@click.option("--engine", type=EngineSpec(), default=None,
              help="Judge loading by this engine release's rules, NAME or NAME==VERSION (NAME alone: the release "
                   "installed here, else the newest requant has checked); its problems are errors. A release "
                   "requant has not checked gets 'not checked against', never a verdict. Default: the engine "
                   "requant.json names, else every engine (then only 'no engine loads it' is an error).")
@click.option("--gpu", type=click.Choice(sorted(GPU_FAMILIES)), default=None,
              help="Also name the MoE method and kernel each judged engine selects on this GPU family "
                   "(sm_80 Ampere, sm_90 Hopper, sm_100/sm_120 Blackwell), or the flag it needs to start.")
@_reads_as_model("PATH")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@verbosity_options
@reports_errors
def verify(path, deep, source, device, engine, gpu, model_name, as_json, quiet):
    """Lint FP4 MoE checkpoint PATH (NVFP4, W4A16, MXFP4): completeness, scales, config dispatch, and
    whether vLLM / SGLang (pinned releases) load every tensor into the right kind of parameter.
    Exits 1 when it finds errors."""
    from requant.verify import failure_line, format_findings, verify as verify_lib

    result = verify_lib(path, deep=deep or source is not None, source=source, progress=progress_shown(quiet), engine=engine,
                        gpu=gpu, device=device, model=model_name)
    failed = None if result["ok"] else failure_line(result)
    if failed and as_json:   # one JSON document: the findings, with the error
        result["error"] = {"code": EXIT_INPUT, "message": failed}
    if as_json or not result.get("diagnosis"):   # a path that is no checkpoint: the error line alone
        click.echo(json.dumps(result, indent=2) if as_json else format_findings(result))
    if failed:
        _fail(failed, EXIT_INPUT)


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("checkpoint")
@click.option("--engine", "engine_specs", type=EngineSpec(), multiple=True,
              help="Engine release to answer for, NAME or NAME==VERSION (repeatable; NAME alone: the release "
                   "installed here, else the newest requant has checked). Default: every engine.")
@click.option("--gpu", type=click.Choice(sorted(GPU_FAMILIES)), required=True,
              help="GPU family: sm_80 Ampere, sm_90 Hopper, sm_100 Blackwell datacenter, sm_120 Blackwell workstation "
                   "(RTX PRO 6000, RTX 50xx).")
@click.option("--tp", type=click.IntRange(1, 64), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--ep", type=click.IntRange(1, 512), default=1, show_default=True,
              help="Expert-parallel size (experts kept whole, split across GPUs).")
@click.option("--revision", help="CHECKPOINT as a Hub repository: branch, tag or commit.")
@click.option("--token", help="CHECKPOINT as a Hub repository: access token (default: HF_TOKEN, else the saved login).")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="CHECKPOINT as a Hub repository: the Hugging Face cache.")
@click.option("--prefer", type=click.Choice(["balanced", "accuracy", "speed"]), default="balanced", show_default=True,
              help="What the recommendation weighs once a path runs and keeps the drafter. balanced: the accuracy "
                   "tier (the source's weights exactly, activations of 8 bits or more), then the speed class, then "
                   "the measured error; accuracy: the measured error first; speed: the speed class first.")
@_reads_as_model("CHECKPOINT")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@verbosity_options
@reports_errors
def advise(checkpoint, engine_specs, gpu, tp, ep, revision, token, cache_dir, prefer, model_name, as_json, quiet):
    """Should CHECKPOINT (a directory or Hub id) be converted at all, for this engine and GPU?

    For the checkpoint as it is and each output requant could write from it: the MoE method and
    kernel of the main layers and of the MTP block, whether the engine starts (and the flags that
    make it), the arithmetic it runs and its measured layer error, then a recommendation with its
    reasons. Reads config.json and the shard headers only (seconds; nothing large is downloaded).
    Runtime outcomes come from reading the engine release's code, not from running it.
    """
    from requant import paths
    from requant.advise import advise as advise_lib, format_advice
    from requant.io.hub import open_headers

    with open_headers(checkpoint, revision, token, cache_dir) as ck:
        result = advise_lib(ck, list(engine_specs), gpu, tp, ep, paths.measured_errors(), prefer, model_name)
    click.echo(json.dumps(result, indent=2) if as_json else format_advice(result))


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--out-dir", "out_dir", type=click.Path(file_okay=False),
              help="Directory for report.json, report.md, report.html and the PNG plots (required).")
@click.option("--out", "old_out_dir", type=click.Path(file_okay=False), hidden=True,
              help="The former spelling of --out-dir (convert's --out is a format).")
@click.option("--layers", help="Subsample: layer numbers and ranges (0,5,10-12) or MTP layer names (mtp.0).")
@click.option("--workers", type=click.IntRange(1, 256),
              help="Experts compared at once (default: one per core, at most 32): processes on the CPU, "
                   "with twice as many more (at most 16) reading the next experts meanwhile; threads feeding a GPU.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]),
              help="Where experts are decoded and compared (default: the CPU's one-pass C comparison where it "
                   "builds, faster than a GPU here; else cuda when available).")
@click.option("--no-forward", is_flag=True, help="Skip the MoE-forward comparison (requant validate; every "
              "selected layer on a GPU, the first one only on a CPU).")
@click.option("--serve", help=SERVE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print report.json instead of the summary.")
@verbosity_options
@reports_errors
def report(src, dst, out_dir, old_out_dir, layers, workers, device, no_forward, serve, as_json, quiet):
    """Accuracy difference of DST's routed experts against SRC's (MXFP4, NVFP4 or W4A16):
    exact scale blocks, SQNR, relative RMSE, max error, cosine, per projection, layer and overall."""
    from requant.report import html, make_report
    from requant.report.render import terminal
    from requant.engines.serve import parse_modes

    if out_dir and old_out_dir and out_dir != old_out_dir:
        raise UsageError("give the report directory once: --out-dir DIR")
    out_dir = out_dir or old_out_dir
    if not out_dir:
        raise UsageError("give the report directory: --out-dir DIR")
    result = make_report(src, dst, out_dir, layers, workers, progress=progress_shown(quiet), forward=not no_forward,
                         serve_modes=parse_modes(serve), device=device)
    comparison = result["timing"].get("comparison", "")
    if comparison.startswith("torch:") and not quiet:
        click.echo(f"requant: note: experts compared with torch passes, which take 2-3x the CPU time of the C "
                   f"pass ({comparison.removeprefix('torch: ')})", err=True)
    click.echo(json.dumps(result, indent=2) if as_json else terminal(result, out_dir, html.plots_missing()))


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("dst", type=click.Path(file_okay=False))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository private (when it does not exist yet).")
@click.option("--message", help="Commit message.")
@click.option("--token", help="Access token with write permission (default: HF_TOKEN, else the saved login).")
@verbosity_options
@reports_errors
def upload(dst, repo_id, private, message, token, quiet):
    """Upload finished conversion DST (shards, index, configs and every other file the conversion
    wrote, the model card included) to Hub repository REPO_ID, creating it if needed.

    Resumable: after a failure, run the same command again; files the Hub already holds are not sent
    again. Refuses a directory that is not a finished checkpoint (an unfinished conversion, no index).
    Honoured: HF_ENDPOINT, HF_TOKEN.
    """
    from requant.io.hub import upload as upload_folder

    url = upload_folder(dst, repo_id, token=token, private=private, message=message, progress=progress_shown(quiet))
    click.echo(f"uploaded {dst} to {repo_id}: {url}")


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--layers", help="Layer numbers and ranges (0,5,10-12) or MTP layer names (mtp.0); default all.")
@click.option("--tokens", type=click.IntRange(1), default=64, show_default=True, help="Random hidden states per layer.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]),
              help="Default: cuda when available. On cpu the routed experts run through the torch reference.")
@click.option("--activations", type=click.Path(dir_okay=False), help="Real MoE inputs (.safetensors or .pt); "
              "also calibrate an input_scale from them for nvfp4-w4a4.")
@click.option("--serve", help=SERVE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@verbosity_options
@reports_errors
def validate(src, dst, layers, tokens, device, activations, serve, as_json, quiet):
    """Run the same hidden states through each MoE layer of SRC and DST with requant's fused-MoE
    kernel (on a GPU; on a CPU through the plain torch reference instead); report error, cosine,
    routing agreement and the kernel's error against the torch reference, then DST as each serving
    mode computes it (--serve). Exits 1 when a layer is past its threshold or a serving mode gives
    non-finite output."""
    from requant.engines.serve import parse_modes
    from requant.validate import format_table, validate as run_validation

    result = run_validation(src, dst, layers, tokens, device, activations, progress=progress_shown(quiet),
                            notice=lambda line: click.echo(line, err=True), serve_modes=parse_modes(serve))
    failed = result.failure()
    summary = result.to_dict()
    if failed and as_json:   # one JSON document: the results, with the error
        summary["error"] = {"code": EXIT_INPUT, "message": failed}
    click.echo(json.dumps(summary, indent=2) if as_json else format_table(result))
    if failed:
        _fail(failed, EXIT_INPUT)


def main():
    global _OWN_PROCESS
    _OWN_PROCESS = True
    for signum in STOP_SIGNALS[1:]:   # SIGINT already raises KeyboardInterrupt
        signal.signal(signum, _stop_requested)
    cli(prog_name="requant")
