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
