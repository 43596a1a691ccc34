"""mpmath arithmetic shared by the naive twins of the variants (no refattn code).

Exact where possible: inputs are taken at their exact binary values, sums and products of exact
numbers stay exact Fractions, anything else is an mpf at the caller's ``mpmath.workdps``.

Examples
--------
>>> exact_sum([0.1, 0.2]) == exact_fraction(0.1) + exact_fraction(0.2)
True
>>> [float(w) for w in softmax_weights([mp(1), mp(1)])]
[0.5, 0.5]
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np

__all__ = [
    "mp",
    "exact_fraction",
    "per_unit",
    "squared_distance",
    "lse",
    "softmax_weights",
    "exact_sum",
    "exact_mul",
    "exact_div",
    "richardson_derivative",
    "naive_vjp",
    "central_vjp",
    "STEP_BITS",
    "SAFETY",
    "richardson_gradient",
]

#: Step of the central differences, 2**-STEP_BITS times max(1, |x|).
STEP_BITS = 50
#: Factor on the Richardson error estimate |D(h) - D(h/2)| (whose own error is O(h^4)).
SAFETY = 8


def mp(x):
    """An mpf holding the exact value of a float / int, or a Fraction rounded at DPS."""
    if isinstance(x, Fraction):
        return mpmath.mpf(x.numerator) / x.denominator
    if isinstance(x, mpmath.mpf):
        return x
    return mpmath.mpf(float(x))


def exact_fraction(x):
    """The exact Fraction of a float input or a Fraction (None for an mpf: not exact)."""
    if isinstance(x, Fraction):
        return x
    if isinstance(x, mpmath.mpf):
        return None
    return Fraction(float(x))


def per_unit(value, units):
    arr = np.broadcast_to(np.asarray(value, dtype=np.float64), (units,))
    return [mp(x) for x in arr]


def squared_distance(x, y):
    return mpmath.fsum((mp(a) - mp(b)) ** 2 for a, b in zip(x, y, strict=True))


def lse(terms):
    terms = [t for t in terms if t != -mpmath.inf]
    top = max(terms)
    return top + mpmath.log(mpmath.fsum(mpmath.exp(t - top) for t in terms))


def softmax_weights(logits):
    """Softmax weights; exactly Fraction(1, n) when every present logit is the same number
    (a tie: the exact results may then sit on a rounding midpoint, which a 60-digit
    approximation of 1/n cannot settle)."""
    present = [s for s in logits if s != -mpmath.inf]
    if all(s == present[0] for s in present):
        share = Fraction(1, len(present))
        return [Fraction(0) if s == -mpmath.inf else share for s in logits]
    top = max(present)
    raw = [mpmath.mpf(0) if s == -mpmath.inf else mpmath.exp(s - top) for s in logits]
    total = mpmath.fsum(raw)
    return [r / total for r in raw]


def exact_sum(terms):
    """Exact Fraction sum when every term is exact, else an mpf sum."""
    terms = list(terms)
    exact = [exact_fraction(t) for t in terms]
    if all(t is not None for t in exact):
        return sum(exact, Fraction(0))
    return mpmath.fsum(mp(t) for t in terms)


def exact_mul(*factors):
    exact = [exact_fraction(f) for f in factors]
    if all(f is not None for f in exact):
        out = Fraction(1)
        for f in exact:
            out *= f
        return out
    out = mpmath.mpf(1)
    for f in factors:
        out *= mp(f)
    return out


def exact_div(a, b):
    qa, qb = exact_fraction(a), exact_fraction(b)
    if qa is not None and qb is not None:
        return qa / qb
    return mp(a) / mp(b)


def richardson_derivative(f, x, h):
    """(f'(x), error estimate) from central differences with steps h, h/2, h/4 and two
    Richardson extrapolations (orders h^2 then h^4 eliminated); the estimate is the change of
    the last extrapolation plus the rounding of f divided by the smallest step."""
    x, h = mp(x), mp(h)
    diffs = []
    for k in range(3):
        step = h / 2**k
        diffs.append((f(x + step) - f(x - step)) / (2 * step))
    first = [(4 * diffs[k + 1] - diffs[k]) / 3 for k in range(2)]
    second = (16 * first[1] - first[0]) / 15
    rounding = abs(f(x)) * mpmath.mpf(10) ** (-mpmath.mp.dps + 5) / (h / 4) + mpmath.mpf(10) ** (
        -mpmath.mp.dps + 5
    )
    return second, abs(second - first[1]) + rounding


def naive_vjp(forward, arrays, grad_out, *, dps=60, step=2.0**-24):
    """Central-difference vjp of ``sum(grad_out * forward(*arrays))`` by
    :func:`richardson_derivative`, for every element of every array: a list (one per array)
    of object arrays of (derivative, error estimate) pairs (mpf), at ``dps`` digits.

    ``forward`` takes object arrays of mpf (the perturbed inputs) and returns nested lists.
    """
    with mpmath.workdps(dps):
        base = [
            np.array([[mp(x) for x in np.ravel(a)]], dtype=object).reshape(np.shape(a))
            for a in arrays
        ]
        weights = np.asarray(grad_out, dtype=np.float64)

        def objective(index, position):
            def f(x):
                args = [a.copy() for a in base]
                args[index][position] = x
                out = np.array(forward(*args), dtype=object)
                return mpmath.fsum(
                    mp(o) * mp(w) for o, w in zip(out.ravel(), weights.ravel(), strict=True)
                )

            return f

        result = []
        for index, a in enumerate(base):
            grads = np.empty(a.shape + (2,), dtype=object)
            for position in np.ndindex(*a.shape):
                grads[position] = richardson_derivative(
                    objective(index, position), a[position], step
                )
            result.append(grads)
        return result


def _flatten(nested):
    if isinstance(nested, list | tuple):
        return [x for item in nested for x in _flatten(item)]
    return [nested]


def central_vjp(function, arrays, grad, *, dps):
    """sum_j grad_j d function_j / d x for every element x of ``arrays``, by central differences
    with one Richardson step, at ``dps`` digits.

    ``function(*arrays)`` takes object arrays of mpf and returns nested lists of numbers
    (mpf / Fraction) in the order of ``grad``'s elements. Returns one (estimate, error) pair of
    float-object arrays per input: the Richardson value ``(4 D(h/2) - D(h)) / 3`` and
    ``SAFETY * |D(h) - D(h/2)|`` (the truncation of D(h/2), far larger than the estimate's
    own O(h^4) and rounding errors when ``h = 2**-STEP_BITS``).
    """
    weights = [mp(g) for g in np.ravel(grad)]
    results = []
    with mpmath.workdps(dps):
        base = [
            np.array([mp(x) for x in np.ravel(a)], dtype=object).reshape(np.shape(a))
            for a in arrays
        ]

        def projected(which, index, step):
            moved = [b.copy() for b in base]
            moved[which][index] = moved[which][index] + step
            values = _flatten(function(*moved))
            return mpmath.fsum(w * mp(v) for w, v in zip(weights, values, strict=True))

        def difference(which, index, step):
            return (projected(which, index, step) - projected(which, index, -step)) / (2 * step)

        for which, arr in enumerate(base):
            estimate = np.empty(arr.shape, dtype=object)
            error = np.empty(arr.shape, dtype=object)
            for index in np.ndindex(*arr.shape):
                h = max(1, abs(arr[index])) * mpmath.ldexp(1, -STEP_BITS)
                coarse, fine = difference(which, index, h), difference(which, index, h / 2)
                estimate[index] = (4 * fine - coarse) / 3
                error[index] = SAFETY * abs(fine - coarse)
            results.append((estimate, error))
    return results


def richardson_gradient(loss, theta, free, dps=50):
    """Gradient of ``loss`` (a function of a flat list of mpf) at the float array ``theta`` by
    central differences with one Richardson step, at ``dps`` digits.

    ``D(h) = (L(t + h e_k) - L(t - h e_k)) / 2h`` has error ``c h^2 + O(h^4)``; the
    extrapolation ``R = (4 D(h/2) - D(h)) / 3`` removes the ``h^2`` term and
    ``|D(h/2) - D(h)|`` (three times the ``h^2`` error of ``D(h/2)``, far above R's own
    ``O(h^4)``) plus the rounding noise of the differences (``16 eps (|L| + 1) / h`` at the
    working precision's ``eps``) is returned as its error estimate. Coordinates where
    ``free`` is False get gradient 0 with error 0 (parameters that are not free, e.g. zero
    self-couplings).
    Returns (gradient, error): object arrays of mpf of theta's shape.
    """
    theta = np.asarray(theta, dtype=np.float64)
    free = np.broadcast_to(free, theta.shape).ravel()
    grad = np.empty(theta.size, dtype=object)
    error = np.empty(theta.size, dtype=object)
    with mpmath.workdps(dps):
        base = [mpmath.mpf(float(v)) for v in theta.ravel()]
        h = mpmath.mpf(2) ** -48
        noise = 16 * mpmath.eps * (abs(loss(base)) + 1) / h

        def central(k, step):
            up, down = list(base), list(base)
            up[k] += step
            down[k] -= step
            return (loss(up) - loss(down)) / (2 * step)

        for k in range(theta.size):
            if not free[k]:
                grad[k], error[k] = mpmath.mpf(0), mpmath.mpf(0)
                continue
            coarse, fine = central(k, h), central(k, h / 2)
            grad[k] = (4 * fine - coarse) / 3
            error[k] = abs(fine - coarse) + noise
    return grad.reshape(theta.shape), error.reshape(theta.shape)
