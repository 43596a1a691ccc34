"""Every function of tests/registry.py: the exact path is the naive twin rounded once (bit for
bit, in the requested dtype) and the float64 path lies within its documented a-priori bound of
the exact path. The table covers every public function of refattn; the rows without a naive
twin or a bound are listed here, so none is left out silently."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given, settings

import refattn
from tests.helpers import assert_rounds_derivative, assert_same_bits, assert_within
from tests.registry import REGISTRY

# the concept modules whose __all__ functions the table covers (masks, spec and bounds are the
# rules and bounds the rows use, tested in their own files)
CONCEPT_MODULES = ("gmm", "mgk", "hopfield", "meanfield", "transformer", "fixedpoint", "mla")

# rows with no naive twin: each says why in its ``reason`` and where it is checked instead
WITHOUT_TWIN = {
    "allowed_mask",
    "gmm.log_posterior",
    "meanfield.ising_tap",
    "meanfield.adaptive_tap",
    "meanfield.deq_attention",
    "meanfield.ising_tap_vjp",
    "meanfield.adaptive_tap_vjp",
    "meanfield.deq_attention_vjp",
    "meanfield.softmax_couplings_vjp",
    "transformer.multihead_attention_vjp",
    "transformer.encoder_block_vjp",
    "transformer.decoder_block_vjp",
    "transformer.composition",
    "fixedpoint.solve",
    "fixedpoint.relative_residual",
    "merge_states_vjp",
    "linear_attention_vjp",
    "mla.absorbed_inputs",
    "mla.multihead_inputs",
    "mla.output_projection",
    "mla.model_scale",
}
# rows with a twin but no float64 bound of their own
WITHOUT_BOUND = {
    "attention[float32]",
    "attention[float16]",
    "attention[bfloat16]",
    "logspace[float32]",
    "logspace[float16]",
    "logspace[bfloat16]",
    "hopfield.retrieve",
    "hopfield.retrieve_vjp",
    "meanfield.softmax_couplings",
}


def public_functions() -> set[str]:
    """refattn's public functions: top-level ones bare, a concept module's as ``module.name``
    (a top-level re-export of a concept function counts once, under its module)."""
    owners = {}
    for module_name in CONCEPT_MODULES:
        module = getattr(refattn, module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isfunction(value):
                owners[value] = f"{module_name}.{name}"
    names = set(owners.values())
    for name in refattn.__all__:
        value = getattr(refattn, name)
        if inspect.isfunction(value):
            names.add(owners.get(value, name))
    return names


def _settings(examples):
    return settings() if examples is None else settings(max_examples=examples)


def _rows(condition):
    return [pytest.param(e, id=n, marks=e.marks) for n, e in REGISTRY.items() if condition(e)]


def test_every_public_function_has_a_row():
    covered = {function for entry in REGISTRY.values() for function in entry.covers}
    public = public_functions()
    assert covered == public, (
        f"public functions without a row: {sorted(public - covered)}; "
        f"rows for no public function: {sorted(covered - public)}"
    )


def test_rows_without_a_twin_or_bound_are_the_listed_ones():
    without_twin = {name for name, e in REGISTRY.items() if e.naive is None}
    without_bound = {name for name, e in REGISTRY.items() if e.naive and e.bound is None}
    assert without_twin == WITHOUT_TWIN
    assert without_bound == WITHOUT_BOUND
    unexplained = sorted(n for n in without_twin | without_bound if not REGISTRY[n].reason)
    assert not unexplained, f"rows without a twin or bound that do not say why: {unexplained}"


@pytest.mark.parametrize("entry", _rows(lambda e: e.naive is not None))
def test_exact_is_the_rounded_naive_twin(entry):
    @_settings(entry.examples[0])
    @given(case=entry.strategy())
    def check(case):
        exact, naive = entry.exact(case), entry.naive(case)
        if entry.out_dtype is not None:
            assert exact["out"].dtype == entry.out_dtype(case), entry.label(case)
        for name, truth in naive.items():
            what, label = f"{entry.name} exact {name}", entry.label(case)
            if entry.derivative:
                assert_rounds_derivative(exact[name], truth, what=what, case=label)
            else:
                assert_same_bits(exact[name], truth, what=what, case=label)

    check()


@pytest.mark.parametrize("entry", _rows(lambda e: e.bound is not None))
def test_float64_within_its_bound(entry):
    @_settings(entry.examples[1])
    @given(case=(entry.bound_strategy or entry.strategy)())
    def check(case):
        fast, exact = entry.fast(case), entry.exact(case)
        for name, bound in entry.bound(case).items():
            assert_within(
                fast[name],
                exact[name],
                bound,
                what=f"{entry.name} float64 {name}",
                case=entry.label(case),
            )

    check()
