"""Mean-field attention of Bal (2021), "Deep Implicit Attention: A Mean-Field Theory Perspective
on Attention Mechanisms" (source document ``002``).

Equation numbers
----------------
The source numbers no equation in its text; refattn numbers its displayed equations in order of
appearance, (1)-(25), one number per line of an ``align`` and none for the ``\\nonumber`` display
of section 4.2 (the numbering MathJax gives the post). The LaTeX label is quoted where the source
has one. The ones used here:

====  ============================  ==================================================
(4)   ``eq:cavitymean``             a_i = sum_j J_ij m_j - V_i m_i (binary spins)
(8)   ``eq:chiijlinresp``           chi = (Lambda - J)^-1
(9)   (unlabelled)                  Lambda = diag(Lambda_1, ..., Lambda_N)
(10)  (unlabelled)                  Lambda_i = V_i + (d<S_i>/dx_i)^-1
(11)  ``eq:viselfcons``             1 / (Lambda_i - V_i) = [(Lambda - J)^-1]_ii
(14)  (unlabelled)                  <S_i> = tanh(sum_j J_ij <S_j> - V_i <S_i> + x_i)
(17)  ``eq:veccavmeans``            a_i = sum_j J_ij <S_j> - V_i <S_i> (vector spins)
(20)  (unlabelled)                  <S_i> = (Sigma^-1 - V_i)^-1 (a_i + X_i)
(21)  (unlabelled)                  <S_i^2> - <S_i>^2 = (Sigma^-1 - V_i)^-1
(22)  (unlabelled)                  (1 - Sigma_i J_ik + Sigma_i V_i delta_ik) chi_kj = Sigma_i
(23)  ``eq:diaupdate``              <S_i> = sum_j J_ij <S_j> - f(<S_i>) + X_i
(24)  ``eq:softmaxcouplings``       J_ij = softmax(X W_Q W_K^T X^T / sqrt(d))_ij
====  ============================  ==================================================

Shapes (docs/conventions.md): N spins (sites), d spin dimension, B... batch. Vector spins
``m`` (B..., N, d); couplings ``J`` (B..., N, N, d, d) with ``J[i, j]`` the d x d block
``J_ij^{alpha beta}`` acting on the column vector ``m_j``; fields ``x`` (B..., N, d).

Pinned readings (each also stated where it is used)
---------------------------------------------------
* ``prior_precision`` is ``Sigma^{-1}``, the precision of the zero-mean Gaussian spin prior
  ``N(0, Sigma)`` of section 3.3 (the source picks ``Sigma = 1_d``, the default here).
* ``Lambda_i`` (eq. (10)) uses the *site* susceptibility ``d<S_i>/dX_i = (Sigma^{-1} - V_i)^{-1}``
  of eq. (21), which gives ``Lambda_i = Sigma^{-1}`` (``response="site"``, default). Section 3.3
  also prints ``Lambda_i = V_i + Sigma^{-1}`` (equivalently eq. (22)), which takes the prior
  covariance ``Sigma`` as the susceptibility; ``response="prior"`` implements that reading.
* The cavity variances are updated by eq. (11) solved for ``V_i`` with ``Lambda`` evaluated at
  the current ``V``: ``V_i <- Lambda_i - [chi_ii]^{-1}``; means and variances are updated
  together (Jacobi order) and the pair ``(m, V)`` is one fixed-point state.
* The cavity derivation assumes no self-coupling (section 3.1: "enforcing the couplings'
  block-diagonal to be zero"): ``adaptive_tap``, ``ising_tap`` and ``deq_attention`` reject
  nonzero diagonal blocks unless ``diagonal="zero"`` (zero them) or, for ``deq_attention``,
  ``diagonal="keep"``. ``naive_step`` keeps them: softmax couplings (eq. (24)) let a token
  attend to itself.

Modules (one job each): ``_model`` (results and the validation of every argument), ``_tap``
(naive step, vector and binary adaptive TAP), ``_deq`` (deep implicit attention, eq. (23)),
``_vjp`` (implicit vector-Jacobian products of the three fixed points), ``_couplings`` (the
softmax couplings of eq. (24) and their vjp). This package re-exports them.
"""

from ._couplings import SoftmaxCouplingsGrads, softmax_couplings, softmax_couplings_vjp
from ._deq import deq_attention
from ._model import MeanFieldGrads, MeanFieldResult
from ._tap import adaptive_tap, ising_tap, naive_step
from ._vjp import adaptive_tap_vjp, deq_attention_vjp, ising_tap_vjp

__all__ = [
    "MeanFieldResult",
    "naive_step",
    "adaptive_tap",
    "ising_tap",
    "deq_attention",
    "MeanFieldGrads",
    "adaptive_tap_vjp",
    "ising_tap_vjp",
    "deq_attention_vjp",
    "softmax_couplings",
    "SoftmaxCouplingsGrads",
    "softmax_couplings_vjp",
]
