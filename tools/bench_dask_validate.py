"""Time of a Dask validation against local ones, in the same run (issue 25, item 7).

    PYTHONPATH=. python tools/bench_dask_validate.py --adapter torch --fixtures DIR [--dtype all]
        [--case PATTERN ...] [--dask-workers 2]

Runs, over the same cases: the local serial validation (one supervised worker process, as
``refattn-oracle validate``), the local parallel one (``--workers N``, N = ``--dask-workers``)
and ``oracle.run.distribute.validate_many`` on a ``LocalCluster`` of N single-threaded worker
processes, twice (the second run finds each Dask worker's supervised child kept from the
first: :mod:`oracle.run.worker_cache`). Prints each wall time (the cluster's start-up apart: a
Dask user's scheduler is already running), the ratios, the verdict counts (which must agree)
and the load average before and after (the figures mean little on a loaded machine). Needs
``pip install dask distributed``.
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="refattn-float64")
    parser.add_argument("--fixtures", default=None)
    parser.add_argument("--suite", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--case", action="append", default=None)
    parser.add_argument("--dask-workers", type=int, default=2)
    args = parser.parse_args(argv)
    import distributed

    from oracle.run.distribute import validate_many
    from oracle.run.validate import validate

    dtype = None if args.dtype == "all" else args.dtype
    source = dict(suite=args.suite, fixtures=args.fixtures, dtype=dtype, cases=args.case)
    n = args.dask_workers
    print(f"load before: {os.getloadavg()}")
    start = time.perf_counter()
    serial = validate(args.adapter, progress=False, **source)
    t_serial = time.perf_counter() - start
    start = time.perf_counter()
    local = validate(args.adapter, progress=False, workers=n, **source)
    t_local = time.perf_counter() - start
    start = time.perf_counter()
    with (
        distributed.LocalCluster(
            n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(n)
        t_cluster = time.perf_counter() - start
        start = time.perf_counter()
        remote = validate_many([args.adapter], client=client, **source)[args.adapter]
        t_dask = time.perf_counter() - start
        start = time.perf_counter()  # again: each Dask worker kept its supervised child
        again = validate_many([args.adapter], client=client, **source)[args.adapter]
        t_again = time.perf_counter() - start
    same = (
        [r.verdict for r in serial.results]
        == [r.verdict for r in remote.results]
        == [r.verdict for r in local.results]
    )
    print(f"cases: {len(serial.results)} (verdicts identical in the three runs: {same})")
    print(f"local serial (one supervised worker): {t_serial:.1f} s, counts {serial.counts()}")
    print(f"local --workers {n}: {t_local:.1f} s, counts {local.counts()}")
    print(f"dask ({n} workers; cluster start-up {t_cluster:.1f} s apart): {t_dask:.1f} s")
    print(f"dask / local --workers {n}: {t_dask / t_local:.2f}")
    print(f"dask / local serial: {t_dask / t_serial:.2f}")
    print(
        f"dask again on the same cluster (children kept): {t_again:.1f} s, "
        f"{t_again / t_local:.2f}x local --workers {n}, counts agree: "
        f"{again.counts() == remote.counts()}"
    )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
