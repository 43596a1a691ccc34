#!/usr/bin/env python
"""Fingerprint the bits of the compiled paths, to check a refactoring changes none of them.

Runs the Numba CPU kernels (query-block forward, key-split decode forward, backward, sigmoid)
and the fast exact engine (forward and vjp) on a fixed set of small option combinations and
records a SHA-256 of every output array's bytes. Run it before and after a change and compare::

    python tools/kernel_bits.py --write before.json
    # ... change the kernels ...
    python tools/kernel_bits.py --compare before.json

Exits 1 when any fingerprint differs (the differing cases are printed). ``NUMBA_NUM_THREADS``
may be varied between the two runs: the kernels are deterministic for any thread count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

import refattn


def _inputs(rng, b, h, kv, length, keys, dim, vdim, dtype):
    q = rng.standard_normal((b, h, length, dim)).astype(dtype)
    k = rng.standard_normal((b, kv, keys, dim)).astype(dtype)
    v = rng.standard_normal((b, kv, keys, vdim)).astype(dtype)
    return q, k, v


def _cases():
    """(name, shape tuple, dtype, options) of every fingerprinted combination."""
    small = (1, 2, 1, 70, 70, 8, 6)
    decode = (1, 4, 2, 1, 1100, 8, 6)
    rng = np.random.default_rng(1)
    bias = rng.standard_normal((1, 2, 70, 70))
    mask = rng.random((1, 2, 70, 70)) < 0.8
    drop = rng.random((1, 2, 70, 70)) < 0.9
    return [
        ("plain64", small, np.float64, {}),
        ("plain32", small, np.float32, {}),
        ("causal", small, np.float64, dict(causal=True)),
        ("window_br", small, np.float64, dict(window=(5, 3), align="bottom_right")),
        ("softcap", small, np.float64, dict(softcap=2.5, causal=True)),
        ("bias_mask", small, np.float64, dict(bias=bias, mask=mask)),
        ("alibi", small, np.float32, dict(alibi_slopes=np.array([0.5, 0.25]), causal=True)),
        ("dropout", small, np.float64, dict(dropout_mask=drop, dropout_p=0.1)),
        ("nan_rows", small, np.float64, dict(window=(0, 0), causal=True, empty_rows="nan")),
        ("decode64", decode, np.float64, {}),
        ("decode32_window", decode, np.float32, dict(window=(700, 0), align="bottom_right")),
        ("decode_softcap", decode, np.float64, dict(softcap=3.0)),
        ("sigmoid", small, np.float64, dict(normalizer="sigmoid", causal=True)),
    ]


def _digest(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def fingerprints(exact: bool = True) -> dict:
    """{case/path/output: digest} of every case (``exact``: the fast exact engine too)."""
    found = {}
    for name, shape, dtype, options in _cases():
        rng = np.random.default_rng(sum(name.encode()))
        q, k, v = _inputs(rng, *shape, dtype)
        sigmoid = options.get("normalizer") == "sigmoid"
        fwd = refattn.attention(q, k, v, backend="numba", return_lse=not sigmoid, **options)
        out = fwd[0] if not sigmoid else fwd
        found[f"{name}/numba/out"] = _digest(out)
        if not sigmoid:
            found[f"{name}/numba/lse"] = _digest(fwd[1])
        grad = rng.standard_normal(out.shape).astype(dtype)
        grads = refattn.attention_vjp(q, k, v, grad, backend="numba", **options)
        for field in ("dq", "dk", "dv", "dbias"):
            value = getattr(grads, field, None)
            if value is not None:
                found[f"{name}/numba/{field}"] = _digest(value)
        if exact and not sigmoid and shape[4] <= 70 and dtype == np.float64:
            out, lse = refattn.attention(q, k, v, precision="exact", return_lse=True, **options)
            found[f"{name}/exact/out"] = _digest(out)
            found[f"{name}/exact/lse"] = _digest(lse)
            if "dropout_mask" not in options:
                g = refattn.attention_vjp(q, k, v, grad, precision="exact", **options)
                for field in ("dq", "dk", "dv"):
                    found[f"{name}/exact/{field}"] = _digest(getattr(g, field))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="write the fingerprints to this JSON file")
    parser.add_argument("--compare", help="compare with the fingerprints in this JSON file")
    parser.add_argument("--no-exact", action="store_true", help="skip the fast exact engine")
    args = parser.parse_args(argv)
    found = fingerprints(exact=not args.no_exact)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            expected = json.load(f)
        differ = [key for key in expected if key in found and expected[key] != found[key]]
        missing = [key for key in expected if key not in found]
        for key in differ:
            print(f"DIFFERS {key}")
        for key in missing:
            print(f"MISSING {key}")
        print(f"{len(found)} fingerprints, {len(differ)} differ, {len(missing)} missing")
        return 1 if differ or missing else 0
    print(f"{len(found)} fingerprints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
