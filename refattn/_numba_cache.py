"""Stale Numba caches of refattn's compiled kernels: found and removed at import.

Numba keys a cached function on the source file that defines it (its modification time and
size), not on the modules it compiles in: a kernel that calls a jitted helper from another
module, or reads a constant from one, keeps loading its old machine code after only the helper
changed. A wheel install never meets this (an upgrade rewrites every file), but a checkout
updated in place (``git pull`` on an editable install) does, and then runs old arithmetic with
no sign of it.

:func:`purge_stale` closes the gap. It keeps a stamp (modification time and size of every
module of the package) next to the caches; when a module changed since the stamp, the caches of
that module and of every module importing it, directly or not, are deleted, and Numba compiles
them again on first use. With nothing changed it costs one ``stat`` per module.
``REFATTN_NUMBA_CACHE_GUARD=0`` turns it off. ``refattn/__init__.py`` imports this module
first, and importing it runs :func:`guard`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: Name of the stamp file, in the package's top cache folder.
STAMP = "refattn-numba-sources.json"


def _modules(root: Path) -> dict[str, tuple[int, int]]:
    """``{relative path: (mtime_ns, size)}`` of every ``.py`` file under ``root``."""
    found = {}
    stack = [root]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__" and not entry.name.startswith("."):
                        stack.append(Path(entry.path))
                elif entry.name.endswith(".py"):
                    st = entry.stat()
                    found[Path(entry.path).relative_to(root).as_posix()] = (
                        st.st_mtime_ns,
                        st.st_size,
                    )
    return found


def _module_name(package: str, relative: str) -> str:
    parts = [package] + relative[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_FROM = re.compile(r"from\s+(\.*)([\w.]*)\s+import\s+(.*)")


def _statements(text: str):
    """The import statements of a module's source outside function bodies (a function's own
    imports cannot put a global into compiled code), one string each."""
    lines = text.splitlines()
    body_of = None  # the indentation of the ``def`` whose body is being skipped
    i = 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        indent = len(lines[i]) - len(stripped)
        i += 1
        if not stripped or stripped.startswith("#"):
            continue
        if body_of is not None and indent > body_of:
            continue
        body_of = None
        if stripped.startswith(("def ", "async def ")):
            body_of = indent
        elif stripped.startswith(("from ", "import ")):
            statement = stripped.split("#")[0]
            while "(" in statement and ")" not in statement and i < len(lines):
                statement += " " + lines[i].split("#")[0]
                i += 1
            while statement.rstrip().endswith("\\") and i < len(lines):
                statement = statement.rstrip()[:-1] + " " + lines[i]
                i += 1
            yield statement


def _imports(root: Path, package: str, relative: str) -> list[tuple[str, str]]:
    """The package names ``relative`` imports outside function bodies, as ``(module,
    module.name)`` pairs: the second when ``name`` is a submodule (``from . import x``), else
    the first (``from .x import y``)."""
    try:
        text = (root / relative).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    name = _module_name(package, relative)
    here = name.split(".") if relative.endswith("__init__.py") else name.split(".")[:-1]
    out = []
    for statement in _statements(text):
        match = _FROM.match(statement)
        if match is None:  # import a.b, c as d
            words = statement[len("import ") :].split(",")
            out.extend((w.split()[0], w.split()[0]) for w in words if w.strip())
            continue
        dots, module, names = match.groups()
        if dots:
            stem = ".".join(here[: len(here) - len(dots) + 1] + ([module] if module else []))
        else:
            stem = module
        for alias in names.replace("(", " ").replace(")", " ").split(","):
            if alias.strip():
                out.append((stem, f"{stem}.{alias.split()[0]}"))
    return [pair for pair in out if pair[0] == package or pair[0].startswith(package + ".")]


def _stale(root: Path, package: str, now: dict, before: dict) -> set[str]:
    """Relative paths whose compiled code may be stale: the changed modules and, through the
    import graph, every module that imports one of them."""
    changed = {path for path in now if before.get(path) != tuple(now[path])}
    changed |= set(before) - set(now)
    if not changed:
        return set()
    by_name = {_module_name(package, path): path for path in now}
    gone = {_module_name(package, path) for path in set(before) - set(now)}
    importers: dict[str, set[str]] = {}
    for path in now:
        for stem, full in _imports(root, package, path):
            name = full if full in by_name or full in gone else stem
            importers.setdefault(name, set()).add(path)
    stale, todo = set(), [_module_name(package, path) for path in changed]
    while todo:
        name = todo.pop()
        path = by_name.get(name)
        if path is not None and path in stale:
            continue
        if path is not None:
            stale.add(path)
        for importer in importers.get(name, ()):
            if importer not in stale:
                todo.append(_module_name(package, importer))
    return stale


def _cache_dir(source_dir: Path) -> Path:
    """Where Numba keeps the caches of the modules in ``source_dir``: ``__pycache__`` beside
    them, or under ``NUMBA_CACHE_DIR`` as Numba's user-provided locator names it."""
    user = os.environ.get("NUMBA_CACHE_DIR")
    if not user:
        return source_dir / "__pycache__"
    import hashlib  # only with NUMBA_CACHE_DIR set

    path = os.path.abspath(source_dir)
    hashed = hashlib.sha1(path.encode()).hexdigest()
    return Path(user) / f"{os.path.split(path)[-1]}_{hashed}"


def _remove_caches(root: Path, relative: str) -> int:
    source = root / relative
    folder = _cache_dir(source.parent)
    stem = source.name[:-3] + "."
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.startswith(stem) and entry.name.endswith((".nbi", ".nbc")):
            try:
                os.remove(entry.path)
                removed += 1
            except OSError:
                pass
    return removed


def purge_stale(root: Path | str | None = None, package: str | None = None) -> int:
    """Delete the Numba caches of ``package``'s modules whose compiled code may be stale.

    A module's caches are stale when it, or any package module it imports directly or not,
    changed (modification time or size) since the last call; the first call (no stamp yet)
    treats every module as changed. The stamp is written atomically afterwards. Any ``OSError``
    (a read-only install) leaves the caches to Numba's own source-file check.

    Parameters
    ----------
    root : path, optional
        The package folder (default: refattn's).
    package : str, optional
        Its import name (default: ``root``'s folder name).

    Returns
    -------
    int
        The number of cache files deleted.

    Examples
    --------
    >>> purge_stale() >= 0
    True
    """
    root = Path(__file__).parent if root is None else Path(root)
    package = root.name if package is None else package
    stamp = _cache_dir(root) / STAMP
    try:
        now = _modules(root)
        try:
            before = {k: tuple(v) for k, v in json.loads(stamp.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            before = {}
        if before == now:
            return 0
        removed = sum(
            _remove_caches(root, path) for path in sorted(_stale(root, package, now, before))
        )
        stamp.parent.mkdir(parents=True, exist_ok=True)
        partial = stamp.with_name(f"{STAMP}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(now, sort_keys=True))
        os.replace(partial, stamp)
    except OSError:
        return 0
    return removed


def serial_twin(dispatcher, options: dict):
    """``dispatcher``'s Python function compiled again with the Numba ``options`` (those of a
    thread-free compile), cached under a name of its own, ``<name>_serial``.

    Numba names a function's cache files by its module, qualified name and first line, and
    keys their index by the argument types alone (not by ``parallel``): a serial compile of
    the threaded function object itself shares one cache entry per signature with it, and each
    then loads whichever machine code was saved first (the threaded pass running serially, or
    the reverse). A copy of the function under another qualified name has its own entry.

    Examples
    --------
    >>> import numba, numpy as np
    >>> @numba.njit(cache=False, parallel=True)
    ... def total(x):
    ...     s = 0.0
    ...     for i in numba.prange(x.shape[0]):
    ...         s += x[i]
    ...     return s
    >>> twin = serial_twin(total, dict(nopython=True, cache=False))
    >>> twin.py_func.__qualname__, float(twin(np.ones(3)))
    ('total_serial', 3.0)
    """
    import types

    import numba

    func = getattr(dispatcher, "py_func", dispatcher)
    name = func.__name__ + "_serial"
    twin = types.FunctionType(
        func.__code__, func.__globals__, name, func.__defaults__, func.__closure__
    )
    twin.__qualname__ = func.__qualname__ + "_serial"
    twin.__module__ = func.__module__
    twin.__doc__ = func.__doc__
    twin.__kwdefaults__ = func.__kwdefaults__
    return numba.jit(**options)(twin)


def guard() -> None:
    """:func:`purge_stale` on refattn, unless ``REFATTN_NUMBA_CACHE_GUARD=0``."""
    if os.environ.get("REFATTN_NUMBA_CACHE_GUARD", "1") != "0":
        purge_stale()


guard()
