"""Shared fixtures: small synthetic checkpoints written once per session and copied per test."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

# The Triton kernels run under the interpreter on CPU-only machines. It must be chosen before any
# module imports triton, and test modules are collected in an order no single module controls.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from requant import synth  # noqa: E402


def pytest_addoption(parser, pluginmanager):
    """--engine-release, the engine tier's option (tests/engines/conftest.py): pytest reads options
    only from the conftests it loads first, which tests/engines/conftest.py is not when the tests
    are run from the repository root."""
    from engines.conftest import add_engine_release_option
    add_engine_release_option(parser, pluginmanager)


def converted_pair(root, dims: synth.Dims, seed: int, hard: synth.HardCases | None = None,
                   options=None) -> tuple[str, str]:
    """A synthetic source in root/src and its NVFP4 conversion (default options) in root/nvfp4."""
    from requant.convert import convert
    from requant.targets import Options

    src, dst = str(root / "src"), str(root / "nvfp4")
    synth.write_checkpoint(src, dims, seed=seed, hard=hard or synth.HardCases())
    convert(src, dst, "nvfp4", options or Options(), progress=False)
    return src, dst


@pytest.fixture(scope="session")
def small_source(tmp_path_factory) -> str:
    """A default-size synthetic checkpoint with every hard case planted."""
    path = str(tmp_path_factory.mktemp("src") / "ckpt")
    synth.write_checkpoint(path, synth.Dims(), seed=1,
                           hard=synth.HardCases(out_of_window=2, zero_blocks=2, neg_zero_blocks=1))
    return path


@pytest.fixture
def source_copy(small_source, tmp_path) -> str:
    """A private copy of the small checkpoint that a test may damage."""
    path = str(tmp_path / "src")
    shutil.copytree(small_source, path)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the real console entry point in a child process, as a user would."""
    return subprocess.run([sys.executable, "-m", "requant", *args], capture_output=True, text=True, timeout=300)


# The model card and requant.json name the source as the user gave it (a path, or repo@commit), and
# the card the command as run (its destination too), so two conversions of the same bytes from or to
# different places differ in these two files only.
SOURCE_NAMING_FILES = ("README.md", "requant.json")


def output_tree(path: str) -> dict[str, str]:
    """tree() of a conversion's output without the files that name its source's and destination's location."""
    return {k: v for k, v in tree(path).items() if k not in SOURCE_NAMING_FILES}


def tree(path: str) -> dict[str, str]:
    """Every file below `path` by its sha256 (symlinks by their target): two trees compare equal
    exactly when their bytes do."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            p = os.path.join(root, name)
            if os.path.islink(p):
                out[os.path.relpath(p, path)] = "-> " + os.readlink(p)
            else:
                with open(p, "rb") as f:
                    out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def direct_writes_supported(directory: str) -> bool:
    """Whether files in `directory` open with O_DIRECT (no: macOS, older kernels' tmpfs)."""
    from requant.io.safetensors import open_direct

    probe = os.path.join(directory, ".direct-probe")
    open(probe, "wb").close()
    try:
        fd = open_direct(probe)
        if fd is not None:
            os.close(fd)
        return fd is not None
    finally:
        os.remove(probe)


def same_encoding(a, b) -> bool:
    """Two int4.Encoded alike: packed codes, scale bits, zero points and both energies."""
    zero_points = (a.zero_point is None and b.zero_point is None) or torch.equal(a.zero_point, b.zero_point)
    return (torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.int16), b.scale.view(torch.int16))
            and zero_points and (a.signal_energy, a.error_energy) == (b.signal_energy, b.error_energy))
