"""Meta tests of oracle.fixtures.golden: truth, determinism, atomic writes, resume, verify, load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from oracle import catalogue
from oracle.fixtures import golden
from tests.naive.attention import naive_attention
from tests.naive.rounding import round_nested

# cheap cases touching every stored member kind: bfloat16 bits, bool masks, grads with dbias
_NAMES = (
    "basic-H2K2-L5S7-D8E8-bf16",
    "causal-br-H2K2-L4S7-D8E8-f32",
    "poison-nan-padding-B2H2K2-L5S10-D8E8-f32",
    "grad-bias-H2K2-L4S5-D8E8-f64",
    "mask-empty-rows-H2K2-L6S7-D8E8-f16",
)


@pytest.fixture(scope="module")
def some_cases():
    return [catalogue.get(name) for name in _NAMES]


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, some_cases):
    out = tmp_path_factory.mktemp("golden-reference")
    golden.generate("smoke", out, cases=some_cases, progress=False)
    return out


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _same_array(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_identical_dirs(first: Path, second: Path):
    __tracebackhide__ = True
    one, two = _file_bytes(first), _file_bytes(second)
    assert sorted(one) == sorted(two), f"file sets differ: {sorted(one)} vs {sorted(two)}"
    differing = [name for name in one if one[name] != two[name]]
    assert not differing, f"files differ byte-wise: {differing}"


def _naive_inputs(fixture, b):
    """q, k, v of batch row b as the naive twin takes them: float8 inputs dequantised here
    (x times its descale of (b, kv head); query head h reads kv head h // G)."""
    n = fixture.case.shapes
    arrays = []
    for name in ("q", "k", "v"):
        x = fixture.inputs[name][b].astype(np.float64)
        descale = fixture.inputs.get(f"{name}_descale")
        if descale is not None:
            factor = descale[b].astype(np.float64)
            if name == "q":
                factor = np.repeat(factor, n.H // n.K)
            x = x * factor[:, None, None]
        arrays.append(x)
    return arrays


@pytest.mark.parametrize(
    "name",
    [
        "causal-br-H2K2-L4S7-D8E8-f32",
        "mask-empty-rows-H2K2-L6S7-D8E8-f16",
        "sinks-empty-rows-H2K2-L9S11-D16E16-f32",
        "kv-lengths-zero-B3H2K2-L6S16-D16E16-f16",
        "sinks-kv-decode-B3H8K2-L1S64-D32E32-bf16",
        "fp8-e4m3-H2K2-L12S20-D16E16-bf16",
        "fp8-e5m2-H2K2-L12S20-D16E16-bf16",
    ],
)
def test_truth_matches_independent_naive_reference(name):
    """The stored truth equals tests/naive/attention.py at 60 digits rounded once to the dtype
    (also for sinks, per-row key lengths and float8 inputs)."""
    case = catalogue.get(name)
    fixture = golden.build(case)
    n = case.shapes
    sinks = fixture.inputs.get("sinks")
    lengths = fixture.inputs.get("kv_lengths")
    for b in range(n.batch):
        mask = None
        if "mask" in fixture.inputs:
            mask = np.broadcast_to(fixture.inputs["mask"][b], (n.H, n.L, n.S))
        out, lse, _ = naive_attention(
            *_naive_inputs(fixture, b),
            mask=mask,
            **case.options,
            dps=60,
            sinks=None if sinks is None else sinks.astype(np.float64),
            kv_length=None if lengths is None else int(lengths[b]),
        )
        for key, nested in (("out", out), ("lse", lse)):
            for suffix, dtype in (("", case.dtype), ("_f64", "float64")):
                want = round_nested(nested, dtype)
                got = fixture.truth[key + suffix][b].astype(np.float64)
                same = (got == want) | (np.isnan(got) & np.isnan(want))
                if not same.all():
                    index = np.argwhere(~same)[0]
                    pytest.fail(
                        f"{name}: truth/{key}{suffix} at batch {b} {tuple(index)}: "
                        f"{got[tuple(index)]!r} != naive {want[tuple(index)]!r}"
                    )


def test_build_contents(some_cases):
    for case in some_cases:
        fixture = golden.build(case)
        assert fixture.truth_kind == "exact-ziv"
        assert fixture.truth["out"].dtype.name == case.dtype, case.name
        assert fixture.truth["out_f64"].dtype == np.float64, case.name
        n = case.shapes
        assert fixture.truth["out"].shape == (n.batch, n.H, n.L, n.E), case.name
        assert fixture.truth["lse"].shape == (n.batch, n.H, n.L), case.name
        if case.grads:
            assert {"dq", "dk", "dv", "dbias", "dq_f64"} <= set(fixture.truth), case.name
        for name in ("mask", "bias", "dropout_mask", "alibi_slopes"):
            assert (name in fixture.options) == (name in fixture.inputs), (case.name, name)
        assert "grad_out" not in fixture.options


def test_new_option_members():
    """sinks, kv_lengths, descales are inputs passed as options; dsinks is in the truth."""
    fixture = golden.build(catalogue.get("grad-sinks-kv-gqa-B2H4K2-L4S12-D16E16-bf16"))
    assert {"sinks", "kv_lengths"} <= set(fixture.options) & set(fixture.inputs)
    assert fixture.inputs["kv_lengths"].dtype == np.int32
    assert fixture.truth["dsinks"].shape == (4,)
    assert fixture.truth["dsinks"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert fixture.truth["dsinks_f64"].dtype == np.float64
    fp8 = golden.build(catalogue.get("fp8-e5m2-H2K2-L12S20-D16E16-bf16"))
    assert fp8.inputs["q"].dtype == np.dtype(ml_dtypes.float8_e5m2)
    assert fp8.inputs["q_descale"].dtype == np.float32
    assert fp8.truth["out"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_float8_members_round_trip(tmp_path):
    """float8 inputs are stored as uint8 bit patterns listed in meta and loaded back as
    ml_dtypes float8 arrays with the same bits; fixtures without them keep the old meta."""
    names = ["fp8-e4m3-H2K2-L12S20-D16E16-bf16", "fp8-e5m2-H2K2-L12S20-D16E16-bf16"]
    cases = [catalogue.get(name) for name in names]
    golden.generate("default", tmp_path, cases=cases, progress=False)
    assert golden.verify(tmp_path) == []
    for case, fixture in zip(cases, golden.load(tmp_path), strict=True):
        kind = "float8_e4m3fn" if "e4m3" in case.name else "float8_e5m2"
        with np.load(tmp_path / f"{case.name}.npz", allow_pickle=False) as archive:
            meta = json.loads(str(archive["meta"]))
            assert meta[kind] == ["inputs/k", "inputs/q", "inputs/v"]
            assert archive["inputs/q"].dtype == np.uint8
        fresh = golden.build(case)
        for name in ("q", "k", "v"):
            assert fixture.inputs[name].dtype == np.dtype(getattr(ml_dtypes, kind))
            assert _same_array(fixture.inputs[name], fresh.inputs[name]), (case.name, name)
        assert _same_array(fixture.truth["out"], fresh.truth["out"])
    plain = golden.fixture_bytes(golden.build(catalogue.get(_NAMES[0])))
    assert b"float8" not in plain


def test_poison_never_reaches_truth():
    fixture = golden.build(catalogue.get("poison-nan-padding-B2H2K2-L5S10-D8E8-f32"))
    assert np.isnan(fixture.inputs["k"].astype(np.float64)).any()
    assert np.isfinite(fixture.truth["out"]).all(), "poison reached the exact output"


def test_deterministic_bytes_and_workers(tmp_path, reference_dir, some_cases):
    golden.generate("smoke", tmp_path / "w2", cases=some_cases, workers=2, progress=False)
    _assert_identical_dirs(reference_dir, tmp_path / "w2")
    golden.generate("smoke", tmp_path / "again", cases=some_cases, progress=False)
    _assert_identical_dirs(reference_dir, tmp_path / "again")


def test_manifest_contents(reference_dir, some_cases):
    manifest = json.loads((reference_dir / golden.MANIFEST).read_text())
    assert manifest["schema_version"] == golden.SCHEMA_VERSION
    assert [e["name"] for e in manifest["cases"]] == [c.name for c in some_cases]
    for entry, case in zip(manifest["cases"], some_cases, strict=True):
        assert entry["spec"] == case.spec()
        assert entry["sha256"] == golden.sha256_of(reference_dir / entry["file"])
        assert entry["category"] == case.category and entry["seed"] == case.seed


def test_npz_is_plain_numpy(reference_dir):
    path = reference_dir / "basic-H2K2-L5S7-D8E8-bf16.npz"
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
        assert "inputs/q" in meta["bfloat16"]
        assert archive["inputs/q"].dtype == np.uint16
        options = json.loads(str(archive["options"]))
        assert options == {}


def test_load_round_trip(reference_dir, some_cases):
    loaded = list(golden.load(reference_dir))
    assert [f.name for f in loaded] == [c.name for c in some_cases]
    for fixture, case in zip(loaded, some_cases, strict=True):
        fresh = golden.build(case)
        assert fixture.case == case
        for group in ("inputs", "truth"):
            mine, theirs = getattr(fixture, group), getattr(fresh, group)
            assert sorted(mine) == sorted(theirs), (case.name, group)
            bad = [k for k in mine if not _same_array(mine[k], theirs[k])]
            assert not bad, f"{case.name}: {group} {bad} changed in the round trip"
        assert sorted(fixture.options) == sorted(fresh.options)
    bf16 = next(golden.load(reference_dir, names=["basic-H2K2-L5S7-D8E8-bf16"]))
    assert bf16.inputs["q"].dtype == np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(KeyError, match="no case named"):
        list(golden.load(reference_dir, names=["nope"]))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


def test_verify_clean_and_flipped_byte(tmp_path, reference_dir):
    assert golden.verify(reference_dir) == []
    broken = _copy(reference_dir, tmp_path / "flipped")
    victim = broken / f"{_NAMES[1]}.npz"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    problems = golden.verify(broken)
    assert len(problems) == 1 and victim.name in problems[0] and "sha256" in problems[0], problems
    with pytest.raises(ValueError, match="sha256"):
        list(golden.load(broken))


def test_verify_missing_extra_schema(tmp_path, reference_dir):
    broken = _copy(reference_dir, tmp_path / "missing")
    (broken / f"{_NAMES[0]}.npz").unlink()
    (broken / "stray.txt").write_text("x")
    problems = golden.verify(broken)
    assert any("missing" in p and _NAMES[0] in p for p in problems), problems
    assert any("stray.txt" in p and "extra" in p for p in problems), problems
    manifest = json.loads((broken / golden.MANIFEST).read_text())
    manifest["schema_version"] = 99
    (broken / golden.MANIFEST).write_text(json.dumps(manifest))
    assert any("schema_version" in p for p in golden.verify(broken))
    (broken / golden.MANIFEST).unlink()
    assert golden.verify(broken) == [f"{golden.MANIFEST}: missing in {broken}"]


class _Interrupt(BaseException):
    """Stands in for a KeyboardInterrupt / kill in the middle of a run."""


def test_interrupted_run_resumes(tmp_path, reference_dir, some_cases, monkeypatch):
    out = tmp_path / "resume"
    real_build = golden.build
    calls = []

    def failing_build(case):
        calls.append(case.name)
        if len(calls) == 3:
            raise _Interrupt
        return real_build(case)

    monkeypatch.setattr(golden, "build", failing_build)
    with pytest.raises(_Interrupt):
        golden.generate("smoke", out, cases=some_cases, progress=False)
    leftovers = sorted(p.name for p in out.iterdir())
    assert golden.MANIFEST not in leftovers, "manifest written by an interrupted run"
    assert not [n for n in leftovers if n.endswith(".tmp")], f"temp files left: {leftovers}"
    assert sorted(n for n in leftovers if n.endswith(".npz")) == sorted(
        f"{n}.npz" for n in calls[:2]
    )
    assert golden.verify(out), "verify must reject an incomplete directory"

    calls.clear()
    monkeypatch.setattr(golden, "build", lambda case: calls.append(case.name) or real_build(case))
    golden.generate("smoke", out, cases=some_cases, progress=False)
    assert calls == [c.name for c in some_cases[2:]], f"resume recomputed {calls}"
    _assert_identical_dirs(reference_dir, out)


def test_resume_recomputes_corrupt_file(tmp_path, reference_dir, some_cases, monkeypatch):
    out = _copy(reference_dir, tmp_path / "corrupt")
    victim = out / f"{_NAMES[2]}.npz"
    victim.write_bytes(victim.read_bytes()[:-7])
    calls = []
    real_build = golden.build
    monkeypatch.setattr(golden, "build", lambda case: calls.append(case.name) or real_build(case))
    golden.generate("smoke", out, cases=some_cases, progress=False)
    assert calls == [_NAMES[2]], f"expected only the corrupt case recomputed, got {calls}"
    _assert_identical_dirs(reference_dir, out)


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "file.npz"

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        golden._write_atomic(target, b"payload")
    assert list(tmp_path.iterdir()) == [], "a failed write left files behind"


def test_dtype_filter_and_bad_arguments(tmp_path, some_cases):
    out = golden.generate(
        "smoke", tmp_path / "f32", cases=some_cases, dtypes=["float32"], progress=False
    )
    names = [e["name"] for e in json.loads((out / golden.MANIFEST).read_text())["cases"]]
    assert names == [c.name for c in some_cases if c.dtype == "float32"]
    assert golden.verify(out) == []


def test_regenerating_a_subset_drops_stale_files(tmp_path, reference_dir, some_cases):
    out = _copy(reference_dir, tmp_path / "subset")
    (out / "notes.txt").write_text("user file")
    golden.generate("smoke", out, cases=some_cases, dtypes=["float32"], progress=False)
    kept = sorted(p.name for p in out.glob("*.npz"))
    assert kept == sorted(f"{c.name}.npz" for c in some_cases if c.dtype == "float32"), kept
    assert (out / "notes.txt").exists(), "generate removed a file it did not write"
    assert golden.verify(out) == [f"notes.txt: extra file not listed in {golden.MANIFEST}"]
    with pytest.raises(ValueError, match="dtypes"):
        golden.generate("smoke", tmp_path / "x", cases=some_cases, dtypes=["int8"])
    with pytest.raises(ValueError, match="workers"):
        golden.generate("smoke", tmp_path / "y", cases=some_cases, workers=0)


def test_progress_bar_log_mode():
    import io

    from oracle.run.progress import Progress

    stream = io.StringIO()
    with Progress(40, "gen", stream=stream) as bar:
        for index in range(40):
            bar.advance(f"case-{index}")
    lines = stream.getvalue().splitlines()
    # a non-terminal stream gets the first step and one line per tenth, the last one complete
    assert len(lines) == 11 and lines[-1].startswith("gen [") and "40/40" in lines[-1], lines
    quiet = io.StringIO()
    with Progress(3, "gen", stream=quiet, enabled=False) as bar:
        bar.advance()
    assert quiet.getvalue() == ""
