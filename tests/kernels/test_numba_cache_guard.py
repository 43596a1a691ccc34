"""Stale Numba caches (:mod:`refattn._numba_cache`): a kernel that compiles in a helper from
another module is recompiled after only the helper changed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from refattn import _numba_cache

ROOT = Path(__file__).resolve().parents[2]

HELPER = textwrap.dedent("""
    from numba import njit

    SCALE = {scale}

    @njit(cache=True)
    def scale(x):
        return SCALE * x
""")
USER = textwrap.dedent("""
    from numba import njit

    from .helper import scale

    @njit(cache=True)
    def run(x):
        return scale(x) + 0.0

    def later():
        from . import other  # a function's import puts nothing into compiled code
        return other
""")
OTHER = textwrap.dedent("""
    from numba import njit

    @njit(cache=True)
    def twice(x):
        return 2.0 * x
""")


def _package(tmp_path, scale=2.0):
    pkg = tmp_path / "tinypkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "user.py").write_text(USER)
    (pkg / "other.py").write_text(OTHER)
    _helper(pkg, scale)
    return pkg


def _helper(pkg, scale):
    path = pkg / "helper.py"
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(HELPER.format(scale=scale))
    # a distinct modification time even on a coarse-grained file system
    os.utime(path, ns=(old + 2_000_000_000, old + 2_000_000_000))


def test_the_changed_module_and_its_importers_are_purged(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    pkg = _package(tmp_path)
    assert _numba_cache.purge_stale(pkg) == 0  # first call: no stamp, no caches yet
    cache = pkg / "__pycache__"
    cache.mkdir(exist_ok=True)
    names = ["helper.scale-6.py311.nbi", "user.run-6.py311.nbi", "user.run-6.py311.1.nbc"]
    names += ["other.twice-4.py311.nbi", "users.x-1.py311.nbi"]
    for name in names:
        (cache / name).write_bytes(b"")
    assert _numba_cache.purge_stale(pkg) == 0  # nothing changed
    _helper(pkg, 3.0)
    assert _numba_cache.purge_stale(pkg) == 3
    left = sorted(p.name for p in cache.iterdir() if p.suffix in (".nbi", ".nbc"))
    assert left == ["other.twice-4.py311.nbi", "users.x-1.py311.nbi"]
    assert _numba_cache.purge_stale(pkg) == 0


def test_function_level_imports_are_not_edges(tmp_path):
    pkg = _package(tmp_path)
    pairs = _numba_cache._imports(pkg, "tinypkg", "user.py")
    assert pairs == [("tinypkg.helper", "tinypkg.helper.scale")]


def test_relative_levels_resolve(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "a" / "b").mkdir(parents=True)
    (pkg / "a" / "b" / "m.py").write_text(
        "from .. import x as y\nfrom ...c import (\n    d,  # note\n    e,\n)\nimport p.f, os\n"
    )
    pairs = _numba_cache._imports(pkg, "p", "a/b/m.py")
    assert pairs == [("p.a", "p.a.x"), ("p.c", "p.c.d"), ("p.c", "p.c.e"), ("p.f", "p.f")]


RUN = (
    "import sys; from refattn._numba_cache import purge_stale; "
    "purge_stale(sys.argv[1]); import tinypkg.user as u; print(u.run(1.0))"
)


def _run(tmp_path, pkg):
    env = dict(
        os.environ,
        NUMBA_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
    )
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(pkg)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    return float(done.stdout.strip())


def test_a_cached_kernel_sees_its_changed_helper(tmp_path):
    """Numba alone would load ``run``'s cached code (user.py did not change) and print 2.0."""
    pkg = _package(tmp_path)
    assert _run(tmp_path, pkg) == 2.0
    assert any((tmp_path / "cache").rglob("user.run-*.nbi"))
    _helper(pkg, 3.0)
    assert _run(tmp_path, pkg) == 3.0
    assert _run(tmp_path, pkg) == 3.0
