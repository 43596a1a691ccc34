"""The refusal cases (oracle.judging.must_refuse): malformed inputs a kernel must refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oracle import catalogue
from oracle.catalogue.names import DTYPES
from oracle.fixtures import golden
from oracle.judging import must_refuse as refusal
from oracle.report.formats import to_junit
from oracle.run.validate import validate
from refattn import attention
from tests.planted.unchecked_impls import unchecked_attention

KINDS = (
    "head-dim",
    "gqa-heads",
    "kv-keys",
    "kv-heads",
    "mask-shape",
    "bias-shape",
    "kv-lengths-long",
    "kv-lengths-negative",
    "batch",
    "window-fraction",
)
REFUSE = "refuse-*"


def _cases(suite="default"):
    return [c for c in catalogue.suite(suite) if c.category == "refusal"]


def _run(impl, strict=False, **convention):
    return validate(
        impl,
        suite="default",
        dtype="float32",
        cases=REFUSE,
        progress=False,
        isolate=False,
        strict=strict,
        **convention,
    )


def _verdicts(report):
    return {r.name.split("-H")[0].split("-B2")[0]: r.verdict for r in report.results}


def test_catalogue_has_every_kind_in_every_dtype_and_float32_in_smoke():
    cases = _cases()
    assert sorted({c.recipe["refuse"] for c in cases}) == sorted(KINDS)
    assert len(cases) == len(KINDS) * len(DTYPES)
    assert all(c.name.startswith("refuse-") and c.function == "attention" for c in cases)
    smoke = _cases("smoke")
    assert {c.dtype for c in smoke} == {"float32"} and len(smoke) == len(KINDS)


def test_refattn_refuses_every_case_and_the_fixture_holds_no_truth():
    for case in _cases():
        fixture = golden.build(case)  # refusal_truth raises if refattn accepts the inputs
        assert fixture.truth == {} and fixture.truth_kind == refusal.TRUTH_KIND


def test_refusal_truth_stops_on_a_case_refattn_accepts():
    case = catalogue.get("refuse-head-dim-H2K2-L5S7-D8E8-f32")
    inputs = catalogue.make_inputs(catalogue.get("basic-H2K2-L5S7-D8E8-f32"))
    with pytest.raises(RuntimeError, match="accepted inputs it must refuse"):
        refusal.refusal_truth(case, inputs)


def test_refattn_passes_and_names_its_error():
    report = _run(attention, strict=True)
    assert report.passed and set(_verdicts(report).values()) == {"pass"}
    assert all(r.message.startswith("refused: ") for r in report.results)


def test_unchecked_implementation_fails_every_case_only_under_strict():
    report = _run(unchecked_attention)
    assert set(_verdicts(report).values()) == {"fail"}, _verdicts(report)
    head_dim = next(r for r in report.results if r.name.startswith("refuse-head-dim"))
    assert head_dim.message == (
        "accepted inputs a kernel must refuse: D_q=8 != D_k=4; "
        "returned an array of shape (1, 2, 5, 8)"
    )
    assert report.passed and not report.failures  # refusal failures: strict only
    assert "skipped" in to_junit(report) and "refusal failure" in to_junit(report)
    assert not _run(unchecked_attention, strict=True).passed


def test_unchecked_implementation_still_passes_well_formed_cases():
    report = validate(
        unchecked_attention,
        suite="smoke",
        dtype="float32",
        cases=["basic-*", "mask-*"],
        progress=False,
        isolate=False,
    )
    assert report.results and all(r.verdict == "pass" for r in report.results)


def test_unsupported_keyword_is_unsupported_not_a_refusal():
    def no_lengths(q, k, v, *, scale=None):
        return unchecked_attention(q, k, v, scale=scale)

    verdicts = _verdicts(_run(no_lengths))
    assert verdicts["refuse-kv-lengths-long"] == "unsupported"
    assert verdicts["refuse-head-dim"] == "fail"


@pytest.mark.parametrize("layout", ["packed", "paged"])
def test_layouts_that_cannot_carry_a_malformation_say_so(layout):
    def careless(q, k, v, **options):
        return np.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)

    report = _run(careless, strict=True, layout=layout)
    verdicts = _verdicts(report)
    assert set(verdicts.values()) <= {"fail", "unsupported"}, verdicts
    for kind in refusal._LAYOUT_CANNOT[layout]:
        result = next(r for r in report.results if r.name.startswith(f"refuse-{kind}-"))
        assert result.verdict == "unsupported"
        assert result.message.startswith(refusal.NOT_EXPRESSIBLE)
    assert verdicts["refuse-head-dim"] == "fail"


def test_an_error_of_the_conversion_is_not_a_refusal():
    """oracle.conventions.layouts tags what its own conversion raises: never a refusal."""
    fixture = golden.build(catalogue.get("refuse-batch-B2H2K2-L5S7-D8E8-f32"))

    def converting(q, k, v, **options):
        err = ValueError("could not convert")
        err.oracle_conversion = True
        raise err

    result = refusal.check_refusal(converting, fixture)
    assert result.verdict == "unsupported" and refusal.NOT_EXPRESSIBLE in result.message


def test_a_result_the_layout_cannot_read_back_is_an_acceptance():
    def wrong_size(q, k, v, **options):
        return np.zeros((3, 1, 1))  # packed out is (B*L, H, E): this cannot be unpacked

    report = _run(wrong_size, strict=True, layout="packed")
    head_dim = next(r for r in report.results if r.name.startswith("refuse-head-dim"))
    assert head_dim.verdict == "fail" and "cannot read back" in head_dim.message


def test_fixture_folder_records_the_expectation(tmp_path):
    cases = [c for c in _cases() if c.dtype in ("float16", "bfloat16")][:4]
    first = golden.generate("default", tmp_path / "a", cases=cases, progress=False)
    second = golden.generate("default", tmp_path / "b", cases=cases, progress=False)
    manifests = [json.loads((d / golden.MANIFEST).read_text()) for d in (first, second)]
    assert [e["sha256"] for e in manifests[0]["cases"]] == [
        e["sha256"] for e in manifests[1]["cases"]
    ]
    entry = manifests[0]["cases"][0]
    assert entry["category"] == "refusal" and entry["truth_kind"] == refusal.TRUTH_KIND
    assert entry["contract"]["expect"] == refusal.EXPECT
    assert "refusal" in manifests[0]["precision_contract"]["categories"]
    assert golden.verify(first) == []
    loaded = list(golden.load(first))
    assert [f.truth for f in loaded] == [{}] * len(cases)
    report = validate(attention, fixtures=first, dtype=None, progress=False, isolate=False)
    assert report.counts("refusal")["pass"] == len(cases)


def test_power_and_features_leave_refusal_cases_out():
    from oracle.reading.features import case_features

    case = catalogue.get("refuse-gqa-heads-H3K2-L5S7-D8E8-f32")
    assert case_features(case, False, catalogue.make_inputs(case)) == (["refusal"], [])


@pytest.mark.peers("torch")
def test_torch_sdpa_adapter_refuses_every_case():
    report = _run("torch", strict=True)
    assert report.passed and set(_verdicts(report).values()) == {"pass"}


@pytest.mark.peers("torch")
def test_raw_torch_sdpa_refuses_some_and_accepts_mismatched_k_and_v():
    """torch 2.13's scaled_dot_product_attention refuses head dims, head counts and batch
    sizes that do not fit, yet returns numbers for k and v of different key or head counts:
    why a refusal failure fails a run only under --strict."""
    import torch.nn.functional as F

    verdicts = _verdicts(_run(F.scaled_dot_product_attention, signature="torch_sdpa"))
    assert "error" not in verdicts.values()
    assert {verdicts[k] for k in ("refuse-head-dim", "refuse-gqa-heads", "refuse-batch")} == {
        "pass"
    }
    assert {k for k, v in verdicts.items() if v == "fail"} <= {"refuse-kv-keys", "refuse-kv-heads"}
