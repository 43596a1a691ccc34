"""Meta tests of oracle.export: safetensors, ONNX and FlashInfer-Trace exports of the smoke suite.

Round trips are bit-identical to the .npz fixtures; tests needing an optional package skip with
one line when it is absent.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import oracle
from oracle import catalogue
from oracle.export import EXPORT_MANIFEST, ExportError
from oracle.export._driver import NO_TRUTH
from oracle.export.safetensors_format import read_safetensors
from oracle.fixtures import golden


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("export-fixtures")
    return golden.generate("smoke", out, progress=False)


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_round_trip(loaded, reference):
    assert loaded.case == reference.case
    for group in ("inputs", "truth"):
        mine, theirs = getattr(loaded, group), getattr(reference, group)
        assert set(mine) == set(theirs)
        for name in theirs:
            assert _same_bits(mine[name], theirs[name]), f"{loaded.name}: {group}/{name}"


# ---------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def safetensors_dir(smoke_dir, tmp_path_factory):
    return oracle.export("safetensors", smoke_dir, tmp_path_factory.mktemp("st"), progress=False)


def test_safetensors_round_trip_is_bit_identical(smoke_dir, safetensors_dir):
    reference = {f.name: f for f in golden.load(smoke_dir)}
    loaded = list(oracle.load_safetensors(safetensors_dir))
    assert sorted(f.name for f in loaded) == sorted(reference)
    for fixture in loaded:
        _assert_round_trip(fixture, reference[fixture.name])
    assert {f.case.dtype for f in loaded} == set(catalogue.names.DTYPES)


def test_safetensors_native_dtypes_and_contract(safetensors_dir):
    path = safetensors_dir / "basic-H2K2-L5S7-D8E8-bf16.safetensors"
    tensors, metadata = read_safetensors(path.read_bytes())
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_length])
    assert header["inputs/q"]["dtype"] == "BF16" and header["truth/out_f64"]["dtype"] == "F64"
    contract = json.loads(metadata["precision_contract"])
    assert "rounded once" in contract["truth"] and "ties to even" in contract["truth"]
    assert contract["refattn_version"] and contract["conventions_version"]
    assert json.loads(metadata["case"])["name"] == "basic-H2K2-L5S7-D8E8-bf16"


def test_safetensors_float8_is_native(tmp_path):
    import ml_dtypes

    from oracle.export.safetensors_format import safetensors_bytes

    array = np.linspace(-2, 2, 7).astype(ml_dtypes.float8_e4m3fn)
    data = safetensors_bytes({"x": array, "y": array.astype(ml_dtypes.float8_e5m2)}, {})
    tensors, _ = read_safetensors(data)
    assert _same_bits(tensors["x"], array) and tensors["y"].dtype.name == "float8_e5m2"


def test_safetensors_read_by_the_safetensors_package(safetensors_dir):
    safetensors = pytest.importorskip("safetensors", reason="safetensors not installed")
    del safetensors
    torch = pytest.importorskip("torch", reason="torch not installed")
    from safetensors import safe_open

    with safe_open(safetensors_dir / "basic-H2K2-L5S7-D8E8-bf16.safetensors", "pt") as handle:
        assert handle.get_tensor("truth/out").dtype == torch.bfloat16


def test_safetensors_torch_loader_gives_device_tensors(smoke_dir, safetensors_dir):
    pytest.importorskip("safetensors", reason="safetensors not installed")
    torch = pytest.importorskip("torch", reason="torch not installed")
    reference = {f.name: f for f in golden.load(smoke_dir)}
    for fixture in oracle.load_safetensors(safetensors_dir, framework="torch", device="cpu"):
        assert fixture.inputs["q"].device.type == "cpu"
        if (
            fixture.case.category == "refusal"
        ):  # malformed inputs, no truth (oracle.judging.must_refuse)
            assert fixture.truth == {}
            continue
        assert isinstance(fixture.truth["out"], torch.Tensor)
        for name, array in reference[fixture.name].truth.items():
            tensor = fixture.truth[name]
            bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
            assert bits.numpy().tobytes() == np.asarray(array).tobytes()
        if "mask" in fixture.options:
            assert fixture.options["mask"].dtype == torch.bool


# ---------------------------------------------------------------------------------------------
# errors and atomicity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("parquet", "FIX", "OUT"), "format: expected one of"),
        (("safetensors", "MISSING", "OUT"), "is not a directory"),
        (("safetensors", "", "OUT"), "expected a fixture directory"),
        (("safetensors", "FIX", ""), "expected a directory path"),
        (("safetensors", "FIX", "FIX"), "is the fixture directory"),
    ],
)
def test_bad_input_is_one_line(smoke_dir, tmp_path, arguments, message):
    paths = {"FIX": smoke_dir, "MISSING": tmp_path / "missing", "OUT": tmp_path / "out", "": ""}
    with pytest.raises(ExportError, match=message) as info:
        oracle.export(*(paths.get(a, a) for a in arguments), progress=False)
    assert "\n" not in str(info.value)


def test_cli_export_and_errors(smoke_dir, tmp_path, capsys):
    from oracle.cli import main

    out = tmp_path / "cli"
    argv = ["export", "--format", "safetensors", "--fixtures", str(smoke_dir), "--out", str(out)]
    assert main(argv + ["--quiet", "--case", "basic-H2K2-L5S7-D8E8-f16"]) == 0
    assert "1 exported" in capsys.readouterr().out
    assert main(argv[:4] + [str(tmp_path / "nope"), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is not a directory" in error


def test_failure_leaves_no_partial_files(smoke_dir, tmp_path, monkeypatch):
    from oracle.export import safetensors_format

    calls = []

    def failing(fixture, staging, out):
        if calls:
            raise OSError("disk full")
        calls.append(fixture.name)
        return safetensors_format._write(fixture, staging, out)

    fmt = safetensors_format.Format("safetensors", failing)
    monkeypatch.setattr(safetensors_format, "FORMAT", fmt)
    with pytest.raises(OSError, match="disk full"):
        oracle.export("safetensors", smoke_dir, tmp_path, progress=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert EXPORT_MANIFEST not in left
    assert [n for n in left if n.endswith(".tmp")] == []
    assert left == sorted([golden.LOCK_FILE, f"{calls[0]}.safetensors"])
    assert os.path.getsize(tmp_path / f"{calls[0]}.safetensors") > 0


# ---------------------------------------------------------------------------------------------
# onnx
# ---------------------------------------------------------------------------------------------


def _inputs_only(name: str) -> golden.Fixture:
    """A fixture with inputs and a placeholder truth: enough to plan an export (no exact run)."""
    case = catalogue.get(name)
    inputs = catalogue.make_inputs(case)
    n = case.shapes
    out = np.zeros(
        (n.batch, n.H, n.L, n.E),
        np.dtype(case.dtype) if case.dtype != "bfloat16" else inputs["q"].dtype,
    )
    return golden.Fixture(case, inputs, golden.call_options(case, inputs), {"out": out})


@pytest.fixture(scope="module")
def onnx_dir(smoke_dir, tmp_path_factory):
    pytest.importorskip("onnx", reason="onnx not installed")
    return oracle.export("onnx", smoke_dir, tmp_path_factory.mktemp("onnx"), progress=False)


def test_onnx_folders_hold_the_exact_output(smoke_dir, onnx_dir):
    import onnx
    from onnx import numpy_helper

    manifest = json.loads((onnx_dir / EXPORT_MANIFEST).read_text())
    reference = {f.name: f for f in golden.load(smoke_dir)}
    skipped = {e["name"]: e["skipped"] for e in manifest["cases"] if e["skipped"]}
    assert [n for n in skipped if not n.startswith("refuse-")] == [
        "poison-nan-padding-B2H2K2-L5S10-D8E8-f32"
    ]
    assert all(skipped[n] == NO_TRUTH for n in skipped if n.startswith("refuse-"))
    assert "poison-nan-padding" in (onnx_dir / "README.md").read_text()
    for entry in manifest["cases"]:
        if entry["skipped"]:
            continue
        folder = onnx_dir / entry["name"]
        onnx.checker.check_model(onnx.load(str(folder / "model.onnx")))
        expected = numpy_helper.to_array(
            onnx.load_tensor(str(folder / "test_data_set_0/output_0.pb"))
        )
        assert _same_bits(expected, reference[entry["name"]].truth["out"])


def test_onnx_reference_and_onnxruntime_pass_wide_dtypes(onnx_dir):
    from oracle.export.onnx_check import run_export_folder

    runtimes = ["reference"]
    try:
        import onnxruntime  # noqa: F401

        runtimes.append("onnxruntime")
    except ImportError:
        pass
    manifest = json.loads((onnx_dir / EXPORT_MANIFEST).read_text())
    dtype = {e["name"]: e["dtype"] for e in manifest["cases"]}
    outcomes = run_export_folder(onnx_dir, runtimes)
    # float16/bfloat16 runtimes compute in the case dtype: outside the runner's rtol, reported
    wide = [o for o in outcomes if dtype[o.name] in ("float32", "float64")]
    assert wide and all(o.passed for o in wide), [o for o in wide if not o.passed]
    assert all(o.cause for o in outcomes if not o.passed)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("alibi-H4K4-L12S24-D16E16-f32", "ALiBi"),
        ("poison-nan-padding-B2H2K2-L5S10-D8E8-f32", "NaN/Inf in k"),
    ],
)
def test_onnx_unexpressible_cases_give_the_reason(name, reason):
    pytest.importorskip("onnx", reason="onnx not installed")
    from oracle.export.onnx_format import node_plan

    assert reason in node_plan(_inputs_only(name))["skipped"]


def test_onnx_structure_is_native_or_folded_from_refattn_spec():
    pytest.importorskip("onnx", reason="onnx not installed")
    from oracle.export.onnx_format import node_plan
    from refattn.spec import allowed_mask

    plan = node_plan(_inputs_only("causal-br-H2K2-L4S7-D8E8-f32"))
    assert plan["attributes"] == {"is_causal": 1} and plan["opset"] == 24
    assert plan["inputs"]["nonpad_kv_seqlen"].tolist() == [7]
    windowed = [c for c in catalogue.suite("default") if c.options.get("window")]
    fixture = _inputs_only(windowed[0].name)
    plan = node_plan(fixture)
    options = fixture.case.options
    expected = allowed_mask(
        fixture.case.shapes.L,
        fixture.case.shapes.S,
        causal=options.get("causal", False),
        window=options["window"],
        align=options.get("align", "top_left"),
    )
    mask = plan["inputs"]["attn_mask"]
    allowed = mask if mask.dtype == bool else mask != -np.inf
    if "mask" not in fixture.inputs and "bias" not in fixture.inputs:
        assert (allowed == expected).all()
    assert plan["folded"] and "is_causal" not in plan["attributes"]


# ---------------------------------------------------------------------------------------------
# flashinfer-trace
# ---------------------------------------------------------------------------------------------

#: cheap default cases the gqa_ragged definitions can state (smoke's D=8 has an irrational scale)
_FLASHINFER_CASES = ("batch-B3H2K2-L8S12-D16E16-bf16", "causal-br-H2K2-L12S32-D16E16-f16")


@pytest.fixture(scope="module")
def flashinfer_dirs(smoke_dir, tmp_path_factory):
    fixtures = tmp_path_factory.mktemp("fi-fixtures")
    cases = [catalogue.get(n) for n in _FLASHINFER_CASES] + catalogue.suite("smoke")
    golden.generate("smoke", fixtures, cases=cases, progress=False)
    out = oracle.export("flashinfer-trace", fixtures, tmp_path_factory.mktemp("fi"), progress=False)
    return fixtures, out


def test_flashinfer_round_trip(flashinfer_dirs):
    from oracle.export.flashinfer_format import read_workload

    fixtures, out = flashinfer_dirs
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    exported = {e["name"]: e for e in manifest["cases"] if not e["skipped"]}
    assert sorted(exported) == sorted(_FLASHINFER_CASES)
    assert any("irrational" in e["skipped"] for e in manifest["cases"] if e["skipped"])
    for fixture in golden.load(fixtures, names=list(exported)):
        entry = exported[fixture.name]
        back = read_workload(out, entry["definition"], fixture.name)
        n = fixture.case.shapes
        q = back["tensors"]["q"].reshape(n.batch, n.L, n.H, n.D).transpose(0, 2, 1, 3)
        assert _same_bits(q, fixture.inputs["q"])
        assert _same_bits(back["tensors"]["k"][: n.S], fixture.inputs["k"][0].transpose(1, 0, 2))
        output = back["expected"]["output"].reshape(n.batch, n.L, n.H, n.E).transpose(0, 2, 1, 3)
        assert _same_bits(output, fixture.truth["out"])
        lse = back["expected"]["lse"].reshape(n.batch, n.L, n.H).transpose(0, 2, 1)
        assert _same_bits(lse, (fixture.truth["lse_f64"] / np.log(2.0)).astype(np.float32))
        definition = json.loads(
            (out / f"definitions/gqa_ragged/{entry['definition']}.json").read_text()
        )
        _check_definition_schema(definition)
        assert back["trace"]["workload"]["axes"]["total_q"] == n.batch * n.L


def _check_definition_schema(definition: dict) -> None:
    """The structural rules of flashinfer_bench.data.definition.Definition (no package needed)."""
    import ast

    assert definition["name"] and definition["op_type"] and definition["axes"]
    for spec in [*definition["inputs"].values(), *definition["outputs"].values()]:
        assert all(axis in definition["axes"] for axis in spec["shape"] or [])
    module = ast.parse(definition["reference"])
    assert any(isinstance(node, ast.FunctionDef) and node.name == "run" for node in module.body)


def test_flashinfer_reference_is_within_the_bench_tolerance(flashinfer_dirs):
    torch = pytest.importorskip("torch", reason="torch not installed")
    from oracle.export.flashinfer_format import BENCH_TOLERANCE, read_workload

    _, out = flashinfer_dirs
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    for entry in manifest["cases"]:
        if entry["skipped"]:
            continue
        definition = json.loads(
            (out / f"definitions/gqa_ragged/{entry['definition']}.json").read_text()
        )
        namespace: dict = {}
        exec(compile(definition["reference"], entry["definition"], "exec"), namespace)
        back = read_workload(out, entry["definition"], entry["name"])
        tensors = {k: _torch_of(torch, v) for k, v in back["tensors"].items()}
        output, lse = namespace["run"](**tensors)
        exact = back["expected"]["output"].astype(np.float64)
        np.testing.assert_allclose(
            output.double().numpy(), exact, rtol=BENCH_TOLERANCE, atol=BENCH_TOLERANCE
        )
        np.testing.assert_allclose(
            lse.double().numpy(),
            back["expected"]["lse"],
            rtol=BENCH_TOLERANCE,
            atol=BENCH_TOLERANCE,
        )


def _torch_of(torch, value):
    if not isinstance(value, np.ndarray):
        return value
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(value))


def test_missing_package_is_one_line(smoke_dir, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "onnx", None)  # makes `import onnx` fail
    monkeypatch.delitem(sys.modules, "oracle.export.onnx_format", raising=False)
    with pytest.raises(ExportError, match="needs the package 'onnx'"):
        oracle.export("onnx", smoke_dir, tmp_path, progress=False)
