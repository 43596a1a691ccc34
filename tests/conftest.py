"""Shared test configuration: hypothesis profiles, tiers, peers, mpmath hygiene.

What the default run (``python -m pytest``, command 2) leaves out is *deselected* at collection,
not skipped, and counted in one line each of the terminal summary:

* ``xslow`` sweeps: run them with ``REFATTN_XSLOW=1``;
* peer tests (``@pytest.mark.peers("torch")``: the test needs that import name) whose peer
  framework is not installed: ``pip install -e ".[peers]"`` installs them all. A module that
  parametrises over peers by a ``peer`` argument maps each value to its import name in a
  module-level ``_PEER_MODULE`` dict (tests/meta/test_adapters.py).

Under pytest-xdist (``-n`` in setup.cfg) the workers collect and deselect; each sends its counts
back in ``workeroutput`` and the controller prints them once.
"""

from __future__ import annotations

import importlib.util
import os
import time

import mpmath
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

PEERS_EXTRA = 'pip install -e ".[peers]"'
_COUNTS = "refattn_not_run"  # the config attribute and workeroutput key of the counts

# A pytest started by a test (NUMBA_DISABLE_JIT tier, cudasim, the oracle's plugin) runs in one
# process: the PYTEST_ADDOPTS it inherits overrides setup.cfg's ``-n`` (the command line still
# wins over both), so nested runs do not start worker pools of their own.
os.environ["PYTEST_ADDOPTS"] = (os.environ.get("PYTEST_ADDOPTS", "") + " -n 0").strip()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Under xdist with several workers, compile the Numba kernels once before the workers start.

    Left to themselves, the workers compile what their first tests need, often the same kernels
    at the same moment; :func:`refattn.kernels.precompile` with ``jobs`` = the workers compiles
    each kernel once into Numba's on-disk cache, on every core, and the workers load it (a
    warm cache loads in seconds). ``REFATTN_PRECOMPILE=0`` leaves compiling to the tests.
    """
    config = session.config
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not isinstance(workers, int) or workers < 2:
        return
    if os.environ.get("REFATTN_PRECOMPILE") == "0" or os.environ.get("NUMBA_DISABLE_JIT") == "1":
        return
    from refattn.kernels import FAMILIES, precompile  # here: only the controller needs it

    say = config.pluginmanager.get_plugin("terminalreporter")
    say = say.write_line if say is not None else print
    say(f"refattn: compiling (or loading) the Numba kernels in {workers} processes ...")
    start = time.perf_counter()
    try:
        precompile(paths=FAMILIES, jobs=workers)
    except RuntimeError as exc:  # the tests compile what they need (and report what fails)
        say(f"refattn: precompiling the kernels failed, the tests compile them: {exc}")
        return
    say(f"refattn: the Numba kernels are ready ({time.perf_counter() - start:.0f} s)")


def _installed(name: str) -> bool:
    """Whether the top-level package of import name ``name`` can be found (nothing imported)."""
    return importlib.util.find_spec(name.split(".")[0]) is not None


def _peer_modules(item) -> set[str]:
    """The import names a peer test needs: its ``peers`` markers' arguments, plus the module of
    its ``peer`` parameter when its module maps peers to modules in ``_PEER_MODULE``."""
    needed = {name for marker in item.iter_markers("peers") for name in marker.args}
    peer_modules = getattr(item.module, "_PEER_MODULE", None)
    callspec = getattr(item, "callspec", None)
    if peer_modules and callspec is not None and "peer" in callspec.params:
        needed.add(peer_modules[callspec.params["peer"]])
    return needed


def pytest_collection_modifyitems(config, items):
    xslow = os.environ.get("REFATTN_XSLOW") == "1"
    kept, not_run = [], {"xslow": 0, "peers": 0, "missing": set()}
    for item in items:
        missing = {name for name in _peer_modules(item) if not _installed(name)}
        if missing:
            not_run["peers"] += 1
            not_run["missing"] |= missing
        elif "xslow" in item.keywords and not xslow:
            not_run["xslow"] += 1
        else:
            kept.append(item)
    if len(kept) != len(items):
        run = set(kept)
        config.hook.pytest_deselected(items=[item for item in items if item not in run])
        items[:] = kept
    setattr(config, _COUNTS, not_run)
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the summary
        workeroutput[_COUNTS] = {**not_run, "missing": sorted(not_run["missing"])}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: every worker collects the same items, so any worker's counts do."""
    counts = getattr(node, "workeroutput", {}).get(_COUNTS)
    if counts is not None:
        setattr(node.config, _COUNTS, {**counts, "missing": set(counts["missing"])})


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    not_run = getattr(config, _COUNTS, None)
    if not not_run:
        return
    if not_run["peers"]:
        missing = ", ".join(sorted(not_run["missing"]))
        terminalreporter.write_line(
            f"refattn: {not_run['peers']} peer tests not run: {missing} not installed "
            f"({PEERS_EXTRA})"
        )
    if not_run["xslow"]:
        terminalreporter.write_line(
            f"refattn: {not_run['xslow']} xslow tests not run (REFATTN_XSLOW=1 runs them)"
        )


@pytest.fixture(autouse=True)
def _mpmath_precision_unchanged():
    """Every test must leave mpmath's global precision (mp and iv) as it found it."""
    before = (mpmath.mp.prec, mpmath.iv.prec)
    yield
    after = (mpmath.mp.prec, mpmath.iv.prec)
    mpmath.mp.prec, mpmath.iv.prec = before
    assert after == before, f"mpmath global precision changed from {before} to {after}"
