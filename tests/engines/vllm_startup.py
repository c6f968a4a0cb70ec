"""Does vLLM start a DeepSeek-V4 checkpoint with these serve flags? `vllm_accepts` runs, on CPU,
the release's own start-up argument handling, read from its wheel (tests/engines/wheels.py):

1. the `vllm serve` command line: the top-level FlexibleArgumentParser with the `serve`
   subcommand, as entrypoints/cli/main.py builds it (ServeSubcommand.subparser_init ->
   entrypoints/common/cli_args.py make_arg_parser -> FrontendArgs.add_cli_args and
   EngineArgs.add_cli_args, whose options come from engine/arg_utils.py get_kwargs over the
   config dataclasses), then FlexibleArgumentParser.parse_args (utils/argparse_utils.py:
   underscores/dashes, dotted JSON keys, then argparse with vLLM's types and choices);
2. ServeSubcommand.validate (cli_args.py validate_parsed_serve_args);
3. the speculative config: EngineArgs.create_speculative_config, which builds the release's
   SpeculativeConfig (config/speculative.py: the pydantic dataclass made by config/utils.py
   `config`, its field types and validators, __post_init__ with hf_config_override, and, from
   0.34.0, the SpeculatorConfig classes of v1/worker/gpu/spec_decode/*/config.py), for the
   checkpoint's config.json as the target's hf config.

How the engine's code is executed: each wheel file gets a namespace (`_Space`) whose missing names
are resolved on first use the way the file's imports say: a top-level definition of the same
file is executed from the wheel, an import from `vllm.*` is resolved in that file, any other
import is the real module (argparse, typing, pydantic, regex, torch). While the engine's code
runs, `vllm.*` function-level imports are answered by the same namespaces (a meta path finder
this module installs and takes out again). Nothing is copied from the engine.

Stand-ins, not the engine's code:
- the config dataclasses the parser reads (ModelConfig, ParallelConfig, ... and VllmConfig):
  dataclasses with each class's own field declarations (annotations and defaults evaluated from
  the wheel) and methods, without __post_init__ or pydantic validation, for get_kwargs to read;
  a field without a default gets None. So a JSON value of another --*-config option (e.g.
  --compilation-config) is parsed as JSON but its keys are not checked against that config;
  --speculative-config is checked in stage 3 by the real SpeculativeConfig;
- the target ModelConfig: the checkpoint's config.json as hf_config (a namespace with
  `update`), model = the checkpoint path, quantization None, the Transformers backend off;
- the draft ModelConfig (SpeculativeConfig builds `ModelConfig(model=..., runner="draft",
  hf_overrides=...)`): config.json again, passed through the hf_overrides SpeculativeConfig
  gives it (the release's own hf_config_override), architectures from the result; no model
  registry, so `speculator_config_class` is None (0.34.0 then detects the method by checkpoint);
- the target ParallelConfig: tensor_parallel_size from the parsed args, the rest defaults;
- names the executed code reaches that cannot be executed here (platform probes, CUDA
  libraries, enums of kernels) are `_Standin` classes: they accept any value, and show up in
  `World.standins`.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import copy
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import io
import json
import logging
import shlex
import sys
import traceback
import types
import typing
from pathlib import Path

from tests.engines import wheels

ENGINE = "vllm"
LAUNCH = ("vllm",)


# -- stand-ins -------------------------------------------------------------------------------

class _StandinMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _standin(f"{cls.__name__}.{name}")

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __contains__(cls, item):
        return False

    def __or__(cls, other):
        return typing.Union[cls, other]

    def __ror__(cls, other):
        return typing.Union[other, cls]

    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema
        return core_schema.any_schema()


class _StandinBase:
    def __init__(self, *args, **kwargs):
        pass

    def __iter__(self):
        return iter(())

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _standin(f"{type(self).__name__}().{name}")


def _standin(name: str) -> type:
    return _StandinMeta(name, (_StandinBase,), {"__module__": "vllm_startup.standin"})


def _modfile(module: str) -> str | None:
    """The wheel file of module `vllm.a.b`: vllm/a/b.py or vllm/a/b/__init__.py."""
    names = set(wheels._zip(ENGINE).namelist())
    base = module.replace(".", "/")
    for rel in (base + ".py", base + "/__init__.py"):
        if rel in names:
            return rel
    return None


def _resolve_relative(relpath: str, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    pkg = relpath.rsplit("/", 1)[0].split("/")
    if not relpath.endswith("__init__.py"):
        pass
    pkg = pkg[: len(pkg) - (level - 1)]
    return ".".join(pkg + ([module] if module else []))


def _config_decorated(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
        if name in ("config", "dataclass"):
            return True
    return False


def _runtime_body(body):
    """A file's top-level statements as they run: `if TYPE_CHECKING:` blocks by their else
    branch, `try:` blocks by their body."""
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _runtime_body(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _runtime_body(node.body)
        else:
            yield node


class _ModuleProxy(types.ModuleType):
    """A `vllm.*` module whose attributes are its file's definitions, resolved on use."""

    def __init__(self, world, relpath, name):
        super().__init__(name)
        self.__dict__["_space"] = world.space(relpath)
        self.__dict__["__path__"] = [] if relpath.endswith("__init__.py") else None
        self.__dict__["__file__"] = None

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        space = self.__dict__["_space"]
        sub = f"{self.__name__}.{name}"
        if name not in space.defs and name not in space.imports and _modfile(sub):
            return space.world.module(sub)
        if name not in space.defs and name not in space.imports and "__getattr__" in space.defs:
            return space["__getattr__"](name)
        try:
            return space[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


class _Space(dict):
    """The namespace of one wheel file: names resolve on first use (see the module docstring)."""

    def __init__(self, world, relpath):
        super().__init__()
        self.world, self.relpath = world, relpath
        tree = wheels._tree(ENGINE, relpath)
        self.defs, self.imports = {}, {}
        for node in _runtime_body(tree.body):
            for name in wheels._binds(node):
                self.defs[name] = node   # the last definition wins (typing.overload stubs come first)
            if isinstance(node, ast.ImportFrom):
                mod = _resolve_relative(relpath, node.module, node.level)
                for a in node.names:
                    self.imports[a.asname or a.name] = (mod, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = (a.name, None)
                    else:
                        self.imports[a.name.split(".")[0]] = (a.name.split(".")[0], None)
        self["__name__"] = relpath[:-3].replace("/", ".").removesuffix(".__init__")
        self["__builtins__"] = builtins
        self["TYPE_CHECKING"] = False
        self._busy = set()

    def __missing__(self, name):
        if hasattr(builtins, name):
            raise KeyError(name)
        value = self.world.resolve(self, name)
        self[name] = value
        return value

    def touch(self, node: ast.AST) -> None:
        """Resolve the names code at class or module level reads (LOAD_NAME does not ask
        __missing__); function bodies resolve theirs when they run."""
        skip = set()
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                skip.update(id(x) for sub in n.body for x in ast.walk(sub))
            elif isinstance(n, ast.Lambda):
                skip.update(id(x) for x in ast.walk(n.body))
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and id(n) not in skip and isinstance(n.ctx, ast.Load):
                try:
                    self[n.id]
                except KeyError:
                    pass


class World:
    """The namespaces of one release's files, with the stand-ins of one stage."""

    def __init__(self, overrides: dict[tuple[str, str], object] | None = None, shells: bool = True):
        self.overrides = {("vllm/version.py", "__version__"): wheels.version(ENGINE),
                          ("vllm/platforms/__init__.py", "current_platform"): _standin("current_platform"),
                          **(overrides or {})}
        self.shells = shells   # config dataclasses as field-only shells (the parser stage)
        self.spaces: dict[str, _Space] = {}
        self.modules: dict[str, _ModuleProxy] = {}
        self.shell_cache: dict[tuple[str, str], type] = {}
        self.standins: list[str] = []

    def space(self, relpath: str) -> _Space:
        if relpath not in self.spaces:
            self.spaces[relpath] = _Space(self, relpath)
        return self.spaces[relpath]

    def module(self, name: str) -> types.ModuleType:
        if name not in self.modules:
            rel = _modfile(name)
            if rel is None:
                raise ModuleNotFoundError(name)
            self.modules[name] = _ModuleProxy(self, rel, name)
        return self.modules[name]

    def standin(self, space, name, why=""):
        self.standins.append(f"{space.relpath}:{name}{' (' + why + ')' if why else ''}")
        return _standin(name)

    def resolve(self, space: _Space, name: str):
        key = (space.relpath, name)
        if key in self.overrides:
            return self.overrides[key]
        if name in space.defs:
            node = space.defs[name]
            if isinstance(node, ast.ClassDef) and self.shells and _config_decorated(node):
                return self.shell(space.relpath, name)
            if key in space._busy:
                return self.standin(space, name, "cyclic")
            space._busy.add(key)
            try:
                return self.execute(space, node)[name]
            except Exception as e:   # a definition that cannot run here
                return self.standin(space, name, f"{type(e).__name__}: {e}"[:200])
            finally:
                space._busy.discard(key)
        if name in space.imports:
            module, attr = space.imports[name]
            if module == "vllm" or module.startswith("vllm."):
                try:
                    if attr is None or _modfile(f"{module}.{attr}") and not self._defines(module, attr):
                        return self.module(module if attr is None else f"{module}.{attr}")
                    target = _modfile(module)
                    if target is None:
                        return self.standin(space, name, f"no {module} in the wheel")
                    return self.space(target)[attr]
                except KeyError:
                    return self.standin(space, name)
            try:
                mod = importlib.import_module(module)
                return mod if attr is None else getattr(mod, attr)
            except Exception as e:
                if attr is not None:
                    with contextlib.suppress(Exception):
                        return importlib.import_module(f"{module}.{attr}")
                return self.standin(space, name, f"{type(e).__name__}")
        raise KeyError(name)

    def _defines(self, module: str, attr: str) -> bool:
        rel = _modfile(module)
        return rel is not None and (attr in self.space(rel).defs or attr in self.space(rel).imports)

    def execute(self, space: _Space, node: ast.stmt) -> _Space:
        node = copy.deepcopy(node)
        if isinstance(node, ast.ClassDef):
            for item in node.body:   # signature annotations are evaluated at def time: dropped
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for arg in [*item.args.posonlyargs, *item.args.args, *item.args.kwonlyargs,
                                item.args.vararg, item.args.kwarg]:
                        if arg is not None:
                            arg.annotation = None
                    item.returns = None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = wheels._StripAnnotations().visit(node) if not node.decorator_list else node
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                        node.args.vararg, node.args.kwarg]:
                if arg is not None:
                    arg.annotation = None
            node.returns = None
        space.touch(node)
        module = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
        if space["__name__"] not in sys.modules:   # dataclasses and pydantic look the module up
            with contextlib.suppress(ModuleNotFoundError):
                sys.modules[space["__name__"]] = self.module(space["__name__"])
        exec(compile(module, f"vllm/{space.relpath}", "exec"), space)
        return space

    def evaluate(self, space: _Space, expr: ast.expr):
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            expr = ast.parse(expr.value, mode="eval").body   # a string annotation
        space.touch(expr)
        return eval(compile(ast.Expression(body=copy.deepcopy(expr)), f"vllm/{space.relpath}", "eval"), space)

    def shell(self, relpath: str, name: str) -> type:
        """Config dataclass `name` as the wheel declares its fields (annotations and defaults
        evaluated from the wheel) and its methods, but a plain dataclass: no pydantic
        validation, no __post_init__ (the parser stage only reads the fields)."""
        key = (relpath, name)
        if key in self.shell_cache:
            return self.shell_cache[key]
        space = self.space(relpath)
        classes = {n.name: n for n in wheels._tree(ENGINE, relpath).body if isinstance(n, ast.ClassDef)}
        node = classes[name]
        self.shell_cache[key] = _standin(name)   # a field of its own type, or a cycle
        bases = []
        for b in node.bases:
            if isinstance(b, ast.Name) and b.id in classes and _config_decorated(classes[b.id]):
                bases.append(self.shell(relpath, b.id))
        fields, defaults = {}, {}
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            ann_src = ast.unparse(item.annotation)
            if ann_src.startswith(("ClassVar", "typing.ClassVar")):
                continue
            try:
                ann = self.evaluate(space, item.annotation)
            except Exception as e:
                ann = self.standin(space, f"{name}.{item.target.id}", f"annotation {ann_src}: {e}"[:200])
            value = None
            if item.value is not None:
                try:
                    value = self.evaluate(space, item.value)
                except Exception:
                    value = None
            if isinstance(value, dataclasses.Field):
                default = value
            elif isinstance(value, (list, dict, set)) or (dataclasses.is_dataclass(value)
                                                         and not isinstance(value, type)):
                default = dataclasses.field(default_factory=lambda v=value: copy.deepcopy(v))
            else:
                default = dataclasses.field(default=value)
            fields[item.target.id], defaults[item.target.id] = ann, default
        body = [wheels._StripAnnotations().visit(copy.deepcopy(item)) for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("__")]
        holder = ast.ClassDef(name=name, bases=[ast.Name(id=f"__shell_base_{i}", ctx=ast.Load())
                                                 for i in range(len(bases))],
                              keywords=[], decorator_list=[], body=body or [ast.Pass()], type_params=[])
        for i, b in enumerate(bases):
            space[f"__shell_base_{i}"] = b
        scratch = {}
        saved = dict.get(space, name, None)
        self.execute(space, holder)
        cls = dict.__getitem__(space, name)
        if saved is None:
            dict.pop(space, name)
        else:
            space[name] = saved
        cls.__annotations__ = fields
        for k, v in defaults.items():
            setattr(cls, k, v)
        cls.__doc__ = ast.get_docstring(node)
        cls.__get_pydantic_core_schema__ = classmethod(_any_schema)   # not validated: see the docstring
        cls = dataclasses.dataclass(cls, kw_only=True)
        self.shell_cache[key] = cls
        return cls

    def klass(self, relpath: str, name: str):
        return self.space(relpath)[name]


# -- `import vllm.x` inside executed functions -------------------------------------------------

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, world: World):
        self.world = world

    def find_spec(self, fullname, path=None, target=None):
        if (fullname == "vllm" or fullname.startswith("vllm.")) and _modfile(fullname):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return self.world.module(spec.name)

    def exec_module(self, module):
        pass


def _vllm_modules() -> dict:
    return {k: m for k, m in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}


@contextlib.contextmanager
def _engine_imports(world: World):
    """`vllm.*` imports resolved from `world` alone: other `vllm.*` modules (the loader harness's
    stand-ins, left by an earlier test module) step aside meanwhile and come back after."""
    finder = _Finder(world)
    others = _vllm_modules()
    for name in others:
        del sys.modules[name]
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in _vllm_modules():
            del sys.modules[name]
        sys.modules.update(others)


# -- stage 1: the command line ------------------------------------------------------------------

_PARSERS: dict[str, tuple] = {}


def _parser_world() -> World:
    return World(overrides={
        ("vllm/platforms/__init__.py", "current_platform"): _standin("current_platform"),
    })


def serve_parser():
    """(top-level parser, ServeSubcommand instance, world), as entrypoints/cli/main.py builds them."""
    version = wheels.version(ENGINE)
    if version not in _PARSERS:
        world = _parser_world()
        with _engine_imports(world):
            FAP = world.klass("vllm/utils/argparse_utils.py", "FlexibleArgumentParser")
            serve = world.klass("vllm/entrypoints/cli/serve.py", "ServeSubcommand")()
            top = FAP(prog="vllm", description="vLLM CLI", epilog="")
            subparsers = top.add_subparsers(required=False, dest="subparser")
            serve.subparser_init(subparsers).set_defaults(dispatch_function=serve.cmd)
        _PARSERS[version] = (top, serve, world)
    return _PARSERS[version]


def _where(e: BaseException) -> str:
    """file:line of the innermost engine statement in the traceback."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith("vllm/vllm/")]
    if not frames:
        return "?"
    path, _, owner = frames[-1].filename.removeprefix("vllm/").partition(":")
    return f"{path}:{frames[-1].lineno}" + (f" {owner}.{frames[-1].name}" if owner else f" {frames[-1].name}")


def _field_where(e: BaseException) -> str | None:
    """For pydantic's ValidationError: where SpeculativeConfig declares the field, or the
    field_validator that refused it."""
    errors = getattr(e, "errors", None)
    if not callable(errors) or type(e).__name__ != "ValidationError":
        return None
    first = errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if not first.get("loc") and isinstance(cause, BaseException):
        return _where(cause)   # raised in __post_init__ or a model validator
    field = str((first.get("loc") or ("",))[0])
    rel = "vllm/config/speculative.py"
    cls = wheels._class_node(ENGINE, rel, "SpeculativeConfig")
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and any(
                "field_validator" in ast.unparse(d) and repr(field) in ast.unparse(d) for d in item.decorator_list):
            if errors()[0].get("type") == "value_error":
                return f"{rel}:{item.lineno} SpeculativeConfig.{item.name}"
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == field:
            return f"{rel}:{item.lineno} SpeculativeConfig.{field}"
    return f"{rel}:{cls.lineno} SpeculativeConfig (no field {field!r})"


def _where_error(parser) -> str:
    """Where FlexibleArgumentParser.error is (argparse errors go through it)."""
    src = wheels.source(ENGINE, "vllm/utils/argparse_utils.py")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == "error":
            return f"vllm/utils/argparse_utils.py:{node.lineno}"
    return "?"


def parse(argv: list[str]):
    top, serve, world = serve_parser()
    argv = list(argv)
    while argv and argv[0] in LAUNCH:
        argv.pop(0)
    err = io.StringIO()
    with _engine_imports(world), contextlib.redirect_stderr(err):
        try:
            return top.parse_args(argv), serve, world, None
        except SystemExit:
            lines = [l for l in err.getvalue().strip().splitlines() if l.strip()]
            return None, serve, world, lines[-1] if lines else "exited"


# -- stage 3: the speculative config -------------------------------------------------------------

class _HfConfig(types.SimpleNamespace):
    """config.json as an attribute bag with PretrainedConfig's `update` and `to_dict`."""

    def update(self, values):
        self.__dict__.update(values)

    def to_dict(self):
        return dict(self.__dict__)

    def get_text_config(self, decoder=None, encoder=None):
        return self   # a config without sub-configs, as PretrainedConfig answers for one


def _hf_config(model: str) -> _HfConfig:
    """config.json as vLLM's hf_config: a V4.1 one (model_type deepseek_v41) through the release's
    transformers_utils/configs/deepseek_v41.py DeepseekV41Config, which flattens text_config."""
    raw = json.loads((Path(model) / "config.json").read_text())
    if raw.get("model_type") == "deepseek_v41":
        cls = _spec_world().space("vllm/transformers_utils/configs/deepseek_v41.py")["DeepseekV41Config"]
        raw = {k: v for k, v in vars(cls(**raw)).items() if not k.startswith("_")}
    return _HfConfig(**raw)


def _any_schema(cls, source, handler):
    from pydantic_core import core_schema
    return core_schema.any_schema()


class _ModelConfig:
    """Stand-in for config/model.py ModelConfig: see the module docstring."""

    __get_pydantic_core_schema__ = classmethod(_any_schema)

    def __init__(self, model, runner="generate", hf_overrides=None, max_model_len=None,
                 quantization=None, **kwargs):
        self.model, self.runner, self.model_weights = model, runner, ""
        self.hf_overrides = {} if hf_overrides is None else hf_overrides
        hf = _hf_config(model)
        if callable(self.hf_overrides):
            hf = self.hf_overrides(hf)
        self.hf_config = self.hf_text_config = hf
        self.model_arch_config = self.get_model_arch_config()
        self.quantization = quantization
        self.max_model_len = max_model_len or getattr(hf, "max_position_embeddings", 4096)
        self.tokenizer = kwargs.get("tokenizer", model)
        self.tokenizer_mode, self.trust_remote_code = "auto", False
        self.allowed_local_media_path, self.allowed_media_domains = "", None
        self.dtype = self.head_dtype = "bfloat16"
        self.seed, self.revision, self.tokenizer_revision, self.config_format = 0, None, None, "auto"
        self.enforce_eager, self.max_logprobs = False, 20
        self.is_moe = bool(getattr(hf, "n_routed_experts", 0))
        self.speculator_config_class = None
        self.registry = _Registry()

    @property
    def architectures(self):
        return self.model_arch_config.architectures

    def get_model_arch_config(self):
        """What ModelConfig keeps as model_arch_config (SpeculativeConfig.update_arch_ rebuilds it
        after rewriting the draft's hf_config): the architectures."""
        convertor = wheels.methods(ENGINE, "vllm/transformers_utils/model_arch_config_convertor.py",
                                   "ModelArchConfigConvertorBase", ["is_deepseek_mla"],
                                   _spec_world().space("vllm/transformers_utils/model_arch_config_convertor.py"))[
                                       "is_deepseek_mla"]
        return types.SimpleNamespace(architectures=list(getattr(self.hf_config, "architectures", []) or []),
                                     is_deepseek_mla=convertor(types.SimpleNamespace(hf_text_config=self.hf_config)))

    def using_transformers_backend(self):
        return False

    # ModelConfig's own answers where the draft's attention layout is asked (0.34.0's DSpark
    # and DFlash speculator configs): the release's methods, run on this stand-in
    @property
    def use_mla(self):
        return _model_config_method("use_mla").fget(self)

    @property
    def is_deepseek_mla(self):
        return _model_config_method("is_deepseek_mla").fget(self)

    def get_sliding_window(self):
        return _model_config_method("get_sliding_window")(self)

    def get_vocab_size(self):
        return self.hf_config.vocab_size

    def verify_with_parallel_config(self, parallel_config):
        pass


def _model_config_method(name: str):
    """config/model.py ModelConfig.`name` (a function or property), executed in that file's namespace."""
    return wheels.methods(ENGINE, "vllm/config/model.py", "ModelConfig", [name],
                          _spec_world().space("vllm/config/model.py"))[name]


class _Registry:
    """model_executor/models/registry.py's ModelRegistry as update_arch_ asks it: an architecture
    resolves only if the release registers it (its `_VLLM_MODELS` table, evaluated from the
    wheel); the model class itself is not imported."""

    def inspect_model_cls(self, architectures, model_config=None):
        table = _spec_world().space("vllm/model_executor/models/registry.py")["_VLLM_MODELS"]
        for arch in architectures:
            if arch in table:
                module, cls = table[arch]
                return types.SimpleNamespace(module=module, cls=cls), arch
        raise ValueError(f"Model architectures {list(architectures)} are not supported for now "
                         "(not in registry.py _VLLM_MODELS)")


class _ParallelConfig:
    __get_pydantic_core_schema__ = classmethod(_any_schema)

    def __init__(self, tensor_parallel_size=1, pipeline_parallel_size=1, enable_expert_parallel=False, **kwargs):
        self.tensor_parallel_size, self.pipeline_parallel_size = tensor_parallel_size, pipeline_parallel_size
        self.enable_expert_parallel = enable_expert_parallel
        self.decode_context_parallel_size = 1
        self.distributed_executor_backend = self.placement_group = None
        self.max_parallel_loading_workers = None
        self.disable_custom_all_reduce = self.ray_workers_use_nsight = False


_SPEC_WORLDS: dict[str, World] = {}


def _spec_world() -> World:
    version = wheels.version(ENGINE)
    if version not in _SPEC_WORLDS:
        over = {("vllm/config/model.py", "ModelConfig"): _ModelConfig,
                ("vllm/config/parallel.py", "ParallelConfig"): _ParallelConfig,
                ("vllm/platforms/__init__.py", "current_platform"): _standin("current_platform")}
        world = World(overrides=over, shells=True)
        _SPEC_WORLDS[version] = world
    return _SPEC_WORLDS[version]


def speculative_config_class(world: World):
    """config/speculative.py SpeculativeConfig, whole: the pydantic dataclass `config` makes."""
    rel = "vllm/config/speculative.py"
    space = world.space(rel)
    if (rel, "SpeculativeConfig") not in world.overrides:
        from pydantic.dataclasses import rebuild_dataclass
        with _engine_imports(world):   # the class itself; the other config classes stay shells
            world.execute(space, space.defs["SpeculativeConfig"])
            cls = dict.__getitem__(space, "SpeculativeConfig")
            # pydantic resolves the field types in the class's module: here, the space
            rebuild_dataclass(cls, force=True, raise_errors=True,
                              _types_namespace={k: v for k, v in dict.items(space) if not k.startswith("__")})
        world.overrides[(rel, "SpeculativeConfig")] = cls
    return dict.__getitem__(space, "SpeculativeConfig")


def create_speculative_config(args, checkpoint_dir: str):
    """EngineArgs.create_speculative_config over the parsed args, the checkpoint as the target."""
    world = _spec_world()
    spec_cls = speculative_config_class(world)
    fns = wheels.methods(ENGINE, "vllm/engine/arg_utils.py", "EngineArgs", ["create_speculative_config"],
                         world.space("vllm/engine/arg_utils.py"))
    world.space("vllm/engine/arg_utils.py")["SpeculativeConfig"] = spec_cls
    engine_args = types.SimpleNamespace(speculative_config=copy.deepcopy(args.speculative_config),
                                        spec_method=getattr(args, "spec_method", None),
                                        spec_model=getattr(args, "spec_model", None),
                                        spec_tokens=getattr(args, "spec_tokens", None))
    target = _ModelConfig(model=checkpoint_dir, max_model_len=args.max_model_len
                          if isinstance(getattr(args, "max_model_len", None), int) else None)
    parallel = _ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                               enable_expert_parallel=bool(getattr(args, "enable_expert_parallel", False)))
    with _engine_imports(world):
        return fns["create_speculative_config"](engine_args, target, parallel)


# -- the whole --------------------------------------------------------------------------------

def vllm_accepts(argv: list[str], checkpoint_dir, gpu: str) -> tuple[bool, str]:
    """(ok, message): whether vLLM's start-up argument handling accepts serve command `argv` (the
    whole `vllm serve ...` command split into words; `{path}` is replaced by the checkpoint) for
    DeepSeek-V4 checkpoint `checkpoint_dir`. Stages (vLLM's own code, see the module docstring):
    the argument parser, the serve arguments' validation, the speculative config. `gpu` is not
    read by these stages (nothing in them asks the platform); it is kept for the tier's common
    signature. The message names the stage and the engine file:line that refused."""
    checkpoint_dir = str(checkpoint_dir)
    argv = [checkpoint_dir if a == "{path}" else a for a in argv]
    if argv[:2] != ["vllm", "serve"]:
        return False, f"not a `vllm serve` command: {shlex.join(argv[:3])}"
    logging.getLogger("vllm").setLevel(logging.ERROR)
    args, serve, world, error = parse(argv)
    if args is None:
        return False, f"argument parser ({_where_error(None)} FlexibleArgumentParser.error): {error}"
    try:
        with _engine_imports(world):
            serve.validate(args)
    except (ValueError, TypeError) as e:
        return False, f"serve argument validation ({_where(e)}): {type(e).__name__}: {e}"
    try:
        spec = create_speculative_config(args, checkpoint_dir)
    except Exception as e:   # ValueError, NotImplementedError, pydantic's ValidationError
        first = str(e).strip().splitlines()
        where = _field_where(e) or _where(e)
        if isinstance(e, AttributeError) and any(n in str(e) for n in ("_ModelConfig", "_HfConfig", "_ParallelConfig")):
            return False, f"speculative config ({where}): not modelled here (a stand-in lacks what vLLM read): {e}"
        return False, (f"speculative config ({where}): {type(e).__name__}: "
                       + " ".join(l.strip() for l in first[:4]))
    if spec is None:
        return True, "accepted: no speculative decoding"
    draft = spec.draft_model_config
    speculator = ""
    if hasattr(type(spec), "speculator_config"):   # 0.34.0 on: v1/worker/gpu/spec_decode/*/config.py
        with _engine_imports(_spec_world()):
            speculator = f", speculator config={type(spec.speculator_config).__name__}"
    return True, (f"accepted: speculative method={spec.method}{speculator}, num_speculative_tokens="
                  f"{spec.num_speculative_tokens}, draft architectures="
                  f"{getattr(draft, 'architectures', None)}, n_predict="
                  f"{getattr(getattr(draft, 'hf_config', None), 'n_predict', None)}, "
                  f"draft tp={spec.draft_tensor_parallel_size}")
