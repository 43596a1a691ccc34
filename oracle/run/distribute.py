"""Fan fixture generation and validation out past one machine, to a Dask cluster.

``refattn-oracle generate ... --executor dask --scheduler ADDRESS`` (or
``golden.generate(..., runner=dask_runner(ADDRESS))``) sends each case to a Dask worker and
splits a large attention case into blocks (one batch element, and for forward-only cases one
query head with its kv head) that run on different workers. The client writes every file and
the manifest itself, through :func:`oracle.fixtures.golden.write_fixture` and the same lock, resume
and
manifest logic as local generation, so workers need no shared file system and the directory is
**byte-identical** to one written by ``--workers N`` processes.

Why blocks cannot change a single bit: every truth element is the exact real result rounded once
(``precision="exact"``), and the exact value of ``out[b, h, i]`` (and of ``lse``, ``dq``...)
depends only on the inputs of its own (batch, head) plane. A block computes exactly the same
real numbers and rounds them once, whatever else is in the call. Gradient cases are split by
batch only (dk and dv sum over the query heads of a kv group), and only when k, v and the bias
carry their own batch dimension (otherwise dk, dv or dbias sum over the batch).

``validate_many`` runs several implementations over the same cases, one Dask task per
(implementation, chunk of cases), one chunk per Dask worker: each task is one usual supervised
worker process of :mod:`oracle.run.validate` kept across its cases (the implementation and its
framework are imported once per Dask worker, not once per case, and the child is kept for the
worker's next tasks: :mod:`oracle.run.worker_cache`), and returns one merged
:class:`~oracle.report.run_report.Report` per implementation. An implementation a worker cannot
import is an ImportError that names the worker.

Workers need refattn installed at the same version as the client (checked: a mismatch is an
error naming both versions) and, for ``--impl module:function``, the implementation importable.
Dask is an optional extra: ``pip install -e ".[dask]"``.

Examples
--------
>>> from oracle import catalogue
>>> case = catalogue.get("long-H2K1-L4S4096-D32E32-f32")
>>> [block for block in plan_blocks(case)]
[(0, 0), (0, 1)]
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

import refattn
from oracle import catalogue
from oracle.catalogue.case import Case
from oracle.fixtures import golden
from oracle.judging import must_refuse as refusal
from oracle.report.run_report import Report
from oracle.run.validate import select_cases, validate

__all__ = ["plan_blocks", "block_truth", "assemble", "dask_runner", "validate_many", "SPLIT_COST"]

#: Cases whose cost (batch x H x L x S x (D + E)) reaches this are split into blocks.
SPLIT_COST = 2**21

_BATCHED = ("q", "k", "v", "mask", "bias", "dropout_mask", "grad_out")  # (B, H|K, L|S, .)


def _client(scheduler):
    try:
        # optional package (dask extra)
        from distributed import Client
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the dask executor needs dask.distributed: pip install -e "
            "\".[dask]\" (or pip install 'dask[distributed]')"
        ) from None
    if not isinstance(scheduler, str) or not scheduler:
        raise ValueError(
            f"scheduler: expected a scheduler address such as 'tcp://host:8786', got {scheduler!r}"
        )
    try:
        return Client(scheduler, timeout="10s")
    except OSError as err:
        raise ValueError(
            f"scheduler: cannot reach the Dask scheduler at {scheduler!r} ({err})"
        ) from None


# ---------------------------------------------------------------------------------------------
# Blocks of one case
# ---------------------------------------------------------------------------------------------


def _cost(case: Case) -> int:
    n = case.shapes
    return n.batch * n.H * n.L * n.S * (n.D + n.E)


def _full_batch(inputs, names, batch) -> bool:
    return all(
        name not in inputs or (inputs[name].ndim >= 4 and inputs[name].shape[-4] == batch)
        for name in names
    )


def plan_blocks(case: Case, inputs=None) -> list:
    """The blocks ``case`` is computed in: ``[None]`` (whole) or ``(b, h)`` pairs.

    ``(b, None)`` is batch element b with every head; ``(b, h)`` one query head of it. Only
    attention cases of cost >= :data:`SPLIT_COST` are split.
    """
    n = case.shapes
    if case.function != "attention" or _cost(case) < SPLIT_COST:
        return [None]
    if inputs is None:
        inputs = catalogue.make_inputs(case)
    batch_ok = _full_batch(inputs, ("k", "v", "bias") if case.grads else ("k", "v"), n.batch)
    if case.grads:
        return [(b, None) for b in range(n.batch)] if batch_ok and n.batch > 1 else [None]
    batches = range(n.batch) if batch_ok else [None]
    return [(b, h) for b in batches for h in range(n.H)]


def _take(array, axis: int, index: int):
    """``array`` restricted to ``index`` along ``axis`` (from the end), broadcast dims kept."""
    if array.ndim < -axis or array.shape[axis] == 1:
        return array
    where = [slice(None)] * array.ndim
    where[axis] = slice(index, index + 1)
    return array[tuple(where)]


def _block_inputs(case: Case, inputs, block):
    b, h = block
    n = case.shapes
    out = dict(inputs)
    if b is not None:
        for name in _BATCHED:
            if name in out:
                out[name] = _take(out[name], -4, b)
        if "grad_lse" in out:
            out["grad_lse"] = _take(out["grad_lse"], -3, b)
    if h is not None:
        group = n.H // n.K
        kv = h // group if case.options.get("gqa", "interleave") == "interleave" else h % n.K
        for name in ("q", "mask", "bias", "dropout_mask"):
            if name in out:
                out[name] = _take(out[name], -3, h)
        for name in ("k", "v"):
            out[name] = _take(out[name], -3, kv)
        if "alibi_slopes" in out:
            out["alibi_slopes"] = _take(out["alibi_slopes"], -1, h)
    return out


def block_truth(spec_json: str, block) -> dict:
    """Truth arrays of one block of a case (runs on a worker); see :func:`plan_blocks`."""
    case = Case.from_spec(json.loads(spec_json))
    inputs = catalogue.make_inputs(case)
    if block is not None:
        inputs = _block_inputs(case, inputs, block)
    refuse = refusal.is_refusal(case)  # malformed inputs: no truth (oracle.judging.must_refuse)
    truth = (refusal.refusal_truth if refuse else golden.TRUTH_BUILDERS[case.function])(
        case, inputs
    )
    return {"refattn_version": refattn.__version__, "truth": truth}


def _heads_axis(name: str, block) -> int:
    """Axis (from the end) along which the head blocks of truth member ``name`` are joined."""
    base = name.removesuffix("_f64")
    _, h = block
    if h is not None:  # forward only: out (B, H, L, E), lse (B, H, L)
        return -2 if base == "lse" else -3
    if base == "dbias":
        return -4
    return -3 if base == "lse" else -4


def assemble(case: Case, blocks: list, parts: list[dict], inputs) -> dict:
    """Concatenate the truths of ``blocks`` (in plan order) into the case's truth."""
    if blocks == [None]:
        return parts[0]
    truth = {}
    for name in parts[0]:
        per_batch: dict = {}
        for block, part in zip(blocks, parts, strict=True):
            per_batch.setdefault(block[0], []).append(part[name])
        heads_axis = _heads_axis(name, blocks[0])
        rows = [
            np.concatenate(arrays, axis=heads_axis) if len(arrays) > 1 else arrays[0]
            for arrays in per_batch.values()
        ]
        if len(rows) == 1:
            truth[name] = rows[0]
        else:
            batch_axis = -3 if name.removesuffix("_f64") == "lse" else -4
            truth[name] = np.concatenate(rows, axis=batch_axis)
    return truth


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


def dask_runner(scheduler, *, client=None):
    """A :data:`oracle.fixtures.golden.Runner` that computes cases on the Dask cluster at
    ``scheduler``.

    Parameters
    ----------
    scheduler : str
        Address of a running Dask scheduler (``tcp://host:8786``); ignored when ``client`` is
        given.
    client : distributed.Client, optional
        An existing client (e.g. of a ``LocalCluster``).

    Returns
    -------
    callable
        ``runner(cases, out_dir)`` for :func:`oracle.fixtures.golden.generate`.
    """

    def runner(todo: list[Case], out: Path) -> Iterator[tuple[str, str]]:
        own = client is None
        active = _client(scheduler) if own else client
        try:
            yield from _run_cases(active, todo, out)
        finally:
            if own:
                active.close()

    return runner


def _run_cases(client, todo: list[Case], out: Path) -> Iterator[tuple[str, str]]:
    # optional package (dask extra)
    from distributed import as_completed

    pending: dict[str, dict] = {}
    futures = []
    for case in sorted(todo, key=lambda c: -_cost(c)):
        inputs = catalogue.make_inputs(case)
        blocks = plan_blocks(case, inputs)
        spec = case.spec_json()
        pending[case.name] = {
            "case": case,
            "inputs": inputs,
            "blocks": blocks,
            "parts": [None] * len(blocks),
        }
        for index, block in enumerate(blocks):
            future = client.submit(
                block_truth,
                spec,
                block,
                pure=False,
                key=f"refattn-{case.name}-{index}-{time.monotonic_ns()}",
            )
            future.refattn_slot = (case.name, index)
            futures.append(future)
    for future in as_completed(futures):
        name, index = future.refattn_slot
        result = future.result()
        if result["refattn_version"] != refattn.__version__:
            raise RuntimeError(
                f"dask worker runs refattn {result['refattn_version']}, this client "
                f"{refattn.__version__}: install the same version on every worker"
            )
        entry = pending[name]
        entry["parts"][index] = result["truth"]
        if all(part is not None for part in entry["parts"]):
            case, inputs = entry["case"], entry["inputs"]
            truth = assemble(case, entry["blocks"], entry["parts"], inputs)
            fixture = golden.Fixture(
                case=case,
                inputs=inputs,
                options=golden.call_options(case, inputs),
                truth=truth,
                truth_kind=golden.truth_kind_of(case),
            )
            del pending[name]
            yield golden.write_fixture(fixture, out)


# ---------------------------------------------------------------------------------------------
# Validation of many implementations
# ---------------------------------------------------------------------------------------------


def _validate_chunk(impl: str, case_names: list, kwargs: dict) -> dict:
    """Validate ``impl`` on several cases in one supervised worker process (runs on a Dask
    worker: the implementation is imported once per chunk, not once per case). An
    implementation the worker cannot load comes back as ``{"import_error", "worker"}``, so
    the client reports it as the worker's, not its own."""
    try:
        report = validate(impl, cases=list(case_names), progress=False, keep_worker=True, **kwargs)
    except ImportError as err:
        return {"import_error": str(err), "worker": _worker_name()}
    return {"results": report.results}


def _worker_name() -> str:
    try:
        # optional package (dask extra)
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):  # pragma: no cover - outside a Dask worker
        return socket.gethostname()


def _chunks(names: list, n: int) -> list:
    """``names`` dealt round-robin into at most ``n`` non-empty chunks (costs interleave)."""
    return [chunk for chunk in (names[i::n] for i in range(max(1, n))) if chunk]


def _gather_results(active, impl, parts, names) -> list:
    results = []
    for part in active.gather(parts):
        if "import_error" in part:
            raise ImportError(
                f"on the Dask worker {part['worker']}: {part['import_error']} (the client "
                f"itself was not asked to import {impl!r}; install it on every worker)"
            )
        results += part["results"]
    order = {name: i for i, name in enumerate(names)}
    return sorted(results, key=lambda r: (order.get(r.name.split("::")[0], len(order)), r.name))


def validate_many(
    impls: Iterable[str],
    *,
    scheduler=None,
    client=None,
    suite=None,
    fixtures=None,
    dtype="float32",
    cases=None,
    **kwargs,
) -> dict[str, Report]:
    """Validate several implementations on a Dask cluster; one merged Report each.

    Parameters
    ----------
    impls : iterable of str
        Adapter names or ``module:function`` strings importable on the workers.
    scheduler : str, optional
        Dask scheduler address (or give ``client``).
    suite, fixtures, dtype, cases, **kwargs
        As :func:`oracle.run.validate.validate` (``fixtures`` must be readable at the same path
        on every worker).

    Returns
    -------
    dict
        implementation -> :class:`~oracle.report.run_report.Report`, the results in case order.
    """
    impls = list(impls)
    if not impls or not all(isinstance(i, str) and i for i in impls):
        raise ValueError(
            f"impls: expected adapter names or 'module:function' strings, got {impls!r}"
        )
    names = select_cases(suite=suite, fixtures=fixtures, dtype=dtype, cases=cases)
    source = {"suite": suite} if fixtures is None else {"fixtures": str(fixtures)}
    own = client is None
    active = _client(scheduler) if own else client
    start = time.perf_counter()
    try:
        workers = len(active.scheduler_info().get("workers", {})) or 1
        options = {**source, "dtype": dtype, **kwargs}
        futures = {
            impl: [
                active.submit(_validate_chunk, impl, chunk, options, pure=False)
                for chunk in _chunks(names, workers)
            ]
            for impl in impls
        }
        reports = {}
        for impl, parts in futures.items():
            results = _gather_results(active, impl, parts, names)
            label = f"suite {suite or 'smoke'}" if fixtures is None else f"fixtures {fixtures}"
            report = Report(
                impl,
                dtype,
                label,
                kwargs.get("strict", False),
                results,
                time.perf_counter() - start,
                kwargs.get("grads", False),
            )
            report.isolated = kwargs.get("isolate", True)
            report.strict_invariance = bool(kwargs.get("strict_invariance", False))
            report.use_layout(kwargs.get("layout", "bhld"))
            reports[impl] = report
        return reports
    finally:
        if own:
            active.close()
