"""Run exported ONNX backend tests on onnxruntime and onnx.reference, as onnx's runner does.

Each folder is read the way ``onnx.backend.test.runner.Runner`` reads backend test data
(``model.onnx``; ``test_data_set_0/input_<i>.pb`` parsed as TensorProto and converted with
``numpy_helper.to_array``, fed to the graph inputs in order) and the outputs are compared with
the runner's own ``Runner.assert_similar_outputs`` at its default ``rtol=1e-3, atol=1e-7``.
Every failure gets a one-line cause: the runtime's error, or the size of the mismatch (largest
absolute error and its distance in units in the last place of the case dtype from the exact
rounded truth).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = ["RUNTIMES", "RTOL", "ATOL", "Outcome", "run_folder", "run_export_folder"]

RUNTIMES = ("onnxruntime", "reference")
#: onnx.backend.test.runner's defaults for a model test (``rtol=1e-3, atol=1e-7``).
RTOL, ATOL = 1e-3, 1e-7


@dataclass
class Outcome:
    """One case on one runtime."""

    name: str
    runtime: str
    passed: bool
    cause: str | None = None
    max_abs_error: float | None = None
    max_ulps: float | None = None
    normwise_eps: float | None = None  # max |err| / (max |truth| * eps of the case dtype)
    actual: np.ndarray | None = None


def _load(folder: Path):
    # optional package (onnx extra)
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(folder / "model.onnx"))
    data = folder / "test_data_set_0"
    count = len(list(data.glob("input_*.pb")))
    inputs = [
        numpy_helper.to_array(onnx.load_tensor(str(data / f"input_{i}.pb"))) for i in range(count)
    ]
    expected = numpy_helper.to_array(onnx.load_tensor(str(data / "output_0.pb")))
    return model, inputs, expected


def _run(model, inputs, runtime: str):
    names = [i.name for i in model.graph.input]
    feeds = dict(zip(names, inputs, strict=True))
    if runtime == "reference":
        # optional package (onnx extra)
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(model).run(None, feeds)[0]
    # optional package (onnx extra)
    import onnxruntime

    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)[0]


def _ulps(actual: np.ndarray, expected: np.ndarray) -> float:
    exact = expected.astype(np.float64)
    spacing = np.abs(np.spacing(expected).astype(np.float64))
    spacing = np.where(spacing == 0, np.finfo(np.float64).tiny, spacing)
    with np.errstate(invalid="ignore"):
        errors = np.abs(actual.astype(np.float64) - exact) / spacing
    return float(np.nanmax(errors)) if np.isfinite(errors).any() else float("nan")


def run_folder(folder, runtime: str) -> Outcome:
    """Run one exported backend-test folder on ``runtime`` ("onnxruntime" or "reference")."""
    # optional package (onnx extra)
    from onnx.backend.test.runner import Runner

    folder = Path(folder)
    model, inputs, expected = _load(folder)
    try:
        actual = np.asarray(_run(model, inputs, runtime))
    except Exception as exc:  # a runtime's refusal is a result: record its first line
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return Outcome(folder.name, runtime, False, f"{type(exc).__name__}: {message[:200]}")
    wide_actual, wide_expected = actual.astype(np.float64), expected.astype(np.float64)
    error = np.abs(wide_actual - wide_expected)
    max_abs = float(np.nanmax(error)) if error.size and not np.isnan(error).all() else 0.0
    ulps = _ulps(actual.astype(expected.dtype), expected) if expected.size else 0.0
    scale = float(np.nanmax(np.abs(wide_expected))) if expected.size else 0.0
    eps = float(ml_dtypes.finfo(expected.dtype).eps)
    normwise = max_abs / (scale * eps) if scale > 0 else max_abs / eps
    try:
        Runner.assert_similar_outputs([wide_expected], [wide_actual], RTOL, ATOL)
    except AssertionError as exc:
        nan = int(np.isnan(wide_actual).sum() - np.isnan(wide_expected).sum())
        detail = next((ln.strip() for ln in str(exc).splitlines() if "Mismatched" in ln), "")
        cause = f"outside rtol={RTOL:g}, atol={ATOL:g}: {detail or 'mismatch'}"
        cause += f"; max |err| {max_abs:.3g} = {ulps:.3g} ulp of {expected.dtype}"
        if nan > 0:
            cause += f"; {nan} NaN where the truth is finite"
        cause += f" ({normwise:.3g} eps of max |truth|)"
        return Outcome(folder.name, runtime, False, cause, max_abs, ulps, normwise, actual)
    return Outcome(folder.name, runtime, True, None, max_abs, ulps, normwise, actual)


def run_export_folder(out, runtimes=RUNTIMES) -> list[Outcome]:
    """Run every exported case of an ONNX export directory on each runtime.

    The folders are discovered by onnx's own backend-test loader
    (``onnx.backend.test.loader.load_model_tests(data_dir, kind)`` with ``kind`` the export
    directory's name), which also supplies each test's ``rtol``/``atol``.
    """
    # optional package (onnx extra)
    from onnx.backend.test.loader import load_model_tests

    out = Path(out).resolve()
    manifest = json.loads((out / "export.json").read_text())
    exported = {e["name"] for e in manifest["cases"] if not e.get("skipped")}
    tests = sorted(load_model_tests(str(out.parent), out.name), key=lambda t: t.name)
    if {t.name for t in tests} != exported:
        raise ValueError(f"{out}: the backend-test loader does not see the exported folders")
    return [run_folder(test.model_dir, runtime) for test in tests for runtime in runtimes]
