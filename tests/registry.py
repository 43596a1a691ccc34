"""The table the tests parametrise over: per refattn function, its fast path, exact path,
naive twin, a-priori bound and input strategy.

Each :class:`Entry` works on a *case*, the keyword dict drawn from its ``strategy``:

* ``fast(case)`` -- the float64 path; ``exact(case)`` -- the exact path (correctly rounded);
* ``naive(case)`` -- the independent loop twin (:mod:`naive`), rounded once to the case dtype;
* ``bound(case)`` -- the documented a-priori bound on ``|fast - exact|`` (from
  oracle.tolerance / refattn's bounds, never a literal); None: no float64 check (the
  per-dtype attention rows share the float64 row's);
* ``strategy()`` / ``bound_strategy()`` -- hypothesis strategies of cases for the exactness and
  the bound checks, with ``examples`` = (exactness, bound) example counts (None: the hypothesis
  profile's, so ``HYPOTHESIS_PROFILE=dev`` explores more);
* ``out_dtype(case)`` -- the dtype every exact output must have, when the case asks for one.

Every column maps output names to arrays (``{"out": ...}`` for single-output functions; out,
lse, weights for attention); ``bound`` gives one bound per checked output.

``tests/test_registry.py`` runs every entry: exact == rounded twin bit for bit, fast within
its bound of exact (one failure names the function: tests are parametrised by entry).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import mpmath
import numpy as np
from hypothesis import strategies as st

import refattn
from oracle.tolerance import iterated_bound, logit_lse_bound, mixture_bound, ratio_bound
from refattn import gmm, hopfield, mgk
from refattn.bounds import UNIT_ROUNDOFF, float64_forward_bound, gamma
from tests.naive.attention import naive_attention_rounded
from tests.naive.gmm import DPS, naive_adapt_keys, naive_adapt_priors, naive_gmm
from tests.naive.hopfield import naive_energy
from tests.naive.logspace import naive_logspace_rounded
from tests.naive.mgk import naive_linear, naive_mgk
from tests.naive.mp import central_vjp, mp
from tests.naive.rounding import round_nested
from tests.strategies import (
    attention_cases,
    gmm_cases,
    linear_problems,
    logspace_rows,
    mgk_problems,
    mixture_problems,
)

__all__ = [
    "Entry",
    "REGISTRY",
    "gmm_term_scale",
    "gmm_vjp_bound",
    "mgk_term_scale",
    "hopfield_energy_bound",
]


@dataclass(frozen=True)
class Entry:
    """One row of the table (see the module docstring)."""

    name: str
    fast: Callable[[dict], dict] | None
    exact: Callable[[dict], dict]
    naive: Callable[[dict], dict]
    bound: Callable[[dict], dict] | None
    strategy: Callable[[], st.SearchStrategy]
    label: Callable[[dict], str]
    examples: tuple[int | None, int | None] = (None, None)
    bound_strategy: Callable[[], st.SearchStrategy] | None = None
    out_dtype: Callable[[dict], np.dtype] | None = None


def _out(function):
    """A single-output column as a one-entry mapping ``{"out": ...}``."""
    return lambda case: {"out": function(case)}


# ----------------------------------------------------------------------------- attention


def _np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _attention_cases(dtype, **sizes):
    @st.composite
    def build(draw):
        q, k, v, opts = draw(attention_cases(dtypes=(dtype,), **sizes))
        return dict(q=q, k=k, v=v, opts=opts, dtype=dtype)

    return build


def _attention_fast(case):
    out, lse = refattn.attention(case["q"], case["k"], case["v"], return_lse=True, **case["opts"])
    return {"out": out, "lse": lse}


def _attention_exact(case):
    out, lse, weights = refattn.attention(
        case["q"],
        case["k"],
        case["v"],
        precision="exact",
        out_dtype=_np_dtype(case["dtype"]),
        return_lse=True,
        return_weights=True,
        **case["opts"],
    )
    return {"out": out, "lse": lse, "weights": weights}


def _attention_naive(case):
    out, lse, weights = naive_attention_rounded(
        case["q"], case["k"], case["v"], case["opts"], _np_dtype(case["dtype"])
    )
    return {"out": out, "lse": lse, "weights": weights}


def _attention_bound(case):
    out, lse = float64_forward_bound(case["q"], case["k"], case["v"], **case["opts"])
    return {"out": out, "lse": lse}


def _attention_label(case):
    q, k, v = case["q"], case["k"], case["v"]
    return (
        f"dtype={case['dtype']} shapes={q.shape},{k.shape},{v.shape} options={sorted(case['opts'])}"
    )


def _attention_entry(dtype):
    wide = dtype == "float64"
    return Entry(
        f"attention[{dtype}]",
        fast=_attention_fast if wide else None,
        exact=_attention_exact,
        naive=_attention_naive,
        bound=_attention_bound if wide else None,
        strategy=_attention_cases(dtype),
        label=_attention_label,
        bound_strategy=_attention_cases(dtype, max_len=8, max_dim=8) if wide else None,
        out_dtype=lambda case: _np_dtype(case["dtype"]),
    )


# ----------------------------------------------------------------------------- logspace

_LOGSPACE = {
    "lse": refattn.logsumexp,
    "softmax": refattn.softmax,
    "log_softmax": refattn.log_softmax,
}


def _logspace_cases(dtype, *, allow_empty_rows=False, **sizes):
    @st.composite
    def build(draw):
        x, where = draw(logspace_rows(**sizes))
        x = x.astype(_np_dtype(dtype))
        if not allow_empty_rows and not where.any(axis=1).all():
            where[:, 0] = True
        return dict(x=x, where=where, dtype=dtype)

    return build


def _logspace_exact(case):
    return {
        name: function(
            case["x"], where=case["where"], precision="exact", out_dtype=_np_dtype(case["dtype"])
        )
        for name, function in _LOGSPACE.items()
    }


def _logspace_naive(case):
    values = naive_logspace_rounded(case["x"], case["where"], _np_dtype(case["dtype"]))
    return dict(zip(_LOGSPACE, values, strict=True))


def _logspace_fast(case):
    return {name: _LOGSPACE[name](case["x"], where=case["where"]) for name in ("lse", "softmax")}


def _logspace_bound(case):
    """Blanchard, Higham & Higham 2021: |error| <= gamma_{n+3} + u |lse| for the log1p form;
    softmax entries exp(x - lse) then have relative error <= gamma_{n+5} + u (|lse| +
    |x - lse|) (lse's absolute error, the subtraction, the exponential)."""
    x, where = case["x"], case["where"]
    n = x.shape[1]
    exact = refattn.logsumexp(x, where=where, precision="exact")
    finite = np.where(np.isfinite(exact), exact, 0.0)
    p_exact = refattn.softmax(x, where=where, precision="exact")
    return {
        "lse": gamma(n + 3) + UNIT_ROUNDOFF * np.abs(finite),
        "softmax": p_exact
        * (
            gamma(n + 5)
            + UNIT_ROUNDOFF
            * (np.abs(finite)[:, None] + np.abs(np.where(where, x, 0) - finite[:, None]))
        ),
    }


def _logspace_entry(dtype):
    wide = dtype == "float64"
    return Entry(
        f"logspace[{dtype}]",
        fast=_logspace_fast if wide else None,
        exact=_logspace_exact,
        naive=_logspace_naive,
        bound=_logspace_bound if wide else None,
        strategy=_logspace_cases(dtype),
        label=lambda case: f"dtype={case['dtype']}, x {case['x'].shape}",
        bound_strategy=(
            _logspace_cases(dtype, allow_empty_rows=True, max_len=40) if wide else None
        ),
    )


# ----------------------------------------------------------------------------- gmm.attention


def gmm_term_scale(q, keys, values, alpha, beta, prior):
    """Sum of |terms| of any logit of the float64 path (a generous a-priori scale)."""
    alpha_max = float(np.max(alpha))
    beta_max = float(np.max(beta))
    reach = np.abs(q).max() + np.abs(keys).max()
    vreach = 2 * np.abs(values).max() + 1
    scale = alpha_max * q.shape[-1] * reach**2 + beta_max * values.shape[-1] * vreach**2
    scale += q.shape[-1] * abs(math.log(np.min(alpha))) + q.shape[-1] * abs(math.log(alpha_max))
    if np.min(beta) > 0:
        scale += values.shape[-1] * (abs(math.log(np.min(beta))) + abs(math.log(beta_max)) + 2)
    if not isinstance(prior, str):
        scale += np.abs(prior[np.isfinite(prior)]).max(initial=0.0)
    return float(scale)


def gmm_vjp_bound(term_scale, n, dim, grads, grad_out, value_scale, iters, lipschitz=1.0):
    """Threshold for |float64 vjp - exact vjp| of the gmm functions: a first-order *estimate*,
    not a proven bound (none is claimed for the float64 reverse pass).

    Each reverse step is a softmax mixture of gradient terms, so the step error is modelled by
    :func:`~refattn.bounds.mixture_bound` with value scale ``G = max|exact grad| + max|grad_out|
    * value_scale``, and propagated over the ``iters`` forward and ``iters`` reverse steps by
    :func:`iterated_bound` with the Lipschitz factor ``lipschitz`` of one EM step (the forward
    tests' ``1 + beta max |mu_u - mu_w|^2``). tests/concepts/test_gmm_vjp.py measures its margin.
    """
    scale = max(float(np.max(np.abs(g), initial=0.0)) for g in grads)
    scale += float(np.max(np.abs(grad_out), initial=0.0)) * (value_scale + 1)
    step = mixture_bound(term_scale, n, dim, scale)
    return iterated_bound(step, lipschitz, 2 * iters)


_GMM_KEYS = ("alpha", "beta", "prior", "v_init", "iters")


def _gmm_fast(case, **extra):
    kwargs = {k: case[k] for k in _GMM_KEYS}
    return gmm.attention(case["q"], case["keys"], case["values"], **kwargs, **extra)


def _gmm_naive(case):
    """naive_gmm on every batch element (batch axis of length 0 or 1 level)."""
    q = case["q"]
    if q.ndim == 2:
        out, _ = naive_gmm(
            q,
            case["keys"],
            case["values"],
            alpha=case["alpha"],
            beta=case["beta"],
            prior=case["prior"],
            v_init=case["v_init"],
            iters=case["iters"],
        )
        return round_nested(out)
    outs = []
    for b in range(q.shape[0]):

        def pick(x, b=b):
            return x if np.ndim(x) == 0 or isinstance(x, str) else x[b]

        out, _ = naive_gmm(
            q[b],
            case["keys"][b],
            case["values"][b],
            alpha=pick(case["alpha"]),
            beta=pick(case["beta"]),
            prior=pick(case["prior"]),
            v_init=None if case["v_init"] is None else case["v_init"][b],
            iters=case["iters"],
        )
        outs.append(out)
    return round_nested(outs)


def _gmm_bound(case):
    scale = gmm_term_scale(
        case["q"], case["keys"], case["values"], case["alpha"], case["beta"], case["prior"]
    )
    return mixture_bound(
        scale,
        case["keys"].shape[-2],
        case["q"].shape[-1] + case["values"].shape[-1],
        np.abs(case["values"]).max(),
    )


def _gmm_label(case):
    prior = case["prior"] if isinstance(case["prior"], str) else "array"
    return f"{case['style']}, prior {prior}, iters {case['iters']}"


# ----------------------------------------------------------------------------- mgk.attention


def mgk_term_scale(q, keys, opts):
    """Sum of |terms| of any MGK logit of the float64 path (a generous a-priori scale)."""
    s2 = np.asarray(opts.get("sigma2", 1.0))
    reach = (np.abs(q).max() + np.abs(keys).max()) ** 2 * q.shape[-1]
    scale = reach / (2 * s2.min())
    scale += q.shape[-1] * (
        abs(math.log(2 * math.pi * s2.min())) + abs(math.log(2 * math.pi * s2.max()))
    )
    if "log_pi" in opts:
        scale += np.abs(opts["log_pi"]).max()
    return float(scale + math.log(keys.shape[-2]))


@st.composite
def _mgk_cases(draw):
    q, keys, v, opts = draw(mgk_problems())
    return dict(
        q=q,
        keys=keys,
        v=v,
        opts=opts,
        mode=draw(st.sampled_from(["soft", "hard"])),
        normalized=draw(st.booleans()),
    )


def _mgk_fast(case, **extra):
    return mgk.attention(
        case["q"],
        case["keys"],
        case["v"],
        mode=case["mode"],
        normalized=case["normalized"],
        **case["opts"],
        **extra,
    )


def _mgk_naive(case):
    return round_nested(
        naive_mgk(
            case["q"],
            case["keys"],
            case["v"],
            mode=case["mode"],
            normalized=case["normalized"],
            **case["opts"],
        )
    )


def _mgk_bound(case):
    q, keys = case["q"], case["keys"]
    return mixture_bound(
        mgk_term_scale(q, keys, case["opts"]),
        keys.shape[0] * keys.shape[1],
        q.shape[-1] + 2,
        np.abs(case["v"]).max(),
    )


# ----------------------------------------------------------------------------- mgk.linear_attention


@st.composite
def _linear_cases(draw):
    q, keys, v, pi = draw(linear_problems())
    return dict(q=q, keys=keys, v=v, pi=pi, causal=draw(st.booleans()))


def _linear_fast(case, **extra):
    return mgk.linear_attention(
        case["q"], case["keys"], case["v"], pi=case["pi"], causal=case["causal"], **extra
    )


def _linear_naive(case):
    return round_nested(
        naive_linear(case["q"], case["keys"], case["v"], pi=case["pi"], causal=case["causal"])
    )


def _linear_bound(case):
    q, keys = case["q"], case["keys"]
    n_terms = q.shape[-1] + keys.shape[1] + keys.shape[0] + 4
    return ratio_bound(n_terms, np.abs(case["v"]).max())


# ----------------------------------------------------------------------------- hopfield.energy


def hopfield_energy_bound(xi, X, beta):
    """A-priori bound of the float64 energy without the constant (two lse evaluations)."""
    scale = beta * xi.shape[-1] * np.abs(xi).max() * np.abs(X).max()
    return logit_lse_bound(
        scale, X.shape[-2], xi.shape[-1], scale + math.log(X.shape[-2])
    ) / beta + logit_lse_bound(xi.shape[-1] * np.abs(xi).max() ** 2, 1, xi.shape[-1])


@st.composite
def _energy_cases(draw):
    xi, X, _, style = draw(mixture_problems(batched=False))
    return dict(
        xi=xi,
        X=X,
        style=style,
        beta=draw(st.sampled_from([0.25, 1.0, 4.0])),
        constant=draw(st.booleans()),
    )


def _energy_fast(case, **extra):
    return hopfield.energy(
        case["xi"], case["X"], beta=case["beta"], constant=case["constant"], **extra
    )


def _energy_naive(case):
    with mpmath.workdps(DPS):
        patterns = [[mp(a) for a in row] for row in case["X"]]
        truth = [
            naive_energy([mp(a) for a in row], patterns, case["beta"], case["constant"])
            for row in case["xi"]
        ]
    return round_nested(truth)


def _energy_bound(case):
    xi, X = case["xi"], case["X"]
    constant = (
        logit_lse_bound(np.abs(X).max() ** 2 * X.shape[-1] + 1, 1, X.shape[-1])
        if case["constant"]
        else 0
    )
    return hopfield_energy_bound(xi, X, case["beta"]) + constant


# ------------------------------------------------------- gmm vjps (attention, adapt_keys/priors)


@st.composite
def _gmm_vjp_cases(draw, function):
    """Small well-scaled problems (central differences need no underflowing weights): inputs,
    cotangent and keywords of one gmm vjp call, and the allowed set written out for the twin."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    length, units = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dim, vdim = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    per_unit = draw(st.booleans())
    alpha = rng.uniform(0.4, 2.0, units) if per_unit else 0.8
    q, keys = rng.standard_normal((length, dim)), rng.standard_normal((units, dim))
    case = dict(
        function=function, q=q, keys=keys, iters=draw(st.integers(1, 2)), kwargs={}, naive_kwargs={}
    )
    if function == "attention":
        case["values"] = rng.standard_normal((units, vdim))
        case["grad"] = rng.standard_normal((length, vdim))
        beta = rng.uniform(0.2, 1.0, units) if per_unit else 0.4
        prior = draw(st.sampled_from(["uniform", "magnitude", "array"]))
        prior = rng.standard_normal(units) if prior == "array" else prior
        v_init = rng.standard_normal((length, vdim)) if draw(st.booleans()) else None
        case["kwargs"] = dict(alpha=alpha, beta=beta, prior=prior, v_init=v_init)
        case["naive_kwargs"] = dict(case["kwargs"])
        if draw(st.booleans()):
            case["kwargs"]["form"] = "unnormalised"
            case["naive_kwargs"]["normalisers"] = False
        if draw(st.booleans()):
            allowed = rng.random((length, units)) < 0.7
            case["kwargs"]["mask"] = allowed
            case["naive_kwargs"]["allowed"] = allowed
    elif function == "adapt_keys":
        case["grad"] = rng.standard_normal((units, dim))
        case["kwargs"] = dict(
            alpha=alpha,
            gamma=rng.choice([0.0, 0.6, np.inf], units),
            prior=draw(st.sampled_from(["uniform", "magnitude"])),
            form=draw(st.sampled_from(["paper", "map", "map_recentred"])),
        )
        case["naive_kwargs"] = dict(case["kwargs"])
    else:
        case["grad"] = rng.standard_normal(units)
        pi0 = rng.uniform(0.2, 1.0, units)
        case["kwargs"] = dict(
            alpha=alpha,
            eta=float(rng.uniform(0.0, 2.0)),
            pi0=pi0 / pi0.sum(),
            form=draw(st.sampled_from(["paper", "map"])),
        )
        case["naive_kwargs"] = dict(case["kwargs"])
    return case


def _gmm_vjp_arrays(case):
    return (case["q"], case["keys"]) + ((case["values"],) if "values" in case else ())


def _gmm_vjp_call(case, **extra):
    function = getattr(gmm, case["function"] + "_vjp")
    grads = function(
        *_gmm_vjp_arrays(case), case["grad"], iters=case["iters"], **case["kwargs"], **extra
    )
    return grads._asdict()


def _gmm_vjp_naive(case):
    """Richardson central differences of the mpmath twin, rounded once; an estimate that cannot
    be told from 0 is 0 (the exact path's +0 for an exact cancellation)."""
    twin = {
        "attention": lambda *a, **k: naive_gmm(*a, **k)[0],
        "adapt_keys": naive_adapt_keys,
        "adapt_priors": naive_adapt_priors,
    }[case["function"]]

    def function(*arrays):
        return twin(*arrays, iters=case["iters"], **case["naive_kwargs"])

    arrays = _gmm_vjp_arrays(case)
    names = list(_gmm_vjp_call(case))
    out = {}
    for name, (estimate, error) in zip(
        names, central_vjp(function, arrays, case["grad"], dps=DPS), strict=True
    ):
        settled = np.where(np.abs(estimate) > error, estimate, 0)
        out[name] = round_nested(settled.tolist())
    return out


def _gmm_vjp_bound(case):
    arrays = _gmm_vjp_arrays(case)
    exact = _gmm_vjp_call(case, precision="exact")
    q, keys = arrays[0], arrays[1]
    values = arrays[2] if len(arrays) == 3 else np.zeros((keys.shape[0], 1))
    beta = case["kwargs"].get("beta", 0.0)
    prior = case["kwargs"].get("prior", "uniform")
    scale = gmm_term_scale(q, keys, values, case["kwargs"]["alpha"], beta, prior)
    diameter = np.ptp(values, axis=-2).max() ** 2 * values.shape[-1]
    lipschitz = (
        1 + float(np.max(beta)) * diameter if case["function"] == "attention" else q.shape[0] + 1
    )
    reach = np.abs(values).max() if len(arrays) == 3 else np.abs(q).max() + np.abs(keys).max()
    bound = gmm_vjp_bound(
        scale,
        q.shape[0] + keys.shape[0],
        q.shape[1] + values.shape[1],
        list(exact.values()),
        case["grad"],
        reach,
        case["iters"],
        lipschitz,
    )
    return {name: bound for name in exact}


def _gmm_vjp_entry(function):
    return Entry(
        f"gmm.{function}_vjp",
        fast=_gmm_vjp_call,
        exact=lambda case: _gmm_vjp_call(case, precision="exact"),
        naive=_gmm_vjp_naive,
        bound=_gmm_vjp_bound,
        strategy=lambda: _gmm_vjp_cases(function),
        label=lambda c: f"iters {c['iters']}, {sorted(c['kwargs'])}",
        examples=(8, 15),
    )


# ----------------------------------------------------------------------------- the table

REGISTRY: dict[str, Entry] = {
    e.name: e
    for e in [
        *(_attention_entry(dtype) for dtype in ("float64", "float32", "float16", "bfloat16")),
        *(_logspace_entry(dtype) for dtype in ("float64", "float32", "float16", "bfloat16")),
        Entry(
            "gmm.attention",
            fast=_out(_gmm_fast),
            exact=_out(lambda case: _gmm_fast(case, precision="exact")),
            naive=_out(_gmm_naive),
            bound=_out(_gmm_bound),
            strategy=gmm_cases,
            label=_gmm_label,
            examples=(40, 20),
            bound_strategy=lambda: gmm_cases(max_iters=1),
        ),
        *(_gmm_vjp_entry(function) for function in ("attention", "adapt_keys", "adapt_priors")),
        Entry(
            "mgk.attention",
            fast=_out(_mgk_fast),
            exact=_out(lambda case: _mgk_fast(case, precision="exact")),
            naive=_out(_mgk_naive),
            bound=_out(_mgk_bound),
            strategy=_mgk_cases,
            label=lambda c: f"{c['mode']}, normalized={c['normalized']}, {sorted(c['opts'])}",
            examples=(50, 50),
        ),
        Entry(
            "mgk.linear_attention",
            fast=_out(_linear_fast),
            exact=_out(lambda case: _linear_fast(case, precision="exact")),
            naive=_out(_linear_naive),
            bound=_out(_linear_bound),
            strategy=_linear_cases,
            label=lambda c: f"causal={c['causal']}",
            examples=(40, 40),
        ),
        Entry(
            "hopfield.energy",
            fast=_out(_energy_fast),
            exact=_out(lambda case: _energy_fast(case, precision="exact")),
            naive=_out(_energy_naive),
            bound=_out(_energy_bound),
            strategy=_energy_cases,
            label=lambda c: f"{c['style']}, beta={c['beta']}, constant={c['constant']}",
            examples=(40, 40),
        ),
    ]
}
