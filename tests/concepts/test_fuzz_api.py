"""Fuzz the public API with wrong and extreme arguments: nothing ends unacceptably.

Every try calls a public function (refattn.attention and attention_vjp on the float64, exact
and numba paths, logsumexp, softmax, log_softmax, layer_norm, multihead_attention, gmm, mgk
and hopfield entry points) with one argument replaced by a wrong or extreme value. An outcome
is acceptable when it is

* a ValueError / TypeError (NotImplementedError for a documented "unsupported") whose message
  names the argument, or
* a result that is right: inside the float64 path's stated bound around a reference (refattn's
  exact path, or an independent mpmath evaluation where the inputs lie beyond the float64
  range), or for the variants finite wherever every input is finite.

Anything else (another exception, a RuntimeWarning, an error not naming the argument, NaN or 0
where a finite answer exists, a result outside its bound) is unacceptable. The run is bounded
(fixed tries plus a seeded random sample) and prints its counts with ``-s``.
"""

from __future__ import annotations

import collections
import re
import warnings
from dataclasses import replace

import mpmath
import numpy as np
import pytest

import refattn
from refattn import gmm, hopfield, meanfield, mgk
from refattn import transformer as T
from refattn.bounds import float64_forward_bound, float64_vjp_bound, transformer_forward_bound
from refattn.kernels import numba_cpu
from refattn.spec import canonicalize
from tests.concepts.params import (
    random_attention_params,
    random_decoder_params,
    random_encoder_params,
)

RAGGED = [[1.0, 2.0], [3.0]]
ACCEPTABLE = {"named-error", "correct", "unsupported"}
TINY = 5e-324


class Try:
    """One call: ``label``, the argument names a clear error may mention, the call, a check."""

    def __init__(self, label, names, call, check=None):
        self.label, self.names, self.call, self.check = label, names, call, check


def _names_in(message: str, names) -> bool:
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(n)}(?![A-Za-z_])", message) for n in names)


def outcome(t: Try) -> str:
    """'named-error', 'correct', 'unsupported' (acceptable) or an UPPER-CASE failure tag."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = t.call()
    except NotImplementedError as error:
        return "unsupported" if _names_in(str(error), t.names) else "UNNAMED-ERROR"
    except (ValueError, TypeError) as error:
        return "named-error" if _names_in(str(error), t.names) else "UNNAMED-ERROR"
    except Exception as error:  # noqa: BLE001 (classified, reported with its type)
        return f"CRASH-{type(error).__name__}"
    if t.check is None:
        return "correct"
    try:
        ok = t.check(result)
    except Exception as error:  # noqa: BLE001
        return f"CHECK-CRASH-{type(error).__name__}"
    return "correct" if ok else "WRONG"


# ----------------------------------------------------------------------------- references
def _same_specials(got, want) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return bool(
        np.array_equal(np.isnan(got), np.isnan(want))
        and np.array_equal(np.where(np.isinf(got), got, 0), np.where(np.isinf(want), want, 0))
    )


def _within(got, want, bound) -> bool:
    """|got - want| <= bound + half an ulp of want (want is the exact value rounded once)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), got.shape)
    if got.shape != want.shape or not _same_specials(got, want):
        return False
    finite = np.isfinite(want)
    with np.errstate(over="ignore", invalid="ignore"):
        err = np.abs(got[finite] - want[finite])
        allowed = bound[finite] + np.spacing(np.abs(want[finite])) / 2
    return bool(np.all(err <= allowed))


def _mp_attention(q, k, v, scale, causal=False):
    """out (L, E), lse (L,) of attention (optionally causal, top-left) as mpmath numbers
    (exact scores, 200 digits); an independent reference where the exact path cannot go."""
    with mpmath.workdps(200):
        s = 1 / mpmath.sqrt(len(q[0])) if scale is None else mpmath.mpf(scale)
        outs, lses = [], []
        for i, qi in enumerate(q):
            row = [
                s
                * mpmath.fsum(
                    mpmath.mpf(float(a)) * mpmath.mpf(float(b)) for a, b in zip(qi, kj, strict=True)
                )
                for j, kj in enumerate(k)
                if not causal or j <= i
            ]
            if not row:
                outs.append([mpmath.mpf(0)] * len(v[0]))
                lses.append(-mpmath.inf)
                continue
            top = max(row)
            terms = [mpmath.exp(t - top) for t in row]
            total = mpmath.fsum(terms)
            lses.append(top + mpmath.log(total))
            outs.append(
                [
                    mpmath.fsum(w * mpmath.mpf(float(v[j][e])) for j, w in enumerate(terms)) / total
                    for e in range(len(v[0]))
                ]
            )
        return np.array(outs, dtype=object), np.array(lses, dtype=object)


def _mp_within(got, want, bound) -> bool:
    """|got - want| <= bound with want an mpmath value (inf bound accepts; +-inf must match
    the rounding of a value beyond the float64 range)."""
    with mpmath.workdps(200):
        for g, w, b in zip(np.ravel(got), np.ravel(want), np.ravel(bound), strict=True):
            if np.isinf(g):
                if not (abs(w) > mpmath.mpf(np.finfo(np.float64).max) and (g > 0) == (w > 0)):
                    return False
                continue
            if w == -mpmath.inf and g == -np.inf:
                continue
            if np.isnan(g) or (not np.isinf(b) and abs(mpmath.mpf(float(g)) - w) > b):
                return False
    return True


def _is_rounded_mp(result, want) -> bool:
    """Each element of an exact-path result is its mpmath value rounded once (200 digits
    settle these well-separated cases: weights are 0 and 1 to far beyond any rounding)."""
    from tests.naive.rounding import round_nested

    return all(
        np.array_equal(np.asarray(g, np.float64), round_nested(w))
        and np.array_equal(np.signbit(g), np.signbit(round_nested(w)))
        for g, w in zip(result, want, strict=True)
    )


def check_attention(args, options):
    """A float64 / numba result of attention vs the exact path, inside the stated bound."""

    def check(result):
        out, lse = result
        plain = _no_flags(_attention_options(options))
        if options.get("backend") == "numba":
            spec = canonicalize(*args, **plain)
            _, weights = refattn.attention(*args, **plain, return_weights=True)
            weights = np.reshape(weights, spec.q.shape[:3] + (spec.k.shape[2],))
            out_b, lse_b = numba_cpu.forward_error_bound(spec, weights)
            out_b, lse_b = spec.unflatten(out_b), spec.unflatten(lse_b)
        else:
            out_b, lse_b = float64_forward_bound(*args, **plain)
        want_out, want_lse = refattn.attention(*args, **plain, precision="exact", return_lse=True)
        return _within(out, want_out, out_b) and _within(lse, want_lse, lse_b)

    return check


def _attention_options(options):
    return {k: v for k, v in options.items() if k not in ("backend", "out_dtype")}


def _no_flags(options):
    return {k: v for k, v in options.items() if k not in ("return_lse", "return_weights")}


# ----------------------------------------------------------------------------- tries
def _base(rng):
    q = rng.standard_normal((2, 3))
    k = rng.standard_normal((3, 3))
    v = rng.standard_normal((3, 2))
    return q, k, v


ARRAY_BAD = {
    "None": None,
    "str": "abc",
    "ragged": RAGGED,
    "int": np.ones((2, 3), dtype=np.int64),
    "complex": np.ones((2, 3), dtype=complex),
    "object": object(),
    "1-D": np.ones(3),
    "0-size": np.zeros((0,)),
    "wrong-last": np.ones((2, 5)),
}
SCALAR_BAD = {
    "nan": float("nan"),
    "inf": float("inf"),
    "-inf": -float("inf"),
    "10**400": 10**400,
    "str": "x",
    "list": [1.0],
    "complex": 1j,
    "bool": True,
    "array": np.ones(2),
    "-1": -1.0,
    "0": 0.0,
    "huge": 1e308,
    "tiny": TINY,
}


def attention_tries(rng):
    q, k, v = _base(rng)
    tries = []
    paths = [dict(), dict(precision="exact"), dict(backend="numba")]
    for path in paths:
        tag = path.get("precision", path.get("backend", "float64"))
        for name, pos in (("q", 0), ("k", 1), ("v", 2)):
            for bad, value in ARRAY_BAD.items():
                args = [q, k, v]
                args[pos] = value
                tries.append(
                    Try(
                        f"attention[{tag}] {name}={bad}",
                        [name],
                        lambda a=tuple(args), p=path: refattn.attention(*a, **p),
                    )
                )
        for option, value_set in (
            ("scale", SCALAR_BAD),
            ("softcap", SCALAR_BAD),
            ("dropout_p", SCALAR_BAD),
        ):
            for bad, value in value_set.items():
                opts = dict(path, **{option: value}, return_lse=True)
                if option == "dropout_p":
                    opts["dropout_mask"] = np.ones((2, 3), dtype=bool)
                check = None if "precision" in path else check_attention((q, k, v), opts)
                tries.append(
                    Try(
                        f"attention[{tag}] {option}={bad}",
                        [option],
                        lambda o=opts: refattn.attention(q, k, v, **o),
                        check,
                    )
                )
        extra = {
            "window=(2**70,0)": dict(window=(2**70, 0)),
            "window=(-1,0)": dict(window=(-1, 0)),
            "window=(1.5,0)": dict(window=(1.5, 0)),
            "window=3": dict(window=3),
            "window=(None,2**64)": dict(window=(None, 2**64)),
            "out_dtype=garbage": dict(out_dtype="garbage"),
            "out_dtype=int": dict(out_dtype=int),
            "align=x": dict(align="x"),
            "gqa=x": dict(gqa="x"),
            "empty_rows=x": dict(empty_rows="x"),
            "causal=1": dict(causal=1),
            "causal=None": dict(causal=None),
            "mask=float": dict(mask=np.ones((2, 3))),
            "mask=ragged": dict(mask=RAGGED),
            "mask=wrong-shape": dict(mask=np.ones((4, 3), dtype=bool)),
            "bias=nan-allowed": dict(bias=np.full((2, 3), np.nan)),
            "bias=ragged": dict(bias=RAGGED),
            "bias=int": dict(bias=np.zeros((2, 3), int)),
            "alibi=scalar": dict(alibi_slopes=1.0),
            "alibi=nan": dict(alibi_slopes=[np.nan]),
            "dropout_p>0 no mask": dict(dropout_p=0.5),
            "dropout_mask=ragged": dict(dropout_mask=RAGGED, dropout_p=0.5),
            "backend=x": dict(backend="x"),
            "precision=x": dict(precision="x"),
        }
        for label, opts in extra.items():
            names = [n for n in opts if n != "return_lse"] + (
                ["dropout_mask"] if label == "dropout_p>0 no mask" else []
            )
            opts = dict(path, **opts)
            if "backend" in label and "precision" in path:
                names.append("backend")
            check = None
            if "window=(2**70" in label or "window=(None" in label:
                check = (
                    None
                    if "precision" in path
                    else check_attention((q, k, v), dict(opts, return_lse=True))
                )
                opts = dict(opts, return_lse=True)
            tries.append(
                Try(
                    f"attention[{tag}] {label}",
                    names,
                    lambda o=opts: refattn.attention(q, k, v, **o),
                    check,
                )
            )
        zero_kv = (np.zeros((1, 2, 2, 3)), np.zeros((1, 0, 3, 3)), np.zeros((1, 0, 3, 2)))
        tries.append(
            Try(
                f"attention[{tag}] K=0", ["k"], lambda p=path, z=zero_kv: refattn.attention(*z, **p)
            )
        )
        tries.append(
            Try(
                f"attention_vjp[{tag}] K=0",
                ["k"],
                lambda p=path, z=zero_kv: refattn.attention_vjp(*z, np.ones((1, 2, 2, 2)), **p),
            )
        )
        for bad, value in ARRAY_BAD.items():
            tries.append(
                Try(
                    f"attention_vjp[{tag}] grad_out={bad}",
                    ["grad_out"],
                    lambda g=value, p=path: refattn.attention_vjp(q, k, v, g, **p),
                )
            )
        tries.append(
            Try(
                f"attention_vjp[{tag}] grad_lse=wrong",
                ["grad_lse"],
                lambda p=path: refattn.attention_vjp(
                    q, k, v, np.ones((2, 2)), grad_lse=np.ones(5), **p
                ),
            )
        )
    return tries


def beyond_range_tries(rng):
    """Scores beyond the float64 range (q, k ~ 1e155 .. 1e300) and subnormal results."""
    tries = []
    for size in (1e155, 1e160, 1e200, 1e300):
        for _ in range(3):
            q = rng.standard_normal((2, 3)) * size
            k = rng.standard_normal((3, 3)) * size
            v = rng.standard_normal((3, 2))

            def check(result, q=q, k=k, v=v):
                out, lse = result
                want_out, want_lse = _mp_attention(q, k, v, 1.0)
                out_b, lse_b = float64_forward_bound(q, k, v, scale=1.0)
                return _mp_within(out, want_out, out_b) and _mp_within(lse, want_lse, lse_b)

            tries.append(
                Try(
                    f"attention[float64] q,k~{size:g}",
                    ["q"],
                    lambda q=q, k=k, v=v: refattn.attention(q, k, v, scale=1.0, return_lse=True),
                    check,
                )
            )
            tries.append(
                Try(
                    f"attention[exact] q,k~{size:g}",
                    ["q"],
                    lambda q=q, k=k, v=v: refattn.attention(
                        q, k, v, scale=1.0, return_lse=True, precision="exact"
                    ),
                    lambda r, q=q, k=k, v=v: _is_rounded_mp(r, _mp_attention(q, k, v, 1.0)),
                )
            )
            tries.append(
                Try(
                    f"attention_vjp[exact] q,k~{size:g}",
                    ["q"],
                    lambda q=q, k=k, v=v: refattn.attention_vjp(
                        q, k, v, np.ones((2, 2)), scale=1.0, precision="exact"
                    ),
                    lambda g: all(np.isfinite(x).all() for x in g[:3]),
                )
            )
            tries.append(
                Try(
                    f"attention[numba] q,k~{size:g}",
                    ["q"],
                    lambda q=q, k=k, v=v: refattn.attention(
                        q, k, v, scale=1.0, return_lse=True, backend="numba"
                    ),
                    lambda r: False,
                )
            )  # must be the clear error, never a result
            tries.append(
                Try(
                    f"attention_vjp[float64] q,k~{size:g}",
                    ["q"],
                    lambda q=q, k=k, v=v: refattn.attention_vjp(
                        q, k, v, np.ones((2, 2)), scale=1.0
                    ),
                    lambda g: all(np.isfinite(x).all() for x in g[:3]),
                )
            )
    for size in (1e20, 1e30):  # float32 inputs: the numba kernels compute in float32
        q = (rng.standard_normal((2, 3)) * size).astype(np.float32)
        k = (rng.standard_normal((3, 3)) * size).astype(np.float32)
        v = rng.standard_normal((3, 2)).astype(np.float32)
        tries.append(
            Try(
                f"attention[numba] float32 q,k~{size:g}",
                ["q"],
                lambda q=q, k=k, v=v: refattn.attention(q, k, v, backend="numba"),
                lambda r: False,
            )
        )
        tries.append(
            Try(
                f"attention[float64] float32 q,k~{size:g}",
                ["q"],
                lambda q=q, k=k, v=v: refattn.attention(q, k, v, return_lse=True),
                check_attention((q, k, v), dict(return_lse=True)),
            )
        )
    for scale_v in (TINY, 2 * TINY, 1e-310, 1e-320):
        q, k, _ = _base(rng)
        v = np.full((3, 2), scale_v) * rng.integers(1, 4, (3, 2))
        opts = dict(return_lse=True)
        tries.append(
            Try(
                f"attention[float64] v~{scale_v:g}",
                ["v"],
                lambda q=q, k=k, v=v, o=opts: refattn.attention(q, k, v, **o),
                check_attention((q, k, v), opts),
            )
        )
        tries.append(
            Try(
                f"attention[numba] v~{scale_v:g}",
                ["v"],
                lambda q=q, k=k, v=v, o=opts: refattn.attention(q, k, v, backend="numba", **o),
                check_attention((q, k, v), dict(opts, backend="numba")),
            )
        )
        grad = np.ones((2, 2))

        def vjp_check(g, q=q, k=k, v=v, grad=grad):
            exact = refattn.attention_vjp(q, k, v, grad, precision="exact")
            bounds = float64_vjp_bound(q, k, v, grad)
            return all(
                _within(a, b, c) for a, b, c in zip(g[:3], exact[:3], bounds[:3], strict=True)
            )

        tries.append(
            Try(
                f"attention_vjp[float64] v~{scale_v:g}",
                ["v"],
                lambda q=q, k=k, v=v, g=grad: refattn.attention_vjp(q, k, v, g),
                vjp_check,
            )
        )
    return tries


def logspace_tries(rng):
    tries = []
    x = rng.standard_normal((2, 3))
    for fn in (refattn.logsumexp, refattn.softmax, refattn.log_softmax):
        for precision in ("float64", "exact"):
            tag = f"{fn.__name__}[{precision}]"

            def call(f=fn, p=precision, **kw):
                return f(precision=p, **kw)

            for bad, value in ARRAY_BAD.items():
                if bad in ("1-D", "wrong-last", "0-size"):
                    continue
                tries.append(Try(f"{tag} x={bad}", ["x"], lambda v=value, c=call: c(x=v)))
            for label, axis in (
                ("None", None),
                ("1.5", 1.5),
                ("5", 5),
                ("'0'", "0"),
                ("True", True),
                ("np.int64(0)", np.int64(0)),
            ):

                def check(r, f=fn, a=axis):
                    want = f(x, axis=a, precision="exact")
                    return np.shape(r) == np.shape(want) and _lse_close(r, want, x)

                tries.append(
                    Try(
                        f"{tag} axis={label}",
                        ["axis"],
                        lambda a=axis, c=call: c(x=x, axis=a),
                        check,
                    )
                )
            for shape in ((0,), (3, 0), (0, 3)):

                def empty_check(r, f=fn, s=shape):
                    if f is refattn.logsumexp:
                        return r.shape == s[:-1] and bool(np.all(np.isneginf(r)))
                    return r.shape == s

                tries.append(
                    Try(
                        f"{tag} empty {shape}",
                        ["x"],
                        lambda s=shape, c=call: c(x=np.zeros(s)),
                        empty_check,
                    )
                )
            tries.append(
                Try(
                    f"{tag} out_dtype=garbage",
                    ["out_dtype"],
                    lambda c=call: c(x=x, out_dtype="garbage"),
                )
            )
            tries.append(Try(f"{tag} where=ragged", ["where"], lambda c=call: c(x=x, where=RAGGED)))
            tries.append(
                Try(f"{tag} where=float", ["where"], lambda c=call: c(x=x, where=np.ones((2, 3))))
            )
    return tries


def _lse_close(got, want, x) -> bool:
    """float64 logspace result vs the exact one: ``gamma_{n+4} (1 + |lse| + max|x|)``
    (Blanchard, Higham & Higham 2021, Theorem 4.2, plus the rounding of the result)."""
    from refattn.bounds import gamma

    bound = gamma(np.size(x) + 4) * (1 + np.abs(np.asarray(want, np.float64)) + np.max(np.abs(x)))
    return _within(got, want, bound)


def layer_norm_tries(rng):
    tries = []
    rows = [
        [1e200, -1e200, 0.0],
        [1.7e308, -1.7e308, 1e308],
        [1e-320, 0.0, -1e-320],
        [TINY, 0.0],
        [1e-200, 3e-200, -2e-200],
        [1e154, 1e154 * (1 + 2**-52)],
    ]
    for row in rows:
        for eps in (0.0, 1e-5, 1e300):
            x = np.array(row)

            def check(r, x=x, eps=eps):
                want = T.layer_norm(x, eps=eps, precision="exact")
                bound = transformer_forward_bound(T.layer_norm, x, eps=eps)
                return bool(np.isfinite(bound).all()) and _within(r, want, bound)

            tries.append(
                Try(
                    f"layer_norm {row} eps={eps:g}",
                    ["x"],
                    lambda x=x, eps=eps: T.layer_norm(x, eps=eps),
                    check,
                )
            )
    x = rng.standard_normal((2, 3))
    for bad, value in ARRAY_BAD.items():
        if bad in ("1-D", "wrong-last"):
            continue
        tries.append(Try(f"layer_norm x={bad}", ["x"], lambda v=value: T.layer_norm(v)))
    for bad, value in SCALAR_BAD.items():
        if bad in ("0", "huge", "tiny"):
            continue
        tries.append(Try(f"layer_norm eps={bad}", ["eps"], lambda v=value: T.layer_norm(x, eps=v)))
    for label, axis in (("None", None), ("1.5", 1.5), ("7", 7)):
        tries.append(
            Try(f"layer_norm axis={label}", ["axis"], lambda a=axis: T.layer_norm(x, axis=a))
        )
    tries.append(
        Try("layer_norm gamma=wrong", ["gamma"], lambda: T.layer_norm(x, gamma=np.ones(5)))
    )
    return tries


def mha_tries(rng):
    p = random_attention_params(4, 2, seed=1)
    x = rng.standard_normal((3, 4))

    def call(**kw):
        return T.multihead_attention(
            kw.pop("x_q", x),
            kw.pop("x_kv", None),
            kw.pop("W_Q", p.W_Q),
            p.W_K,
            p.W_V,
            p.W_O,
            num_heads=kw.pop("num_heads", 2),
            **kw,
        )

    tries = []
    for bad, value in ARRAY_BAD.items():
        tries.append(
            Try(
                f"mha x_q={bad}",
                ["x_q"] + (["W_Q"] if bad == "wrong-last" else []),
                lambda v=value: call(x_q=v),
            )
        )
        tries.append(Try(f"mha W_Q={bad}", ["W_Q"], lambda v=value: call(W_Q=v)))
    for label, heads in (("0", 0), ("3", 3), ("1.5", 1.5), ("None", None), ("-2", -2)):
        tries.append(
            Try(f"mha num_heads={label}", ["num_heads"], lambda h=heads: call(num_heads=h))
        )
    tries.append(Try("mha scale=10**400", ["scale"], lambda: call(scale=10**400)))
    tries.append(Try("mha unknown keyword", ["colour"], lambda: call(colour=1)))
    tries.append(Try("mha out_dtype=garbage", ["out_dtype"], lambda: call(out_dtype="garbage")))
    return tries


def _flat_grads(grads):
    """The fields of a vjp result as one flat array (for the finiteness checks)."""
    return np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in grads])


def variant_tries(rng):
    q = np.array([[0.0, 1.0]])
    keys = np.array([[0.0, 1.0], [1.0, 0.0]])
    values = np.array([[1.0], [0.0]])

    def finite_or_exact(call, kwargs):
        """Finite, or the same NaN/inf pattern as the exact path (a result beyond the range)."""

        def check(result):
            result = np.asarray(result, np.float64)
            if np.isfinite(result).all():
                return True
            return _same_specials(result, call(**kwargs, precision="exact"))

        return check

    calls = {
        "gmm.attention": (
            lambda **kw: gmm.attention(
                kw.pop("q", q),
                kw.pop("keys", keys),
                kw.pop("values", values),
                alpha=kw.pop("alpha", 1.0),
                **kw,
            ),
            ["q", "keys", "values"],
            ["alpha", "beta"],
        ),
        "mgk.attention": (
            lambda **kw: mgk.attention(
                kw.pop("q", np.zeros((1, 1))),
                kw.pop("keys", np.array([[[0.0]], [[2.0]]])),
                kw.pop("v", np.array([[1.0], [0.0]])),
                sigma2=kw.pop("sigma2", 1.0),
                **kw,
            ),
            ["q", "keys", "v"],
            ["sigma2"],
        ),
        "hopfield.retrieve": (
            lambda **kw: hopfield.retrieve(
                kw.pop("xi", np.array([[3.0, 0.0]])),
                kw.pop("X", np.eye(2)),
                beta=kw.pop("beta", 8.0),
                **kw,
            ),
            ["xi", "X"],
            ["beta", "steps"],
        ),
        "gmm.adapt_keys": (
            lambda **kw: gmm.adapt_keys(
                kw.pop("queries", np.array([[2.0, 0.0]])),
                kw.pop("keys0", np.array([[0.0, 0.0]])),
                alpha=kw.pop("alpha", 1.0),
                gamma=kw.pop("gamma", 1.0),
                **kw,
            ),
            ["queries", "keys0"],
            ["alpha", "gamma", "iters"],
        ),
        "gmm.attention_vjp": (
            lambda **kw: _flat_grads(
                gmm.attention_vjp(
                    kw.pop("q", q),
                    kw.pop("keys", keys),
                    kw.pop("values", values),
                    kw.pop("grad_out", np.ones((1, 1))),
                    alpha=kw.pop("alpha", 1.0),
                    beta=kw.pop("beta", 0.5),
                    iters=kw.pop("iters", 2),
                    **kw,
                )
            ),
            ["q", "keys", "values", "grad_out"],
            ["alpha", "beta", "iters"],
        ),
        "gmm.adapt_keys_vjp": (
            lambda **kw: _flat_grads(
                gmm.adapt_keys_vjp(
                    kw.pop("queries", np.array([[2.0, 0.0]])),
                    kw.pop("keys0", np.array([[0.0, 0.0]])),
                    kw.pop("grad_out", np.ones((1, 2))),
                    alpha=kw.pop("alpha", 1.0),
                    gamma=kw.pop("gamma", 1.0),
                    **kw,
                )
            ),
            ["queries", "keys0", "grad_out"],
            ["alpha", "gamma", "iters"],
        ),
        "gmm.adapt_priors_vjp": (
            lambda **kw: _flat_grads(
                gmm.adapt_priors_vjp(
                    kw.pop("queries", np.array([[0.0], [1.0]])),
                    kw.pop("keys", np.array([[0.0], [1.0]])),
                    kw.pop("grad_out", np.array([1.0, -1.0])),
                    alpha=kw.pop("alpha", 1.0),
                    eta=kw.pop("eta", 0.5),
                    pi0=kw.pop("pi0", np.array([0.5, 0.5])),
                    **kw,
                )
            ),
            ["queries", "keys", "grad_out"],
            ["alpha", "eta", "iters"],
        ),
        "mgk.em_update_pi": (
            lambda **kw: (
                mgk.em_update_pi(
                    kw.pop("q", np.array([[0.0], [0.0]])),
                    kw.pop("keys", np.array([[[0.0], [50.0]]])),
                    log_pi=kw.pop("log_pi", np.log(np.array([[0.5, 0.5]]))),
                    sigma2=kw.pop("sigma2", 1.0),
                    **kw,
                ).pi
            ),
            ["q", "keys", "log_pi"],
            ["sigma2"],
        ),
        "mgk.linear_attention": (
            lambda **kw: mgk.linear_attention(
                kw.pop("q", np.zeros((1, 1))),
                kw.pop("keys", np.array([[[0.0]], [[1.0]]])),
                kw.pop("v", np.array([[0.0], [3.0]])),
                pi=kw.pop("pi", np.ones((2, 1))),
                **kw,
            ),
            ["q", "keys", "v", "pi"],
            [],
        ),
        "sinusoidal_positions": (
            lambda **kw: T.sinusoidal_positions(kw.pop("length", 2), kw.pop("dim", 2), **kw),
            [],
            ["length", "dim", "base"],
        ),
        "feed_forward": (
            lambda **kw: T.feed_forward(
                kw.pop("x", np.array([[1.0, -1.0]])),
                kw.pop("W1", np.eye(2)),
                None,
                kw.pop("W2", np.eye(2)),
                None,
                **kw,
            ),
            ["x", "W1", "W2"],
            [],
        ),
        "hopfield.energy": (
            lambda **kw: hopfield.energy(
                kw.pop("xi", np.array([[1.0, 0.0]])),
                kw.pop("X", np.eye(2)),
                beta=kw.pop("beta", 1.0),
                **kw,
            ),
            ["xi", "X"],
            ["beta"],
        ),
    }
    tries = []
    for label, (call, arrays, scalars) in calls.items():
        for name in arrays:
            for bad, value in ARRAY_BAD.items():
                tries.append(
                    Try(
                        f"{label} {name}={bad}",
                        [name],
                        lambda c=call, n=name, v=value: c(**{n: v}),
                        finite_or_exact(call, {name: value}),
                    )
                )
        for name in scalars:
            for bad, value in SCALAR_BAD.items():
                if name in ("steps", "iters", "length", "dim") and bad in ("10**400", "huge"):
                    continue  # a huge iteration count is valid and runs as asked
                tries.append(
                    Try(
                        f"{label} {name}={bad}",
                        [name],
                        lambda c=call, n=name, v=value: c(**{n: v}),
                        finite_or_exact(call, {name: value}),
                    )
                )
        tries.append(
            Try(
                f"{label} out_dtype=garbage",
                ["out_dtype"],
                lambda c=call: c(out_dtype="garbage", precision="exact"),
            )
        )
        tries.append(Try(f"{label} precision=x", ["precision"], lambda c=call: c(precision="x")))
    return tries


def random_extreme_tries(rng, count):
    """Random finite inputs with magnitudes from subnormal to near overflow, checked against
    the exact path (or mpmath) inside the stated bound."""
    tries = []
    for i in range(count):
        shape_l, shape_s, dim = rng.integers(1, 4, 3)
        exps = rng.choice([-320, -300, -150, -20, 0, 20, 150], size=3)
        q = rng.standard_normal((shape_l, dim)) * 10.0 ** exps[0]
        k = rng.standard_normal((shape_s, dim)) * 10.0 ** exps[1]
        v = rng.standard_normal((shape_s, 2)) * 10.0 ** exps[2]
        opts = dict(return_lse=True, causal=bool(rng.integers(2)), scale=1.0)

        def check(result, q=q, k=k, v=v, opts=opts):
            out, lse = result
            want_out, want_lse = _mp_attention(q, k, v, 1.0, opts["causal"])
            out_b, lse_b = float64_forward_bound(q, k, v, scale=1.0, causal=opts["causal"])
            return _mp_within(out, want_out, out_b) and _mp_within(lse, want_lse, lse_b)

        tries.append(
            Try(
                f"random #{i} exps={exps.tolist()} causal={opts['causal']}",
                ["q"],
                lambda q=q, k=k, v=v, o=opts: refattn.attention(q, k, v, **o),
                check,
            )
        )
    return tries


def all_tries(seed=0, random_count=40):
    rng = np.random.default_rng(seed)
    return (
        attention_tries(rng)
        + beyond_range_tries(rng)
        + logspace_tries(rng)
        + layer_norm_tries(rng)
        + mha_tries(rng)
        + variant_tries(rng)
        + random_extreme_tries(rng, random_count)
    )


# Unacceptable outcomes another item owns: counted and printed apart, not failed here. Empty
# since the exact path settles every finite input (issue #9 item 5).
OWNED_ELSEWHERE: set[str] = set()


@pytest.mark.filterwarnings("ignore::numba.NumbaWarning")
def test_fuzz_public_api_has_no_unacceptable_outcome():
    tries = all_tries()
    results = [(t.label, outcome(t)) for t in tries]
    counts = collections.Counter(o for _, o in results)
    print(f"\nfuzz: {len(results)} tries, outcomes {dict(sorted(counts.items()))}")
    elsewhere = [
        f"{label}: {o}" for label, o in results if o not in ACCEPTABLE and label in OWNED_ELSEWHERE
    ]
    if elsewhere:
        print("owned by another item (exact path):", "; ".join(elsewhere))
    bad = [
        f"{label}: {o}"
        for label, o in results
        if o not in ACCEPTABLE and label not in OWNED_ELSEWHERE
    ]
    assert not bad, f"{len(bad)} unacceptable of {len(results)}:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- transformer and
# mean-field inputs (issue 28): the caller's callables and the parameter dataclasses. Kept apart
# from all_tries so that its counts read on their own.


def _deq_problem():
    """x (N=3, d=2) and couplings J with ||J||_inf = 0.2 (the DEQ map contracts)."""
    x = np.array([[0.5, -0.25], [1.0, 0.0], [-0.5, 0.75]])
    J = np.zeros((3, 3, 2, 2))
    J[0, 1] = J[1, 2] = J[2, 0] = 0.1 * np.eye(2)
    return x, J


def _quarter(z):
    return 0.25 * z


def _same_means_as_quarter(x, J):
    """The fixed point equals, bit for bit, the one with the ndarray correction z / 4 (a valid
    result spelled as a list or in float32 must not change a bit)."""

    def check(result):
        return np.array_equal(result.means, meanfield.deq_attention(x, J, _quarter).means)

    return check


def _random_encoder_params_seed_x():
    builder = getattr(T, "random_encoder_params", None)
    if builder is None:
        return None  # moved to tests/concepts/params.py: no public seed left to validate
    return builder(4, 2, 8, seed="x")


def transformer_meanfield_tries():
    x, J = _deq_problem()
    wrong_images = {
        "wrong shape": lambda z: np.ones(5),
        "transposed": lambda z: z.T,
        "scalar": lambda z: 0.0,
        "extra axis": lambda z: z[None],
        "ragged": lambda z: RAGGED,
        "complex": lambda z: z * 1j,
        "str": lambda z: "abc",
        "None": lambda z: None,
        "NaN": lambda z: z * np.nan,
        "inf": lambda z: np.full(z.shape, np.inf),
    }
    tries = []
    for bad, f in wrong_images.items():
        tries.append(
            Try(
                f"meanfield.deq_attention correction returns {bad}",
                ["correction"],
                lambda f=f: meanfield.deq_attention(x, J, f),
            )
        )
        tries.append(
            Try(
                f"meanfield.deq_attention_vjp correction_vjp returns {bad}",
                ["correction_vjp"],
                lambda f=f: meanfield.deq_attention_vjp(
                    x, J, x, correction=_quarter, correction_vjp=lambda z, v: f(v)
                ),
            )
        )
    tries.append(
        Try(
            "meanfield.deq_attention exact correction returns wrong shape",
            ["correction"],
            lambda: meanfield.deq_attention(
                x,
                J,
                lambda z: z if z.dtype != object else z[:1],
                precision="exact",
                lipschitz=1.0 / 8,
            ),
        )
    )
    for label, f in (("a list", lambda z: (0.25 * z).tolist()), ("float32", lambda z: z / 4)):
        tries.append(
            Try(
                f"meanfield.deq_attention correction returns {label}",
                ["correction"],
                lambda f=f: meanfield.deq_attention(x, J, f),
                lambda res: np.array_equal(
                    res.means, meanfield.deq_attention(x, J, _quarter).means
                ),
            )
        )
    for name, call, names in (
        ("meanfield.naive_step", lambda v: meanfield.naive_step(v, J, x), ["m", "J", "x"]),
        ("meanfield.adaptive_tap", lambda v: meanfield.adaptive_tap(v, J), ["x", "J"]),
        ("meanfield.deq_attention", lambda v: meanfield.deq_attention(v, J), ["x", "J"]),
        ("meanfield.ising_tap", lambda v: meanfield.ising_tap(v, np.zeros((2, 2))), ["x", "J"]),
        (
            "meanfield.adaptive_tap prior_precision",
            lambda v: meanfield.adaptive_tap(x, J, prior_precision=v),
            ["prior_precision"],
        ),
        (
            "meanfield.softmax_couplings mask",
            lambda v: meanfield.softmax_couplings(x, np.eye(2), np.eye(2), mask=v),
            ["mask"],
        ),
    ):
        for bad, value in ARRAY_BAD.items():
            tries.append(Try(f"{name} {bad}", names, lambda c=call, v=value: c(v)))
    tries += [
        Try(
            "meanfield.naive_step batch dims",
            ["m", "J"],
            lambda: meanfield.naive_step(np.ones((2, 3, 2)), np.ones((4, 3, 3, 2, 2)), x),
        ),
        Try(
            "meanfield.softmax_couplings mask batch",
            ["mask"],
            lambda: meanfield.softmax_couplings(
                np.ones((2, 3, 2)), np.eye(2), np.eye(2), mask=np.ones((4, 3, 3), bool)
            ),
        ),
        Try("transformer.random_encoder_params seed='x'", ["seed"], _random_encoder_params_seed_x),
        Try(
            "transformer.multihead_attention batch dims",
            ["x_q", "x_kv"],
            lambda: T.multihead_attention(
                np.ones((2, 3, 4)), np.ones((5, 3, 4)), *[np.eye(4)] * 4, num_heads=2
            ),
        ),
    ]
    params = random_encoder_params(4, 2, 8, seed=0)
    for field in ("attn", "ffn", "norm1", "norm2"):
        tries.append(
            Try(
                f"transformer.encoder_block params.{field}=None",
                [f"params.{field}"],
                lambda f=field: T.encoder_block(np.ones((3, 4)), replace(params, **{f: None})),
            )
        )
    decoder = random_decoder_params(4, 2, 8, seed=0)
    tries.append(
        Try(
            "transformer.decoder_block memory width",
            ["params.cross_attn.W_K", "memory"],
            lambda: T.decoder_block(np.ones((3, 4)), np.ones((5, 3)), decoder),
        )
    )
    return tries


def test_fuzz_transformer_and_meanfield_inputs():
    results = [(t.label, outcome(t)) for t in transformer_meanfield_tries()]
    counts = collections.Counter(o for _, o in results)
    outcomes = dict(sorted(counts.items()))
    print(f"\nfuzz transformer/meanfield: {len(results)} tries, outcomes {outcomes}")
    bad = [f"{label}: {o}" for label, o in results if o not in ACCEPTABLE]
    assert not bad, f"{len(bad)} unacceptable of {len(results)}:\n" + "\n".join(bad)
