"""The fixture-only judging parts of an attention case, computed once and kept.

Everything the judge needs that depends on the fixture alone -- not on the implementation
under test -- is a *judging part* of the case (:class:`oracle.reading.case.CaseView`):

* ``"default"`` / ``"tight"``: per tier, the natural scales (T1) of out and lse, the
  textbook baseline's normalised errors (the ``E_base`` of (T2)) and the floors (T6) or the
  tight-tier model (T7) (:mod:`oracle.judging.tolerance`);
* ``"grads"``: the gradients' natural scales, the textbook backward's errors and the floor
  (T5) for the expected number of checked elements;
* ``"models"``: the squared normalised errors of the grading error models
  (:func:`oracle.diagnose.models.error_models`), kept with the tier's part when the judge
  grades the output (``"default+models"``, :func:`with_models`): one file a case to read.

Parts are kept at two levels (:func:`judging_part`): in memory for the rest of the process
(every implementation, tier and kernel of a run, power's planted kernels included) and, when a
cache folder is known (:func:`cache_dir`), on disk across runs, one file per fixture and part
named by the fixture's content key (:func:`oracle.reading.case.fixture_key`; for a fixture the
worker has just read from a checked file, :func:`oracle.reading.case.loaded_key`), the part and
:data:`JUDGING_VERSION`. Files are written atomically (:func:`oracle.fixtures.atomic.
write_atomic`); a file that is missing, unreadable, of another key or version, or whose
arrays do not fit the fixture is recomputed and rewritten, never trusted.

The cache folder is ``$REFATTN_CACHE`` when set (``off`` turns the disk cache off), else
``<fixtures>/.judge-cache`` for fixtures read from a directory (:func:`oracle.fixtures.golden.
load`), else none (in memory only).
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from oracle.diagnose.models import error_models
from oracle.fixtures.atomic import CACHE_VARIABLE, JUDGE_CACHE, cache_folder, write_atomic
from oracle.fixtures.npz import read_npz
from oracle.judging import tolerance as tol
from oracle.reading.baseline import textbook_attention_vjp

__all__ = [
    "JUDGING_VERSION",
    "CACHE_FOLDER",
    "CACHE_VARIABLE",
    "cache_dir",
    "judging_part",
    "clear_memory",
    "forward_part",
    "grads_part",
    "models_part",
    "forward_models_part",
    "with_models",
    "forward_threshold",
    "expected",
    "floors",
    "finite_part",
]

#: the folder inside a fixture directory that holds its judging parts
CACHE_FOLDER = JUDGE_CACHE
#: parts kept in memory (least recently used dropped first)
MEMORY_ENTRIES = 4096

# The modules whose code decides a judging part: a change to any of them is a new version.
_POLICY_MODULES = (
    "oracle/judging/tolerance.py",
    "oracle/judging/parts.py",
    "oracle/reading/baseline.py",
    "oracle/reading/case.py",
    "oracle/reading/heads.py",
    "oracle/reading/allowed.py",
    "oracle/reading/sparse.py",
    "oracle/reading/latent.py",
    "oracle/diagnose/models.py",
)


def _judging_version() -> str:
    """sha256 (16 hex digits) of refattn's version and the source of the policy's modules."""
    import refattn

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(str(getattr(refattn, "__version__", "")).encode())
    for name in _POLICY_MODULES:
        path = root / name
        digest.update(name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"absent")
    return digest.hexdigest()[:16]


#: the version of the judging policy a cached part was computed by
JUDGING_VERSION = _judging_version()

_MEMORY: OrderedDict = OrderedDict()
#: parts read from the disk cache ahead of their case (:func:`read_ahead`), taken by
#: :func:`judging_part` and checked there as any disk read
_AHEAD: dict = {}


def clear_memory() -> None:
    """Forget the parts kept in memory (the disk cache stays)."""
    _MEMORY.clear()


def cache_dir(fixture) -> Path | None:
    """The disk cache folder for ``fixture`` (see the module docstring), or None."""
    return cache_folder(getattr(fixture, "origin", None))


def read_ahead(fixture, key: str, names) -> None:
    """Read the disk-cached parts ``names`` of the fixture with content key ``key`` before
    its case is judged (:mod:`oracle.run.stored` does it in its fixture-reading thread; dict
    operations only, safe beside the judging thread); :func:`judging_part` takes them."""
    folder = cache_dir(fixture)
    for part in names if folder is not None else ():
        if (key, part) not in _MEMORY:
            found = _read(_path(folder, key, part), key, part)
            if found is not None:
                _AHEAD[(key, part)] = found


def forget_ahead(key: str, names) -> None:
    """Drop the parts read ahead for ``key`` that its case did not take."""
    for part in names:
        _AHEAD.pop((key, part), None)


def _path(folder: Path, key: str, part: str) -> Path:
    return folder / f"{key[:32]}-{part}-{JUDGING_VERSION}.npz"


def judging_part(fixture, key: str, part: str, compute, valid) -> dict:
    """The judging part ``part`` of the fixture with content key ``key``: from memory, else
    from the disk cache (when :func:`cache_dir` names one and ``valid(arrays)`` accepts what
    it holds), else ``compute()`` (a dict of str to array, stored in both).

    ``compute`` returns names mapped to arrays or JSON-able values (kept as JSON text)."""
    memo_key = (key, part)
    found = _MEMORY.get(memo_key)
    if found is not None:
        _MEMORY.move_to_end(memo_key)
        return found
    folder = cache_dir(fixture)
    path = None if folder is None else _path(folder, key, part)
    found = _AHEAD.pop(memo_key, None)
    if found is None and path is not None:
        found = _read(path, key, part)
    if found is not None and not _accepted(valid, found):
        found = None
    if found is None:
        start = time.perf_counter()
        found = compute()
        # what the part cost: a cached part credits it to the case's diagnosis budget
        found["seconds"] = np.asarray(time.perf_counter() - start)
        if path is not None:
            _write(path, key, part, found)
    _MEMORY[memo_key] = found
    while len(_MEMORY) > MEMORY_ENTRIES:
        _MEMORY.popitem(last=False)
    return found


def _accepted(valid, arrays) -> bool:
    try:
        return bool(valid(arrays))
    except Exception:  # noqa: BLE001 - a cached entry that cannot even be checked is recomputed
        return False


def _read(path: Path, key: str, part: str) -> dict | None:
    """The arrays of a cache file, or None when it is missing, unreadable or not this entry."""
    try:
        members = read_npz(path)  # numpy.load's arrays, faster (oracle.fixtures.npz)
        meta = json.loads(str(members.pop("meta")))
        json_names = meta.get("json", [])
        if meta.get("key") != key or meta.get("part") != part:
            return None
        if meta.get("version") != JUDGING_VERSION:
            return None
        return {n: (json.loads(str(x)) if n in json_names else x) for n, x in members.items()}
    except Exception:  # noqa: BLE001 - a corrupt or foreign file is recomputed, never trusted
        return None


def _write(path: Path, key: str, part: str, arrays: dict) -> None:
    """Store ``arrays`` atomically; a folder that cannot be written leaves memory only."""
    json_names = [n for n, x in arrays.items() if not isinstance(x, np.ndarray)]
    members = {n: (np.array(json.dumps(x)) if n in json_names else x) for n, x in arrays.items()}
    meta = {"key": key, "part": part, "version": JUDGING_VERSION, "json": json_names}
    buffer = io.BytesIO()
    try:
        np.savez(buffer, meta=np.array(json.dumps(meta)), **members)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, buffer.getvalue())
    except (OSError, ValueError, TypeError):
        return  # a read-only fixture directory: the parts stay in memory for this process


# ---------------------------------------------------------------------------------------------
# The parts themselves, from the case view
# ---------------------------------------------------------------------------------------------


def finite_part(errors, truth):
    """Baseline errors where the truth is finite (a NaN truth says nothing about accuracy)."""
    return np.where(np.isfinite(truth), errors, 0.0)


def floors(view, count, dtype=None) -> dict:
    """The per-row floors (T5) of ``view`` in ``dtype`` (the case's by default) for ``count``
    checked elements (:func:`oracle.judging.tolerance.forward_floors`)."""
    allowed = (
        view.allowed
        if not view.single
        else np.broadcast_to(view.exact64.allowed, view.magnitude.shape)
    )
    found = tol.forward_floors(
        view.dtype if dtype is None else dtype,
        **view.sizes,
        magnitude=view.magnitude,
        allowed=allowed,
        n_stored=view.n_stored,
        dropout=view.options.get("dropout_mask") is not None,
        count=count,
    )
    if view.single:
        found["out"], found["lse"] = found["out"][0], found["lse"][0]
    return found


def _heads(view, x):
    return x[None] if view.single else x


def _element_args(view, count) -> dict:
    return dict(
        weights=_heads(view, view.exact64.weights),
        magnitude=view.magnitude,
        dots=view.dots,
        D=view.shapes["D"],
        S=view.shapes["S"],
        n_stored=view.n_stored,
        softcap=view.options.get("softcap") is not None,
        count=count,
    )


def _out_rule(view, rule, dtype, truth, count):
    value = rule(
        dtype,
        **_element_args(view, count),
        dropped=_heads(view, view.dropped),
        v=view.v,
        out=_heads(view, truth),
        gqa=view.options.get("gqa"),
        dropout=view.options.get("dropout_mask") is not None,
    )
    return value[0] if view.single else value


def _lse_rule(view, rule, dtype, truth, count):
    value = rule(dtype, **_element_args(view, count), lse=_heads(view, truth))
    return value[0] if view.single else value


def expected(view, key, dtype, truth, count):
    """The tight-tier model (T7) of ``key`` ("out" or "lse") evaluated at ``dtype``."""
    if key == "out":
        return _out_rule(view, tol.output_expected, dtype, truth, count)
    return _lse_rule(view, tol.lse_expected, dtype, truth, count)


def forward_threshold(tier, dtype, base_err, floor) -> tol.Threshold:
    """(T2) from the baseline errors and the floor; in the tight tier (T7) the floor alone."""
    if tier == "tight":
        return tol.Threshold(tol.K_FORWARD, None, floor, tol.unit_roundoff(dtype), "tight")
    return tol.threshold(base_err, floor, dtype, k=tol.K_FORWARD)


def forward_part(view, truth_out, truth_lse, tier) -> dict:
    """out's (and lse's, when the fixture has it) scale, baseline errors and floor in
    ``tier``: "out/scale", "out/base", "out/floor" (and the same for "lse/"), and "empty":
    the rows with no allowed key (the judge marks a worst element in one; kept here so that
    judging a passing output never evaluates the float64 textbook)."""
    dtype = view.dtype
    base = view.textbook()
    scale = tol.output_scale(view.dropped, view.v, gqa=view.options.get("gqa"))
    scale = scale[0] if view.single else scale
    out_rule = tol.output_expected if tier == "tight" else tol.output_floor
    found = {
        "out/scale": scale,
        "out/base": finite_part(tol.normalised_error(base.out, truth_out, scale, dtype), truth_out),
        "out/floor": np.asarray(_out_rule(view, out_rule, dtype, truth_out, truth_out.size)),
        "empty": ~np.asarray(view.exact64.allowed).any(axis=-1),
    }
    if truth_lse is not None:
        magnitude = view.magnitude[0] if view.single else view.magnitude
        lscale = tol.lse_scale(truth_lse, view.exact64.weights, magnitude)
        errors = tol.normalised_error(base.lse, truth_lse, lscale, dtype)
        lse_rule = tol.lse_expected if tier == "tight" else tol.lse_floor
        found["lse/scale"] = lscale
        found["lse/base"] = finite_part(errors, truth_lse)
        found["lse/floor"] = np.asarray(_lse_rule(view, lse_rule, dtype, truth_lse, truth_lse.size))
    return found


def forward_valid(truth_out, truth_lse):
    """A check that cached forward parts fit the fixture's out and lse."""

    def valid(found) -> bool:
        fits = found["out/scale"].shape == truth_out.shape and found["out/base"].shape == (
            truth_out.shape
        )
        np.broadcast_shapes(found["out/floor"].shape, truth_out.shape)
        fits = fits and found["empty"].dtype == bool
        if truth_lse is not None:
            fits = fits and found["lse/scale"].shape == truth_lse.shape
            np.broadcast_shapes(found["lse/floor"].shape, truth_lse.shape)
        return fits

    return valid


def grads_part(view, grad_out, grad_lse, truths: dict, count: int) -> dict:
    """The gradients' natural scales ("<name>/scale"), the textbook backward's normalised
    errors ("<name>/base") and the floor (T5) for ``count`` checked elements ("floor")."""
    scales = tol.grad_scales(
        view.q,
        view.k,
        view.v,
        grad_out,
        view.exact64.weights,
        view.dropped,
        grad_lse=grad_lse,
        sink_weights=view.exact64.sink_weights,
        **view.options,
    )
    base = textbook_attention_vjp(
        view.q, view.k, view.v, grad_out, grad_lse=grad_lse, dtype=view.dtype, **view.options
    )
    found = {"floor": np.asarray(floors(view, count)["grad"]), "count": np.asarray(count)}
    for position, name in enumerate(GRADS):
        truth = truths.get(name)
        if truth is None:
            continue
        errors = tol.normalised_error(base[position], truth, scales[name], view.dtype)
        found[f"{name}/scale"] = np.asarray(scales[name])
        found[f"{name}/base"] = finite_part(errors, truth)
    return found


#: the gradients in the order an implementation's vjp returns them
GRADS = ("dq", "dk", "dv", "dbias", "dsinks", "dqv")


def with_models(tier: str) -> str:
    """The name of ``tier``'s part kept with the grading models (:func:`forward_models_part`)."""
    return f"{tier}+models"


def forward_models_part(view, truth_out, truth_lse, tier, rounded) -> dict:
    """:func:`forward_part` and :func:`models_part` (its ``"models"``) in one part."""
    found = forward_part(view, truth_out, truth_lse, tier)
    found.update(models_part(view, truth_out, found["out/scale"], rounded))
    return found


def models_part(view, truth_out, scale, rounded) -> dict:
    """{"models": {label: sum of squared normalised errors}} of the grading error models."""
    return {
        "models": {
            label: float(
                np.sum(
                    finite_part(
                        tol.normalised_error(model, truth_out, scale, view.dtype), truth_out
                    )
                    ** 2
                )
            )
            for label, model in error_models(view, rounded=rounded).items()
        }
    }
