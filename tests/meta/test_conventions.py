"""oracle.conventions.layouts: torch functions in each layout are validated as they are; bfloat16
and
float8 cross the NumPy/torch boundary bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from oracle.cli import main
from oracle.conventions.layouts import check_convention, page_size, wrap
from oracle.run.validate import validate

pytestmark = pytest.mark.peers("torch")

LAYOUT_IMPLS = {
    "bhld": "tests.planted.convention_impls:attention_bhld",
    "blhd": "tests.planted.convention_impls:flash_attn_func",
    "packed": "tests.planted.convention_impls:flash_attn_varlen_func",
    "paged": "tests.planted.convention_impls:flash_attn_with_kvcache",
}
CASES = [
    "basic-*",
    "causal-tl-*",
    "gqa-interleave-*",
    "mqa-interleave-*",
    "long-*",
    "decode-*",
    "batch-*",
    "mask-padding-*",
]


@pytest.mark.parametrize("layout", list(LAYOUT_IMPLS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_function_in_each_layout_passes(layout, dtype):
    report = validate(
        LAYOUT_IMPLS[layout],
        suite="default",
        dtype=dtype,
        cases=CASES,
        framework="torch",
        layout=layout,
        progress=False,
        isolate=False,
    )
    verdicts = {r.name: r.verdict for r in report.results}
    assert report.passed, [r.explain() for r in report.failures]
    judged = [n for n, v in verdicts.items() if v == "pass"]
    assert len(judged) >= 6, verdicts
    if layout in ("packed", "paged"):  # per-position arrays have no place there
        assert all(v == "unsupported" for n, v in verdicts.items() if "mask-" in n)


def test_paged_kernel_ignoring_the_block_table_fails():
    report = validate(
        "tests.planted.convention_impls:paged_ignoring_table",
        suite="default",
        dtype="float32",
        cases=["basic-*", "batch-*"],
        framework="torch",
        layout="paged",
        progress=False,
        isolate=False,
    )
    assert not report.passed


@pytest.mark.parametrize(
    "dtype",
    [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.float16, np.float64],
)
def test_bits_round_trip_through_torch(dtype):
    bits = (
        np.arange(256, dtype=np.uint8)
        if np.dtype(dtype).itemsize == 1
        else np.arange(-(2**15), 2**15, 97, dtype=np.int64)
    )
    values = (
        bits.astype(np.uint8)
        if np.dtype(dtype).itemsize == 1
        else bits.astype(np.dtype(f"i{np.dtype(dtype).itemsize}"))
    ).view(dtype)
    values = values.reshape(1, 1, -1, 1)
    echo = wrap(lambda q, k, v, **_: q, framework="torch")
    back = echo(values, values, values)
    assert back.dtype == values.dtype
    assert back.tobytes() == values.tobytes()


def test_cli_framework_and_layout(capsys):
    code = main(
        [
            "validate",
            "--impl",
            LAYOUT_IMPLS["blhd"],
            "--suite",
            "smoke",
            "--dtype",
            "float32",
            "--framework",
            "torch",
            "--layout",
            "blhd",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out


def test_bad_convention_names_the_argument():
    with pytest.raises(ValueError, match="layout: expected one of"):
        check_convention(layout="bshd")
    with pytest.raises(ValueError, match="device: 'cuda' needs framework='torch'"):
        check_convention(device="cuda")
    assert page_size(255) == 16 and page_size(4096) == 64


@pytest.mark.peers("jax")
def test_jax_function_in_its_own_layout():
    report = validate(
        "tests.planted.convention_impls:jax_dot_product_attention",
        suite="default",
        dtype="float32",
        cases=["basic-*", "causal-tl-*", "gqa-interleave-*"],
        framework="jax",
        layout="blhd",
        progress=False,
        isolate=False,
    )
    assert report.passed, [r.explain() for r in report.failures]
    assert sum(r.verdict == "pass" for r in report.results) >= 3


def test_pytest_plugin_takes_the_convention():
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "oracle",
            "-q",
            "-p",
            "no:cacheprovider",
            "--refattn-impl",
            LAYOUT_IMPLS["packed"],
            "--refattn-layout",
            "packed",
            "--refattn-framework",
            "torch",
            "--refattn-dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
