"""Running an implementation over a suite: validate, in parallel, supervised, distributed.

* :mod:`oracle.run.validate` -- :func:`validate` (the module is callable: ``oracle.validate``);
* :mod:`oracle.run.parallel` -- local worker processes (``--workers N``);
* :mod:`oracle.run.supervise` -- an implementation in a worker process;
  :mod:`oracle.run.worker_cache`
  keeps such workers across runs;
* :mod:`oracle.run.distribute` -- Dask fan-out of generation and validation;
* :mod:`oracle.run.invariance` -- determinism, batch invariance, decode = prefill;
* :mod:`oracle.run.impls` -- resolving the implementation under test;
* :mod:`oracle.run.progress` -- the progress bar.
"""
