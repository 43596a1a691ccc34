"""The oracle's own reading of a case: what the inputs mean, in the oracle's own arithmetic.

* :mod:`oracle.reading.allowed` -- the allowed set (refattn.spec's one rule on plain arrays);
* :mod:`oracle.reading.heads` -- head layout and GQA expansion;
* :mod:`oracle.reading.sparse` -- sparse key selection as a mask;
* :mod:`oracle.reading.latent` -- FlashAttention 3's ``qv`` fold;
* :mod:`oracle.reading.batching` -- batch surgery keeping broadcast axes broadcast;
* :mod:`oracle.reading.features` -- the features and shape classes a case exercises;
* :mod:`oracle.reading.baseline` -- the textbook attention the tolerance policy compares against;
* :mod:`oracle.reading.case` -- :class:`CaseView`: a fixture read once (exact inputs, shapes,
  options, the float64 textbook, score magnitudes) for the judge, the policy and the diagnoses.
"""
