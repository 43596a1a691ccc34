"""Implementations that refuse cases in a framework's own words (tests/meta/test_refusals.py):
a refusal is "unsupported" with the message, anything else stays "error" or "fail"."""

from __future__ import annotations

from oracle.reading.baseline import textbook_attention

__all__ = ["refuses_gqa", "says_bad_value", "index_error", "drops_a_column", "asserts_shape"]


def _attend(q, k, v, return_lse=False, **options):
    result = textbook_attention(q, k, v, **options)
    return (result.out, result.lse) if return_lse else result.out


def refuses_gqa(q, k, v, **options):
    """Refuses grouped heads as many kernels do: ValueError "... must match"."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"number of heads of q ({q.shape[1]}) and k ({k.shape[1]}) must match")
    return _attend(q, k, v, **options)


def asserts_shape(q, k, v, **options):
    """An assert that reads as a refusal: "only supports"."""
    assert q.shape[1] == k.shape[1], "this kernel only supports H == K"
    return _attend(q, k, v, **options)


def says_bad_value(q, k, v, **options):
    """A ValueError whose message is no refusal: an error."""
    raise ValueError("bad value in the softmax")


def index_error(q, k, v, **options):
    """A crash-like exception (IndexError, even with refusal words): an error."""
    raise IndexError("index 9 is out of bounds: must be below 8")


def drops_a_column(q, k, v, **options):
    """Returns an output one column short: a wrong shape is an error, never a refusal."""
    out = _attend(q, k, v, **options)
    return (out[0][..., :-1], out[1]) if isinstance(out, tuple) else out[..., :-1]
