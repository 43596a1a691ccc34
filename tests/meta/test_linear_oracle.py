"""The linear-attention oracle: suites, judging, planted bugs and their diagnoses, presets.

Thresholds come from oracle/judging/linear.py (the tolerance rule); no literal tolerances.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import refattn
from oracle import catalogue
from oracle.catalogue.linear_families import SUITES, TRUTH_BOUNDED
from oracle.fixtures import golden
from oracle.judging.judge import check_fixture
from oracle.power.linear import KERNELS
from oracle.power.linear_planted import LINEAR_BROKEN, LINEAR_CORRECT
from oracle.reading.linear_chunked import DEVIATIONS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "linear.md"


@pytest.fixture(scope="module")
def default_cases():
    return catalogue.suite("linear-default")


def _fixture(name):
    return golden.build(catalogue.get(name))


def test_suites_nest_and_cover_the_brief(default_cases):
    smoke = {c.name for c in catalogue.suite("linear-smoke")}
    names = [c.name for c in default_cases]
    assert len(set(names)) == len(names) and smoke < set(names)
    assert {c.dtype for c in default_cases} == {"float64", "float32", "float16", "bfloat16"}
    lengths = {c.shapes.L for c in default_cases}
    assert {1, 63, 65, 127, 129, 65536} <= lengths
    forms = {c.recipe["form"] for c in default_cases}
    assert forms == {"gdn", "kda", "gla", "sgla"}
    packed = [c.recipe["cu"] for c in default_cases if "cu" in c.recipe]
    assert any(0 in np.diff(cu) and 1 in np.diff(cu) for cu in packed)
    decode = [c for c in default_cases if c.shapes.L == 1]
    assert decode and all(c.recipe.get("h0") for c in decode)
    assert any(c.shapes.H > c.shapes.K for c in default_cases)  # GVA
    assert any(c.grads for c in default_cases)
    assert any(c.recipe.get("gates") == "deep" for c in default_cases)
    assert any(c.recipe.get("beta") == "edges" for c in default_cases)
    assert {c.options.get("qk_l2norm", False) for c in default_cases} == {True, False}
    assert all(c.name.startswith("lin-") for c in default_cases)
    assert SUITES == ("linear-smoke", "linear-default")


def test_inputs_follow_the_recipes():
    inputs = catalogue.make_inputs(catalogue.get("lin-gdn-beta01-H2K2-T65-D8E8-f32"))
    assert set(np.unique(inputs["beta"])) <= {0.0, 1.0}
    deep = catalogue.make_inputs(catalogue.get("lin-kda-deep-H2K2-T65-D8E8-f64"))
    assert deep["g"].min() >= -20 and deep["g"].max() <= -2
    assert deep["g"].shape == (1, 2, 65, 8)


def test_refattn_passes_the_smoke_suite():
    report = __import__("oracle").validate(
        refattn.linear_attention, suite="linear-smoke", dtype=None, progress=False
    )
    assert report.passed and {r.verdict for r in report.results} == {"pass"}


def test_gradient_case_judges_every_gradient():
    fixture = _fixture("lin-gdn-grad-H2K1-T12-D4E4-f32")
    result = check_fixture(refattn.linear_attention, fixture, grads=True)
    assert result.verdict == "pass", result.message
    assert set(result.checks) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"}


def test_fixture_round_trip_and_verify(tmp_path):
    names = ["lin-gdn-varlen-H2K2-T70-D8E8-bf16", "lin-sgla-grad-H2K2-T10-D4E4-f16"]
    golden.generate(
        "linear-default", tmp_path, cases=[catalogue.get(n) for n in names], progress=False
    )
    assert golden.verify(tmp_path) == []
    loaded = {f.name: f for f in golden.load(tmp_path)}
    assert loaded[names[0]].inputs["cu_seqlens"].dtype == np.int64
    assert check_fixture(refattn.linear_attention, loaded[names[0]]).verdict == "pass"


@pytest.mark.slow
def test_long_row_is_compact_with_a_bounded_truth(tmp_path):
    case = catalogue.get("lin-sgla-long-H1K1-T65536-D4E4-bf16")
    golden.generate("linear-default", tmp_path, cases=[case], progress=False)
    size = sum(p.stat().st_size for p in tmp_path.glob("*.npz"))
    assert size < 2**20  # inputs regenerated on load, o stored at sampled steps
    fixture = next(iter(golden.load(tmp_path)))
    assert fixture.truth_kind == TRUTH_BOUNDED and "bound_o" in fixture.truth
    assert check_fixture(refattn.linear_attention, fixture).verdict == "pass"


@pytest.mark.parametrize("kernel", sorted(LINEAR_CORRECT))
def test_correct_kernels_pass(kernel):
    for name in ("lin-kda-chunk65-H2K2-T65-D8E8-bf16", "lin-gdn-varlen-H2K2-T70-D8E8-f32"):
        assert check_fixture(LINEAR_CORRECT[kernel], _fixture(name)).verdict == "pass"


#: a case that shows each planted bug, in float64 (every deviation is visible there)
SHOWS = {
    "decay_off_by_one": "lin-gdn-chunk65-H2K2-T65-D8E8-f64",
    "cumsum_bf16": "lin-kda-chunk65-H2K2-T65-D8E8-f64",
    "l2norm_eps_outside": "lin-gdn-tinynorm-H2K2-T20-D8E8-f64",
    "l2norm_no_eps": "lin-gdn-tinynorm-H2K2-T20-D8E8-f64",
    "solve_bf16": "lin-gdn-chunk65-H2K2-T65-D8E8-f64",
    "no_reset": "lin-gdn-varlen-H2K2-T70-D8E8-f64",
    "beta_twice": "lin-gdn-basic-H2K2-T16-D8E8-f64",
    "exp_for_exp2": "lin-sgla-exp2-H2K2-T65-D8E8-f64",
    "state_transposed": "lin-gla-basic-H2K2-T16-D8E8-f64",
    "final_early": "lin-gdn-decode-B2H2K2-T1-D8E8-f64",
}


def test_every_deviation_is_planted():
    assert set(SHOWS) == set(DEVIATIONS) == set(LINEAR_BROKEN)
    assert set(KERNELS) == set(LINEAR_CORRECT) | set(LINEAR_BROKEN)


@pytest.mark.parametrize("bug", sorted(SHOWS))
def test_planted_bug_fails_and_is_named(bug):
    result = check_fixture(LINEAR_BROKEN[bug][0], _fixture(SHOWS[bug]))
    assert result.verdict == "fail"
    assert any(note.startswith(bug + ":") for note in result.diagnosis), result.diagnosis


@pytest.mark.xslow
def test_power_catches_every_bug_on_the_default_suite():
    from oracle.power import power, render

    result = power(suite="linear-default", progress=False)
    text = render(result)
    assert "CONTROL FAILS" not in text and "WEAK" not in text, text


# --- presets: flash-linear-attention's convention and transformers' qwen3_next ---------------


def _fla_modules():
    """flash-linear-attention's module names bound to loops written from its documented
    semantics (tests/planted/linear_fla_like.py), where FLA itself is not installed."""
    from tests.planted import linear_fla_like as fla

    table = {
        "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": "gated_delta_rule"},
        "fla.ops.kda": {"chunk_kda": "kda"},
        "fla.ops.gla": {"chunk_gla": "gla"},
        "fla.ops.simple_gla": {"chunk_simple_gla": "simple_gla"},
    }
    modules = {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops")}
    for name, functions in table.items():
        module = types.ModuleType(name)
        for public, form in functions.items():
            setattr(module, public, getattr(fla, f"fused_recurrent_{form}"))
        modules[name] = module
    return modules


def _blocks():
    """The python blocks of docs/linear.md's oracle section."""
    section = DOCS.read_text().split("## Validating a linear-attention kernel")[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _block_params():
    """The block indices; a block calling transformers needs it (deselected when absent)."""
    return [
        pytest.param(
            index, marks=[pytest.mark.peers("transformers")] if "transformers" in b else []
        )
        for index, b in enumerate(_blocks())
    ]


@pytest.mark.slow
@pytest.mark.peers("torch")
@pytest.mark.parametrize("index", _block_params())
def test_docs_validation_examples_run(index, monkeypatch):
    block = _blocks()[index]
    try:
        import fla  # noqa: F401
    except ImportError:
        for name, module in _fla_modules().items():
            monkeypatch.setitem(sys.modules, name, module)
    exec(compile(block, f"docs/linear.md oracle block {index}", "exec"), {})


def test_docs_have_one_example_per_preset():
    from oracle.conventions.linear_presets import PRESETS

    text = "\n".join(_blocks())
    assert len(_blocks()) == 6
    assert all(f'"{name}"' in text for name in PRESETS)


@pytest.mark.slow
@pytest.mark.peers("torch")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "function, preset",
    [
        ("fused_recurrent_gated_delta_rule", "fla_gated_delta_rule"),
        ("fused_recurrent_kda", "fla_kda"),
        ("fused_recurrent_gla", "fla_gla"),
        ("fused_recurrent_simple_gla", "fla_simple_gla"),
    ],
)
def test_fla_semantics_loop_passes_with_its_preset(function, preset, dtype):
    from oracle.run.validate import validate
    from tests.planted import linear_fla_like

    impl = getattr(linear_fla_like, function)
    form = {"fla_gated_delta_rule": "gdn", "fla_kda": "kda"}.get(preset, preset[4:])
    form = {"simple_gla": "sgla"}.get(form, form)
    report = validate(
        impl,
        suite="linear-default",
        signature=preset,
        dtype=dtype,
        cases=[f"lin-{form}-*-T1-*", f"lin-{form}-*-T6[35]-*", f"lin-{form}-*-T70-*"],
        progress=False,
    )
    verdicts = {r.verdict for r in report.results}
    assert report.passed and "pass" in verdicts and verdicts <= {"pass", "unsupported"}


@pytest.mark.slow
@pytest.mark.peers("transformers")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["chunk", "recurrent"])
def test_transformers_gated_delta_rule_passes_with_its_preset(which, dtype):
    from transformers.models.qwen3_next import modeling_qwen3_next

    from oracle.run.validate import validate

    impl = getattr(modeling_qwen3_next, f"torch_{which}_gated_delta_rule")
    report = validate(
        impl,
        suite="linear-default",
        signature="transformers_gated_delta_rule",
        dtype=dtype,
        cases=["lin-gdn-*-T1-*", "lin-gdn-*-T6[35]-*", "lin-gdn-*-T70-*"],
        progress=False,
    )
    verdicts = {r.verdict for r in report.results}
    assert report.passed and "pass" in verdicts and verdicts <= {"pass", "unsupported"}


@pytest.mark.xslow
@pytest.mark.peers("transformers")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["chunk", "recurrent"])
def test_transformers_gated_delta_rule_passes_every_gdn_row(which, dtype):
    """transformers' own functions, no wrapper code: every GDN row of linear-default passes
    (the T = 65536 row and the gradients through torch autograd included); packed sequences
    and base-2 gates are the only rows it cannot express (about 80 s each on 2 loaded cores)."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    from oracle.run.validate import validate

    impl = getattr(modeling_qwen3_next, f"torch_{which}_gated_delta_rule")
    report = validate(
        impl,
        suite="linear-default",
        signature="transformers_gated_delta_rule",
        dtype=dtype,
        cases=["lin-gdn-*"],
        grads=True,
        progress=False,
    )
    unsupported = {r.name.split("-")[2] for r in report.results if r.verdict == "unsupported"}
    passed = [r.name for r in report.results if r.verdict == "pass"]
    assert report.passed and unsupported == {"varlen", "exp2"}, report.results
    assert len(passed) == len(report.results) - 2 and any("T65536" in n for n in passed)


def test_preset_refuses_what_the_library_cannot_express():
    from oracle.conventions.linear_presets import wrap

    fixture = _fixture("lin-gdn-varlen-H2K2-T70-D8E8-f32")
    wrapped = wrap(lambda *a, **k: None, "transformers_gated_delta_rule")
    result = check_fixture(wrapped, fixture)
    assert result.verdict == "unsupported" and "cu_seqlens" in result.message
    kda = wrap(lambda *a, **k: None, "fla_kda")
    result = check_fixture(kda, fixture)
    assert result.verdict == "unsupported" and "form" in result.message
