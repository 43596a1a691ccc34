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
from oracle import catalogue, golden
from oracle.export import EXPORT_MANIFEST, ExportError
from oracle.export.safetensors_format import read_safetensors


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
