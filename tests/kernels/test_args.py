"""The kernels' argument layout (refattn.kernels._args, refattn.exact.fast._params): every slot
constant is its name's position in the one tuple of names, and the vectors follow it."""

from __future__ import annotations

import numpy as np

from refattn.exact.fast import _params
from refattn.exact.fast.allowed_set import AllowedRule
from refattn.kernels import _args
from refattn.spec import canonicalize

LAYOUTS = [
    (_args, "DIM_", _args.DIMS),
    (_args, "OPT_", _args.OPTS),
    (_args, "FOPT_", _args.FOPTS),
    (_args, "TERM_", _args.TERMS),
    (_params, "P_", _params.PRM),
    (_params, "VO_", _params.VJP_OPTS),
    (_params, "VF_", _params.VJP_FOPTS),
    (_params, "R_", _params.RULE),
]


def test_slot_constants_follow_their_tuple():
    for module, prefix, names in LAYOUTS:
        for slot, name in enumerate(names):
            assert getattr(module, prefix + name.upper()) == slot, (prefix, name)
    assert AllowedRule._fields == _params.RULE


def test_vectors_are_laid_out_by_name():
    q, k, v = np.zeros((2, 4, 3, 5)), np.zeros((2, 2, 7, 5)), np.zeros((2, 2, 7, 6))
    keep = np.ones((2, 4, 3, 7), bool)
    spec = canonicalize(
        q, k, v, causal=True, softcap=2.0, window=(3, 1), dropout_mask=keep, dropout_p=0.5
    )
    _, _, _, _, dims, opts, fopts, terms = _args.kernel_arguments(spec, np.float64)
    assert dims.tolist() == list(spec.dims) == [2, 4, 2, 3, 7, 5, 6]
    assert dims[_args.DIM_KV_HEADS] == 2 and dims[_args.DIM_LENGTH] == 3
    assert opts[_args.OPT_CAUSAL] == 1 and opts[_args.OPT_HAS_SOFTCAP] == 1
    assert (opts[_args.OPT_LEFT], opts[_args.OPT_RIGHT]) == (3, 1)
    assert fopts[_args.FOPT_SOFTCAP] == 2.0 and fopts[_args.FOPT_KEEP_SCALE] == 2.0
    assert len(opts) == len(_args.OPTS) and len(terms) == len(_args.TERMS)
