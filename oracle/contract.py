"""The precision contract written into every fixture folder's ``manifest.json``.

A fixture read without refattn must say what it promises: what each truth member is (the
exact real result of the case rounded once, to which dtype, how ties go), which conventions
define the case (docs/conventions.md of which refattn version), how an implementation is judged
(the tolerance tiers of :mod:`oracle.tolerance`) and how inputs that are not stored are rebuilt.

Examples
--------
>>> from oracle import catalogue
>>> case_contract(catalogue.get("basic-H2K2-L5S7-D8E8-f32"))["rounded_to"]
'float32'
"""

from __future__ import annotations

import refattn

from .catalogue.case import Case

__all__ = ["folder_contract", "case_contract"]

_TIERS = {
    "default": "T2: error normalised by the natural scale sum_j w_ij |v_je| (T1) within "
    "max(k E_base, F) + u_out, E_base the error of the same-dtype textbook implementation "
    "(FlashAttention's test rule generalised), F the floor of a correct float32-accumulating "
    "algorithm; free of false alarms for any correct algorithm (oracle/tolerance.py)",
    "tight": "T7: the expected error of a correct float32-accumulating tiled kernel on the "
    "case; narrower accumulation fails (oracle/tolerance.py)",
}


def folder_contract(truth_kind: str) -> dict:
    """The folder-wide part: truth definition, conventions, tiers, versions."""
    return {
        "truth": "every truth member is the exact real result of the case under "
        "docs/conventions.md, rounded once to the member's dtype (the case dtype; <name>_f64 "
        "to float64), round to nearest, ties to even; not the output of any floating-point "
        "algorithm",
        "truth_kind": truth_kind,
        "conventions": f"docs/conventions.md of refattn {refattn.__version__}",
        "conventions_version": refattn.__version__,
        "refattn_version": refattn.__version__,
        "tolerance_tiers": dict(_TIERS),
        "categories": {
            "conformance": "the pinned semantics: a disagreeing implementation is wrong or "
            "uses another convention",
            "robustness": "NaN/Inf poison at excluded positions: fails only under --strict",
            "refusal": "malformed inputs (shapes that do not fit, kv_lengths past S...) a "
            "kernel must refuse with an error; no truth (truth_kind 'refusal', expect "
            "'refuse'): an implementation that returns an array fails, only under --strict",
        },
        "regenerated_inputs": "a case whose fixture has a 'regenerated' member stores no "
        "inputs: they are rebuilt from the case spec and seed (oracle.catalogue.make_inputs; "
        "SplitMix64 streams, oracle/catalogue/seeding.py and attention_long_inputs.py) and "
        "checked against the recorded sha256 of their npy bytes",
    }


def case_contract(case: Case) -> dict:
    """The per-case part: the dtypes of its truths and how they were rounded (a refusal
    case: what it expects instead)."""
    if case.category == "refusal":
        return {
            "expect": "refuse",
            "truth": "none: the inputs are malformed (see the case description); a correct "
            "implementation raises an error instead of returning an array",
            "inputs": "stored",
            "gradients": False,
        }
    return {
        "rounded_to": case.dtype,
        "also_float64": "the _f64 members",
        "rounding": "once, to nearest, ties to even",
        "inputs": "regenerated" if case.recipe.get("compact") else "stored",
        "gradients": bool(case.grads),
    }
