"""The forward functions of :mod:`refattn.transformer` and their compositions.

Each public function validates its call into a :class:`Composition` (a ``*_plan``), then
evaluates it on the float64 path (over :class:`~refattn.transformer.Float64Ops`) or encloses
and rounds it once on the exact path (:mod:`refattn.exact.transformer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .. import _checks
from ..exact import transformer as X
from ._ops import Float64Ops, decoder, encoder, ffn, mha
from ._params import (
    LAYOUTS,
    NORMS,
    AttentionParams,
    DecoderParams,
    EncoderParams,
    FeedForwardParams,
    NormParams,
    arrays_of,
    attention_keywords,
    check_attention,
    check_decoder,
    check_encoder,
    check_ffn,
    check_norm,
    convert,
    float_input,
    require_finite,
)


def unchanged(out):
    return out


class Composition(NamedTuple):
    """A validated call of one of this module's functions as a composition of operations.

    ``chain(ops, *inputs.values(), params)`` evaluates it over the operations ``ops``
    (``linear``, ``activation``, ``layer_norm``, ``attention``, ``positions``, and ``+`` of
    values): :class:`Float64Ops` (the float64 path), the exact path's enclosures
    (:class:`refattn.exact.transformer.EnclosureOps`), or error-tracking operations
    (:func:`refattn.bounds.transformer_forward_bound`). ``finish`` maps the chain's value to
    the returned array.
    """

    chain: Callable
    inputs: dict
    params: object
    what: str
    finish: Callable = unchanged


def widen_to_float64(plan: Composition) -> Composition:
    """The composition with its inputs and parameters widened to float64."""
    inputs = {name: _checks.as_float64(a) for name, a in plan.inputs.items()}
    params = plan.params
    if hasattr(params, "__dataclass_fields__"):
        params = convert(params, _checks.as_float64)
    return plan._replace(inputs=inputs, params=params)


def _run(plan: Composition, precision, out_dtype):
    """Evaluate ``plan`` on the chosen path.

    float64: inputs and params widened to float64. exact: converted to point intervals once,
    the chain enclosed at each working precision, rounded once by the Ziv loop.
    """
    precision = _checks.precision(precision)
    if precision == "float64":
        plan = widen_to_float64(plan)
        return plan.finish(plan.chain(Float64Ops, *plan.inputs.values(), plan.params))
    dtype = _checks.out_dtype(out_dtype)
    require_finite(plan.inputs)
    require_finite(arrays_of(plan.params))
    out = X.round_composition(
        plan.chain, list(plan.inputs.values()), plan.params, dtype, plan.what, map_params=convert
    )
    return plan.finish(out)


# ----------------------------------------------------------------------------- public API


def multihead_attention(
    x_q,
    x_kv,
    W_Q,
    W_K,
    W_V,
    W_O,
    *,
    b_Q=None,
    b_K=None,
    b_V=None,
    b_O=None,
    num_heads,
    num_kv_heads=None,
    precision="float64",
    out_dtype=None,
    **attention_kwargs,
):
    """Multi-head (self or cross) attention, [L17] "Multihead attention", [AMT] "Self-Attention".

    .. math::

        \\mathrm{multihead}(x_q, x_{kv}) = \\mathrm{concat}(\\mathrm{head}_0, \\dots,
            \\mathrm{head}_{H-1})\\, W_O + b_O, \\qquad
        \\mathrm{head}_h = \\mathrm{attention}(x_q W_Q^{(h)} + b_Q^{(h)},\\;
            x_{kv} W_K^{(g(h))} + b_K^{(g(h))},\\; x_{kv} W_V^{(g(h))} + b_V^{(g(h))})

    where ``W^{(h)}`` is the column block ``h*D:(h+1)*D`` (``h*E:(h+1)*E`` for values) and
    ``g(h)`` the kv head of query head h (``gqa``, as in :func:`refattn.attention`).

    Parameters
    ----------
    x_q : (..., L, M) float array
        Queries' source. ``x_kv``: (..., S, N), or None for self-attention (``x_kv = x_q``).
        Leading dims broadcast.
    W_Q, W_K, W_V, W_O : (M, H*D), (N, K*D), (N, K*E), (H*E, P) float arrays
    b_Q, b_K, b_V, b_O : (H*D,), (K*D,), (K*E,), (P,) float arrays, optional
    num_heads, num_kv_heads : int
        H and K (default K = H; K < H is GQA, K = 1 is MQA).
    precision : {"float64", "exact"}
    out_dtype : dtype, optional
        Exact path only: float64 (default), float32, float16, bfloat16.
    **attention_kwargs
        Any of ``scale, bias, mask, causal, window, align, softcap, alibi_slopes, gqa,
        dropout_mask, dropout_p, empty_rows`` with the meaning of :func:`refattn.attention`;
        ``bias``/``mask`` broadcast to (..., H, L, S). The default scale is ``1/sqrt(D)``
        with D the *per-head* width ([L17]'s ``sqrt(d_k)``).

    Returns
    -------
    (..., L, P) ndarray

    Notes
    -----
    The float64 path projects with BLAS matmuls and calls :func:`refattn.attention`; its
    error is bounded by :func:`refattn.bounds.transformer_forward_bound`. The exact path encloses
    the whole chain (see :mod:`refattn.exact.transformer`) and rounds once.
    [L17]'s masked attention ``softmax((Q^T K + M)/sqrt(d_k))`` with ``M`` in {0, -inf} is
    ``mask=`` here (``bias=-inf`` is the same): excluded keys are removed from the sums.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> x, eye = np.eye(2), np.eye(2)
    >>> T.multihead_attention(x, None, eye, eye, eye, eye, num_heads=1, scale=0.0).tolist()
    [[0.5, 0.5], [0.5, 0.5]]
    >>> np.round(T.multihead_attention(x, None, eye, eye, eye, eye, num_heads=2), 4).tolist()
    [[0.7311, 0.5], [0.5, 0.7311]]
    """
    plan = mha_plan(
        x_q,
        x_kv,
        W_Q,
        W_K,
        W_V,
        W_O,
        b_Q=b_Q,
        b_K=b_K,
        b_V=b_V,
        b_O=b_O,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        **attention_kwargs,
    )
    return _run(plan, precision, out_dtype)


def mha_plan(
    x_q,
    x_kv,
    W_Q,
    W_K,
    W_V,
    W_O,
    *,
    b_Q=None,
    b_K=None,
    b_V=None,
    b_O=None,
    num_heads,
    num_kv_heads=None,
    **attention_kwargs,
) -> Composition:
    x_q = float_input(x_q, "x_q")
    x_kv = x_q if x_kv is None else float_input(x_kv, "x_kv")
    try:  # checked here: attention's own check names its q, k, v, not these arguments
        np.broadcast_shapes(x_q.shape[:-2], x_kv.shape[:-2])
    except ValueError:
        raise ValueError(
            f"x_q, x_kv: the batch dimensions (...) do not broadcast: x_q {x_q.shape}, "
            f"x_kv {x_kv.shape}"
        ) from None
    params = check_attention(
        x_q, x_kv, AttentionParams(W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, num_heads, num_kv_heads)
    )
    kwargs = attention_keywords(attention_kwargs)

    def chain(ops, xq, xkv, p):
        return mha(ops, xq, xkv, p, kwargs)

    return Composition(chain, {"x_q": x_q, "x_kv": x_kv}, params, "multihead_attention")


def layer_norm(x, *, gamma=None, beta=None, eps=1e-5, axis=-1, precision="float64", out_dtype=None):
    """Layer normalisation, [L17] "Other layers": ``h_i <- g/sigma (h_i - mu)``.

    .. math::

        y_i = \\gamma_i \\frac{x_i - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}} + \\beta_i, \\qquad
        \\mu = \\frac1M \\sum_i x_i, \\quad \\sigma^2 = \\frac1M \\sum_i (x_i - \\mu)^2

    Parameters
    ----------
    x : float array, normalised along ``axis`` (width M)
    gamma, beta : (M,) float arrays, optional
        Gain (the notes' ``g``) and shift (not in the notes; torch/Vaswani). None: 1 and 0.
    eps : float >= 0
        Added to the variance inside the square root (torch ``nn.LayerNorm``), taken at its
        exact binary (float64) value. ``eps=0`` is the notes' formula exactly.
    axis : int
        The normalised axis (its width M must be >= 1).
    precision, out_dtype : as :func:`multihead_attention`

    Notes
    -----
    The variance is the *biased* one (divide by M, the notes' ``1/H``; torch's LayerNorm too).
    Rows with a NaN or Inf give a NaN row on both paths (``inf - inf``); a constant row with
    ``eps=0`` is ``0/0`` = NaN. The float64 path is the two-pass formula (mean, then the
    centred second moment); its error bound is :func:`refattn.bounds.transformer_forward_bound`.
    Rows with max |x| outside [2**-400, 2**400] are first scaled by a power of two (the
    result is scale-invariant), so the squares neither overflow nor underflow: e.g.
    ``[1e200, -1e200, 0]`` gives ``[1.2247..., -1.2247..., 0]`` with a finite bound.
    The exact path computes the mean and variance as exact rationals: only the square root
    is enclosed.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> T.layer_norm(np.array([1.0, 3.0]), eps=0.0).tolist()
    [-1.0, 1.0]
    >>> T.layer_norm(np.array([1.0, 2.0, 4.0]), precision="exact", out_dtype="float16").dtype
    dtype('float16')
    """
    plan = layer_norm_plan(x, gamma=gamma, beta=beta, eps=eps, axis=axis)
    precision = _checks.precision(precision)
    if precision == "float64":
        return _run(plan, precision, out_dtype)
    dtype = _checks.out_dtype(out_dtype)
    p = plan.params
    require_finite({"gamma": p.gamma, "beta": p.beta})
    moved = plan.inputs["x"]
    rows = _checks.as_float64(moved).reshape(-1, moved.shape[-1])
    out = X.round_layer_norm(rows, p.gamma, p.beta, p.eps, dtype)
    return plan.finish(out.reshape(moved.shape))


def layer_norm_plan(x, *, gamma=None, beta=None, eps=1e-5, axis=-1) -> Composition:
    x = _checks.float_array(x, "x", ndim_min=1)
    axis = _checks.axis(axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: {axis} is out of range for x of shape {x.shape}")
    if x.shape[axis] == 0:
        raise ValueError(
            f"x: the normalised axis {axis} has width 0 (shape {x.shape}); "
            "expected at least one element"
        )
    moved = np.moveaxis(x, axis, -1)
    p = check_norm(moved.shape[-1], NormParams(gamma, beta, eps))

    def chain(ops, h, params):
        return ops.layer_norm(h, params)

    return Composition(chain, {"x": moved}, p, "layer_norm", lambda out: np.moveaxis(out, -1, axis))


def sinusoidal_positions(
    length, dim, base=10000, layout="interleave", *, precision="float64", out_dtype=None
):
    """Sinusoidal position table, [L17] "Other layers" (positional embedding; Vaswani 2017).

    .. math::

        PE_{pos, 2i} = \\sin(pos / b^{2i/d}), \\qquad PE_{pos, 2i+1} = \\cos(pos / b^{2i/d})

    Parameters
    ----------
    length : int >= 0
        Positions 0 .. length-1.
    dim : even int >= 2
        d (odd widths are rejected: the notes pair every sine with a cosine).
    base : float > 0
        b, taken at its exact binary value (default 10000).
    layout : {"interleave", "concat"}
        "interleave": sine of frequency i at column 2i, cosine at 2i+1 (the notes, Vaswani).
        "concat": all sines (columns 0..d/2-1) then all cosines (d/2..d-1), as in
        tensor2tensor and several other implementations.
    precision, out_dtype : as :func:`multihead_attention`

    Returns
    -------
    (length, dim) ndarray

    Notes
    -----
    float64 path: ``angle = pos * base**(-(2i/d))`` with NumPy's pow, then sin/cos; its
    error bound is :func:`refattn.bounds.transformer_forward_bound` (grows with pos). Other
    implementations compute the frequencies as ``exp(2i * (-log(b)/d))`` (the torch tutorial)
    and round differently; the exact path is the arbiter.
    Exact path: the angles ``pos * exp(-(2i/d) log b)`` are exact reals (2i/d an exact
    rational), and each sin/cos is rounded once.

    Examples
    --------
    >>> import refattn.transformer as T
    >>> T.sinusoidal_positions(2, 2).tolist()
    [[0.0, 1.0], [0.8414709848078965, 0.5403023058681398]]
    """
    plan = _positions_plan(length, dim, base, layout)
    precision = _checks.precision(precision)
    if precision == "float64":
        return _run(plan, precision, out_dtype)
    return X.round_positions(*plan.params, _checks.out_dtype(out_dtype))


def _positions_plan(length, dim, base=10000, layout="interleave") -> Composition:
    length = _nonnegative_int(length, "length")
    dim = _nonnegative_int(dim, "dim")
    if dim < 2 or dim % 2:
        raise ValueError(f"dim: expected an even width >= 2 (sine/cosine pairs), got {dim}")
    base = _checks.real_scalar(base, "base", positive=True)
    _checks.choice(layout, "layout", LAYOUTS)

    def chain(ops, params):
        return ops.positions(*params)

    return Composition(chain, {}, (length, dim, base, layout), "sinusoidal_positions")


def _nonnegative_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return int(value)


def feed_forward(x, W1, b1, W2, b2, activation="relu", *, precision="float64", out_dtype=None):
    """Position-wise feed-forward ([AMT] "Transformers": "a set of standard MLPs").

    .. math:: \\mathrm{FFN}(x) = \\mathrm{act}(x W_1 + b_1) W_2 + b_2

    Parameters
    ----------
    x : (..., L, M) float array
    W1, b1, W2, b2 : (M, F), (F,) or None, (F, P), (P,) or None
    activation : {"relu", "gelu"}
        "gelu" is the exact-erf form ``x/2 (1 + erf(x/sqrt 2))`` (torch ``approximate="none"``),
        *not* the tanh approximation.
    precision, out_dtype : as :func:`multihead_attention`

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> T.feed_forward(np.array([[1.0, -1.0]]), np.eye(2), None, np.eye(2), None).tolist()
    [[1.0, 0.0]]
    """
    return _run(ffn_plan(x, W1, b1, W2, b2, activation), precision, out_dtype)


def ffn_plan(x, W1, b1, W2, b2, activation="relu") -> Composition:
    x = float_input(x, "x", ndim_min=1)
    params = check_ffn(x, FeedForwardParams(W1, b1, W2, b2, activation))
    return Composition(ffn, {"x": x}, params, "feed_forward")


def encoder_block(
    x,
    params: EncoderParams,
    *,
    norm="post",
    mask=None,
    precision="float64",
    out_dtype=None,
    **attention_kwargs,
):
    """One Transformer encoder block ([AMT] "Transformers", Figure 2; Vaswani 2017).

    .. math::

        \\text{post:}\\; h = \\mathrm{LN}_1(x + \\mathrm{MHA}(x)),\\;
            y = \\mathrm{LN}_2(h + \\mathrm{FFN}(h)) \\qquad
        \\text{pre:}\\; h = x + \\mathrm{MHA}(\\mathrm{LN}_1(x)),\\;
            y = h + \\mathrm{FFN}(\\mathrm{LN}_2(h))

    Parameters
    ----------
    x : (..., L, M) float array
    params : EncoderParams
        ``attn`` maps width M to M (P = M), ``ffn`` M -> F -> M.
    norm : {"post", "pre"}
        "post" (default) is the lectures' and Vaswani's block. "pre" (GPT-2 style) adds no
        final norm: in pre-LN stacks that norm follows the last block, not each block.
    mask : bool array broadcastable to (..., H, L, L), optional (True = attend)
    precision, out_dtype : as :func:`multihead_attention`
    **attention_kwargs
        Further keywords for the self-attention (as :func:`multihead_attention`).

    Notes
    -----
    No dropout (inference). The exact path is the exact value of the whole block, rounded
    once.

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> eye, ffn = np.eye(4), T.FeedForwardParams(np.eye(4, 8), None, np.eye(8, 4), None)
    >>> attn = T.AttentionParams(eye, eye, eye, eye, num_heads=2)  # W_Q, W_K, W_V, W_O
    >>> p = T.EncoderParams(attn, ffn, norm1=T.NormParams(), norm2=T.NormParams())
    >>> T.encoder_block(np.ones((3, 4)), p).shape
    (3, 4)
    """
    plan = encoder_plan(x, params, norm=norm, mask=mask, **attention_kwargs)
    return _run(plan, precision, out_dtype)


def encoder_plan(x, params, *, norm="post", mask=None, **attention_kwargs) -> Composition:
    x = float_input(x, "x")
    _checks.choice(norm, "norm", NORMS)
    params = check_encoder(x, params)
    kwargs = attention_keywords(dict(attention_kwargs, mask=mask))

    def chain(ops, h, p):
        return encoder(ops, h, p, norm, kwargs)

    return Composition(chain, {"x": x}, params, "encoder_block")


def decoder_block(
    x,
    memory,
    params: DecoderParams,
    *,
    norm="post",
    self_mask=None,
    memory_mask=None,
    precision="float64",
    out_dtype=None,
):
    """One Transformer decoder block ([L17] "Masked Multi-head attention"; Vaswani 2017).

    .. math::

        \\text{post:}\\; h_1 = \\mathrm{LN}_1(x + \\mathrm{MHA}_{causal}(x, x)),\\;
        h_2 = \\mathrm{LN}_2(h_1 + \\mathrm{MHA}(h_1, m)),\\;
        y = \\mathrm{LN}_3(h_2 + \\mathrm{FFN}(h_2))

    ("pre": ``h_1 = x + MHA_causal(LN_1 x)``, ``h_2 = h_1 + MHA(LN_2 h_1, m)``,
    ``y = h_2 + FFN(LN_3 h_2)``; the memory m is not normalised by the block.)

    Parameters
    ----------
    x : (..., L, M) float array
    memory : (..., S, N) float array (the encoder output)
    params : DecoderParams
    norm : {"post", "pre"}
    self_mask : bool array broadcastable to (..., H, L, L), optional
        Combined (AND) with the causal mask ``j <= i`` (top-left aligned), which is always on.
    memory_mask : bool array broadcastable to (..., H, L, S), optional
    precision, out_dtype : as :func:`multihead_attention`

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> eye, ffn = np.eye(4), T.FeedForwardParams(np.eye(4, 8), None, np.eye(8, 4), None)
    >>> attn = T.AttentionParams(eye, eye, eye, eye, num_heads=2)  # W_Q, W_K, W_V, W_O
    >>> p = T.DecoderParams(attn, attn, ffn, T.NormParams(), T.NormParams(), T.NormParams())
    >>> T.decoder_block(np.ones((3, 4)), np.ones((5, 4)), p).shape
    (3, 4)
    """
    plan = decoder_plan(x, memory, params, norm=norm, self_mask=self_mask, memory_mask=memory_mask)
    return _run(plan, precision, out_dtype)


def decoder_plan(x, memory, params, *, norm="post", self_mask=None, memory_mask=None):
    x = float_input(x, "x")
    memory = float_input(memory, "memory")
    _checks.choice(norm, "norm", NORMS)
    params = check_decoder(x, memory, params)
    self_kwargs = {"mask": self_mask, "causal": True}
    cross_kwargs = {"mask": memory_mask}

    def chain(ops, h, m, p):
        return decoder(ops, h, m, p, norm, self_kwargs, cross_kwargs)

    return Composition(chain, {"x": x, "memory": memory}, params, "decoder_block")


def composition(function, *args, **kwargs) -> Composition:
    """The validated float64 composition that ``function(*args, **kwargs)`` evaluates.

    ``function`` is one of :func:`multihead_attention`, :func:`layer_norm`,
    :func:`sinusoidal_positions`, :func:`feed_forward`, :func:`encoder_block`,
    :func:`decoder_block`; the arguments are validated as by the function (without
    ``precision``/``out_dtype``) and widened to float64. Evaluating the result over
    :class:`Float64Ops` gives the function's float64 path; over other operations, another
    analysis of the same computation (:func:`refattn.bounds.transformer_forward_bound`).

    Examples
    --------
    >>> import numpy as np, refattn.transformer as T
    >>> plan = T.composition(T.layer_norm, np.array([1.0, 3.0]), eps=0.0)
    >>> plan.finish(plan.chain(T.Float64Ops, *plan.inputs.values(), plan.params)).tolist()
    [-1.0, 1.0]
    """
    plans = {
        multihead_attention: mha_plan,
        layer_norm: layer_norm_plan,
        sinusoidal_positions: _positions_plan,
        feed_forward: ffn_plan,
        encoder_block: encoder_plan,
        decoder_block: decoder_plan,
    }
    if function not in plans:
        names = ", ".join(f.__name__ for f in plans)
        raise ValueError(
            f"function: expected one of {names} of refattn.transformer, got {function!r}"
        )
    return widen_to_float64(plans[function](*args, **kwargs))
