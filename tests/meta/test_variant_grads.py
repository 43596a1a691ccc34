"""Meta tests of the variant gradient cases: the fixtures carry exact vjps, the judge checks an
implementation's vjp (``impl.vjp`` or the ``f_vjp`` beside a plain function ``f``)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from oracle import catalogue
from oracle.catalogue import variants as vc
from oracle.fixtures import golden
from oracle.run import validate as V
from refattn import hopfield, mgk
from tests.helpers import assert_same_bits

SMOKE, DEFAULT = "variants-smoke", "variants-default"


def _grad_cases(suite, function=None, dtypes=None):
    return [
        c
        for c in catalogue.suite(suite)
        if c.grads
        and (function is None or c.function == function)
        and (dtypes is None or c.dtype in dtypes)
    ]


def _explain(report):
    return "\n".join(r.explain() for r in report.results if r.verdict != "pass")


def test_gradient_cases_exist_exactly_for_functions_with_a_vjp():
    functions = {c.function for c in _grad_cases(DEFAULT)}
    assert {"mgk.attention", "mgk.linear_attention", "hopfield.retrieve"} <= functions
    for function in functions:
        assert vc.vjp_of(function) is not None, function
    for case in _grad_cases(DEFAULT):
        inputs, truths = vc.required_members(case)
        assert "grad_out" in inputs and any(t.startswith("d") for t in truths), case.name


@pytest.mark.parametrize("case", _grad_cases(SMOKE), ids=lambda c: c.name)
def test_fixture_gradients_are_the_exact_vjp(case):
    fixture = golden.build(case)
    exact = vc.call_refattn_vjp(case, fixture.inputs, precision="exact", out_dtype=case.dtype)
    assert set(exact) == set(vc.grad_names(case.function))
    for name, value in exact.items():
        assert_same_bits(fixture.truth[name], value, what=f"{case.name} truth/{name}")
    forward = vc.forward_inputs(fixture.inputs)
    assert "grad_out" not in forward and "grad_out" in fixture.inputs


def _refattn_function(function):
    spec = vc.FUNCTIONS[function]
    return getattr(importlib.import_module(spec.module), spec.attribute)


@pytest.mark.parametrize("function", sorted({c.function for c in _grad_cases(DEFAULT)}))
def test_refattn_float64_vjps_pass(function):
    """Every function with gradient cases: refattn's float64 vjp (found as f_vjp beside the
    plain function) passes its own gradient cases."""
    chosen = _grad_cases(DEFAULT, function, ("float64", "float32"))
    report = V.validate(
        _refattn_function(function), suite=chosen, dtype=None, grads=True, progress=False
    )
    assert report.passed, _explain(report)
    for result in report.results:
        grads = [n for n in result.checks if n.startswith("d")]
        assert grads == list(vc.grad_names(function)), (result.name, list(result.checks))
        assert "gradients" in result.features


def _with_vjp(forward, vjp):
    def impl(**kwargs):
        return forward(**kwargs)

    impl.vjp = vjp
    return impl


def _flipped_dq(**kwargs):
    grads = mgk.attention_vjp(**kwargs)
    return grads._replace(dq=-grads.dq)


def _hopfield_without_key_path(xi, X, grad_out, *, beta, steps):
    # forgets that X is also the keys: dX from the values only
    from refattn.attention import attention_vjp

    grads = attention_vjp(xi, X, X, grad_out, scale=beta)
    return hopfield.RetrieveGrads(grads.dq, grads.dv)


BROKEN = [
    ("mgk vjp with dq of the wrong sign", "mgk.attention", _with_vjp(mgk.attention, _flipped_dq)),
    (
        "hopfield vjp without the key path",
        "hopfield.retrieve",
        _with_vjp(hopfield.retrieve, _hopfield_without_key_path),
    ),
]


@pytest.mark.parametrize("label, function, impl", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_vjp_fails(label, function, impl):
    chosen = [
        c
        for c in _grad_cases(DEFAULT, function, ("float64", "float32"))
        if c.options.get("steps", 1) == 1
    ][:2]
    report = V.validate(impl, suite=chosen, dtype=None, grads=True, progress=False)
    verdicts = {r.name: r.verdict for r in report.results}
    assert verdicts and all(v == "fail" for v in verdicts.values()), f"{label}: {verdicts}"
    failing = [n for r in report.results for n, c in r.checks.items() if not c.passed]
    assert failing and all(n.startswith("d") for n in failing), failing


def _float32_torch_vjp(q, keys, v, grad_out, *, sigma2=1.0, mode="soft", mask=None, **_options):
    """An honest float32 implementation: the soft/hard MGK forward in float32 torch,
    differentiated by autograd (uniform pi)."""
    import torch

    from refattn.masks import allowed_mask

    leaves = [
        torch.tensor(np.asarray(a, dtype=np.float32), requires_grad=True) for a in (q, keys, v)
    ]
    qs, ks, vs = leaves
    length, units = q.shape[-2], keys.shape[-3]
    allowed = torch.tensor(
        np.broadcast_to(
            allowed_mask(length, units, mask=mask), q.shape[:-2] + (length, units)
        ).copy()
    )
    dist = ((qs[..., :, None, None, :] - ks[..., None, :, :, :]) ** 2).sum(-1) / (2 * sigma2)
    if mode == "soft":
        scores = torch.logsumexp(-dist, -1) - float(np.log(keys.shape[-2]))
    else:
        scores = torch.amax(-dist, -1)
    scores = torch.where(allowed, scores, torch.tensor(-float("inf")))
    weights = torch.nan_to_num(torch.softmax(scores, -1))  # empty rows: 0
    out = weights @ vs
    (out * torch.tensor(np.asarray(grad_out, dtype=np.float32))).sum().backward()
    return mgk.MGKGrads(*(t.grad.numpy().astype(q.dtype) for t in leaves))


@pytest.mark.peers("torch")
def test_float32_vjp_is_no_false_alarm():
    chosen = [c for c in _grad_cases(DEFAULT, "mgk.attention") if c.dtype != "float64"]
    report = V.validate(
        _with_vjp(mgk.attention, _float32_torch_vjp),
        suite=chosen,
        dtype=None,
        grads=True,
        progress=False,
    )
    assert report.passed, _explain(report)
    worst = max(
        c.max_error for r in report.results for n, c in r.checks.items() if n.startswith("d")
    )
    assert worst > 0, "float32 arithmetic should not be exact"


def test_no_vjp_is_unsupported_and_forward_only_passes():
    chosen = _grad_cases(SMOKE, "mgk.attention")

    def forward_only(**kwargs):  # no .vjp and no forward_only_vjp beside it
        return mgk.attention(**kwargs)

    report = V.validate(forward_only, suite=chosen, dtype=None, grads=True, progress=False)
    assert [r.verdict for r in report.results] == ["unsupported"], _explain(report)
    report = V.validate(forward_only, suite=chosen, dtype=None, progress=False)
    assert report.passed, _explain(report)


def test_grad_scale_is_per_sample_magnitude():
    from oracle.judging.variant_scales import grad_scale

    truth = np.array([[[1.0, -3.0]], [[0.5, 0.25]]])
    assert grad_scale(truth).tolist() == [[[3.0, 3.0]], [[0.5, 0.5]]]


def _naive_forward(case, inputs, h):
    """The case's forward on head h by its mpmath twin (object arrays of mpf in)."""
    from tests.naive.hopfield import naive_retrieve
    from tests.naive.mgk import naive_linear, naive_mgk

    o = case.options
    if case.function == "mgk.attention":
        mask = inputs.get("mask")
        return lambda q, k, v: naive_mgk(
            q,
            k,
            v,
            sigma2=o.get("sigma2", 1.0),
            mode=o.get("mode", "soft"),
            mask=None if mask is None else mask[0, h],
        )
    if case.function == "mgk.linear_attention":
        pi = np.asarray(inputs["pi"], dtype=np.float64)[0, h]
        return lambda q, k, v: naive_linear(q, k, v, pi=pi, causal=o.get("causal", False))
    return lambda xi, X: naive_retrieve(xi, X, o["beta"], o["steps"])[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        c
        for c in _grad_cases(SMOKE)
        if c.function in ("mgk.attention", "mgk.linear_attention", "hopfield.retrieve")
    ],
    ids=lambda c: c.name,
)
def test_fixture_gradients_round_the_richardson_derivative(case):
    """The stored float64 gradients against an independent reference: central differences of
    the mpmath twins with Richardson extrapolation, head by head."""
    from tests.helpers import assert_rounds_derivative
    from tests.naive.mp import naive_vjp

    fixture = golden.build(case)
    inputs = fixture.inputs
    names = vc.grad_names(case.function)
    arrays = [np.asarray(inputs[n[1:]], dtype=np.float64) for n in names]
    grad_out = np.asarray(inputs["grad_out"], dtype=np.float64)
    for h in range(case.shapes.H):
        derivative = naive_vjp(
            _naive_forward(case, inputs, h), [a[0, h] for a in arrays], grad_out[0, h]
        )
        for name, deriv in zip(names, derivative, strict=True):
            assert_rounds_derivative(
                fixture.truth[name][0, h], deriv, what=f"{case.name} truth/{name} head {h}"
            )
