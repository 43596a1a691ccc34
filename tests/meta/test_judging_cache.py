"""The case view (oracle.reading.case), the judging parts kept in memory and on disk
(oracle.judging.parts), both tiers from one call, the remembered return_lse refusal and the
case filter of golden.load."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.judging import parts
from oracle.judging.judge import check_fixture
from oracle.reading.case import fixture_key, read_case
from oracle.run.validate import validate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from tests.planted.broken_impls import missing_scale, textbook  # noqa: E402

NAMES = ("basic-H2K2-L5S7-D8E8-f32", "causal-br-H2K2-L4S7-D8E8-f32")


@pytest.fixture(scope="module")
def fixtures():
    cases = [c for c in catalogue.suite("default") if c.name in NAMES]
    assert len(cases) == len(NAMES)
    return [golden.build(case) for case in cases]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(parts.CACHE_VARIABLE, str(folder))
    parts.clear_memory()
    yield folder
    parts.clear_memory()


def _thresholds(result):
    return {n: np.asarray(c.threshold.value) for n, c in result.checks.items()}


def _same(a, b):
    assert a.verdict == b.verdict and set(a.checks) == set(b.checks)
    for name, limit in _thresholds(a).items():
        np.testing.assert_array_equal(limit, _thresholds(b)[name])


def test_case_view_is_read_once_and_read_only(fixtures):
    view = read_case(fixtures[0])
    assert view.shapes["G"] == view.shapes["H"] // view.shapes["K"]
    assert view.exact64 is view.exact64 and view.textbook() is view.textbook()
    with pytest.raises(ValueError):
        view.q[...] = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.q = None
    assert fixtures[0].inputs["q"].flags.writeable  # the fixture's own array is untouched
    assert view.key == fixture_key(fixtures[0])


def test_content_key_follows_the_content(fixtures):
    changed = dataclasses.replace(fixtures[0], truth=dict(fixtures[0].truth))
    assert fixture_key(changed) == fixture_key(fixtures[0])
    changed.truth["out"] = changed.truth["out"] + 1
    assert fixture_key(changed) != fixture_key(fixtures[0])


def test_disk_cache_is_written_reused_and_never_trusted_blindly(fixtures, cache):
    fixture = fixtures[1]
    first = check_fixture(textbook, fixture)
    files = sorted(cache.glob("*.npz"))
    assert {f.name.split("-")[1] for f in files} >= {"default+models"}  # one file a case
    parts.clear_memory()
    again = check_fixture(textbook, fixture)  # read back from disk
    _same(first, again)
    for path in files:  # corrupt: recomputed and rewritten, same verdicts
        path.write_bytes(b"not an npz")
    parts.clear_memory()
    _same(first, check_fixture(textbook, fixture))
    assert all(np.load(path, allow_pickle=False) is not None for path in files)
    bad = check_fixture(missing_scale, fixture)
    assert bad.verdict == "fail", bad.explain()


def test_cached_parts_judge_as_fresh_ones(fixtures, cache, monkeypatch):
    fresh = {}
    monkeypatch.setenv(parts.CACHE_VARIABLE, "off")
    for fixture in fixtures:
        parts.clear_memory()
        fresh[fixture.name] = check_fixture(missing_scale, fixture, tolerance="tight")
    monkeypatch.setenv(parts.CACHE_VARIABLE, str(cache))
    for fixture in fixtures:
        check_fixture(textbook, fixture, tolerance="tight")  # fills the cache
    parts.clear_memory()
    for fixture in fixtures:
        _same(fresh[fixture.name], check_fixture(missing_scale, fixture, tolerance="tight"))


def test_both_tiers_from_one_call(fixtures, cache):
    calls = []

    def counted(q, k, v, **options):
        calls.append(1)
        return missing_scale(q, k, v, **options)

    for fixture in fixtures:
        both = check_fixture(counted, fixture, tolerance="both")
        _same(both, check_fixture(missing_scale, fixture))
        _same(both.tight, check_fixture(missing_scale, fixture, tolerance="tight"))
    assert len(calls) == len(fixtures)
    report = validate(textbook, fixtures=fixtures, tolerance="both", progress=False)
    assert report.tolerance == "default" and report.tight.tolerance == "tight"
    assert report.passed and report.tight.passed
    assert [r.name for r in report.tight.results] == [r.name for r in report.results]


def test_a_refused_return_lse_keyword_is_not_offered_again(fixtures, cache):
    class NoLse:
        """Refuses return_lse as a signature without it would (a TypeError naming it)."""

        def __init__(self):
            self.calls = []

        def __call__(self, q, k, v, **options):
            self.calls.append("return_lse" in options)
            if "return_lse" in options:
                raise TypeError("NoLse() got an unexpected keyword argument 'return_lse'")
            return textbook(q, k, v, **options)

    impl = NoLse()
    for fixture in fixtures:
        result = check_fixture(impl, fixture)
        assert result.verdict == "pass" and "lse" not in result.checks, result.explain()
    # return_lse=True is offered on the first case only
    assert impl.calls == [True, False] + [False] * (len(fixtures) - 1)


def test_load_reads_only_the_selected_cases(fixtures, tmp_path):
    out = golden.generate(
        "default", tmp_path / "fx", cases=[f.case for f in fixtures], progress=False
    )
    other = out / f"{NAMES[1]}.npz"
    other.write_bytes(b"corrupt")  # never read when not selected
    loaded = list(golden.load(out, cases="BASIC-*", check=False))
    assert [f.name for f in loaded] == [NAMES[0]]
    assert loaded[0].origin == str(out)
    (out / parts.CACHE_FOLDER).mkdir()  # the judging cache is no extra file
    assert not any(parts.CACHE_FOLDER in problem for problem in golden.verify(out))
