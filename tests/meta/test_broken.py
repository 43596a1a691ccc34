"""Detection: every deliberately broken implementation fails its cases, with the right
diagnosis; correct implementations raise no false alarm."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle import catalogue
from oracle.catalogue import Case, Shapes
from oracle.catalogue.names import DTYPE_TAGS
from oracle.fixtures import golden
from oracle.fixtures.golden import Fixture
from oracle.run.validate import validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.planted.broken_impls import BROKEN, textbook  # noqa: E402

#: keys beyond which a default case is a long row, left to the power tests (their diagnoses
#: and exact truths cost minutes, not seconds)
LONG_ROWS = 4096

_BUILT: dict = {}  # case name -> Fixture: each exact truth is built once per session


def _build(patterns=None, kernel_scale=True):
    chosen = [
        case
        for case in catalogue.suite("default")
        if case.function == "attention"
        and (kernel_scale or not case.name.startswith("k-"))
        and case.shapes.S <= LONG_ROWS  # the 2k-128k-key rows: oracle.power's (slow) tests
    ]
    if patterns is not None:
        chosen = [
            case for case in chosen if any(fnmatch.fnmatchcase(case.name, p) for p in patterns)
        ]
    for case in chosen:
        if case.name not in _BUILT:
            _BUILT[case.name] = golden.build(case)
    return [_BUILT[case.name] for case in chosen]


@pytest.fixture(scope="module")
def default_fixtures():
    """The default-suite cases the broken implementations and gradient tests need."""
    patterns = [p for broken in BROKEN.values() for p in broken.cases]
    patterns += ["grad-*", "basic-*", "mask-*", "poison-*"]
    return _build(patterns)


@pytest.fixture(scope="module")
def positive_long_fixture():
    """Values around 1 over 2048 keys: a float16 running sum stagnates (ulp(1) = 2**-10 is
    twice a term's size), which a float32 accumulator does not. The catalogue's Gaussian values
    cancel and hide this bug, hence this extra case."""
    from refattn.attention import attention

    rng = np.random.default_rng(4096)
    L, S, D, E = 2, 2048, 4, 4
    q = rng.standard_normal((1, 1, L, D)).astype(np.float16)
    k = rng.standard_normal((1, 1, S, D)).astype(np.float16)
    v = (1 + 0.25 * rng.standard_normal((1, 1, S, E))).astype(np.float16)
    out, lse = attention(q, k, v, precision="exact", return_lse=True)
    case = Case(
        "positive-long-H1K1-L2S2048-D4E4-f16",
        ("tests",),
        "conformance",
        "float16",
        Shapes(batch=1, H=1, K=1, L=L, S=S, D=D, E=E),
        description="values around 1, long rows",
    )
    return Fixture(case, {"q": q, "k": k, "v": v}, {}, {"out_f64": out, "lse_f64": lse})


def _relevant(fixtures, patterns):
    return [f for f in fixtures if any(fnmatch.fnmatchcase(f.case.name, p) for p in patterns)]


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_implementation_is_caught(name, default_fixtures, positive_long_fixture):
    broken = BROKEN[name]
    chosen = _relevant([*default_fixtures, positive_long_fixture], broken.cases)
    assert chosen, f"{name}: no case matches {broken.cases}"
    report = validate(broken.impl, fixtures=chosen, dtype=None, progress=False)
    assert not report.passed, f"{name}: passed {[r.name for r in report.results]}"
    for result in report.results:
        assert result.verdict == "fail", f"{name}: {result.explain()}"
        assert result.worst is not None and result.worst.error > result.worst.threshold, (
            result.explain()
        )
        if broken.diagnosis is not None:
            assert any(broken.diagnosis in d for d in result.diagnosis), (
                f"{name}: expected diagnosis {broken.diagnosis!r}\n{result.explain()}"
            )


@pytest.mark.parametrize("impl_name", ["textbook", "refattn-float64"])
def test_no_false_alarm(impl_name, default_fixtures):
    """The oracle's own baseline and refattn's float64 path pass (robustness included: both
    remove excluded positions from every sum)."""
    impl = textbook if impl_name == "textbook" else "refattn-float64"
    report = validate(impl, fixtures=default_fixtures, dtype=None, strict=True, progress=False)
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)


#: the dtype of the default-tier sweep (every dtype and the kernel-scale cases: xslow)
SWEEP_DTYPE = "float32"


@pytest.mark.slow
@pytest.mark.parametrize("impl_name", ["textbook", "refattn-float64"])
def test_no_false_alarm_on_default(impl_name):
    """The same on every case of the default suite in one dtype but the kernel-scale ones
    (every dtype and the kernel-scale cases: the xslow twin below)."""
    _no_false_alarm_on(impl_name, _build([f"*-{DTYPE_TAGS[SWEEP_DTYPE]}"], kernel_scale=False))


@pytest.mark.xslow
@pytest.mark.parametrize("impl_name", ["textbook", "refattn-float64"])
def test_no_false_alarm_on_every_default_case(impl_name):
    """Every case of default, every dtype, the kernel-scale cases (L, S up to 300) included."""
    _no_false_alarm_on(impl_name, _build())


def _no_false_alarm_on(impl_name, fixtures):
    impl = textbook if impl_name == "textbook" else "refattn-float64"
    report = validate(impl, fixtures=fixtures, dtype=None, strict=True, progress=False)
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert report.passed and not failed, "\n".join(failed)


def test_no_false_alarm_with_gradients(default_fixtures):
    from refattn.attention import attention, attention_vjp

    def impl(q, k, v, **options):
        return attention(q, k, v, **options)

    impl.vjp = attention_vjp
    grads = [f for f in default_fixtures if f.case.grads]
    report = validate(impl, fixtures=grads, dtype=None, grads=True, progress=False)
    failed = [r.explain() for r in report.results if r.verdict != "pass"]
    assert not failed, "\n".join(failed)
    checked = {q for r in report.results for q in r.checks}
    assert {"dq", "dk", "dv", "dbias"} <= checked, checked


def test_broken_gradient_is_caught(default_fixtures):
    from refattn.attention import attention, attention_vjp

    def impl(q, k, v, **options):
        return attention(q, k, v, **options)

    def vjp(q, k, v, grad_out, **options):
        grads = attention_vjp(q, k, v, grad_out, **options)
        return grads._replace(dv=grads.dv * (1 + 2 * np.finfo(np.float32).eps))

    impl.vjp = vjp
    chosen = [f for f in default_fixtures if f.case.grads and f.case.dtype == "float64"]
    report = validate(impl, fixtures=chosen, dtype=None, grads=True, progress=False)
    assert all(r.verdict == "fail" for r in report.results), report.summary()
    assert all(not r.checks["dv"].passed for r in report.results), report.summary()
