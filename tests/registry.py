"""The table the tests parametrise over: per refattn function, its fast path, exact path,
naive twin, a-priori bound and input strategy.

Each :class:`Entry` works on a *case*, the keyword dict drawn from its ``strategy``:

* ``fast(case)`` -- the float64 path; ``exact(case)`` -- the exact path (correctly rounded);
* ``naive(case)`` -- the independent loop twin (:mod:`naive`), rounded once to the case dtype;
* ``bound(case)`` -- the documented a-priori bound on ``|fast - exact|`` (from
  oracle.judging.tolerance / refattn's bounds, never a literal); None: no float64 check (the
  per-dtype attention rows share the float64 row's);
* ``strategy()`` / ``bound_strategy()`` -- hypothesis strategies of cases for the exactness and
  the bound checks, with ``examples`` = (exactness, bound) example counts (None: the hypothesis
  profile's, so ``HYPOTHESIS_PROFILE=dev`` explores more);
* ``out_dtype(case)`` -- the dtype every exact output must have, when the case asks for one;
* ``functions`` -- the public functions the row covers (default: its name without ``[dtype]``);
* ``derivative`` -- the twin is a numerical derivative: ``naive`` gives (estimate, error)
  pairs (``tests.naive.mp.naive_vjp``) the exact path must round (bit for bit where the
  interval rounds to one value; within it elsewhere);
* ``marks`` -- pytest marks of the row's tests (``slow`` where one row costs minutes);
* ``reason`` -- why a row has no naive twin (``naive=None``: a :func:`gap` row) or no float64
  bound (``bound=None``), and where that function is checked instead.

Every column maps output names to arrays (``{"out": ...}`` for single-output functions; out,
lse, weights for attention); ``bound`` gives one bound per checked output.

``tests/test_registry.py`` runs every entry: exact == rounded twin bit for bit, fast within
its bound of exact (one failure names the function: tests are parametrised by entry).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import strategies as st

import refattn
from oracle.judging.tolerance import iterated_bound, logit_lse_bound, mixture_bound, ratio_bound
from refattn import gmm, hopfield, meanfield, mgk, transformer
from refattn.bounds import (
    UNIT_ROUNDOFF,
    feed_forward_vjp_bound,
    float64_forward_bound,
    float64_vjp_bound,
    gamma,
    layer_norm_vjp_bound,
    merge_bound,
    mgk_vjp_bound,
    mlk_vjp_bound,
    transformer_forward_bound,
)
from tests.concepts import params
from tests.naive.attention import naive_attention_rounded, naive_attention_vjp
from tests.naive.gmm import DPS, naive_adapt_keys, naive_adapt_priors, naive_gmm
from tests.naive.hopfield import naive_energy, naive_retrieve
from tests.naive.linear import naive_linear_rounded
from tests.naive.logspace import naive_logspace_rounded
from tests.naive.meanfield import exact_naive_step, mp_softmax_couplings
from tests.naive.merge import naive_merge_rounded
from tests.naive.mgk import naive_allowed, naive_em, naive_linear, naive_mgk
from tests.naive.mp import central_vjp, mp, naive_vjp
from tests.naive.rounding import round_nested
from tests.naive.transformer import (
    mp_array,
    naive_decoder,
    naive_encoder,
    naive_feed_forward,
    naive_layer_norm,
    naive_mha,
    naive_positions,
)
from tests.strategies import (
    attention_cases,
    gmm_cases,
    linear_attention_cases,
    linear_problems,
    logspace_rows,
    merge_states_cases,
    mgk_problems,
    mixture_problems,
    weak_vector_couplings,
)

__all__ = [
    "Entry",
    "REGISTRY",
    "gap",
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
    exact: Callable[[dict], dict] | None
    naive: Callable[[dict], dict] | None
    bound: Callable[[dict], dict] | None
    strategy: Callable[[], st.SearchStrategy] | None
    label: Callable[[dict], str] | None
    examples: tuple[int | None, int | None] = (None, None)
    bound_strategy: Callable[[], st.SearchStrategy] | None = None
    out_dtype: Callable[[dict], np.dtype] | None = None
    functions: tuple[str, ...] = ()
    reason: str = ""
    marks: tuple = ()
    derivative: bool = False

    @property
    def covers(self) -> tuple[str, ...]:
        """The public functions (``gmm.attention``; top-level ones bare) this row checks."""
        return self.functions or (self.name.split("[")[0],)


def gap(name: str, reason: str) -> Entry:
    """A row for a public function with no naive twin wired into the table yet: ``reason``
    says why and where it is checked instead (tests/test_registry.py lists these rows)."""
    return Entry(name, None, None, None, None, None, None, reason=reason)


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


_PER_DTYPE = "the float64 path is checked by the [float64] row"


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
        reason="" if wide else _PER_DTYPE,
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
    |x - lse|) (lse's absolute error, the subtraction, the exponential). Both bound the
    distance to the real result; the comparison is with the exact path's float64 rounding of
    it, so each threshold adds that rounding's half ulp (u |truth|)."""
    x, where = case["x"], case["where"]
    n = x.shape[1]
    exact = refattn.logsumexp(x, where=where, precision="exact")
    finite = np.where(np.isfinite(exact), exact, 0.0)
    p_exact = refattn.softmax(x, where=where, precision="exact")
    return {
        "lse": gamma(n + 3) + 2 * UNIT_ROUNDOFF * np.abs(finite),
        "softmax": p_exact
        * (
            gamma(n + 5)
            + UNIT_ROUNDOFF
            * (1 + np.abs(finite)[:, None] + np.abs(np.where(where, x, 0) - finite[:, None]))
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
        functions=("logsumexp", "softmax", "log_softmax"),
        reason=(
            "log_softmax: no bound of its own (its float64 path is x - lse: the lse bound)"
            if wide
            else _PER_DTYPE
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


# ---------------------------------------------------------------- gmm.adapt_keys, adapt_priors


def _adapt_cases(function, max_iters=2):
    @st.composite
    def build(draw):
        q, keys, _, style = draw(mixture_problems(batched=False))
        units = keys.shape[0]
        if function == "adapt_keys":
            kwargs = dict(
                gamma=draw(st.sampled_from([0.0, 0.5, 3.0])),
                prior=draw(st.sampled_from(["uniform", "magnitude"])),
                form=draw(st.sampled_from(["paper", "map", "map_recentred"])),
            )
        else:
            kwargs = dict(
                eta=draw(st.sampled_from([0.0, 1.0, 10.0])),
                pi0=np.full(units, 1.0 / units),
                form=draw(st.sampled_from(["paper", "map"])),
            )
        iters = draw(st.integers(1, max_iters))
        return dict(q=q, keys=keys, style=style, alpha=0.8, iters=iters, kwargs=kwargs)

    return build


def _adapt(function):
    def call(case, **extra):
        return getattr(gmm, function)(
            case["q"],
            case["keys"],
            alpha=case["alpha"],
            iters=case["iters"],
            **case["kwargs"],
            **extra,
        )

    return call


def _adapt_naive(function):
    twin = {"adapt_keys": naive_adapt_keys, "adapt_priors": naive_adapt_priors}[function]

    def naive(case):
        return round_nested(
            twin(
                case["q"], case["keys"], alpha=case["alpha"], iters=case["iters"], **case["kwargs"]
            )
        )

    return naive


def _adapt_keys_bound(case):
    """One step (the bound strategy draws iters = 1): a softmax mixture of the queries; the
    MAP forms divide by gamma + alpha W with W up to L."""
    q, keys = case["q"], case["keys"]
    scale = gmm_term_scale(q, keys, keys, case["alpha"], 0.0, "uniform")
    magnitude = np.abs(q).max() + np.abs(keys).max()
    bound = mixture_bound(scale, q.shape[0] + keys.shape[0], q.shape[1], magnitude)
    if case["kwargs"]["form"] != "paper":
        bound *= q.shape[0] + 1
    return iterated_bound(bound, q.shape[0] + 1, case["iters"])


def _adapt_priors_bound(case):
    q, keys = case["q"], case["keys"]
    units = keys.shape[0]
    scale = gmm_term_scale(q, keys, keys, case["alpha"], 0.0, "uniform")
    scale += 2 * abs(math.log(units) + 1)
    step = mixture_bound(scale, q.shape[0] + units, q.shape[1], 2.0)
    return iterated_bound(step, 2, case["iters"])


def _adapt_entry(function, bound, bound_strategy):
    return Entry(
        f"gmm.{function}",
        fast=_out(_adapt(function)),
        exact=_out(lambda case: _adapt(function)(case, precision="exact")),
        naive=_out(_adapt_naive(function)),
        bound=_out(bound),
        strategy=_adapt_cases(function),
        label=lambda c: f"{c['style']}, iters {c['iters']}, {c['kwargs'].get('form')}",
        examples=(15, 15),
        bound_strategy=bound_strategy,
    )


# ----------------------------------------------------------------- mgk and hopfield vjps

_MGK_VJP_OPTIONS = (
    {},
    {"mode": "hard"},
    {"normalized": True, "sigma2": 0.7},
    {"log_pi": np.log(np.array([[0.25, 0.75]] * 3)), "causal": True},
    {"window": (1, 0), "align": "bottom_right"},
)


@st.composite
def _mgk_vjp_cases(draw, function):
    """Small problems (q (2, 2), keys (3, 2, 2) or (3, 2), v (3, 2)) and a cotangent: every
    element is one central difference of the mpmath twin."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    length, units, comps, dim, vdim = 2, 3, 2, 2, 2
    case = dict(
        function=function,
        q=rng.standard_normal((length, dim)),
        keys=rng.standard_normal((units, comps, dim)),
        v=rng.standard_normal((units, vdim)),
        grad=rng.standard_normal((length, vdim)),
    )
    if function == "attention":
        case["options"] = draw(st.sampled_from(_MGK_VJP_OPTIONS))
    else:
        pi = rng.uniform(0.2, 1.0, (units, comps))
        case["options"] = {"pi": pi / pi.sum(axis=1, keepdims=True), "causal": draw(st.booleans())}
    return case


def _mgk_vjp(case, **extra):
    function = getattr(mgk, case["function"] + "_vjp")
    grads = function(case["q"], case["keys"], case["v"], case["grad"], **case["options"], **extra)
    return dict(zip(("dq", "dkeys", "dv"), grads, strict=True))


def _mgk_vjp_naive(case):
    twin = naive_mgk if case["function"] == "attention" else naive_linear

    def forward(q, keys, v):
        return twin(q, keys, v, **case["options"])

    derivative = naive_vjp(forward, (case["q"], case["keys"], case["v"]), case["grad"])
    return dict(zip(("dq", "dkeys", "dv"), derivative, strict=True))


def _mgk_vjp_bound(case):
    q, keys, v, grad, options = case["q"], case["keys"], case["v"], case["grad"], case["options"]
    if case["function"] == "attention":
        return mgk_vjp_bound(
            q,
            keys,
            v,
            grad,
            sigma2=options.get("sigma2", 1.0),
            log_pi=options.get("log_pi"),
            normalized=options.get("normalized", False),
        )
    allowed = refattn.allowed_mask(q.shape[0], keys.shape[0], causal=options["causal"])
    return mlk_vjp_bound(q, keys, v, grad, pi=options["pi"], allowed=allowed)


def _mgk_vjp_entry(function):
    return Entry(
        f"mgk.{function}_vjp",
        fast=_mgk_vjp,
        exact=lambda case: _mgk_vjp(case, precision="exact"),
        naive=_mgk_vjp_naive,
        bound=_mgk_vjp_bound,
        strategy=lambda: _mgk_vjp_cases(function),
        label=lambda c: f"options {sorted(c['options'])}",
        examples=(5, 15),
        derivative=True,
    )


@st.composite
def _retrieve_vjp_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dict(
        xi=rng.standard_normal((2, 3)),
        X=rng.standard_normal((4, 3)),
        grad=rng.standard_normal((2, 3)),
        beta=draw(st.sampled_from([0.75, 2.0])),
        steps=draw(st.integers(1, 2)),
    )


def _retrieve_vjp_exact(case):
    grads = hopfield.retrieve_vjp(
        case["xi"],
        case["X"],
        case["grad"],
        beta=case["beta"],
        steps=case["steps"],
        precision="exact",
    )
    return dict(zip(("dxi", "dX"), grads, strict=True))


def _retrieve_vjp_naive(case):
    def forward(xi, X):
        return naive_retrieve(xi, X, case["beta"], case["steps"])[0]

    derivative = naive_vjp(forward, (case["xi"], case["X"]), case["grad"])
    return dict(zip(("dxi", "dX"), derivative, strict=True))


# ----------------------------------------------------------------------------- softmax_couplings


@st.composite
def _couplings_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sites, dim = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    return dict(
        x=rng.standard_normal((sites, dim)),
        W_Q=rng.standard_normal((dim, dim)) / np.sqrt(dim),
        W_K=rng.standard_normal((dim, dim)) / np.sqrt(dim),
        W_V=rng.standard_normal((dim, dim)) / np.sqrt(dim),
        mask=rng.random((sites, sites)) < 0.7,
        causal=draw(st.booleans()),
    )


def _couplings_exact(case):
    out = meanfield.softmax_couplings(
        case["x"],
        case["W_Q"],
        case["W_K"],
        case["W_V"],
        mask=case["mask"],
        causal=case["causal"],
        precision="exact",
    )
    return {"out": out}


def _couplings_naive(case):
    sites = case["x"].shape[0]
    allowed = case["mask"] & naive_allowed(sites, sites, causal=case["causal"])
    with mpmath.workdps(DPS):
        truth = mp_softmax_couplings(case["x"], case["W_Q"], case["W_K"], case["W_V"], allowed)
        return {"out": round_nested(truth)}


# ----------------------------------------------------------------------------- attention_vjp


@st.composite
def _attention_vjp_cases(draw):
    """Plain single-head problems (the twin's scope): q (L, D), k (S, D), v (S, E), grad_out
    (L, E) and an optional scale."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    length, keys = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    dim, vdim = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    return dict(
        q=rng.standard_normal((length, dim)),
        k=rng.standard_normal((keys, dim)),
        v=rng.standard_normal((keys, vdim)),
        grad=rng.standard_normal((length, vdim)),
        scale=draw(st.sampled_from([None, 0.5, 2.0])),
    )


def _attention_vjp(case, **extra):
    grads = refattn.attention_vjp(
        case["q"], case["k"], case["v"], case["grad"], scale=case["scale"], **extra
    )
    return dict(zip(("dq", "dk", "dv"), grads[:3], strict=True))


def _attention_vjp_naive(case):
    grads = naive_attention_vjp(case["q"], case["k"], case["v"], case["grad"], scale=case["scale"])
    return {name: round_nested(g) for name, g in zip(("dq", "dk", "dv"), grads, strict=True)}


def _attention_vjp_bound(case):
    bounds = float64_vjp_bound(case["q"], case["k"], case["v"], case["grad"], scale=case["scale"])
    return dict(zip(("dq", "dk", "dv"), bounds[:3], strict=True))


# ----------------------------------------------------------------------------- mgk.em_update_pi


@st.composite
def _em_cases(draw):
    q, keys, _, opts = draw(mgk_problems())
    comps = keys.shape[1]
    log_pi = opts.get("log_pi", np.full(keys.shape[:2], -math.log(comps)))
    return dict(q=q, keys=keys, log_pi=log_pi, sigma2=opts.get("sigma2", 1.0), opts=opts)


def _em_call(case, **extra):
    result = mgk.em_update_pi(
        case["q"],
        case["keys"],
        log_pi=case["log_pi"],
        sigma2=case["sigma2"],
        mask=case["opts"].get("mask"),
        **extra,
    )
    return {"pi": result.pi, "responsibilities": result.responsibilities}


def _em_naive(case):
    pi, resp = naive_em(
        case["q"],
        case["keys"],
        log_pi=case["log_pi"],
        sigma2=case["sigma2"],
        mask=case["opts"].get("mask"),
    )
    return {"pi": round_nested(pi), "responsibilities": round_nested(resp)}


def _em_bound(case):
    """Both outputs are softmax mixtures of values in [0, 1] (value scale 2 covers the
    normalisation) over the units' components and the queries."""
    q, keys = case["q"], case["keys"]
    scale = mgk_term_scale(q, keys, dict(case["opts"], log_pi=case["log_pi"]))
    bound = mixture_bound(scale, keys.shape[0] * keys.shape[1] + len(q), q.shape[-1] + 2, 2.0)
    return {"pi": bound, "responsibilities": bound}


# ----------------------------------------------------------------------------- meanfield.naive_step


@st.composite
def _naive_step_cases(draw):
    x, J = draw(weak_vector_couplings())
    return dict(m=np.tanh(x[::-1] * 3.0), J=J, x=x)


def _naive_step(case, **extra):
    return meanfield.naive_step(case["m"], case["J"], case["x"], **extra)


def _naive_step_bound(case):
    """One sum of n d products and x per element: gamma_{n d + 1} times the sum of |terms|."""
    m, J, x = case["m"], case["J"], case["x"]
    n, d = x.shape
    return gamma(n * d + 1) * (np.einsum("ijab,jb->ia", np.abs(J), np.abs(m)) + np.abs(x))


# ----------------------------------------------------------------------------- hopfield.retrieve


@st.composite
def _retrieve_cases(draw):
    xi, X, _, style = draw(mixture_problems(batched=False))
    return dict(
        xi=xi,
        X=X,
        style=style,
        beta=draw(st.sampled_from([0.5, 2.0])),
        steps=draw(st.integers(1, 3)),
    )


def _retrieve_exact(case):
    result = hopfield.retrieve(
        case["xi"],
        case["X"],
        beta=case["beta"],
        steps=case["steps"],
        return_trace=True,
        precision="exact",
    )
    return {"states": result.states, "energy": result.energy}


def _retrieve_naive(case):
    states, energies = naive_retrieve(case["xi"], case["X"], case["beta"], case["steps"])
    return {"states": round_nested(states), "energy": round_nested(energies)}


# ----------------------------------------------------------------------------- transformer


def _transformer_naive(twin):
    """A transformer twin evaluated at DPS digits and rounded once to float64."""

    def naive(case):
        with mpmath.workdps(DPS):
            return {"out": round_nested(twin(case))}

    return naive


def _transformer_bound(function, call):
    return lambda case: {"out": call(case, partial(transformer_forward_bound, function))}


@st.composite
def _layer_norm_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, width = draw(st.integers(1, 3)), draw(st.integers(2, 6))
    return dict(
        x=rng.standard_normal((rows, width)) * 3 + 1,
        gamma=rng.standard_normal(width),
        beta=rng.standard_normal(width),
        # eps > 0: with eps = 0 a width-2 row normalises to exactly -1, +1 and gamma * 1 + beta
        # can be a tie of float64, which an enclosure cannot decide (UndecidedRoundingError)
        eps=1e-5,
    )


def _layer_norm(case, function=transformer.layer_norm, **extra):
    return function(case["x"], gamma=case["gamma"], beta=case["beta"], eps=case["eps"], **extra)


def _layer_norm_twin(case):
    norm = transformer.NormParams(gamma=case["gamma"], beta=case["beta"], eps=case["eps"])
    return naive_layer_norm(mp_array(case["x"]), norm)


@st.composite
def _positions_cases(draw):
    return dict(
        length=draw(st.integers(1, 12)),
        dim=draw(st.sampled_from([2, 4, 6])),
        base=draw(st.sampled_from([10000.0, 7.5])),
        layout=draw(st.sampled_from(["interleave", "concat"])),
    )


def _positions(case, function=transformer.sinusoidal_positions, **extra):
    return function(case["length"], case["dim"], case["base"], case["layout"], **extra)


def _positions_twin(case):
    return naive_positions(case["length"], case["dim"], case["base"], case["layout"])


@st.composite
def _block_cases(draw):
    """Small blocks: params from refattn.transformer's seeded builders, inputs from a seed."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    seed, activation = draw(st.integers(0, 2**16)), draw(st.sampled_from(["relu", "gelu"]))
    return dict(
        seed=seed,
        activation=activation,
        norm=draw(st.sampled_from(["post", "pre"])),
        x=rng.standard_normal((3, 4)),
        x_kv=rng.standard_normal((5, 3)),
        memory=rng.standard_normal((2, 3)),
        encoder=params.random_encoder_params(4, 2, 6, seed=seed, activation=activation),
        decoder=params.random_decoder_params(4, 2, 6, seed=seed, memory_dim=3, num_kv_heads=1),
        attention=params.random_attention_params(
            4, 2, seed=seed, num_kv_heads=1, kv_dim=3, head_dim=2
        ),
    )


def _feed_forward(case, function=transformer.feed_forward, **extra):
    p = case["encoder"].ffn
    return function(case["x"], p.W1, p.b1, p.W2, p.b2, case["activation"], **extra)


def _mha(case, function=transformer.multihead_attention, **extra):
    p = case["attention"]
    return function(
        case["x"],
        case["x_kv"],
        p.W_Q,
        p.W_K,
        p.W_V,
        p.W_O,
        b_Q=p.b_Q,
        b_K=p.b_K,
        b_V=p.b_V,
        b_O=p.b_O,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        **extra,
    )


def _mha_twin(case):
    allowed = np.ones((case["x"].shape[0], case["x_kv"].shape[0]), dtype=bool)
    return naive_mha(mp_array(case["x"]), mp_array(case["x_kv"]), case["attention"], allowed)


def _encoder(case, function=transformer.encoder_block, **extra):
    return function(case["x"], case["encoder"], norm=case["norm"], **extra)


def _decoder(case, function=transformer.decoder_block, **extra):
    return function(case["x"], case["memory"], case["decoder"], norm=case["norm"], **extra)


def _transformer_entry(name, call, twin, strategy, examples):
    function = getattr(transformer, name)
    return Entry(
        f"transformer.{name}",
        fast=_out(call),
        exact=_out(lambda case: call(case, precision="exact")),
        naive=_transformer_naive(twin),
        bound=_transformer_bound(function, call),
        strategy=strategy,
        label=lambda case: ", ".join(
            f"{k}={case[k]}" for k in ("activation", "norm", "layout", "eps") if k in case
        ),
        examples=examples,
    )


_TRANSFORMER_ROWS = [
    _transformer_entry("layer_norm", _layer_norm, _layer_norm_twin, _layer_norm_cases, (10, 10)),
    _transformer_entry(
        "sinusoidal_positions", _positions, _positions_twin, _positions_cases, (6, 6)
    ),
    _transformer_entry(
        "feed_forward",
        _feed_forward,
        lambda case: naive_feed_forward(mp_array(case["x"]), case["encoder"].ffn),
        _block_cases,
        (4, 4),
    ),
    _transformer_entry("multihead_attention", _mha, _mha_twin, _block_cases, (3, 3)),
    _transformer_entry(
        "encoder_block",
        _encoder,
        lambda case: naive_encoder(mp_array(case["x"]), case["encoder"], case["norm"]),
        _block_cases,
        (3, 3),
    ),
    _transformer_entry(
        "decoder_block",
        _decoder,
        lambda case: naive_decoder(
            mp_array(case["x"]), mp_array(case["memory"]), case["decoder"], case["norm"]
        ),
        _block_cases,
        (3, 3),
    ),
]

# ----------------------------------------------------------------- transformer vjps (dx)


def _grads_dict(grads):
    """A vjp's NamedTuple as a mapping, without the fields it leaves None."""
    return {name: value for name, value in grads._asdict().items() if value is not None}


def _with_grad(strategy):
    """Cases of ``strategy`` plus a cotangent of the output's shape (from the case's seed)."""

    @st.composite
    def build(draw):
        case = draw(strategy())
        rows, width = case["x"].shape
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        return dict(case, grad=rng.standard_normal((rows, width)))

    return build


def _layer_norm_vjp_call(case, **extra):
    grads = transformer.layer_norm_vjp(
        case["x"],
        case["grad"],
        gamma=case["gamma"],
        beta=case["beta"],
        eps=case["eps"],
        **extra,
    )
    return _grads_dict(grads)


def _layer_norm_vjp_naive(case):
    """dx only (the parameter gradients are checked in tests/concepts/test_transformer_vjp.py):
    the Richardson derivative of the layer-norm twin."""
    norm = transformer.NormParams(gamma=case["gamma"], beta=case["beta"], eps=case["eps"])
    (dx,) = naive_vjp(lambda x: naive_layer_norm(x, norm), (case["x"],), case["grad"])
    return {"dx": dx}


def _layer_norm_vjp_bound(case):
    bounds = layer_norm_vjp_bound(
        case["x"], case["grad"], gamma=case["gamma"], beta=case["beta"], eps=case["eps"]
    )
    return _grads_dict(bounds)


def _feed_forward_vjp_call(case, function=transformer.feed_forward_vjp, **extra):
    p = case["encoder"].ffn
    args = (case["x"], p.W1, p.b1, p.W2, p.b2, case["grad"], case["activation"])
    return _grads_dict(function(*args, **extra))


def _feed_forward_vjp_naive(case):
    """dx only (the weight gradients are checked in tests/concepts/test_transformer_vjp.py)."""
    ffn = case["encoder"].ffn
    (dx,) = naive_vjp(lambda x: naive_feed_forward(x, ffn), (case["x"],), case["grad"])
    return {"dx": dx}


def _feed_forward_vjp_bound(case):
    return _feed_forward_vjp_call(case, feed_forward_vjp_bound)


# ----------------------------------------------------------------------------- rows without a twin

_VJP_ELSEWHERE = (
    "no naive twin row yet: the exact vjp is checked against central differences of the "
    "mpmath twin and against torch autograd in {where}"
)
_GAPS = [
    gap(
        "allowed_mask",
        "the allowed-set rule (refattn.spec), a boolean mask with no precision paths; "
        "tests/naive keeps an independent rule and the paths built on it are compared with it",
    ),
    gap(
        "gmm.log_posterior",
        "no naive twin wired yet (tests/naive/gmm.py has its query and value terms); checked "
        "in tests/concepts/test_gmm.py",
    ),
    *(
        gap(
            f"meanfield.{name}",
            "a fixed point: the exact path is a certified (Krawczyk) enclosure rounded once; "
            "its mpmath twins (mp_ising, mp_solve) need the solver's state, checked in "
            "tests/concepts/test_meanfield.py",
        )
        for name in ("ising_tap", "adaptive_tap", "deq_attention")
    ),
    *(
        gap(
            f"meanfield.{name}",
            "an implicit vjp of a fixed point: checked against Richardson gradients of the "
            "mpmath losses (tests/naive/meanfield.py) in tests/concepts/test_meanfield_vjp.py",
        )
        for name in ("ising_tap_vjp", "adaptive_tap_vjp", "deq_attention_vjp")
    ),
    gap(
        "meanfield.softmax_couplings_vjp",
        _VJP_ELSEWHERE.format(where="tests/concepts/test_meanfield_vjp.py"),
    ),
    *(
        gap(
            f"transformer.{name}",
            _VJP_ELSEWHERE.format(where="tests/concepts/test_transformer_vjp.py"),
        )
        for name in (
            "multihead_attention_vjp",
            "encoder_block_vjp",
            "decoder_block_vjp",
        )
    ),
    gap(
        "transformer.composition",
        "records a composition for the reverse pass (no numerics of its own); its vjps are "
        "the transformer *_vjp rows",
    ),
    *(
        gap(
            f"mla.{name}",
            "a rearrangement of MLA's weights into attention calls (refattn.attention is the "
            "numerics): absorbed == non-absorbed, exactly on a dyadic grid, in "
            "tests/concepts/test_mla.py",
        )
        for name in ("absorbed_inputs", "multihead_inputs", "output_projection", "model_scale")
    ),
    *(
        gap(
            f"fixedpoint.{name}",
            "a generic solver / its residual on the caller's map, no exact path; tested on "
            "contractive affine maps with closed-form fixed points in "
            "tests/concepts/test_fixedpoint.py",
        )
        for name in ("solve", "relative_residual")
    ),
]

# ----------------------------------------------------------------------------- the table

# ----------------------------------------------------------------------------- merge_states

_MERGE_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _merge_cases(*, nonfinite=True, dtypes=_MERGE_DTYPES):
    @st.composite
    def build(draw):
        outs, lses, base2 = draw(merge_states_cases(nonfinite=nonfinite))
        return dict(
            outs=outs, lses=lses, base=2 if base2 else "e", dtype=draw(st.sampled_from(dtypes))
        )

    return build


def _merge_fast(case):
    out, lse = refattn.merge_states(case["outs"], case["lses"], lse_base=case["base"])
    return {"out": out, "lse": lse}


def _merge_exact(case):
    out, lse = refattn.merge_states(
        case["outs"],
        case["lses"],
        lse_base=case["base"],
        precision="exact",
        out_dtype=_np_dtype(case["dtype"]),
    )
    return {"out": out, "lse": lse}


def _merge_naive(case):
    out, lse = naive_merge_rounded(
        case["outs"], case["lses"], case["base"] == 2, _np_dtype(case["dtype"])
    )
    return {"out": out, "lse": lse}


def _merge_bound(case):
    """refattn.bounds.merge_bound plus the exact path's own float64 rounding (u |exact|)."""
    out_bound, lse_bound = merge_bound(case["outs"], case["lses"], lse_base=case["base"])
    exact = _merge_exact(case)
    half = {k: UNIT_ROUNDOFF * np.abs(np.where(np.isfinite(v), v, 0.0)) for k, v in exact.items()}
    return {"out": out_bound + half["out"], "lse": lse_bound + half["lse"]}


_MERGE_ENTRY = Entry(
    "merge_states",
    fast=_merge_fast,
    exact=_merge_exact,
    naive=_merge_naive,
    bound=_merge_bound,
    strategy=_merge_cases(),
    label=lambda c: f"base={c['base']} dtype={c['dtype']} outs {c['outs'].shape}",
    bound_strategy=_merge_cases(dtypes=("float64",)),
    out_dtype=lambda case: _np_dtype(case["dtype"]),
)


# ----------------------------------------------------------------------- linear attention


def _recurrence_call(case, **extra):
    o, state = refattn.linear_attention(
        case["q"],
        case["k"],
        case["v"],
        case["g"],
        case["beta"],
        output_final_state=True,
        **case["opts"],
        **extra,
    )
    return {"out": o, "state": state}


def _recurrence_naive(case):
    o, state = naive_linear_rounded(
        case["q"],
        case["k"],
        case["v"],
        case["g"],
        case["beta"],
        dtype=_np_dtype(case["dtype"]),
        **case["opts"],
    )
    return {"out": o, "state": state}


def _recurrence_bound(case):
    """refattn.linear.forward_error_bound plus the exact path's own float64 rounding."""
    o_bound, s_bound = refattn.linear.forward_error_bound(
        case["q"], case["k"], case["v"], case["g"], case["beta"], **case["opts"]
    )
    exact = _recurrence_call(case, precision="exact")
    return {
        "out": o_bound + UNIT_ROUNDOFF * np.abs(exact["out"]),
        "state": s_bound + UNIT_ROUNDOFF * np.abs(exact["state"]),
    }


_RECURRENCE_ENTRY = Entry(
    "linear_attention",
    fast=_recurrence_call,
    exact=lambda case: _recurrence_call(
        case, precision="exact", out_dtype=_np_dtype(case["dtype"])
    ),
    naive=_recurrence_naive,
    bound=_recurrence_bound,
    strategy=lambda: linear_attention_cases(dtypes=("float64", "float32", "float16", "bfloat16")),
    label=lambda c: f"{c['form']} dtype={c['dtype']} v {c['v'].shape} {sorted(c['opts'])}",
    examples=(30, 30),
    bound_strategy=linear_attention_cases,
    out_dtype=lambda case: _np_dtype(case["dtype"]),
)
_RECURRENCE_VJP_REASON = (
    "its twin is a numerical derivative of every input (six arrays): "
    "tests/exact/test_linear_exact.py checks the exact vjp against central differences of the "
    "mpmath twin (tests.naive.linear.mp_linear), tests/concepts/test_linear.py the float64 "
    "vjp within refattn.bounds.linear_vjp_bound"
)

_MERGE_VJP_REASON = (
    "float64 only (no exact path yet): tests/concepts/test_merge.py checks it against central "
    "differences of the mpmath twin (tests.naive.merge.mp_merge)"
)

REGISTRY: dict[str, Entry] = {
    e.name: e
    for e in [
        *(_attention_entry(dtype) for dtype in ("float64", "float32", "float16", "bfloat16")),
        *(_logspace_entry(dtype) for dtype in ("float64", "float32", "float16", "bfloat16")),
        _MERGE_ENTRY,
        gap("merge_states_vjp", _MERGE_VJP_REASON),
        _RECURRENCE_ENTRY,
        gap("linear_attention_vjp", _RECURRENCE_VJP_REASON),
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
        _adapt_entry("adapt_keys", _adapt_keys_bound, _adapt_cases("adapt_keys", max_iters=1)),
        _adapt_entry("adapt_priors", _adapt_priors_bound, None),
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
        Entry(
            "hopfield.retrieve",
            fast=None,
            exact=_retrieve_exact,
            naive=_retrieve_naive,
            bound=None,
            strategy=_retrieve_cases,
            label=lambda c: f"{c['style']}, beta={c['beta']}, steps={c['steps']}",
            examples=(10, None),
            reason="no a-priori bound of the iterated float64 retrieve is claimed (one step is "
            "attention: tests/concepts/test_hopfield.py compares it bit for bit)",
        ),
        Entry(
            "attention_vjp",
            fast=_attention_vjp,
            exact=lambda case: _attention_vjp(case, precision="exact"),
            naive=_attention_vjp_naive,
            bound=_attention_vjp_bound,
            strategy=_attention_vjp_cases,
            label=lambda c: f"q {c['q'].shape}, k {c['k'].shape}, scale={c['scale']}",
            examples=(5, 5),
            # the first call compiles the fast exact vjp engine (minutes on a loaded machine)
            marks=(pytest.mark.slow,),
        ),
        Entry(
            "mgk.em_update_pi",
            fast=_em_call,
            exact=lambda case: _em_call(case, precision="exact"),
            naive=_em_naive,
            bound=_em_bound,
            strategy=_em_cases,
            label=lambda c: f"keys {c['keys'].shape}, {sorted(c['opts'])}",
            examples=(15, 15),
        ),
        Entry(
            "meanfield.naive_step",
            fast=_out(_naive_step),
            exact=_out(lambda case: _naive_step(case, precision="exact")),
            naive=_out(
                lambda case: round_nested(exact_naive_step(case["m"], case["J"], case["x"]))
            ),
            bound=_out(_naive_step_bound),
            strategy=_naive_step_cases,
            label=lambda c: f"x {c['x'].shape}",
            examples=(15, 15),
        ),
        _mgk_vjp_entry("attention"),
        _mgk_vjp_entry("linear_attention"),
        Entry(
            "hopfield.retrieve_vjp",
            fast=None,
            exact=_retrieve_vjp_exact,
            naive=_retrieve_vjp_naive,
            bound=None,
            strategy=_retrieve_vjp_cases,
            label=lambda c: f"beta={c['beta']}, steps={c['steps']}",
            examples=(3, None),
            derivative=True,
            reason="no a-priori bound of the float64 retrieve vjp is claimed; "
            "tests/concepts/test_mgk_vjp.py checks it against the oracle's gradient floor",
        ),
        Entry(
            "meanfield.softmax_couplings",
            fast=None,
            exact=_couplings_exact,
            naive=_couplings_naive,
            bound=None,
            strategy=_couplings_cases,
            label=lambda c: f"x {c['x'].shape}, causal={c['causal']}",
            examples=(10, None),
            reason="its float64 bound (scores, log1p-form weights, one product with W_V) is "
            "spelled out in tests/concepts/test_meanfield_vjp.py, not yet a registry column",
        ),
        *_TRANSFORMER_ROWS,
        Entry(
            "transformer.layer_norm_vjp",
            fast=_layer_norm_vjp_call,
            exact=lambda case: _layer_norm_vjp_call(case, precision="exact"),
            naive=_layer_norm_vjp_naive,
            bound=_layer_norm_vjp_bound,
            strategy=_with_grad(_layer_norm_cases),
            label=lambda c: f"x {c['x'].shape}",
            examples=(5, 10),
            derivative=True,
            reason="the twin checks dx; dgamma and dbeta are checked against central "
            "differences and torch in tests/concepts/test_transformer_vjp.py",
        ),
        Entry(
            "transformer.feed_forward_vjp",
            fast=_feed_forward_vjp_call,
            exact=lambda case: _feed_forward_vjp_call(case, precision="exact"),
            naive=_feed_forward_vjp_naive,
            bound=_feed_forward_vjp_bound,
            strategy=_with_grad(_block_cases),
            label=lambda c: f"activation={c['activation']}",
            examples=(4, 8),
            derivative=True,
            reason="the twin checks dx; the weight gradients are checked against central "
            "differences and torch in tests/concepts/test_transformer_vjp.py",
        ),
        *_GAPS,
    ]
}
