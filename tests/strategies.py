"""Hypothesis strategies shared by the test modules (one section per area)."""

from __future__ import annotations

import numpy as _np
from hypothesis import strategies as _st

# ----------------------------------------------------------------------------- fixed points
# (refattn.fixedpoint / refattn.meanfield)


def _scaled_to_radius(rng, shape, radius):
    """Random square matrices (..., P, P) rescaled to spectral radius ``radius``."""
    matrices = rng.standard_normal(shape)
    rho = _np.abs(_np.linalg.eigvals(matrices)).max(axis=-1)
    return matrices * (radius / rho)[..., None, None]


@_st.composite
def contractive_affine_maps(draw, max_batch=4, max_dim=8):
    """(A, b): a batch of affine maps z -> A z + b with spectral radius of A in [0, 0.9]."""
    batch = draw(_st.integers(1, max_batch))
    dim = draw(_st.integers(1, max_dim))
    seed = draw(_st.integers(0, 2**32 - 1))
    radius = draw(_st.lists(_st.floats(0.0, 0.9), min_size=batch, max_size=batch))
    rng = _np.random.default_rng(seed)
    A = _scaled_to_radius(rng, (batch, dim, dim), _np.array(radius))
    return A, rng.standard_normal((batch, dim))


@_st.composite
def weak_vector_couplings(draw, max_sites=4, max_dim=3, strength=0.5):
    """(x, J) vector-spin fields (N, d) and couplings (N, N, d, d) with zero diagonal blocks and
    spectral norm of the (N d, N d) coupling matrix equal to ``strength`` times a draw in (0, 1]."""
    n = draw(_st.integers(2, max_sites))
    d = draw(_st.integers(1, max_dim))
    seed = draw(_st.integers(0, 2**32 - 1))
    scale = draw(_st.floats(0.05, 1.0))
    symmetric = draw(_st.booleans())
    rng = _np.random.default_rng(seed)
    J = rng.standard_normal((n, n, d, d))
    if symmetric:
        J = (J + J.transpose(1, 0, 3, 2)) / 2
    J[_np.arange(n), _np.arange(n)] = 0.0
    norm = _np.linalg.norm(J.transpose(0, 2, 1, 3).reshape(n * d, n * d), 2)
    J *= strength * scale / norm
    return rng.standard_normal((n, d)), J


# ---------------------------------------------------------------------------------------------
# transformer pieces (refattn.transformer)
# ---------------------------------------------------------------------------------------------


@_st.composite
def position_shifts(draw):
    """(pos, shift, dim, base, layout) for the sinusoidal rotation property."""
    pos = draw(_st.integers(0, 300))
    shift = draw(_st.integers(0, 300))
    dim = 2 * draw(_st.integers(1, 4))
    base = draw(_st.sampled_from([10000.0, 500.0, 2.0, 1.5]))
    layout = draw(_st.sampled_from(["interleave", "concat"]))
    return pos, shift, dim, base, layout


@_st.composite
def head_layouts(draw):
    """(num_heads, head_dim, seed) for small exact multi-head attention cases."""
    return (draw(_st.integers(1, 3)), draw(_st.integers(1, 2)), draw(_st.integers(0, 2**16)))


# ------------------------------------------------------------------------------ attention
# (refattn.attention / refattn.attention_vjp; the lead's section)


@_st.composite
def attention_cases(
    draw, *, max_len=6, max_dim=5, dtypes=("float64",), options=True, allow_empty=True
):
    """(q, k, v, options): small attention problems covering every option.

    Inputs come from a drawn seed (fast, reproducible); the drawn flags choose shapes (GQA,
    L != S both ways, D != E), input scale (up to logit gaps > 40), adversarial structure
    (ties at the max, duplicated keys), masks with fully masked rows, -inf bias, causal/window
    in both alignments, softcap, ALiBi and deterministic dropout.
    """
    kv_heads = draw(_st.sampled_from([1, 2]))
    heads = kv_heads * draw(_st.sampled_from([1, 2]))
    length = draw(_st.integers(1, max_len))
    keys = draw(_st.integers(1, max_len))
    dim = draw(_st.integers(1, max_dim))
    vdim = draw(_st.integers(1, max_dim))
    dtype = draw(_st.sampled_from(dtypes))
    seed = draw(_st.integers(0, 2**32 - 1))
    input_scale = draw(_st.sampled_from([0.0, 0.5, 1.0, 4.0, 16.0]))
    rng = _np.random.default_rng(seed)
    q = rng.standard_normal((heads, length, dim)) * input_scale
    k = rng.standard_normal((kv_heads, keys, dim))
    v = rng.standard_normal((kv_heads, keys, vdim))
    if draw(_st.booleans()):  # ties: duplicated keys give equal scores
        k[:, -1] = k[:, 0]
    opts = {}
    if options:
        if draw(_st.booleans()):
            opts["causal"] = True
        if draw(_st.booleans()):
            opts["align"] = "bottom_right"
        if draw(_st.booleans()):
            opts["window"] = (
                draw(_st.one_of(_st.none(), _st.integers(0, 3))),
                draw(_st.one_of(_st.none(), _st.integers(0, 3))),
            )
        if draw(_st.booleans()):
            mask = rng.random((heads, length, keys)) < 0.7
            if allow_empty and draw(_st.booleans()):
                mask[0, 0] = False
            opts["mask"] = mask
        if draw(_st.booleans()):
            bias = rng.standard_normal((length, keys))
            bias[rng.random((length, keys)) < 0.2] = -_np.inf
            opts["bias"] = bias
        if draw(_st.booleans()):
            opts["softcap"] = draw(_st.sampled_from([0.5, 2.0, 30.0]))
        if draw(_st.booleans()):
            opts["alibi_slopes"] = 2.0 ** -rng.integers(0, 4, heads).astype(float)
        if draw(_st.booleans()):
            opts["dropout_mask"] = rng.random((heads, length, keys)) < 0.8
            opts["dropout_p"] = draw(_st.sampled_from([0.0, 0.25, 0.5]))
        if draw(_st.booleans()):
            opts["gqa"] = "tile"
        if draw(_st.booleans()):
            opts["scale"] = draw(_st.sampled_from([0.3, 1.0, -0.5]))
    cast = _np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    return q.astype(cast), k.astype(cast), v.astype(cast), opts


# ----------------------------------------------------------------------------- seed mechanisms
# (refattn.gmm / refattn.mgk / refattn.hopfield)

MIXTURE_STYLES = ("normal", "ties", "zeros", "dyadic", "wide")


def _mixture_array(rng, style, shape, spread=1.0):
    """Test data of one style: ties repeat the first row, dyadic values have few bits."""
    if style == "dyadic":
        return rng.integers(-8, 9, shape) / 4.0
    data = rng.standard_normal(shape) * (8.0 if style == "wide" else spread)
    if style == "zeros":
        data[...] = 0.0
    if style == "ties" and len(shape) >= 2:
        data[..., 1:, :] = data[..., :1, :]
    return data


@_st.composite
def mixture_problems(draw, max_length=3, max_units=4, max_dim=3, max_vdim=2, batched=True):
    """(q (..., L, D), keys (..., S, D), values (..., S, E), style) with an optional batch axis
    of 2; styles: normal, ties (equal keys), zeros (q = keys = 0), dyadic, wide (|x| ~ 8)."""
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    style = draw(_st.sampled_from(MIXTURE_STYLES))
    batch = (2,) if batched and draw(_st.booleans()) else ()
    length = draw(_st.integers(1, max_length))
    units = draw(_st.integers(1, max_units))
    dim = draw(_st.integers(1, max_dim))
    vdim = draw(_st.integers(1, max_vdim))
    q = _mixture_array(
        rng,
        "zeros" if style == "zeros" else ("normal" if style == "ties" else style),
        batch + (length, dim),
    )
    keys = _mixture_array(rng, style, batch + (units, dim))
    values = _mixture_array(
        rng, "dyadic" if style in ("dyadic", "zeros") else "normal", batch + (units, vdim)
    )
    return q, keys, values, style


@_st.composite
def unit_parameters(draw, units, low=0.25, high=2.0, batch=()):
    """A precision as a scalar or a per-unit array (..., S) in [low, high]."""
    if draw(_st.booleans()):
        return draw(_st.sampled_from([low, 1.0, high, 0.5 * (low + high)]))
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    return rng.uniform(low, high, batch + (units,))


@_st.composite
def mgk_problems(draw, max_length=3, max_keys=4, max_components=3, max_dim=2, max_vdim=2):
    """(q (L, D), keys (S, R, D), v (S, E), options) for refattn.mgk.attention: log_pi,
    sigma2 (scalar or per component), and the allowed-set options (mask, causal, window,
    align)."""
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    style = draw(_st.sampled_from(MIXTURE_STYLES))
    length = draw(_st.integers(1, max_length))
    keys_n = draw(_st.integers(1, max_keys))
    comps = draw(_st.integers(1, max_components))
    dim = draw(_st.integers(1, max_dim))
    vdim = draw(_st.integers(1, max_vdim))
    q = _mixture_array(rng, "normal" if style == "ties" else style, (length, dim))
    keys = _mixture_array(rng, style, (keys_n, comps, dim))
    v = _mixture_array(rng, "normal", (keys_n, vdim))
    opts = {}
    if draw(_st.booleans()):
        weights = rng.uniform(0.05, 1.0, (keys_n, comps))
        opts["log_pi"] = _np.log(weights / weights.sum(axis=-1, keepdims=True))
    if draw(_st.booleans()):
        opts["sigma2"] = rng.uniform(0.25, 2.0, (keys_n, comps))
    elif draw(_st.booleans()):
        opts["sigma2"] = draw(_st.sampled_from([0.5, 2.0]))
    if draw(_st.booleans()):
        opts["causal"] = True
    if draw(_st.booleans()):
        opts["align"] = "bottom_right"
    if draw(_st.booleans()):
        opts["window"] = (
            draw(_st.one_of(_st.none(), _st.integers(0, 2))),
            draw(_st.one_of(_st.none(), _st.integers(0, 2))),
        )
    if draw(_st.booleans()):
        opts["mask"] = rng.random((length, keys_n)) < 0.7
    return q, keys, v, opts


@_st.composite
def gmm_cases(draw, max_iters=3, need_trace=False, batched=True):
    """Keyword dict of one refattn.gmm.attention call (q, keys, values, alpha, beta, prior,
    v_init, iters) plus the input ``style``; ``need_trace`` keeps beta > 0."""
    q, keys, values, style = draw(mixture_problems(batched=batched))
    units = keys.shape[-2]
    batch = keys.shape[:-2]
    alpha = draw(unit_parameters(units, batch=batch))
    beta = draw(unit_parameters(units, low=0.05, high=0.5, batch=batch))
    if not need_trace and draw(_st.booleans()):
        beta = 0.0
    prior = draw(_st.sampled_from(["uniform", "magnitude", "array"]))
    if prior == "array":
        rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
        prior = rng.standard_normal(batch + (units,))
        if units > 1 and draw(_st.booleans()):
            prior[..., -1] = -_np.inf
    v_init = None
    if draw(_st.booleans()) and _np.max(beta) > 0:
        v_init = _np.zeros(q.shape[:-1] + (values.shape[-1],)) + values[..., :1, :]
    iters = draw(_st.integers(1, max_iters))
    return dict(
        q=q,
        keys=keys,
        values=values,
        alpha=alpha,
        beta=beta,
        prior=prior,
        v_init=v_init,
        iters=iters,
        style=style,
    )


@_st.composite
def linear_problems(draw):
    """(q, keys, v, pi) for refattn.mgk.linear_attention: an mgk problem with a strictly
    positive component distribution pi (S, R)."""
    q, keys, v, _ = draw(mgk_problems())
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    pi = rng.uniform(0.0, 1.0, keys.shape[:2]) + 1e-3
    return q, keys, v, pi / pi.sum(-1, keepdims=True)


@_st.composite
def logspace_rows(draw, max_len=7):
    """(x (3, n), where (3, n)): rows of scores with spread 0 to 700 and an optional
    exclusion mask (some rows may have no allowed entry)."""
    n = draw(_st.integers(1, max_len))
    seed = draw(_st.integers(0, 2**32 - 1))
    spread = draw(_st.sampled_from([0.0, 1.0, 30.0, 700.0]))
    rng = _np.random.default_rng(seed)
    x = rng.standard_normal((3, n)) * spread
    where = rng.random((3, n)) < draw(_st.sampled_from([1.0, 0.6]))
    return x, where


# ------------------------------------------------------------------------------ hard inputs
# (the exact path's worst cases: ties at the maximum, results on or next to rounding
# midpoints, huge logit gaps, near-cancelling outputs, subnormal and near-overflow values)

HARD_GAPS = (60.0, 700.0, 1e5, 1e9)
HARD_TARGETS = ("float64", "float32", "bfloat16", "float16")
HARD_STYLES = ("midpoint", "ties", "cancel", "subnormal", "overflow", "plain")


def _target_dtype(name):
    return _np.dtype(__import__("ml_dtypes").bfloat16) if name == "bfloat16" else _np.dtype(name)


def midpoint_pair(center: float, target: str):
    """Two float64 values whose mean is the rounding midpoint of ``target`` just above
    ``center`` (the two neighbours of that midpoint in float64 for a float64 target)."""
    dtype = _target_dtype(target)
    low = float(_np.array([center]).astype(dtype)[0])
    if low > center:
        low = float(_np.nextafter(_np.array([low], dtype), _np.array([-_np.inf], dtype))[0])
    high = float(_np.nextafter(_np.array([low], dtype), _np.array([_np.inf], dtype))[0])
    if target == "float64":  # the midpoint itself is not a float64: split it in two
        return low, high
    middle = (low + high) / 2  # exact: narrower formats embed with spare bits
    return middle, middle


@_st.composite
def hard_values(draw, target, style, count):
    """``count`` float64 values of one style; the first two average to a midpoint of
    ``target`` (style ``midpoint``) or cancel (``cancel``)."""
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    values = rng.standard_normal(count)
    if style == "midpoint" and count >= 2:
        values[0], values[1] = midpoint_pair(float(values[0]), target)
    elif style == "cancel" and count >= 2:
        values[1] = -values[0] * (1 + 2.0**-50 * rng.integers(-2, 3))
    elif style == "subnormal":
        smallest = float(_np.finfo(_np.float64).smallest_subnormal)
        values = (
            rng.integers(-9, 10, count)
            * smallest
            * (
                float(__import__("ml_dtypes").finfo(_target_dtype(target)).smallest_subnormal)
                / smallest
                if target != "float64"
                else 1.0
            )
        )
    elif style == "overflow":
        values = (
            _np.finfo(_np.float64).max * rng.uniform(0.5, 1.0, count) * rng.choice([-1, 1], count)
        )
    return values


@_st.composite
def hard_logspace_rows(draw):
    """(x (R, n), where (R, n), target): rows whose leading entries tie (or sit on a
    midpoint of ``target``) and whose other entries lie a gap of 60 .. 1e9 below."""
    target = draw(_st.sampled_from(HARD_TARGETS))
    gap = draw(_st.sampled_from(HARD_GAPS))
    n = draw(_st.integers(2, 5))
    ties = draw(_st.integers(1, n - 1))
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    top = draw(_st.sampled_from(["midpoint", "plain", "overflow", "small"]))
    if top == "midpoint":
        head = midpoint_pair(float(rng.standard_normal() * 8), target)[0]
    elif top == "overflow":
        head = float(_np.finfo(_np.float64).max) * float(rng.uniform(0.5, 1.0))
    elif top == "small":
        head = float(rng.integers(-3, 4)) * 2.0**-1070
    else:
        head = float(rng.standard_normal() * 4)
    x = _np.full((1, n), head)
    x[0, ties:] = head - gap * rng.uniform(1.0, 1.5, n - ties)
    where = _np.ones((1, n), dtype=bool)
    if n > 2 and draw(_st.booleans()):
        where[0, -1] = False
    return x, where, target


@_st.composite
def hard_attention_cases(draw, max_keys=5):
    """(q (1, L, 1), k (1, S, 1), v (1, S, E), opts, target) with scale 1: keys tied at the
    maximum score, the others a gap of 60 .. 1e9 below, and values of one hard style (their
    tied mean on a midpoint of ``target``, near-cancelling, subnormal, near overflow)."""
    target = draw(_st.sampled_from(HARD_TARGETS))
    gap = draw(_st.sampled_from(HARD_GAPS))
    style = draw(_st.sampled_from(HARD_STYLES))
    keys = draw(_st.integers(2, max_keys))
    ties = draw(_st.integers(1, keys - 1))
    length = draw(_st.integers(1, 2))
    vdim = draw(_st.integers(1, 2))
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    top = float(rng.integers(-4, 5))
    if draw(_st.booleans()):  # the maximum score itself on a midpoint (lse's hard case)
        top = midpoint_pair(top + float(rng.uniform()), target)[0]
    k = _np.empty((1, keys, 1))
    k[0, :ties, 0] = top
    k[0, ties:, 0] = top - gap * rng.uniform(1.0, 1.5, keys - ties)
    q = _np.ones((1, length, 1))
    if length > 1:
        q[0, 1:, 0] = 0.5
    v = _np.empty((1, keys, vdim))
    for e in range(vdim):
        v[0, :, e] = draw(hard_values(target, style, keys))
    if style == "midpoint" and ties == 1 and target == "float64":
        k[0, 1, 0] = top  # the float64 midpoint needs two tied keys
    perm = rng.permutation(keys)
    opts = {"scale": 1.0}
    return q, k[:, perm], v[:, perm], opts, target


# ------------------------------------------------------------------------------ merged states
MERGE_LSE_STYLES = ("integers", "plain", "gaps", "ties")


@_st.composite
def merge_states_cases(draw, max_states=5, max_rows=3, max_vdim=3, nonfinite=True):
    """(outs (P, 1, L, E), lses (P, 1, L), base2): states with empty ones (lse -inf), integer
    lses (exact base-2 weights), lse gaps up to 1e5, ties; optionally NaN/inf inputs."""
    states = draw(_st.integers(1, max_states))
    rows, vdim = draw(_st.integers(1, max_rows)), draw(_st.integers(1, max_vdim))
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    style = draw(_st.sampled_from(MERGE_LSE_STYLES))
    shape = (states, 1, rows)
    if style == "integers":
        lses = rng.integers(-6, 6, shape).astype(float)
    elif style == "ties":
        lses = _np.full(shape, float(rng.normal()))
    else:
        lses = rng.normal(size=shape) * (30.0 if style == "plain" else 1e5)
    lses[rng.random(shape) < draw(_st.sampled_from([0.0, 0.3, 1.0]))] = -_np.inf
    outs = rng.normal(size=shape + (vdim,))
    if draw(_st.booleans()):
        outs = _np.round(outs * 4) / 4  # dyadic outputs: exact cancellations, midpoints
    if nonfinite and draw(_st.integers(0, 4)) == 0:
        specials = _np.array([_np.nan, _np.inf, -_np.inf])
        outs.flat[rng.integers(outs.size)] = specials[rng.integers(3)]
        if draw(_st.booleans()):
            lses.flat[rng.integers(lses.size)] = specials[rng.integers(3)]
    return outs, lses, draw(_st.booleans())


# ------------------------------------------------------------------------------ linear attention
#: The named forms of refattn.linear_attention: (gate kind, delta rule).
LINEAR_FORMS = {
    "gdn": ("scalar", True),
    "kda": ("vector", True),
    "deltanet": (None, True),
    "gla": ("vector", False),
    "simple_gla": ("scalar", False),
    "linear": (None, False),
}
LINEAR_GATE_STYLES = ("moderate", "near_zero", "deep", "integers")


def _linear_gates(rng, style, shape):
    """Log gates: moderate (-2, 0], near 0 (|g| < 1e-3), deep (down to -20), or integers
    (exact powers of two with gate_base 2)."""
    if style == "near_zero":
        return -rng.uniform(0.0, 1e-3, shape)
    if style == "deep":
        return -rng.uniform(0.0, 20.0, shape)
    if style == "integers":
        return -rng.integers(0, 3, shape).astype(float)
    return -rng.uniform(0.0, 2.0, shape)


def _linear_betas(rng, shape, style):
    if style == "ends":
        return rng.integers(0, 2, shape).astype(float)  # beta exactly 0 or 1
    return rng.uniform(0.0, 1.0, shape)


def linear_call(case):
    """The canonical call (refattn.linear._inputs.LinearCall) of a
    :func:`linear_attention_cases` case, as refattn.linear_attention builds it."""
    from refattn.linear import _inputs

    opts = case["opts"]
    return _inputs.canonicalize(
        case["q"],
        case["k"],
        case["v"],
        case["g"],
        case["beta"],
        scale=opts.get("scale"),
        initial_state=opts.get("initial_state"),
        cu_seqlens=opts.get("cu_seqlens"),
        qk_l2norm=opts.get("qk_l2norm", False),
        gate_base=opts.get("gate_base", "e"),
    )


@_st.composite
def linear_attention_cases(draw, dtypes=("float64",), max_length=4, max_dim=3, forms=None):
    """A case of refattn.linear_attention: dict(q, k, v, g, beta, opts, dtype, form).

    Every form, GVA (HV = G H), packed sequences (cu_seqlens with empty and 1-token
    sequences), initial states, l2norm, gate base 2, gates near 0 and down to -20, beta at 0
    and 1; inputs cast to the case dtype (their exact values are the inputs)."""
    form = draw(_st.sampled_from(sorted(forms or LINEAR_FORMS)))
    gate_kind, delta = LINEAR_FORMS[form]
    dtype = draw(_st.sampled_from(dtypes))
    rng = _np.random.default_rng(draw(_st.integers(0, 2**32 - 1)))
    heads, group = draw(_st.integers(1, 2)), draw(_st.integers(1, 2))
    length, dim, vdim = (
        draw(_st.integers(0, max_length)),
        draw(_st.integers(1, max_dim)),
        draw(_st.integers(1, max_dim)),
    )
    packed = draw(_st.booleans())
    batch = 1 if packed else draw(_st.integers(1, 2))
    opts = {"qk_l2norm": draw(_st.booleans()), "gate_base": draw(_st.sampled_from(["e", "2"]))}
    if packed:
        cuts = sorted(draw(_st.lists(_st.integers(0, length), max_size=3)))
        opts["cu_seqlens"] = _np.array([0, *cuts, length], dtype=_np.int64)
    sequences = len(opts["cu_seqlens"]) - 1 if packed else batch
    vheads = heads * group
    cast = _target_dtype(dtype)
    q = rng.normal(size=(batch, heads, length, dim)).astype(cast)
    k = rng.normal(size=(batch, heads, length, dim)).astype(cast)
    v = rng.normal(size=(batch, vheads, length, vdim)).astype(cast)
    g = beta = None
    if gate_kind is not None:
        shape = (batch, vheads, length) + ((dim,) if gate_kind == "vector" else ())
        g = _linear_gates(rng, draw(_st.sampled_from(LINEAR_GATE_STYLES)), shape).astype(cast)
    if delta:
        beta = _linear_betas(rng, (batch, vheads, length), draw(_st.sampled_from(["u", "ends"])))
        beta = beta.astype(cast)
    if draw(_st.booleans()):
        opts["initial_state"] = rng.normal(size=(sequences, vheads, dim, vdim)).astype(cast)
    if draw(_st.booleans()):
        opts["scale"] = float(draw(_st.sampled_from([0.5, 1.0, 0.3])))
    return dict(q=q, k=k, v=v, g=g, beta=beta, opts=opts, dtype=dtype, form=form)
