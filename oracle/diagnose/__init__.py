"""Diagnoses of failing cases and the first-case guidance.

* :mod:`oracle.diagnose.diagnosis` -- which named alternative semantics a failing output matches;
* :mod:`oracle.diagnose.alternative` -- the named alternatives' record;
* :mod:`oracle.diagnose.models` -- error models of the accuracy grades;
* :mod:`oracle.diagnose.peers`, :mod:`~oracle.diagnose.tiles`, :mod:`~oracle.diagnose.sparse`,
  :mod:`~oracle.diagnose.latent`, :mod:`~oracle.diagnose.fp4`, :mod:`~oracle.diagnose.merge`,
  :mod:`~oracle.diagnose.sigmoid` -- the alternatives of each feature;
* :mod:`oracle.diagnose.guidance` -- the calling-convention flag the first cases point to.
"""
