"""oracle.run.distribute: blocks of a case reassemble to the very same truth, and a Dask cluster
writes the very same bytes as local generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from oracle import catalogue
from oracle.catalogue.case import Case, Shapes, seed_of
from oracle.cli import main
from oracle.fixtures import golden
from oracle.run import distribute

# cases whose blocks cover every slicing rule: GQA both mappings, broadcast mask, bias, ALiBi,
# dropout, gradients with a batch, grad_lse, causal bottom-right
BLOCK_CASES = [
    "long-H2K1-L4S4096-D32E32-f32",
]


def _case(tag, shapes, options=None, recipe=None, grads=False, dtype="float32"):
    name = f"dist-{tag}-{shapes.tag()}-{dtype}"
    return Case(
        name,
        ("test",),
        "conformance",
        dtype,
        shapes,
        options or {},
        recipe or {},
        seed=seed_of(name),
        grads=grads,
    )


SYNTHETIC = [
    _case(
        "gqa-tile-alibi",
        Shapes(batch=2, H=4, K=2, L=5, S=7, D=8, E=6),
        {"gqa": "tile", "causal": True, "align": "bottom_right"},
        {"alibi": True},
    ),
    _case(
        "gqa-mask-bias",
        Shapes(batch=2, H=4, K=1, L=6, S=9, D=4, E=4),
        {"window": (2, 1)},
        {"mask": "padding", "bias": "gaussian"},
    ),
    _case(
        "dropout",
        Shapes(batch=2, H=2, K=2, L=4, S=6, D=4, E=4),
        {"dropout_p": 0.25},
        {"dropout": True},
    ),
    _case(
        "grads",
        Shapes(batch=3, H=4, K=2, L=5, S=6, D=4, E=4),
        {"causal": True},
        {"bias": "gaussian", "grad_lse": True},
        grads=True,
    ),
]


def _same_truth(expected: dict, got: dict) -> None:
    assert sorted(expected) == sorted(got)
    for name in expected:
        assert expected[name].dtype == got[name].dtype, name
        assert expected[name].shape == got[name].shape, name
        assert expected[name].tobytes() == got[name].tobytes(), name


@pytest.mark.parametrize("case", SYNTHETIC, ids=lambda c: c.name)
def test_blocks_reassemble_bit_identically(case, monkeypatch):
    monkeypatch.setattr(distribute, "SPLIT_COST", 0)
    inputs = catalogue.make_inputs(case)
    blocks = distribute.plan_blocks(case, inputs)
    assert len(blocks) > 1
    if case.grads:
        assert all(h is None for _, h in blocks)  # dk, dv sum over the heads of a group
    parts = [distribute.block_truth(case.spec_json(), block)["truth"] for block in blocks]
    _same_truth(
        golden.TRUTH_BUILDERS["attention"](case, inputs),
        distribute.assemble(case, blocks, parts, inputs),
    )


def test_broadcast_batch_is_not_split_for_gradients(monkeypatch):
    monkeypatch.setattr(distribute, "SPLIT_COST", 0)
    case = SYNTHETIC[-1]
    inputs = catalogue.make_inputs(case)
    inputs["k"] = inputs["k"][:1]  # k shared by the batch: dk sums over it
    assert distribute.plan_blocks(case, inputs) == [None]


def test_default_suite_splits_its_long_rows():
    case = catalogue.get(BLOCK_CASES[0])
    assert len(distribute.plan_blocks(case)) == case.shapes.batch * case.shapes.H


def _manifest_files(directory: Path) -> dict:
    manifest = json.loads((directory / golden.MANIFEST).read_text())
    return {entry["file"]: entry["sha256"] for entry in manifest["cases"]}


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    # ":0": a free port for the scheduler's HTTP server (8787 may be taken by another cluster)
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as local:
        yield local


@pytest.mark.slow
def test_dask_generation_is_byte_identical(cluster, tmp_path, monkeypatch):
    import distributed

    cases = [c for c in catalogue.suite("smoke")] + [catalogue.get(BLOCK_CASES[0])]
    local = golden.generate("mixed", tmp_path / "local", cases=cases, progress=False)
    with distributed.Client(cluster) as client:
        remote = golden.generate(
            "mixed",
            tmp_path / "dask",
            cases=cases,
            progress=False,
            runner=distribute.dask_runner(None, client=client),
        )
    assert _manifest_files(local) == _manifest_files(remote)
    assert (local / golden.MANIFEST).read_bytes() == (remote / golden.MANIFEST).read_bytes()
    assert golden.verify(remote) == []


@pytest.mark.slow
def test_cli_dask_executor(cluster, tmp_path, capsys):
    out = tmp_path / "fixtures"
    code = main(
        [
            "generate",
            "--suite",
            "smoke",
            "--out",
            str(out),
            "--quiet",
            "--executor",
            "dask",
            "--scheduler",
            cluster.scheduler_address,
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert golden.verify(out) == []
    code = main(
        [
            "validate",
            "--adapter",
            "refattn-float64",
            "--impl",
            "tests.planted.broken_impls:missing_scale",
            "--suite",
            "smoke",
            "--dtype",
            "float32",
            "--quiet",
            "--executor",
            "dask",
            "--scheduler",
            cluster.scheduler_address,
        ]
    )
    text = capsys.readouterr().out
    assert code == 1  # the broken implementation fails, the other passes
    assert text.count("no failures") == 1


@pytest.mark.slow
def test_validate_many_merges_reports(cluster):
    import distributed

    with distributed.Client(cluster) as client:
        reports = distribute.validate_many(
            ["refattn-float64", "tests.planted.broken_impls:missing_scale"],
            client=client,
            suite="smoke",
            dtype="float32",
            cases="basic-*",
        )
    good, bad = reports["refattn-float64"], reports["tests.planted.broken_impls:missing_scale"]
    assert good.passed and [r.verdict for r in good.results] == ["pass"] * len(good.results)
    assert not bad.passed and {r.verdict for r in bad.results} == {"fail"}
    assert [r.name for r in good.results] == [r.name for r in bad.results]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--suite", "smoke", "--out", "x", "--executor", "dask"], "--scheduler"),
        (["generate", "--suite", "smoke", "--out", "x", "--scheduler", "tcp://h:1"], "only with"),
        (["validate", "--suite", "smoke"], "--adapter NAME"),
    ],
)
def test_executor_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unreachable_scheduler_is_one_line(tmp_path, capsys):
    pytest.importorskip("distributed")
    code = main(
        [
            "generate",
            "--suite",
            "smoke",
            "--out",
            str(tmp_path / "f"),
            "--quiet",
            "--executor",
            "dask",
            "--scheduler",
            "tcp://127.0.0.1:9",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("refattn-oracle: error: scheduler: cannot reach") and err.count("\n") == 1
    assert not np.any([p.suffix == ".npz" for p in (tmp_path / "f").glob("*")])


@pytest.mark.slow
def test_validate_many_reuses_workers_and_names_worker_import_errors(cluster):
    import distributed

    with distributed.Client(cluster) as client:
        with pytest.raises(ImportError, match="on the Dask worker tcp://"):
            distribute.validate_many(
                ["no_such_module_anywhere:attn"], client=client, suite="smoke", dtype="float32"
            )
        reports = distribute.validate_many(
            ["refattn-float64"], client=client, suite="smoke", dtype="float32"
        )
    from oracle.run.validate import select_cases

    names = [r.name for r in reports["refattn-float64"].results]
    assert names == list(select_cases(suite="smoke", dtype="float32"))  # case order kept
    assert reports["refattn-float64"].passed
    # one task (one supervised worker process) per Dask worker, not one per case
    assert len(distribute._chunks(names, 2)) == 2


def test_chunks_deal_round_robin():
    from oracle.run.distribute import _chunks

    assert _chunks(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert _chunks(["a"], 4) == [["a"]]
