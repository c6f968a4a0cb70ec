"""Optional dependencies. The core install converts, inspects, verifies, synthesises and writes a
report's JSON and Markdown; the rest comes with pip extras, and a missing one is one line that
names the extra to install."""

from __future__ import annotations

import importlib

from requant.errors import UnsupportedError

# importable module -> (pip extra that installs it, what needs it)
EXTRAS = {
    "triton": ("gpu", "requant's fused-MoE kernel (validate, report's forward comparison)"),
    "matplotlib": ("plots", "report plotting"),
}


class MissingExtra(UnsupportedError):
    """An optional dependency is not installed."""


def install_hint(module: str) -> str:
    extra, what = EXTRAS[module]
    return f"{what} needs {module}, which is not installed: pip install 'requant[{extra}]'"


def require(module: str):
    """Import `module`, or raise MissingExtra naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:   # installed, but something it imports is missing: not ours to name
            raise
        raise MissingExtra(install_hint(module)) from None
