"""Refusal cases: their (empty) truth and their judge.

A refusal case (category ``"refusal"``, :mod:`oracle.catalogue.attention_refusal_families`)
holds inputs no attention call can give a meaning to: head dims of q and k that differ, a GQA
head count that does not divide, k and v of different key counts, a mask that does not
broadcast, kv_lengths past S... A correct kernel raises; one that returns numbers has read past
a buffer, broadcast silently or truncated.

* Truth: none. :func:`refusal_truth` checks that :func:`refattn.attention` itself refuses the
  inputs (a catalogue case refattn accepts is a bug of the catalogue: generation stops) and
  returns no arrays; the fixture's truth kind is :data:`TRUTH_KIND`.
* Judge (:func:`check_refusal`): the implementation raises -> ``"pass"`` (its message is
  kept); it returns anything -> ``"fail"`` ("accepted inputs a kernel must refuse: ...");
  ``NotImplementedError`` (an option it lacks, or a layout of :mod:`oracle.conventions.layouts` that
  cannot express the malformed inputs) -> ``"unsupported"``; never "pass" for a refusal that
  the oracle's own conversion raised.

A refusal failure fails a validation only under ``--strict`` (as robustness failures do):
real peers do not refuse every case (torch 2.13's ``scaled_dot_product_attention`` returns an
array for k and v of different key counts).

Examples
--------
>>> from oracle import catalogue
>>> from oracle.fixtures import golden
>>> from refattn import attention
>>> fixture = golden.build(catalogue.get("refuse-head-dim-H2K2-L5S7-D8E8-f32"))
>>> fixture.truth, fixture.truth_kind
({}, 'refusal')
>>> check_refusal(attention, fixture).verdict
'pass'
>>> import numpy as np
>>> def careless(q, k, v, **options):
...     return np.zeros(q.shape[:-1] + v.shape[-1:])
>>> print(check_refusal(careless, fixture).message)
accepted inputs a kernel must refuse: D_q=8 != D_k=4; returned an array of shape (1, 2, 5, 8)
"""

from __future__ import annotations

import time

import numpy as np

from oracle.catalogue.attention_refusal_families import CATEGORY, malformation
from oracle.catalogue.case import Case
from oracle.conventions.signatures import declared, get
from oracle.judging.results import CaseResult
from refattn import attention

#: The message of a refusal case a calling convention cannot carry (oracle.conventions.layouts).
NOT_EXPRESSIBLE = "not expressible in this layout"

__all__ = [
    "CATEGORY",
    "TRUTH_KIND",
    "EXPECT",
    "is_refusal",
    "refusal_truth",
    "check_refusal",
    "not_expressible",
]

#: The truth kind of a refusal fixture (manifest entry and fixture ``meta``).
TRUTH_KIND = "refusal"
#: What a refusal case expects of an implementation (the precision contract's ``expect``).
EXPECT = "refuse"


def is_refusal(case: Case) -> bool:
    """Whether ``case`` is a refusal case (no truth; the implementation must raise)."""
    return case.category == CATEGORY


def refusal_truth(case: Case, inputs) -> dict[str, np.ndarray]:
    """No truth arrays; raises RuntimeError when refattn.attention accepts the inputs."""
    options = {**case.options, **{n: x for n, x in inputs.items() if n not in ("q", "k", "v")}}
    try:
        out = attention(inputs["q"], inputs["k"], inputs["v"], **options)
    except (ValueError, TypeError):
        return {}
    raise RuntimeError(
        f"refusal case {case.name}: refattn.attention accepted inputs it must refuse "
        f"({malformation(case, inputs)}) and returned shape {np.shape(out)}"
    )


def check_refusal(impl, fixture, reproduce: str = "", options=None) -> CaseResult:
    """Judge ``impl`` on refusal fixture ``fixture``: "pass" when it raises (see the module
    docstring). ``options``: the keywords to pass (default the fixture's own)."""
    case = fixture.case
    result = CaseResult(case.name, case.category, case.dtype, "pass", description=case.description)
    options = dict(fixture.options if options is None else options)
    inputs = fixture.inputs
    start = time.perf_counter()
    why = not_expressible(case, getattr(impl, "convention", None))
    if why is not None:
        result.verdict, result.message = "unsupported", f"{NOT_EXPRESSIBLE}: {why}"
        return result
    try:
        returned = impl(*(np.copy(inputs[x]) for x in "qkv"), **options)
    except NotImplementedError as err:
        result.verdict, result.message = "unsupported", str(err) or "NotImplementedError"
    except TypeError as err:
        keyword = next((n for n in options if f"'{n}'" in str(err)), None)
        if "keyword argument" in str(err) and keyword is not None:
            result.verdict = "unsupported"
            result.message = f"the implementation does not accept {keyword}= ({err})"
        else:
            result.message = _refused(err)
    except Exception as err:  # noqa: BLE001 - any error is a refusal
        if getattr(err, "oracle_conversion", False):  # raised by oracle.conventions.layouts itself
            result.verdict = "unsupported"
            result.message = f"{NOT_EXPRESSIBLE} ({type(err).__name__}: {err})"
        elif getattr(err, "oracle_returned", False):  # impl returned; its layout unreadable
            result.verdict, result.reproduce = "fail", reproduce
            result.message = (
                f"accepted inputs a kernel must refuse: {malformation(case, inputs)}; "
                f"returned a result its layout cannot read back ({type(err).__name__}: {err})"
            )
        else:
            result.message = _refused(err)
    except SystemExit as err:
        result.verdict = "error"
        result.message = f"the implementation called exit({err.code!r})"
    else:
        result.verdict = "fail"
        result.message = (
            f"accepted inputs a kernel must refuse: {malformation(case, inputs)}; "
            f"returned {_shape_of(returned)}"
        )
        result.reproduce = reproduce
    result.seconds = time.perf_counter() - start
    return result


#: Malformations that live in an option (the others are in the shapes of q, k, v).
_IN_OPTIONS = {
    "mask-shape": "mask",
    "bias-shape": "bias",
    "kv-lengths-long": "kv_lengths",
    "kv-lengths-negative": "kv_lengths",
    "window-fraction": "window",
}
#: Malformations a layout of oracle.conventions.layouts cannot carry (it rebuilds them into a valid
#: call, or has no place for them); bhld and blhd carry every one.
_LAYOUT_CANNOT = {
    "packed": {"mask-shape", "bias-shape", "kv-lengths-long", "kv-lengths-negative", "batch"},
    "paged": {"mask-shape", "bias-shape", "kv-lengths-long", "kv-lengths-negative", "batch"}
    | {"kv-keys", "kv-heads"},
}


def not_expressible(case: Case, convention) -> str | None:
    """Why the calling convention ``convention`` (``impl.convention`` of a function wrapped by
    :func:`oracle.conventions.layouts.wrap`; None: the oracle's own bhld NumPy convention) cannot
    carry the malformed inputs of refusal case ``case`` to the implementation (None if it
    can): the layout rebuilds them (packed and paged turn kv_lengths into sequence lengths, a
    cache has one key count for k and v) or a signature converts the option (a mask folded
    into an attn_mask, a window into the library's own sides) -- the implementation would then
    be judged on a call that is no longer malformed."""
    if not convention:
        return None
    kind, layout = case.recipe["refuse"], convention.get("layout", "bhld")
    if layout not in ("bhld", "blhd", *_LAYOUT_CANNOT):
        return f"layout {layout!r} carries no refusal case"
    if kind in _LAYOUT_CANNOT.get(layout, ()):
        return f"layout {layout!r} cannot carry {kind.replace('-', ' ')}"
    option = _IN_OPTIONS.get(kind)
    if option is None:
        return None
    if "signature" in convention:
        preset = get(convention["signature"])
    else:
        preset = declared(layout, convention.get("causal_align"), convention.get("keywords"))
    if preset is None:
        return None
    rule = preset.keywords.get(option, option if preset.passthrough else None)
    if isinstance(rule, str):
        return None
    if rule is None or type(rule).__name__ == "Refuse":
        return f"{preset.name} takes no {option}="
    return f"{preset.name} converts {option}= (its malformed value would not reach the call)"


def _refused(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"refused: {type(err).__name__}: {text}"[:300]


def _shape_of(returned) -> str:
    if isinstance(returned, (tuple, list)) and returned:
        shapes = ", ".join(str(np.shape(x)) for x in returned)
        return f"a {type(returned).__name__} of arrays of shapes {shapes}"
    return f"an array of shape {np.shape(returned)}"
