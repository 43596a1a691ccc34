"""The oracle on sigmoid attention: the planted bugs (tests/planted/sigmoid_impls.py) fail their
default cases with their diagnosis named, the correct implementation passes (gradients
included), and an implementation without the ``normalizer`` keyword is "unsupported"."""

from __future__ import annotations

import fnmatch

import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.run.validate import validate
from tests.planted.sigmoid_impls import SIGMOID_BROKEN, sigmoid_textbook

_BUILT: dict = {}

#: The default-tier cases (float32, small shapes); the slow tier takes every sigmoid case.
FAST = (
    "sigmoid-H*-f32",
    "sigmoid-log-s-*-f32",
    "sigmoid-causal-br-*-f32",
    "sigmoid-window-*-f32",
    "sigmoid-gqa-*-f32",
    "sigmoid-mask-empty-rows-*-f32",
    "sigmoid-dropout-*-f32",
)


def _fixtures(patterns):
    chosen = [
        case
        for case in catalogue.suite("default")
        if case.name.startswith("sigmoid")
        and any(fnmatch.fnmatchcase(case.name, p) for p in patterns)
    ]
    for case in chosen:
        if case.name not in _BUILT:
            _BUILT[case.name] = golden.build(case)
    return [_BUILT[case.name] for case in chosen]


def _caught(name, patterns):
    broken = SIGMOID_BROKEN[name]
    fixtures = _fixtures(patterns)
    report = validate(broken.impl, fixtures=fixtures, dtype=None, progress=False)
    failed = [r for r in report.results if r.verdict == "fail"]
    assert len(failed) >= 5, f"{name}: only {len(failed)} failures\n{report.summary()}"
    for result in failed:
        assert any(broken.diagnosis in d for d in result.diagnosis), (
            f"{name}: expected diagnosis {broken.diagnosis!r}\n{result.explain()}"
        )
    return failed


@pytest.mark.parametrize("name", sorted(SIGMOID_BROKEN))
def test_planted_sigmoid_bug_is_caught(name):
    _caught(name, FAST)


def test_correct_sigmoid_passes():
    report = validate(sigmoid_textbook, fixtures=_fixtures(FAST), dtype=None, progress=False)
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)


def test_without_the_keyword_is_unsupported():
    def impl(q, k, v, *, scale=None, bias=None, causal=False, align="top_left"):
        return sigmoid_textbook(q, k, v, scale=scale, bias=bias, causal=causal, align=align)

    report = validate(impl, fixtures=_fixtures(["sigmoid-H*-f32"]), dtype=None, progress=False)
    assert [r.verdict for r in report.results] == ["unsupported"], report.summary()
    assert "normalizer" in report.results[0].message


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SIGMOID_BROKEN))
def test_planted_sigmoid_bug_every_dtype(name):
    _caught(name, SIGMOID_BROKEN[name].cases)


@pytest.mark.slow
def test_correct_sigmoid_passes_the_short_cases_with_gradients():
    # S <= 32 (the 1k- and 4k-key rows' truths come from the referee: the xslow twin below)
    _sigmoid_textbook_passes(["sigmoid-*S[0-9]-*", "sigmoid-*S[0-9][0-9]-*"])


@pytest.mark.xslow
def test_correct_sigmoid_passes_every_case_with_gradients():
    _sigmoid_textbook_passes(["sigmoid*"])


def _sigmoid_textbook_passes(patterns):
    fixtures = _fixtures(patterns)
    assert fixtures
    report = validate(sigmoid_textbook, fixtures=fixtures, dtype=None, grads=True, progress=False)
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)
    assert any("dq" in r.checks for r in report.results)


def _torch_passes(patterns, grads):
    from tests.naive.sigmoid_torch import sigmoid_attention

    fixtures = _fixtures(patterns)
    report = validate(
        sigmoid_attention, fixtures=fixtures, dtype=None, framework="torch", grads=grads,
        progress=False,
    )  # fmt: skip
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)


@pytest.mark.peers("torch")
def test_torch_sigmoid_passes():
    """The torch implementation written from the description: no false alarm (--framework
    torch); every case, every dtype, with gradients: the slow twin below."""
    _torch_passes(["sigmoid-log-s-*-f32", "sigmoid-mask-empty-rows-*-f32"], grads=False)


@pytest.mark.slow
@pytest.mark.peers("torch")
def test_torch_sigmoid_passes_every_case_with_gradients():
    _torch_passes(["sigmoid*"], grads=True)
