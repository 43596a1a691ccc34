"""Judging an implementation's outputs: the judge, the one tolerance policy, the results.

* :mod:`oracle.judging.judge` -- run an implementation on a fixture, judge every output;
* :mod:`oracle.judging.tolerance` -- THE tolerance policy (the only place thresholds live);
* :mod:`oracle.judging.variant_scales` -- natural scales and condition factors of the variants;
* :mod:`oracle.judging.parts` -- the fixture-only judging parts (baselines, scales, floors),
  computed once per fixture and kept in memory and on disk;
* :mod:`oracle.judging.results` -- :class:`Check`, :class:`CaseResult` (a run's
  :class:`~oracle.report.run_report.Report` collects them);
* :mod:`oracle.judging.passing` -- which of a case's options an implementation receives;
* :mod:`oracle.judging.refused` -- an implementation's exception read as a refusal ("unsupported");
* :mod:`oracle.judging.must_refuse` -- the refuse-* cases: inputs a kernel must refuse.
"""
