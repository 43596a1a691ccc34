"""The option table of refattn.attention (:data:`refattn.spec.OPTIONS`) and the signatures
that state it: attention and attention_vjp keep explicit keyword parameters (for users and
IDEs), and those must be the table, with the table's defaults."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import refattn
from refattn import spec
from refattn.transformer import ATTENTION_KEYWORDS

#: keyword parameters of attention / attention_vjp that are about the call, not the problem
CALL_KEYWORDS = {
    "return_lse",
    "return_weights",
    "precision",
    "out_dtype",
    "backend",
    "lse_base",
    "grad_lse",
}


def _keyword_defaults(function) -> dict:
    parameters = inspect.signature(function).parameters.values()
    return {
        p.name: p.default
        for p in parameters
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in CALL_KEYWORDS
    }


@pytest.mark.parametrize("function", [refattn.attention, refattn.attention_vjp])
def test_signature_is_the_table(function):
    assert _keyword_defaults(function) == spec.defaults()
    assert tuple(_keyword_defaults(function)) == spec.option_names()


def test_table_rows_are_well_formed():
    names = spec.option_names()
    assert len(set(names)) == len(names)
    fields = {field.name for field in dataclasses.fields(spec.AttentionSpec)}
    for row in spec.OPTIONS:
        assert row.kind in spec.OPTION_KINDS, row
        assert row.into in spec.FOLDS, row
        assert (row.kind == "choice") == bool(row.choices), row
        assert row.kind != "choice" or row.default in row.choices, row
        assert (row.kind == "per-head") == bool(row.unit), row
        # an option keeps its own spec field unless it folds into the inputs or the indices
        assert (row.name in fields) or row.into in ("inputs", "indices"), row
        assert row.doc and row.doc == row.doc.strip(), row
        # an array option (all kinds but the scalar ones and the per-head arrays) has a batch
        has_batch = row.is_array and row.kind != "per-head"
        assert (row.batch_axis is not None) == has_batch, row
        assert set(spec.SCALAR_KINDS) <= set(spec.OPTION_KINDS)
    grads = [row.gradient for row in spec.OPTIONS if row.gradient]
    assert set(grads) <= set(refattn.AttentionLatentGrads._fields)


def test_helpers():
    assert spec.option("softcap").kind == "positive float"
    with pytest.raises(KeyError, match="'nope' is not an option"):
        spec.option("nope")
    assert spec.defaults("interval") == {
        "causal": False,
        "window": None,
        "align": "top_left",
        "kv_lengths": None,
    }
    assert spec.field_defaults("indices") == {"key_indices": None, "index_reading": "set"}
    scope = dict(spec.defaults(), q=1, other=2)
    assert spec.options_in(scope) == spec.defaults()


def test_transformer_passes_the_marked_options():
    assert ATTENTION_KEYWORDS == tuple(r.name for r in spec.OPTIONS if r.core)


def test_canonicalize_refuses_an_unknown_keyword():
    q = np.zeros((2, 3))
    with pytest.raises(TypeError, match="canonicalize\\(\\) got an unexpected keyword argument"):
        spec.canonicalize(q, q, q, casual=True)


def test_canonicalize_takes_q_k_v_as_keywords():
    q = np.zeros((2, 3))
    assert spec.canonicalize(q=q, k=q, v=q, causal=True).causal is True


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("scale", "x", TypeError, "scale"),
        ("softcap", 0.0, ValueError, "softcap"),
        ("dropout_p", 1.0, ValueError, "dropout_p: expected a value in \\[0, 1\\)"),
        ("dropout_p", 0.5, ValueError, "dropout_mask: dropout is deterministic"),
        ("causal", 1, TypeError, "causal: expected a bool"),
        ("align", "middle", ValueError, "align: expected one of"),
        ("alibi_slopes", np.array([np.inf]), ValueError, "alibi_slopes: expected finite slopes"),
        ("sinks", np.zeros(2), ValueError, "one logit per query head"),
        ("kv_lengths", np.array([5]), ValueError, "kv_lengths: expected shape"),
        ("mask", np.zeros((2, 2)), TypeError, "mask: expected a boolean array"),
        ("index_reading", "bag", ValueError, "index_reading: expected one of"),
    ],
)
def test_each_kind_names_its_option(name, value, error, message):
    q = np.zeros((2, 3))
    with pytest.raises(error, match=message):
        spec.canonicalize(q, q, q, **{name: value})
