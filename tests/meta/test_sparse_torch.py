"""The torch implementation of sparse key selection written from the description
(tests/naive/sparse_torch.py) passes the sparse cases with ``framework="torch"``, in refattn's
bhld layout and in the DSA calling convention (``layout="dsa"``: indices (B, L, K, T))."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate

pytestmark = pytest.mark.peers("torch")

SMALL = ["sparse-sentinels-*", "sparse-empty-rows-*", "sparse-duplicates-*"]
EVERY = ["sparse-*", "grad-sparse-*", "fp8-*-sparse-*"]


def _check(cases, layout, dtype, grads=False):
    impl = (
        "tests.naive.sparse_torch:torch_sparse_attention"
        if layout == "bhld"
        else "tests.naive.sparse_torch:dsa_sparse_attention"
    )
    report = validate(
        impl,
        suite="default",
        dtype=dtype,
        cases=cases,
        framework="torch",
        layout=layout,
        grads=grads,
        progress=False,
        isolate=False,
    )
    verdicts = {r.name: r.verdict for r in report.results}
    assert report.passed, [r.explain() for r in report.failures]
    assert verdicts and all(v == "pass" for v in verdicts.values()), verdicts


def test_dsa_convention_passes_a_small_case():
    _check(["sparse-empty-rows-*"], "dsa", "float32")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bhld", "dsa"])
def test_torch_sparse_passes_small_cases(layout):
    _check(SMALL, layout, "float32")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_torch_sparse_passes_every_sparse_case(dtype):
    _check(EVERY, "bhld", dtype, grads=True)


@pytest.mark.slow
def test_dsa_layout_passes_every_sparse_case():
    _check(EVERY, "dsa", "bfloat16")
