"""Independent loop twins of refattn's concepts, one module per concept.

Plain Python loops over mpmath numbers (or exact Fractions), written from the source papers
and docs/conventions.md, never from refattn's code: no module here imports refattn. Slow by
design, for small shapes.

* :mod:`naive.attention` -- attention (out, lse, weights) and a score-spread bound;
* :mod:`naive.logspace` -- logsumexp, softmax, log_softmax of masked rows;
* :mod:`naive.rounding` -- rounding an exact value to a dtype (candidate search);
* :mod:`naive.mp` -- the exact/mpmath arithmetic the variant twins share, and central
  differences with a Richardson error estimate (the gradients' truth);
* :mod:`naive.transformer` -- layer norm, multi-head attention, feed-forward, blocks,
  positions;
* :mod:`naive.gmm`, :mod:`naive.mgk`, :mod:`naive.hopfield`, :mod:`naive.meanfield` -- the
  probabilistic variants;
* :mod:`naive.gmm_torch` -- a float64 PyTorch twin of gmm (vectorised, from the paper) whose
  autograd checks the gmm vector-Jacobian products.
"""
