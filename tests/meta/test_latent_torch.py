"""The torch implementation of latent attention written from its description
(tests/naive/latent_torch.py) passes the latent cases with ``framework="torch"``; skipped
without torch."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate
from tests.meta.test_latent_cases import _fixtures

pytest.importorskip("torch")


@pytest.mark.slow
def test_torch_twin_passes_the_latent_cases():
    from tests.naive.latent_torch import attention

    fixtures = [f for f in _fixtures(("float32", "bfloat16")) if not f.case.grads]
    report = validate(
        attention, fixtures=fixtures, dtype=None, framework="torch", strict=True, progress=False
    )
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)


@pytest.mark.slow
def test_torch_twin_passes_every_default_latent_case():
    from tests.naive.latent_torch import attention

    fixtures = [f for f in _fixtures(("float64", "float32", "float16", "bfloat16"), big=True)]
    fixtures = [f for f in fixtures if not f.case.grads]
    report = validate(
        attention, fixtures=fixtures, dtype=None, framework="torch", strict=True, progress=False
    )
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)
