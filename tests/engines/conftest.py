"""The engine conformance tier's releases: `--engine-release ENGINE==X.Y.Z` (repeatable) picks the
release of an engine whose wheel the tier reads (tests/engines/wheels.py); without it,
REQUANT_ENGINE_RELEASES, else the newest release wheels.py knows.

pytest takes command-line options only from the conftests it loads before parsing them, and this
one is not among them when the tests run from the repository root; so the top conftest,
tests/conftest.py, calls `add_engine_release_option` from its pytest_addoption, which registers
the option and the plugin that applies it (also for tests outside this folder that read wheels,
tests/test_engine_numerics.py)."""

from __future__ import annotations

from . import wheels


class EngineReleases:
    """Applies --engine-release to wheels.py before any test module is imported."""

    @staticmethod
    def pytest_configure(config):
        wheels.use(config.getoption("engine_release"))

    @staticmethod
    def pytest_report_header(config):
        return "engine releases: " + ", ".join(f"{e}=={wheels.version(e)}" for e in wheels.NEWEST)


def add_engine_release_option(parser, pluginmanager) -> None:
    parser.addoption("--engine-release", action="append", default=[], metavar="ENGINE==X.Y.Z",
                     help="engine release the conformance tier (tests/engines) runs, e.g. vllm==0.33.0; repeatable. "
                          f"Default: ${wheels.ENV}, else " + ", ".join(f"{e}=={v}" for e, v in wheels.NEWEST.items()))
    pluginmanager.register(EngineReleases(), "requant-engine-releases")
