"""refattn's own implementations validated on the catalogue's cases of sinks, per-row key
lengths and float8 inputs (the oracle's judge, thresholds of oracle.judging.tolerance): they must
pass
every one, gradients (dsinks included) too."""

from __future__ import annotations

import pytest

from oracle.run.validate import validate

_PATTERNS = ["sinks*", "kv-lengths*", "grad-sinks*", "grad-kv*", "fp8*", "poison-nan-kv*"]
#: one case per option family and kind, for the default tier of the Numba kernels
_NUMBA_QUICK = [
    "sinks-empty-rows-*-f32",
    "kv-lengths-zero-*-f32",
    "sinks-kv-decode-B*-f32",
    "grad-sinks-kv-gqa-*-f32",
    "fp8-e4m3-H*-bf16",
]


def _check(adapter, patterns):
    __tracebackhide__ = True
    report = validate(
        adapter,
        suite="default",
        dtype=None,
        grads=True,
        strict=True,
        progress=False,
        isolate=False,
        cases=patterns,
    )
    bad = [f"{r.name}: {r.verdict} ({r.message})" for r in report.results if r.verdict != "pass"]
    assert not bad, f"{adapter} on the new option cases:\n" + "\n".join(bad)
    return report


def test_float64_path_passes_every_option_case():
    report = _check("refattn-float64", _PATTERNS)
    assert len(report.results) >= 60
    checked = {name for r in report.results for name in r.checks}
    assert {"out", "lse", "dq", "dk", "dv", "dsinks"} <= checked
    features = {f for r in report.results for f in r.features}
    assert {"sinks", "kv-lengths", "fp8"} <= features


def test_numba_kernels_pass_option_cases():
    report = _check("refattn-numba", _NUMBA_QUICK)
    assert len(report.results) == len(_NUMBA_QUICK)


@pytest.mark.slow
def test_numba_kernels_pass_every_option_case():
    _check("refattn-numba", _PATTERNS)


def _padding_mask_reading(q, k, v, kv_lengths=None, mask=None, **options):
    """kv_lengths as a key-padding mask: causal aligned to the padded S (a real peer reading)."""
    import numpy as np

    from refattn.attention import attention

    keys = np.shape(k)[-2]
    padding = (np.arange(keys)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, None, :]
    return attention(q, k, v, mask=padding if mask is None else mask & padding, **options)


def _sinks_ignored(q, k, v, sinks=None, **options):
    from refattn.attention import attention

    return attention(q, k, v, **options)


@pytest.mark.parametrize(
    ("impl", "name", "label"),
    [
        (
            _padding_mask_reading,
            "kv-lengths-causal-br-B3H2K2-L8S24-D16E16-f32",
            "kv_lengths as a key-padding mask",
        ),
        (_sinks_ignored, "sinks-causal-br-H2K2-L12S32-D16E16-f32", "sinks ignored"),
        (_sinks_ignored, "sinks-kv-decode-B3H8K2-L1S64-D32E32-bf16", "sinks ignored"),
    ],
)
def test_other_readings_fail_and_are_diagnosed(impl, name, label):
    from oracle import catalogue
    from oracle.fixtures import golden
    from oracle.judging.judge import check_fixture

    result = check_fixture(impl, golden.build(catalogue.get(name)))
    assert result.verdict == "fail", f"{name}: {result.verdict} ({result.message})"
    assert any(label in d for d in result.diagnosis), f"{name}: diagnosis {result.diagnosis}"


def test_vjp_without_dsinks_is_unsupported():
    """A gradient case with sinks whose vjp returns no dsinks is never a pass."""
    from oracle import catalogue
    from oracle.fixtures import golden
    from oracle.judging.judge import check_fixture
    from refattn.attention import attention, attention_vjp

    def impl(q, k, v, **options):
        return attention(q, k, v, **options)

    impl.vjp = lambda q, k, v, grad_out, **options: tuple(
        attention_vjp(q, k, v, grad_out, **options)
    )[:4]
    fixture = golden.build(catalogue.get("grad-sinks-H2K2-L8S12-D16E16-f64"))
    result = check_fixture(impl, fixture, grads=True)
    assert result.verdict == "unsupported" and "dsinks" in result.message, result.message
