"""Time of a Dask validation against a local one, in the same run (issue 25, item 7).

    PYTHONPATH=. python tools/bench_dask_validate.py --adapter torch --fixtures DIR [--dtype all]

Runs the local supervised validation (one worker process, as ``refattn-oracle validate``) and
``oracle.distribute.validate_many`` on a ``LocalCluster`` of ``--dask-workers`` processes
(default 2), over the same cases, and prints both wall times, their ratio, the verdict counts
(which must agree) and the load average. Needs ``pip install dask distributed``.
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

    from oracle.distribute import validate_many
    from oracle.validate import validate

    dtype = None if args.dtype == "all" else args.dtype
    source = dict(suite=args.suite, fixtures=args.fixtures, dtype=dtype, cases=args.case)
    print(f"load before: {os.getloadavg()}")
    start = time.perf_counter()
    local = validate(args.adapter, progress=False, **source)
    t_local = time.perf_counter() - start
    with (
        distributed.LocalCluster(
            n_workers=args.dask_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        start = time.perf_counter()
        remote = validate_many([args.adapter], client=client, **source)[args.adapter]
        t_dask = time.perf_counter() - start
    print(f"cases: {len(local.results)}")
    print(f"local (one supervised worker): {t_local:.1f} s, counts {local.counts()}")
    print(f"dask ({args.dask_workers} workers): {t_dask:.1f} s, counts {remote.counts()}")
    print(f"dask / local: {t_dask / t_local:.2f}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
