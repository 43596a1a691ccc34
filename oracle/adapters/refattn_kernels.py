"""refattn's own fast kernels as implementations under test.

``refattn-numba`` runs the deterministic Numba CPU kernels (:mod:`refattn.kernels.numba_cpu`):
float64 cases compute in float64, every other dtype in float32 (float32 accumulation); the
result is rounded once to the case dtype. ``refattn-cuda`` runs the numba.cuda kernels
(:mod:`refattn.kernels.cuda`) the same way; on a machine without a GPU it needs
``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) and is slow, so use it on the smoke
suite there. A GPU run of the oracle is one command::

    refattn-oracle validate --adapter refattn-cuda --suite default --dtype float32 --grads

Both support every option of :func:`refattn.attention` except ``return_weights`` and expose
``.vjp(q, k, v, grad_out, grad_lse=None, **options) -> (dq, dk, dv, dbias, dsinks)``.
sinks and kv_lengths are rewritten for the kernels as :func:`refattn.attention` does it
(``refattn.spec``: an explicit mask and one more key for the sink); float8 inputs compute
from their exact dequantised values and their results are rounded to bfloat16.

Examples
--------
>>> import numpy as np
>>> from oracle.adapters.refattn_kernels import RefattnNumba
>>> q = np.array([[1.0, 0.0]]); k = np.array([[1.0, 0.0], [0.0, 1.0]]); v = np.array([[1.0], [3.0]])
>>> RefattnNumba()(q, k, v, causal=True).tolist()
[[1.0]]
"""

from __future__ import annotations

import numpy as np

from oracle.adapters import OPTION_NAMES, Adapter
from oracle.adapters.refattn_numpy import output_dtype, round_to
from refattn import kernels
from refattn.broadcast import reduce_to
from refattn.spec import canonicalize, check_cotangent, fold, needs_fold, split_qv_grads

__all__ = ["RefattnNumba", "RefattnCuda"]


class _KernelAdapter(Adapter):
    fully_masked_rows = "as empty_rows asks"

    def _module(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _canonical(self, q, k, v, options):
        """As :meth:`Adapter._canonical`, but empty_rows="nan" is supported (not a peer)."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"{self.name}: unknown option(s) {unknown}; an adapter takes "
                f"{', '.join(OPTION_NAMES)}"
            )
        options = dict(options)
        return_lse = bool(options.pop("return_lse", False))
        # fp4 k, v may come with a q of the case dtype (block-scaled inputs are dequantised
        # exactly by canonicalize, as float8 ones are)
        dtypes = {
            np.asarray(a).dtype
            for a in (q, k, v)
            if not np.asarray(a).dtype.name.startswith("float4")
        }
        if len(dtypes) > 1:
            raise TypeError(
                f"{self.name}: q, k, v must share one dtype, got "
                f"{[np.asarray(a).dtype.name for a in (q, k, v)]}"
            )
        return canonicalize(q, k, v, **options), return_lse

    def __call__(self, q, k, v, **options):
        self._dtype = output_dtype(q)  # float8 q: results in bfloat16 (spec.q is float64)
        return super().__call__(q, k, v, **options)

    def _forward(self, spec, return_lse):
        work = fold(spec, alibi_into_bias=True) if needs_fold(spec) else spec
        out, lse = self._module().attention(work, return_lse=True)
        dtype = self._dtype
        return round_to(out, dtype), round_to(lse, dtype) if return_lse else None

    def vjp(self, q, k, v, grad_out, grad_lse=None, **options):
        """(dq, dk, dv, dbias, dsinks) in the input dtype (bfloat16 for float8 inputs); dbias
        has bias's own shape, dsinks (H,) (None without bias / sinks)."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"{self.name}: unknown option(s) {unknown}")
        options = dict(options)
        options.pop("return_lse", None)
        spec, _ = self._canonical(q, k, v, options)
        _, heads, _, length, _, _, vdim = spec.dims
        do = check_cotangent(spec, grad_out, "grad_out", (heads, length, vdim))
        dl = (
            None
            if grad_lse is None
            else check_cotangent(spec, grad_lse, "grad_lse", (heads, length))
        )
        work = fold(spec, alibi_into_bias=True) if needs_fold(spec) else spec
        dq, dk, dv, dbias = self._module().attention_vjp(work, do, dl)
        dsinks = None
        if spec.sinks is not None:  # the sink is the folded key's bias column (refattn.spec)
            keys = spec.k.shape[2]
            dsinks = np.asarray(dbias, np.float64)[..., -1].sum(axis=(0, 2))
            dk, dv, dbias = dk[..., :keys, :], dv[..., :keys, :], dbias[..., :-1]
        if spec.bias is None:
            dbias = None
        if dbias is not None and np.shape(dbias) != spec.bias_shape:
            dbias = reduce_to(
                np.asarray(dbias, np.float64).reshape(spec.batch_shape + dbias.shape[1:]),
                spec.bias_shape,
            )
        dtype = output_dtype(q)
        dq, dk, dv, dqv = split_qv_grads(spec, dq, dk, dv)  # qv: dqv sixth (refattn._qv)
        grads = (
            round_to(spec.unflatten(dq), dtype),
            round_to(spec.unflatten(dk), dtype),
            round_to(spec.unflatten(dv), dtype),
            round_to(dbias, dtype),
            round_to(dsinks, dtype),
        )
        return grads if dqv is None else grads + (round_to(spec.unflatten(dqv), dtype),)


class RefattnNumba(_KernelAdapter):
    """refattn.kernels (Numba CPU), rounded once to the case dtype."""

    name = "refattn-numba"
    peer = "refattn Numba CPU kernels"

    def _module(self):
        return kernels


class RefattnCuda(_KernelAdapter):
    """refattn.kernels.cuda (numba.cuda; the simulator when NUMBA_ENABLE_CUDASIM=1)."""

    name = "refattn-cuda"
    peer = "refattn numba.cuda kernels"

    def __init__(self):
        # numba.cuda (cuda extra, ~115 more modules) reads NUMBA_ENABLE_CUDASIM at import: only here
        from refattn.kernels import cuda

        if not cuda.available():
            raise ImportError(
                "no CUDA device (numba.cuda.is_available() is False); set "
                "NUMBA_ENABLE_CUDASIM=1 before numba is imported to use the "
                "simulator"
            )

    def _module(self):
        # numba.cuda (cuda extra, ~115 more modules) reads NUMBA_ENABLE_CUDASIM at import: only here
        from refattn.kernels import cuda

        return cuda
