"""Transformer pieces from the lecture notes: multi-head attention, layer norm, sinusoidal
positions, feed-forward, encoder and decoder blocks (float64 and exact paths).

Sources (``../shared/seeds``; the notes carry no equation numbers, so sections are cited):

* [L17] lecture 17 notes (003): "Multihead attention", "Masked Multi-head attention",
  "Other layers" (layer normalization, positional embedding).
* [AMT] "Attention Mechanisms and the Transformer" (004): "Self-Attention" (the multi-head
  display ``q_i^r = W_q^r x_i, ..., y_i = W_y concat[y_i^1, y_i^2, ...]``) and "Transformers"
  (the Transformer block, Figure 2).

Shape letters as in :mod:`refattn`, plus M (model width, the last axis of ``x``), N (width of
the key/value source ``x_kv`` or ``memory``), P (output width of ``W_O``), F (hidden width of
the feed-forward layer).

Conventions pinned here (see also :func:`multihead_attention`):

* Row vectors: ``x`` is (..., L, M) and a projection is ``x @ W + b`` with ``W`` (M, P). The
  notes' column form ``q = W_q x`` is ``W = W_q^T`` here (torch's ``nn.Linear`` stores the
  same ``W_q`` as ``weight`` and computes ``x @ weight.T``).
* Head split: head h of a projection is its columns ``h*D:(h+1)*D`` (torch
  ``nn.MultiheadAttention``, the notes' "concat"): heads are contiguous column blocks.
* Exact path: every output element is the exact real value of the *whole* composition
  (projections, attention, residuals, norms, feed-forward) rounded once to ``out_dtype``.
  It requires finite inputs and parameters and is meant for small shapes (Python loops over
  intervals; measured on this 2-core machine: an encoder block with L=8, M=16, H=4, F=32
  takes about 0.07 s, with L=16, M=32, F=64 about 0.5 s).
* Readings of the notes: [AMT] writes ``y_i^r = sum_j W_ij^r v_j`` (no head index on v) and
  scales by ``1/sqrt(d)``; [L17] by ``1/sqrt(d_k)``. Here each head uses its own values
  ``v_j^r`` and the default scale is ``1/sqrt(D)`` with D the per-head key width.
  [L17]'s masked form ``softmax((Q^T K + M)/sqrt(d_k))`` (M of 0/-inf) equals removing the
  masked keys, which is what ``mask``/``causal`` do. [L17]'s layer norm has a gain g and no
  shift or eps; ``beta`` and ``eps`` (inside the square root, torch's placement) are
  additions, ``eps=0`` and no ``beta`` give the notes' formula. [AMT]'s block states
  "self-attention + residual, LayerNorm, MLPs, LayerNorm"; the MLP's residual is Vaswani's.
* float64 error: :func:`refattn.bounds.transformer_forward_bound` gives an a-priori
  (first-order) bound on the float64 path's error for every function here, by running error
  analysis along the same composition (:func:`composition`).

Modules (one job each): ``_params`` (the parameter dataclasses and the validation of every
argument), ``_ops`` (the float64 operations and their vector-Jacobian products, and the chains
written once over any operations), ``_forward`` (the forward functions and their
:class:`Composition`), ``_vjp`` (the ``*_vjp`` functions). This package re-exports them.
"""

from ._forward import (
    Composition,
    composition,
    decoder_block,
    encoder_block,
    feed_forward,
    layer_norm,
    multihead_attention,
    sinusoidal_positions,
)
from ._ops import Float64Ops, Float64VJPOps
from ._ops import moment_exponent as moment_exponent
from ._ops import scaled_moments as scaled_moments
from ._params import ACTIVATIONS as ACTIVATIONS
from ._params import ATTENTION_KEYWORDS as ATTENTION_KEYWORDS
from ._params import LAYOUTS as LAYOUTS
from ._params import NORMS as NORMS
from ._params import (
    AttentionParams,
    DecoderParams,
    EncoderParams,
    FeedForwardParams,
    NormParams,
)
from ._vjp import (
    DecoderGrads,
    EncoderGrads,
    FeedForwardGrads,
    LayerNormGrads,
    MultiheadAttentionGrads,
    decoder_block_vjp,
    encoder_block_vjp,
    feed_forward_vjp,
    layer_norm_vjp,
    multihead_attention_vjp,
)

__all__ = [
    "AttentionParams",
    "FeedForwardParams",
    "NormParams",
    "EncoderParams",
    "DecoderParams",
    "multihead_attention",
    "layer_norm",
    "sinusoidal_positions",
    "feed_forward",
    "encoder_block",
    "decoder_block",
    "Composition",
    "composition",
    "Float64Ops",
    "Float64VJPOps",
    "LayerNormGrads",
    "FeedForwardGrads",
    "MultiheadAttentionGrads",
    "EncoderGrads",
    "DecoderGrads",
    "layer_norm_vjp",
    "feed_forward_vjp",
    "multihead_attention_vjp",
    "encoder_block_vjp",
    "decoder_block_vjp",
]
