"""Adapter for ``jax.nn.dot_product_attention`` (the ``xla`` implementation, on the CPU).

The call runs under ``jax.jit``, as JAX programs run it, except float16, which runs eagerly:
jit-compiled float16 fails on the CPU in jax 0.10 (see ``_attend``).

Option mapping (refattn -> JAX; JAX's layout is (B, L, H, D), the adapter transposes):

=================  ==================================================================
refattn            JAX
=================  ==================================================================
scale              ``scale=`` (JAX multiplies the logits by it in the logits dtype)
mask (bool)        ``mask=`` (True = attend), 4-D
bias (float)       ``bias=`` (added to the logits), 4-D, in q's dtype (exactly, or unsupported)
causal             ``is_causal=True`` (top-left ``tril``; bottom_right only when L == S)
window (l, r)      ``local_window_size=(l, r)`` (top-left; an unbounded side becomes
                   L + S, wider than the sequence, which is the same allowed set)
gqa interleave     native (JAX reshapes query heads as (K, G): head h reads h // G)
return_lse         ``return_residual=True`` (the residual is JAX's logsumexp)
kv_lengths         ``key_value_seq_lengths=`` (keys j >= S_b masked), without causal/window
                   or with top_left alignment (JAX's masks have no per-row offset)
=================  ==================================================================

Unsupported (NotImplementedError): softcap, ALiBi, dropout, ``gqa="tile"``, E != D,
``align="bottom_right"`` with L != S for causal or window (JAX has no alignment option), so
also kv_lengths with a bottom_right causal or window, sinks, float8 inputs.

Measured behaviour passed through unchanged (``jax`` 0.10):

* masked logits are replaced by a large negative number, not removed: a row whose every key
  is masked (mask, causal, window) gets *uniform* weights over all S keys (out = mean of v,
  lse = log S + that number), while a row excluded only by a -inf bias gives NaN (the bias
  is added, not masked);
* the softmax (and lse) is always computed in float32, for float64 inputs too, so float64
  results carry float32-sized errors;
* float64 needs ``jax_enable_x64``: constructing this adapter turns it on for the process.

Examples
--------
>>> import numpy as np
>>> from oracle.adapters import get
>>> jax_attention = get("jax")  # doctest: +SKIP
>>> q = np.ones((2, 3, 4)); k = np.ones((2, 5, 4)); v = np.ones((2, 5, 4))
>>> jax_attention(q, k, v, window=(1, None)).shape  # doctest: +SKIP
(2, 3, 4)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from oracle.adapters import Adapter, exact_cast, reject_common

__all__ = ["JaxDotProductAttention"]


class JaxDotProductAttention(Adapter):
    """refattn's calling convention over jax.nn.dot_product_attention."""

    name = "jax"
    peer = f"jax {jax.__version__} jax.nn.dot_product_attention"
    fully_masked_rows = "uniform weights over all keys (mean of v)"

    def __init__(self):
        # Without x64 JAX silently computes float64 inputs in float32.
        jax.config.update("jax_enable_x64", True)

    def _check(self, spec, return_lse):
        reject_common(self, spec, window=True, lse=True, return_lse=return_lse, kv_lengths=True)
        if (
            spec.kv_lengths is not None
            and spec.align == "bottom_right"
            and (spec.causal or spec.window is not None)
        ):
            self.unsupported(
                "kv_lengths",
                spec.kv_lengths.tolist(),
                "its causal and window masks are top-left; key_value_seq_lengths cannot align "
                "each row to its own length",
            )
        if spec.v.shape[-1] != spec.q.shape[-1]:
            self.unsupported(
                "v",
                f"E={spec.v.shape[-1]} != D={spec.q.shape[-1]}",
                "value must have the key's shape",
            )
        if (
            spec.kv_lengths is None
            and spec.offset != 0
            and (spec.causal or spec.window is not None)
        ):
            self.unsupported(
                "align",
                spec.align,
                "its causal and window masks are top-left (no offset) and L != S here",
            )

    def _call(self, spec, q, k, v, bias, return_lse):
        """Peer call on (B, H, L, D) jax arrays; returns out (B, H, L, E) and lse or None."""
        length, keys = q.shape[2], k.shape[2]
        window = None
        if spec.window is not None:
            wide = length + keys
            window = tuple(wide if side is None else side for side in spec.window)
        mask = None if spec.mask is None else jnp.asarray(spec.mask)
        lengths = None if spec.kv_lengths is None else jnp.asarray(spec.kv_lengths, jnp.int32)
        # float16 runs eagerly: jax 0.10's own fallback for it only works outside jit.
        attend = _attend if q.dtype == jnp.float16 else _attend_jit
        return attend(q, k, v, bias, mask, lengths, spec.scale, spec.causal, window, return_lse)

    def _forward(self, spec, return_lse):
        self._check(spec, return_lse)
        bias = None
        if spec.bias is not None:
            bias = jnp.asarray(exact_cast(spec.bias, spec.q.dtype, "bias", self.peer))
        out, lse = self._call(
            spec, *(jnp.asarray(a) for a in (spec.q, spec.k, spec.v)), bias, return_lse
        )
        return np.asarray(out), None if lse is None else np.asarray(lse)

    def vjp(self, q, k, v, grad_out, **options):
        """(dq, dk, dv, dbias) of the same call by ``jax.vjp``, in the input dtype and shapes.

        dbias is None without bias; ``grad_lse`` is unsupported (JAX stops lse's gradient).
        """
        if options.pop("grad_lse", None) is not None:
            self.unsupported("grad_lse", "<cotangent>", "its lse residual has no gradient")
        spec, return_lse = self._canonical(q, k, v, options)
        self._check(spec, return_lse)
        heads, length, keys = spec.q.shape[1], spec.q.shape[2], spec.k.shape[2]
        batch = tuple(spec.batch_shape)

        def flatten(x, tail):
            if spec.single_head:
                x = x[None]
            full = jnp.broadcast_to(x, batch + tuple(tail))
            return full.reshape((-1,) + tuple(tail)) if batch else full[None]

        def forward(q, k, v, bias):
            flat = [
                flatten(x, s.shape[1:])
                for x, s in zip((q, k, v), (spec.q, spec.k, spec.v), strict=True)
            ]
            bias4 = None if bias is None else flatten(bias, (heads, length, keys))
            out, _ = self._call(spec, *flat, bias4, False)
            out = out.reshape(batch + tuple(out.shape[1:]))
            return out[0] if spec.single_head else out

        primals = [jnp.asarray(np.asarray(a)) for a in (q, k, v)]
        bias = options.get("bias")
        if bias is not None:
            bias = jnp.asarray(exact_cast(np.asarray(bias), spec.q.dtype, "bias", self.peer))
        primals.append(bias)
        _, pullback = jax.vjp(forward, *primals)
        grads = pullback(jnp.asarray(np.asarray(grad_out)))
        return tuple(None if g is None else np.asarray(g) for g in grads)


def _attend(q, k, v, bias, mask, kv_lengths, scale, is_causal, window, return_lse):
    """jax.nn.dot_product_attention in the (B, H, L, D) layout.

    Run under ``jax.jit`` (:data:`_attend_jit`) except for float16: jit-compiled, jax 0.10
    fails for float16 on the CPU ("The precision 'F16_F16_F32' is not supported by
    dot_general on CPU") because the function's own fallback (a try/except around the
    einsum) only catches errors raised eagerly.
    """
    result = jax.nn.dot_product_attention(
        jnp.swapaxes(q, 1, 2),
        jnp.swapaxes(k, 1, 2),
        jnp.swapaxes(v, 1, 2),
        bias=bias,
        mask=mask,
        scale=scale,
        is_causal=is_causal,
        key_value_seq_lengths=kv_lengths,
        local_window_size=window,
        implementation="xla",
        return_residual=return_lse,
    )
    if return_lse:
        out, lse = result
        return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2)
    return jnp.swapaxes(result, 1, 2), None


#: The jit-compiled call (one compilation per shapes, dtype and options; static options).
_attend_jit = jax.jit(_attend, static_argnums=(6, 7, 8, 9))
