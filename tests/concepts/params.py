"""Seeded parameter builders of the transformer tests (test-only: moved out of
refattn.transformer, whose users build their own :class:`refattn.transformer.EncoderParams`).

Weights are N(0, 1/fan_in), biases and layer-norm shifts N(0, 0.1^2), gains 1 + N(0, 0.1^2);
values are drawn in float64 and cast to ``dtype`` (the cast values are then the exact inputs of
the exact path). Every builder is deterministic in ``seed``.
"""

from __future__ import annotations

import numpy as np

from refattn.transformer import (
    AttentionParams,
    DecoderParams,
    EncoderParams,
    FeedForwardParams,
    NormParams,
)


def _normal(rng, shape, std, dtype):
    return (rng.standard_normal(shape) * std).astype(dtype)


def random_attention_params(
    model_dim,
    num_heads,
    *,
    seed,
    num_kv_heads=None,
    head_dim=None,
    kv_dim=None,
    out_dim=None,
    bias=True,
    dtype="float64",
):
    """Random :class:`AttentionParams`: weights N(0, 1/fan_in), biases N(0, 0.1^2).

    ``head_dim`` D = E defaults to ``model_dim // num_heads``; ``kv_dim`` N and ``out_dim`` P
    default to ``model_dim``. Values are drawn in float64 and cast to ``dtype`` (the cast
    values are then the exact inputs of the exact path).
    """
    rng = np.random.default_rng(seed)
    kv_heads = num_kv_heads or num_heads
    dim = head_dim or max(1, model_dim // num_heads)
    kv_dim = kv_dim or model_dim
    out_dim = out_dim or model_dim

    def b(n):
        return _normal(rng, (n,), 0.1, dtype) if bias else None

    return AttentionParams(
        W_Q=_normal(rng, (model_dim, num_heads * dim), model_dim**-0.5, dtype),
        W_K=_normal(rng, (kv_dim, kv_heads * dim), kv_dim**-0.5, dtype),
        W_V=_normal(rng, (kv_dim, kv_heads * dim), kv_dim**-0.5, dtype),
        W_O=_normal(rng, (num_heads * dim, out_dim), (num_heads * dim) ** -0.5, dtype),
        b_Q=b(num_heads * dim),
        b_K=b(kv_heads * dim),
        b_V=b(kv_heads * dim),
        b_O=b(out_dim),
        num_heads=num_heads,
        num_kv_heads=kv_heads,
    )


def _random_ffn(rng, model_dim, ffn_dim, activation, dtype):
    return FeedForwardParams(
        W1=_normal(rng, (model_dim, ffn_dim), model_dim**-0.5, dtype),
        b1=_normal(rng, (ffn_dim,), 0.1, dtype),
        W2=_normal(rng, (ffn_dim, model_dim), ffn_dim**-0.5, dtype),
        b2=_normal(rng, (model_dim,), 0.1, dtype),
        activation=activation,
    )


def _random_norm(rng, model_dim, dtype):
    return NormParams(
        gamma=(1 + _normal(rng, (model_dim,), 0.1, "float64")).astype(dtype),
        beta=_normal(rng, (model_dim,), 0.1, dtype),
    )


def random_encoder_params(
    model_dim, num_heads, ffn_dim, *, seed, num_kv_heads=None, activation="relu", dtype="float64"
):
    """Random :class:`EncoderParams` (see :func:`random_attention_params`); gamma ~ 1 +
    N(0, 0.1^2), beta ~ N(0, 0.1^2), eps = 1e-5. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**32, size=2)
    return EncoderParams(
        attn=random_attention_params(
            model_dim, num_heads, seed=int(seeds[0]), num_kv_heads=num_kv_heads, dtype=dtype
        ),
        ffn=_random_ffn(rng, model_dim, ffn_dim, activation, dtype),
        norm1=_random_norm(rng, model_dim, dtype),
        norm2=_random_norm(rng, model_dim, dtype),
    )


def random_decoder_params(
    model_dim,
    num_heads,
    ffn_dim,
    *,
    seed,
    memory_dim=None,
    num_kv_heads=None,
    activation="relu",
    dtype="float64",
):
    """Random :class:`DecoderParams`; ``memory_dim`` N (default ``model_dim``)."""
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**32, size=2)
    return DecoderParams(
        self_attn=random_attention_params(
            model_dim, num_heads, seed=int(seeds[0]), num_kv_heads=num_kv_heads, dtype=dtype
        ),
        cross_attn=random_attention_params(
            model_dim,
            num_heads,
            seed=int(seeds[1]),
            num_kv_heads=num_kv_heads,
            kv_dim=memory_dim or model_dim,
            dtype=dtype,
        ),
        ffn=_random_ffn(rng, model_dim, ffn_dim, activation, dtype),
        norm1=_random_norm(rng, model_dim, dtype),
        norm2=_random_norm(rng, model_dim, dtype),
        norm3=_random_norm(rng, model_dim, dtype),
    )
