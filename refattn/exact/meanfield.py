"""Exact paths of :mod:`refattn.meanfield` (Bal 2021): linear fixed points in exact rational
arithmetic (:mod:`refattn.exact.rationals`), nonlinear ones certified by the Krawczyk test
(:mod:`refattn.exact.krawczyk`) inside the Ziv loop, every output rounded once.

The functions return arrays; :mod:`refattn.meanfield` assembles its ``MeanFieldResult``.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from mpmath import iv, mp, mpf

from .._blocks import big, block_diag, diag_blocks
from ..broadcast import reduce_to
from . import intervals as I
from .krawczyk import Krawczyk, solve_linear
from .rationals import fractions, invert, round_rationals
from .rounding import correctly_round

__all__ = [
    "naive_step",
    "adaptive_tap_site",
    "adaptive_tap_prior",
    "ising_tap",
    "deq_linear",
    "deq_contraction",
    "PRIOR_EXACT_MAX_SIZE",
    "linear_fixed_point_vjp",
    "ising_tap_vjp",
    "deq_contraction_vjp",
    "softmax_couplings",
    "softmax_couplings_vjp",
    "softmax_couplings_backward",
]


def naive_step(m, J, x, batch, dtype):
    """The exact naive update ``sum_j J_ij m_j + x_i`` (B..., N, d), rounded once."""
    n, d = m.shape[-2:]
    mb = np.broadcast_to(fractions(m, "m"), (*batch, n, d)).reshape(-1, n * d, 1)
    Jb = big(np.broadcast_to(fractions(J, "J"), (*batch, n, n, d, d)).reshape(-1, n, n, d, d))
    xb = np.broadcast_to(fractions(x, "x"), (*batch, n, d)).reshape(-1, n * d, 1)
    exact = np.matmul(Jb, mb) + xb
    return round_rationals(exact, dtype, "naive_step").reshape(*batch, n, d)


def _site_closed_form(x, J, P, batch):
    """Exact (means, V, chi_ii) of the response="site" fixed point per sample (Fractions):
    m = (P - J)^{-1} x, chi_ii = [(P - J)^{-1}]_ii, V_i = P_i - chi_ii^{-1}."""
    n, d = x.shape[-2:]
    xs = np.broadcast_to(fractions(x, "x"), (*batch, n, d)).reshape(-1, n * d)
    Js = np.broadcast_to(fractions(J, "J"), (*batch, n, n, d, d)).reshape(-1, n, n, d, d)
    Pf = fractions(P, "prior_precision")
    Pbig = block_diag(Pf[None])[0]
    system = None
    means, cavity, chis = [], [], []
    for xb, Jb in zip(xs, Js, strict=True):
        if system is None or J.ndim > 4:  # a shared (unbatched) J is solved once
            chi = invert(Pbig - big(Jb[None])[0], "Sigma^-1 - J")
            chi_diag = diag_blocks(chi[None], n, d)[0]
            inverses = [invert(block, f"chi_ii (site {i})") for i, block in enumerate(chi_diag)]
            system = chi, chi_diag, Pf - np.stack(inverses)
        chi, chi_diag, V = system
        means.append(chi.dot(xb).reshape(n, d))
        cavity.append(V)
        chis.append(chi_diag)
    return (
        np.array(means, dtype=object),
        np.array(cavity, dtype=object),
        np.array(chis, dtype=object),
    )


def adaptive_tap_site(x, J, P, batch, dtype):
    """(means, cavity_var, chi_diag) of the closed-form fixed point (response="site") in exact
    rational arithmetic, rounded once."""
    n, d = x.shape[-2:]
    means, cavity, chis = _site_closed_form(x, J, P, batch)
    return (
        round_rationals(means, dtype, "means").reshape(*batch, n, d),
        round_rationals(cavity, dtype, "cavity_var").reshape(*batch, n, d, d),
        round_rationals(chis, dtype, "chi_diag").reshape(*batch, n, d, d),
    )


# Exact path of adaptive_tap with response="prior": the means are the closed form
# (P - J)^{-1} x and chi_ii = Sigma_i = P_i^{-1} exactly (the fixed point of eq. (11) with
# Lambda_i = V_i + P_i); the cavity variances solve the nonlinear system, with
# D = N d, unknowns V_i (N d^2, index i d^2 + a d + b) and Y = (P + V - J)^{-1} (D^2, index
# N d^2 + r D + s):
#   E2 = (P + V - J) Y - I      (D^2 equations, eqs. (8), (22))
#   E3 = P_i Y_ii - I           (N d^2 equations, eq. (11): chi_ii = (Lambda_i - V_i)^{-1})

#: Largest N d of the certified exact path of adaptive_tap(response="prior"): the Krawczyk
#: test is dense in (N d)^2 + N d^2 unknowns.
PRIOR_EXACT_MAX_SIZE = 12


class _TapPriorProblem:
    def __init__(self, J, P):
        n, d = P.shape[:2]
        self.n, self.d, self.size = n, d, n * d
        self.J = big(J[None])[0].tolist()
        self.P = P.tolist()
        self.offset = n * d * d
        # structural nonzeros of P + V - J in each row: the diagonal block and J's nonzeros
        self.support = [
            [t for t in range(n * d) if t // d == r // d or self.J[r][t] != 0] for r in range(n * d)
        ]

    def _blocks(self, u, ops):
        d, D = self.d, self.size
        J = [[ops.num(v) for v in row] for row in self.J]
        P = [[[ops.num(v) for v in row] for row in site] for site in self.P]
        V = lambda i, a, b: u[i * d * d + a * d + b]  # noqa: E731
        Y = lambda r, s: u[self.offset + r * D + s]  # noqa: E731

        def A(r, t):
            i, a, b = r // d, r % d, t % d
            diagonal = P[i][a][b] + V(i, a, b) if t // d == i else 0
            return diagonal - J[r][t]

        return P, Y, A

    def residual(self, u, ops):
        n, d, D = self.n, self.d, self.size
        P, Y, A = self._blocks(u, ops)
        out = [
            sum(A(r, t) * Y(t, s) for t in self.support[r]) - (1 if r == s else 0)
            for r in range(D)
            for s in range(D)
        ]
        out.extend(
            sum(P[i][a][b] * Y(i * d + b, i * d + c) for b in range(d)) - (1 if a == c else 0)
            for i in range(n)
            for a in range(d)
            for c in range(d)
        )
        return out

    def jacobian(self, u, ops):
        n, d, D = self.n, self.d, self.size
        P, Y, A = self._blocks(u, ops)
        entries = []
        for r in range(D):
            i, a = divmod(r, d)
            for s in range(D):
                row = r * D + s
                entries.extend((row, self.offset + t * D + s, A(r, t)) for t in self.support[r])
                entries.extend((row, i * d * d + a * d + b, Y(i * d + b, s)) for b in range(d))
        for i in range(n):
            for a in range(d):
                for c in range(d):
                    row = D * D + i * d * d + a * d + c
                    entries.extend(
                        (row, self.offset + (i * d + b) * D + i * d + c, P[i][a][b])
                        for b in range(d)
                    )
        return entries


def adaptive_tap_prior(V, x, J, P, batch, dtype):
    """(means, cavity_var, chi_diag, iterations) of the response="prior" fixed point near the
    float64 cavity variances ``V``, rounded once: means and chi_ii in closed form, V certified
    by the Krawczyk test."""
    n, d = x.shape[-2:]
    size = int(np.prod(batch, dtype=int))
    means, _, _ = _site_closed_form(x, J, P, batch)  # the means do not depend on V
    sigma = np.stack(
        [
            invert(block, f"prior_precision (site {i})")
            for i, block in enumerate(fractions(P, "prior_precision"))
        ]
    )
    Js = np.broadcast_to(J, (*batch, n, n, d, d)).reshape(size, n, n, d, d)
    Vs = V.reshape(size, n, d, d)
    certifiers = []
    for b in range(size):
        if b == 0 or J.ndim > 4:  # V depends on J only: a shared J is certified once
            Pbig, Vbig = block_diag(P[None])[0], block_diag(Vs[b : b + 1])[0]
            Y = np.linalg.inv(Pbig + Vbig - big(Js[b : b + 1])[0])
            u0 = np.concatenate([Vs[b].ravel(), Y.ravel()])
            certifiers.append(
                Krawczyk(_TapPriorProblem(Js[b], P), u0, range(len(u0)), "adaptive_tap")
            )
    isolated = _isolated_sites(Js, scalar=False)
    means_flat, block = means.reshape(size, -1), n * d * d

    def evaluate(prec):
        boxes = [c.enclose(prec)[:block] for c in certifiers]
        rows = [
            list(means_flat[b]) + boxes[min(b, len(boxes) - 1)] + list(sigma.ravel())
            for b in range(size)
        ]
        return I.endpoints(np.array(rows, dtype=object))

    def exact_zero(index):
        b, k = index
        k -= n * d
        if 0 <= k < block and isolated[b, k // (d * d)]:
            return 0  # an isolated site has chi_ii = (P_i + V_i)^{-1} = P_i^{-1}: V_i = 0
        return None

    out = correctly_round(
        evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, fallback=exact_zero, what="adaptive_tap"
    )
    iterations = np.array([certifiers[min(b, len(certifiers) - 1)].steps for b in range(size)])
    return (
        out[:, : n * d].reshape(*batch, n, d),
        out[:, n * d : n * d + block].reshape(*batch, n, d, d),
        out[:, n * d + block :].reshape(*batch, n, d, d),
        iterations.reshape(batch),
    )


def _isolated_sites(J, scalar):
    """Sites with no coupling in or out (their cavity variance is exactly 0)."""
    axes = (-1,) if scalar else (-3, -2, -1)
    rows = (J != 0).any(axis=axes)
    cols = (
        (np.swapaxes(J, -1, -2) != 0).any(axis=(-1,))
        if scalar
        else (np.swapaxes(J, -3, -4) != 0).any(axis=axes)
    )
    return ~(rows | cols)


# Exact path of ising_tap: unknowns u = (m_i, Lambda_i, Y_pl) with Y = (Lambda - J)^{-1}, laid
# out as m -> [0, N), Lambda -> [N, 2N), Y_pl -> 2N + p N + l; equations E1 (N), E2 (N^2),
# E3 (N) in the same order:
#   E1_i = m_i - tanh(sum_j J_ij m_j - (Lambda_i - 1/(1 - m_i^2)) m_i + x_i)   (eqs. (14), (10))
#   E2   = (Lambda - J) Y - I                                                  (eq. (8))
#   E3_i = Y_ii - (1 - m_i^2)                                                  (eq. (11))

#: Largest working precision of the exact Ziv loops of the nonlinear fixed points (an exact
#: zero that no structural rule proves would otherwise double the precision up to
#: config.ZIV_MAX_PREC).
_CERTIFIED_MAX_PREC = 4096


class _IsingProblem:
    def __init__(self, J, x):
        self.n, self.J, self.x = len(x), J.tolist(), x.tolist()
        self.nonzero = (J != 0).tolist()

    def residual(self, u, ops):
        n, J, x = (
            self.n,
            [[ops.num(v) for v in row] for row in self.J],
            [ops.num(v) for v in self.x],
        )
        m, lam, Y = u[:n], u[n : 2 * n], u[2 * n :]
        out = []
        for i in range(n):
            s = sum(J[i][j] * m[j] for j in range(n)) - lam[i] * m[i] + m[i] / (1 - m[i] * m[i])
            out.append(m[i] - ops.tanh(s + x[i]))
        for k in range(n):
            for l in range(n):
                coupled = sum(J[k][p] * Y[p * n + l] for p in range(n))
                out.append(lam[k] * Y[k * n + l] - coupled - (1 if k == l else 0))
        out.extend(Y[i * n + i] - (1 - m[i] * m[i]) for i in range(n))
        return out

    def jacobian(self, u, ops):
        n, J, x, nonzero = (
            self.n,
            [[ops.num(v) for v in row] for row in self.J],
            [ops.num(v) for v in self.x],
            self.nonzero,
        )
        m, lam, Y = u[:n], u[n : 2 * n], u[2 * n :]
        entries = []
        for i in range(n):
            c = 1 - m[i] * m[i]
            t = ops.tanh(sum(J[i][j] * m[j] for j in range(n)) - lam[i] * m[i] + m[i] / c + x[i])
            slope = 1 - t * t
            entries.extend((i, j, -slope * J[i][j]) for j in range(n) if nonzero[i][j])
            entries.append((i, i, 1 - slope * ((1 + m[i] * m[i]) / (c * c) - lam[i])))
            entries.append((i, n + i, slope * m[i]))
        for k in range(n):
            for l in range(n):
                row = n + k * n + l
                entries.append((row, n + k, Y[k * n + l]))
                entries.extend(
                    (row, 2 * n + p * n + l, (lam[k] if p == k else 0) - J[k][p])
                    for p in range(n)
                    if p == k or nonzero[k][p]
                )
        for i in range(n):
            entries.append((n + n * n + i, i, 2 * m[i]))
            entries.append((n + n * n + i, 2 * n + i * n + i, 1))
        return entries


def _ising_certifier(m, V, J, x):
    n = len(x)
    free_m = bool((x != 0).any())  # x = 0: m = 0 is an exact solution; certify (Lambda, Y)
    m = m if free_m else np.zeros(n)
    lam = V + 1 / (1 - m * m)
    u0 = np.concatenate([m, lam, np.linalg.inv(np.diag(lam) - J).ravel()])
    return Krawczyk(_IsingProblem(J, x), u0, range(0 if free_m else n, 2 * n + n * n), "ising_tap")


def _ising_outputs(box, n):
    m, lam, Y = box[:n], box[n : 2 * n], box[2 * n :]
    return m + [lam[i] - 1 / (1 - m[i] * m[i]) for i in range(n)] + [Y[i * n + i] for i in range(n)]


def ising_tap(m, V, J, x, batch, dtype):
    """Correctly rounded (means, cavity_var, chi_diag, iterations) of the certified binary-spin
    fixed points near the float64 (m, V), per flattened sample."""
    n = x.shape[-1]
    certifiers = [
        _ising_certifier(mb, Vb, Jb, xb) for mb, Vb, Jb, xb in zip(m, V, J, x, strict=True)
    ]
    isolated = _isolated_sites(J, scalar=True)

    def evaluate(prec):
        boxes = [c.enclose(prec) for c in certifiers]
        with I.workprec(prec):  # V_i = Lambda_i - 1/(1 - m_i^2) on the certified box
            outputs = [_ising_outputs(box, n) for box in boxes]
        return I.endpoints(np.array(outputs, dtype=object))

    def exact_zero(index):
        # an isolated site has V_i = 0 (chi_ii = 1 / Lambda_i) and, if x_i = 0, m_i = 0
        b, k = index
        kind, site = divmod(k, n)
        if isolated[b, site] and (kind == 1 or (kind == 0 and x[b, site] == 0)):
            return 0
        return None

    out = correctly_round(
        evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, fallback=exact_zero, what="ising_tap"
    ).reshape(len(certifiers), 3, n)
    iterations = np.array([c.steps for c in certifiers], dtype=int)
    return (*(out[:, k].reshape(*batch, n) for k in range(3)), iterations.reshape(batch))


def deq_linear(x, J, batch, dtype):
    """z = (I - J)^{-1} x (B..., N, d) in exact rational arithmetic, rounded once."""
    n, d = x.shape[-2:]
    xs = np.broadcast_to(fractions(x, "x"), (*batch, n, d)).reshape(-1, n * d)
    Js = np.broadcast_to(fractions(J, "J"), (*batch, n, n, d, d)).reshape(-1, n, n, d, d)
    eye = np.identity(n * d, dtype=object) * Fraction(1)
    shared = invert(eye - big(Js[:1])[0], "I - J") if J.ndim == 4 else None
    out = []
    for xb, Jb in zip(xs, Js, strict=True):
        inverse = shared if shared is not None else invert(eye - big(Jb[None])[0], "I - J")
        out.append(inverse.dot(xb))
    return round_rationals(np.array(out, dtype=object), dtype, "means").reshape(*batch, n, d)


def _upper(value):
    """Exact upper bound of |value| for an interval (or exact number) as an mpf."""
    value = value if isinstance(value, iv.mpf) else I.point(value)
    return mp.make_mpf(abs(value)._mpi_[1])


def _enclosure_image(value, shape, name, like_name):
    """``value``, the caller's ``name`` evaluated on an interval box, as an object array of
    ``shape``; any other shape raises an error naming ``name`` (never a reshape error)."""
    image = np.asarray(value, dtype=object)
    if image.shape != tuple(shape):
        raise ValueError(
            f"{name}: on the exact path, expected an array of enclosures of the shape of "
            f"{like_name} {tuple(shape)}, got shape {image.shape}"
        )
    return image


def deq_contraction(z0, x, J, correction, lipschitz, dtype):
    """(z, iterations): certified enclosure of z* = T(z*), T(z) = J z - f(z) + x, by the
    contraction bound, refined from the float64 fixed point ``z0`` and rounded once."""
    batch, (n, d) = z0.shape[:-2], z0.shape[-2:]
    size = int(np.prod(batch, dtype=int))
    row_sums = np.sum(np.abs(fractions(J, "J")), axis=(-3, -1)).reshape(size, -1)
    q = [max(row) + Fraction(lipschitz) for row in row_sums]
    if max(q) >= 1:
        raise ValueError(
            f"deq_attention: the exact path needs a max-norm contraction, but ||J||_inf + "
            f"lipschitz = {float(max(q))!r} >= 1"
        )
    state = {"z": z0, "iterations": 0}

    def T(z, Jbig, xi):
        coupled = np.matmul(Jbig, z.reshape(size, n * d, 1)).reshape(*batch, n, d) + xi
        return coupled - _enclosure_image(correction(z), z.shape, "correction", "z")

    def evaluate(prec):
        with I.workprec(prec):
            Jbig = big(I.to_intervals(J).reshape(size, n, n, d, d))
            xi = I.to_intervals(x)
            z = I.to_intervals(state["z"])
            scale = max([1] + [_upper(v) for v in z.ravel()]) * mpf(2) ** (8 - prec)
            for step in range(64 * prec):
                image = T(z, Jbig, xi)
                gap = [max(_upper(v) for v in row) for row in (image - z).reshape(size, -1)]
                if max(gap) <= scale or step == 64 * prec - 1:
                    break
                z = np.vectorize(lambda v: v.mid, otypes=[object])(image)
            if max(gap) > scale:
                raise ArithmeticError(
                    f"deq_attention: no contraction to 2**{8 - prec} within "
                    f"{64 * prec} iterations at {prec} bits"
                )
            state["z"], state["iterations"] = np.vectorize(float)(z), step
            radius = [
                (I.point(qb) / (1 - I.point(qb)) * iv.mpf(g)).b
                for qb, g in zip(q, gap, strict=True)
            ]
            flat = image.reshape(size, -1)
            enclosure = np.array(
                [[v + iv.mpf([-radius[b], radius[b]]) for v in flat[b]] for b in range(size)],
                dtype=object,
            )
        return I.endpoints(enclosure)

    z = correctly_round(evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, what="deq_attention")
    return z.reshape(*batch, n, d), state["iterations"]


# ----------------------------------------------------------------------------- gradients


def linear_fixed_point_vjp(x, J, P, g, batch, keep_diagonal, dtype):
    """(dx, dJ) of ``m = (P - J)^{-1} x`` in exact rational arithmetic, rounded once:
    ``u = (P - J)^{-T} g``, ``dx = u``, ``dJ_ij = u_i m_j^T``, each summed over the broadcast
    batch dimensions before the one rounding (``P = I`` for deep implicit attention)."""
    n, d = x.shape[-2:]
    size = int(np.prod(batch, dtype=int))
    xs = np.broadcast_to(fractions(x, "x"), (*batch, n, d)).reshape(size, n * d)
    gs = np.broadcast_to(fractions(g, "grad_out"), (*batch, n, d)).reshape(size, n * d)
    Js = np.broadcast_to(fractions(J, "J"), (*batch, n, n, d, d)).reshape(size, n, n, d, d)
    Pbig = block_diag(np.broadcast_to(fractions(P, "prior_precision"), (1, n, d, d)))[0]
    dx = np.empty((size, n, d), dtype=object)
    dJ = np.empty((size, n, n, d, d), dtype=object)
    inverse = None
    for b in range(size):
        if inverse is None or J.ndim > 4:  # a shared J is inverted once
            inverse = invert(Pbig - big(Js[b : b + 1])[0], "the coupling matrix P - J")
        m = inverse.dot(xs[b]).reshape(n, d)
        u = inverse.T.dot(gs[b]).reshape(n, d)
        dx[b] = u
        dJ[b] = u[:, None, :, None] * m[None, :, None, :]
        if not keep_diagonal:
            for i in range(n):
                dJ[b, i, i] = Fraction(0)
    dx = reduce_to(dx.reshape(*batch, n, d), x.shape)
    dJ = reduce_to(dJ.reshape(*batch, n, n, d, d), J.shape)
    return (
        round_rationals(dx, dtype, "dx").reshape(x.shape),
        round_rationals(dJ, dtype, "dJ").reshape(J.shape),
    )


def _ising_adjoint_matrix(m, lam, Y, J, n):
    """Transpose of the Jacobian of the reduced binary-spin equations in (m, Lambda) at the
    fixed point (any number system): H1_i = m_i - tanh(h_i), H2_i = Y_ii - (1 - m_i^2) with
    Y = (Lambda - J)^{-1} (derivation at :func:`refattn.meanfield.ising_tap_vjp`)."""
    zero = 0 * m[0]
    H = [[zero] * (2 * n) for _ in range(2 * n)]
    for i in range(n):
        c = 1 - m[i] * m[i]
        for j in range(n):
            if J[i][j] != 0:
                H[i][j] = -c * J[i][j]
            H[n + i][n + j] = -Y[i * n + j] * Y[j * n + i]
        H[i][i] = 1 - c * ((1 + m[i] * m[i]) / (c * c) - lam[i])
        H[i][n + i] = c * m[i]
        H[n + i][i] = 2 * m[i]
    return [[H[j][i] for j in range(2 * n)] for i in range(2 * n)]


def _ising_sample_vjp(box, J, g, n, zero_field, prec):
    """(dx, dJ) intervals of one sample from its certified box (m, Lambda, Y)."""
    m, lam, Y = box[:n], box[n : 2 * n], box[2 * n :]
    Jv = [[I.point(v) for v in row] for row in J.tolist()]
    A = _ising_adjoint_matrix(m, lam, Y, Jv, n)
    rhs = [I.point(v) for v in g.tolist()] + [iv.mpf(0)] * n
    w = solve_linear(A, rhs, prec, "ising_tap_vjp")
    if zero_field:  # m = 0: the system is block diagonal with a zero right side for w2
        w[n:] = [iv.mpf(0)] * n
    w1c = [w[i] * (1 - m[i] * m[i]) for i in range(n)]
    dJ = np.empty((n, n), dtype=object)
    for p in range(n):
        for q in range(n):
            dJ[p, q] = (
                iv.mpf(0)
                if p == q
                else w1c[p] * m[q] - sum(w[n + i] * Y[i * n + p] * Y[q * n + i] for i in range(n))
            )
    return np.array(w1c, dtype=object), dJ


def ising_tap_vjp(m, V, J, x, g, batch, x_shape, J_shape, dtype):
    """Correctly rounded (dx, dJ) of the certified binary-spin fixed points near the float64
    (m, V) (flattened samples): the fixed point is enclosed by the Krawczyk test of
    :func:`ising_tap`, the adjoint linear system by :func:`refattn.exact.krawczyk.solve_linear`
    on the interval Jacobian over that box, and dx, dJ summed over the batch, rounded once."""
    n = x.shape[-1]
    certifiers = [
        _ising_certifier(mb, Vb, Jb, xb) for mb, Vb, Jb, xb in zip(m, V, J, x, strict=True)
    ]
    zero_field = [not (xb != 0).any() for xb in x]

    def evaluate(prec):
        boxes = [c.enclose(prec) for c in certifiers]
        with I.workprec(prec):
            grads = [
                _ising_sample_vjp(box, Jb, gb, n, zf, prec)
                for box, Jb, gb, zf in zip(boxes, J, g, zero_field, strict=True)
            ]
            dx = reduce_to(
                np.array([a for a, _ in grads], dtype=object).reshape(*batch, n), x_shape
            )
            dJ = reduce_to(
                np.array([b for _, b in grads], dtype=object).reshape(*batch, n, n), J_shape
            )
        return I.endpoints(np.concatenate([dx.ravel(), dJ.ravel()]))

    out = correctly_round(evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, what="ising_tap_vjp")
    size = int(np.prod(x_shape, dtype=int))
    return out[:size].reshape(x_shape), out[size:].reshape(J_shape)


def _contract(T, start, q, prec, norm):
    """Enclosure (size, K) of the fixed point of the map ``T`` (interval arrays (size, K)),
    a contraction with constant ``q[b]`` in the max-norm (``norm="inf"``) or the 1-norm
    (``"1"``) of each sample, iterated from the float64 ``start``: returns the enclosure
    ``T(z_k) + [-r, r]``, ``r = q / (1 - q) ||T(z_k) - z_k||`` and the float64 ``z_k``."""
    size, width = start.shape
    z = I.to_intervals(start)
    scale = (
        max([1] + [_upper(v) for v in z.ravel()])
        * mpf(2) ** (8 - prec)
        * (width if norm == "1" else 1)
    )
    best, stalled = None, 0
    for _ in range(64 * prec):
        image = T(z)
        rows = (image - z).reshape(size, -1)
        if norm == "inf":
            gap = [max(_upper(v) for v in row) for row in rows]
        else:
            gap = [
                mp.make_mpf(sum((iv.mpf(_upper(v)) for v in row), iv.mpf(0))._mpi_[1])
                for row in rows
            ]
        # the bound holds at every step; stop when it is tight, or when the widths of the
        # enclosed map (an interval box of z* in the adjoint) keep the gap from shrinking
        stalled = stalled + 1 if best is not None and max(gap) >= best else 0
        best = max(gap) if best is None else min(best, max(gap))
        if max(gap) <= scale or stalled >= 4:
            break
        z = np.vectorize(lambda v: v.mid, otypes=[object])(image)
    radius = [
        (I.point(qb) / (1 - I.point(qb)) * iv.mpf(gb)).b for qb, gb in zip(q, gap, strict=True)
    ]
    enclosure = np.array(
        [[v + iv.mpf([-radius[b], radius[b]]) for v in image[b]] for b in range(size)], dtype=object
    )
    return enclosure, np.vectorize(float)(z)


def deq_contraction_vjp(
    z0, u0, x, J, g, correction, correction_vjp, lipschitz, keep_diagonal, shapes, dtype
):
    """Correctly rounded (dx, dJ) of deep implicit attention with a correction: ``z*``
    enclosed by the max-norm contraction of :func:`deq_contraction`, then the adjoint
    ``u = J^T u - f'(z*)^T u + g`` enclosed by the same constant ``q = ||J||_inf + L`` in the
    1-norm (``||J^T||_1 = ||J||_inf`` and ``||f'(z)^T||_1 = ||f'(z)||_inf <= L``), with
    ``f'(z*)^T u`` enclosed by ``correction_vjp`` over the box of ``z*``; ``dx = u``,
    ``dJ_ij = u_i z_j^T``, summed over the batch and rounded once."""
    batch, (n, d) = z0.shape[:-2], z0.shape[-2:]
    size, width = int(np.prod(batch, dtype=int)), n * d
    row_sums = np.sum(np.abs(fractions(J, "J")), axis=(-3, -1)).reshape(size, -1)
    q = [max(row) + Fraction(lipschitz) for row in row_sums]
    if max(q) >= 1:
        raise ValueError(
            f"deq_attention_vjp: the exact path needs a max-norm contraction, but ||J||_inf + "
            f"lipschitz = {float(max(q))!r} >= 1"
        )
    state = {"z": z0.reshape(size, width), "u": u0.reshape(size, width)}
    x_shape, J_shape = shapes

    def evaluate(prec):
        with I.workprec(prec):
            Jbig = big(I.to_intervals(J).reshape(size, n, n, d, d))
            xi = I.to_intervals(x).reshape(size, width)
            gi = I.to_intervals(g).reshape(size, width)

            def forward(z):
                coupled = np.matmul(Jbig, z[..., None])[..., 0] + xi
                image = correction(z.reshape(*batch, n, d))
                return coupled - _enclosure_image(image, (*batch, n, d), "correction", "z").reshape(
                    size, width
                )

            Z, state["z"] = _contract(forward, state["z"], q, prec, "inf")
            Zs = Z.reshape(*batch, n, d)

            def adjoint(u):
                coupled = np.matmul(np.swapaxes(Jbig, -1, -2), u[..., None])[..., 0] + gi
                image = correction_vjp(Zs, u.reshape(*batch, n, d))
                return coupled - _enclosure_image(
                    image, (*batch, n, d), "correction_vjp", "v"
                ).reshape(size, width)

            U, state["u"] = _contract(adjoint, state["u"], q, prec, "1")
            U = U.reshape(size, n, d)
            dJ = U[:, :, None, :, None] * Z.reshape(size, n, d)[:, None, :, None, :]
            if not keep_diagonal:
                for i in range(n):
                    dJ[:, i, i] = iv.mpf(0)
            dx = reduce_to(U.reshape(*batch, n, d), x_shape)
            dJ = reduce_to(dJ.reshape(*batch, n, n, d, d), J_shape)
        return I.endpoints(np.concatenate([dx.ravel(), dJ.ravel()]))

    out = correctly_round(evaluate, dtype, max_prec=_CERTIFIED_MAX_PREC, what="deq_attention_vjp")
    split = int(np.prod(x_shape, dtype=int))
    return out[:split].reshape(x_shape), out[split:].reshape(J_shape)


def _coupling_weights(x, allowed, Q, K, s):
    """Interval (A, q, k) of one sample: q = x W_Q, k = x W_K, A the softmax of
    ``s q_i . k_j`` over the allowed j (exact zeros elsewhere; max-shifted)."""
    n = len(x)
    xi = I.to_intervals(x)
    q, k = np.matmul(xi, Q), np.matmul(xi, K)
    scores = np.matmul(q, k.T) * s
    weights = np.empty((n, n), dtype=object)
    weights[...] = iv.mpf(0)
    for i in range(n):
        row = np.flatnonzero(allowed[i])
        if row.size == 0:
            continue
        top = max(row, key=lambda j: mpf(scores[i, j]._mpi_[1]))
        terms = {j: iv.mpf(1) if j == top else I.exp(scores[i, j] - scores[i, top]) for j in row}
        total = sum(terms.values())
        for j in row:
            weights[i, j] = terms[j] / total
    return weights, q, k


def softmax_couplings_backward(x, W_Q, W_K, W_V, A, q, k, G, s):
    """(dx, dW_Q, dW_K, dW_V) of one sample of eq. (24)'s couplings ``J_ij = A_ij W_V^T``
    for the cotangent ``G`` (N, N, d, d), in any number system (float or interval arrays):
    ``dA_ij = sum_ab G_ij^{ab} W_V[b, a]``, ``dW_V = (sum_ij A_ij G_ij)^T``,
    ``dS = A (dA - rowsum(A dA))`` (zero where A is an excluded zero), ``dq = s dS k``,
    ``dk = s dS^T q``, ``dx = dq W_Q^T + dk W_K^T``, ``dW_Q = x^T dq``, ``dW_K = x^T dk``."""
    dA = (G * W_V.T).sum(axis=(-1, -2))
    dW_V = (G * A[:, :, None, None]).sum(axis=(0, 1)).T
    dS = A * (dA - (A * dA).sum(axis=1, keepdims=True))
    dq, dk = np.matmul(dS, k) * s, np.matmul(dS.T, q) * s
    dx = np.matmul(dq, W_Q.T) + np.matmul(dk, W_K.T)
    return dx, np.matmul(x.T, dq), np.matmul(x.T, dk), dW_V


def softmax_couplings_vjp(x, W_Q, W_K, W_V, allowed, scale, G, x_shape, dtype):
    """(dx, dW_Q, dW_K, dW_V) of the softmax couplings, enclosed (forward and backward) and
    rounded once; sums over the batch are part of the exact value."""
    n, d = x.shape[-2:]
    batch = allowed.shape[:-2]
    xs = np.broadcast_to(x, (*batch, n, d)).reshape(-1, n, d)
    masks = allowed.reshape(-1, n, n)
    Gs = G.reshape(-1, n, n, d, d)
    shapes = [x_shape, W_Q.shape, W_K.shape, W_V.shape]

    def evaluate(prec):
        with I.workprec(prec):
            s = 1 / I.sqrt(I.point(W_Q.shape[1])) if scale is None else I.point(scale)
            Q, K, V = (I.to_intervals(w) for w in (W_Q, W_K, W_V))
            parts = []
            for xb, allowed_b, Gb in zip(xs, masks, Gs, strict=True):
                A, q, k = _coupling_weights(xb, allowed_b, Q, K, s)
                parts.append(
                    softmax_couplings_backward(
                        I.to_intervals(xb), Q, K, V, A, q, k, I.to_intervals(Gb), s
                    )
                )
            dx = reduce_to(
                np.array([p[0] for p in parts], dtype=object).reshape(*batch, n, d), x_shape
            )
            rest = [sum(p[m] for p in parts) for m in (1, 2, 3)]
        return I.endpoints(np.concatenate([a.ravel() for a in [dx, *rest]]))

    flat = correctly_round(evaluate, dtype, what="softmax_couplings_vjp")
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape, dtype=int))
        out.append(flat[start : start + size].reshape(shape))
        start += size
    return out


def softmax_couplings(x, W_Q, W_K, W_V, allowed, scale, dtype):
    """Softmax couplings (eq. (24)) ``A_ij W_V[b, a]`` enclosed and rounded once; excluded
    pairs (``allowed`` False) are exact zeros. ``scale`` None is ``1/sqrt(D)``."""
    n, d = x.shape[-2:]
    batch = allowed.shape[:-2]
    xs = np.broadcast_to(x, (*batch, n, d)).reshape(-1, n, d)
    masks = allowed.reshape(-1, n, n)
    values = W_V.T.tolist()

    def evaluate(prec):
        with I.workprec(prec):
            s = 1 / I.sqrt(I.point(W_Q.shape[1])) if scale is None else I.point(scale)
            Q, K, V = (
                I.to_intervals(W_Q),
                I.to_intervals(W_K),
                [[I.point(v) for v in row] for row in values],
            )
            out = np.empty((len(xs), n, n, d, d), dtype=object)
            out[...] = iv.mpf(0)
            for b, (xb, allowed_b) in enumerate(zip(xs, masks, strict=True)):
                A, _, _ = _coupling_weights(xb, allowed_b, Q, K, s)
                for i, j in zip(*np.nonzero(allowed_b), strict=True):
                    out[b, i, j] = [[A[i, j] * v for v in line] for line in V]
        return I.endpoints(out)

    return correctly_round(evaluate, dtype, what="softmax_couplings").reshape(*batch, n, n, d, d)
