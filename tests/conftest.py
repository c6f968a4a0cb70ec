"""Shared fixtures (helpers the tests import live in tests/helpers/ and tests/factory.py)."""

from __future__ import annotations

import os

# The Triton kernels run under the interpreter on CPU-only machines. It must be chosen before any
# module imports triton, and test modules are collected in an order no single module controls.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from requant import synth  # noqa: E402
from tests.factory import Checkpoints  # noqa: E402


def pytest_addoption(parser, pluginmanager):
    """--engine-release, the engine tier's option (tests/engines/conftest.py): pytest reads options
    only from the conftests it loads first, which tests/engines/conftest.py is not when the tests
    are run from the repository root."""
    from engines.conftest import add_engine_release_option
    add_engine_release_option(parser, pluginmanager)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """The session's shared checkpoints (tests/factory.py); at the end, none may have changed."""
    made = Checkpoints(tmp_path_factory.mktemp("checkpoints"))
    yield made
    changed = made.changed()
    assert not changed, f"tests changed shared checkpoints (a test that modifies one takes checkpoints.copy): {changed}"


@pytest.fixture(scope="session")
def small_source(checkpoints) -> str:
    """A default-size synthetic checkpoint with every hard case planted (shared: read-only)."""
    return checkpoints.source(synth.Dims(), seed=1,
                              hard=synth.HardCases(out_of_window=2, zero_blocks=2, neg_zero_blocks=1))


@pytest.fixture
def source_copy(checkpoints, small_source, tmp_path) -> str:
    """A private copy of the small checkpoint that a test may damage."""
    return checkpoints.copy(small_source, tmp_path / "src")
