"""Compact fixtures: cases whose inputs are regenerated on load instead of stored.

A long-row case (:mod:`oracle.catalogue.attention_long_families`, recipe key ``compact``) has
millions of inputs but a truth of a few rows; storing its q, k, v would make ``default``'s
fixture folder gigabytes. Its ``.npz`` holds instead a ``regenerated`` member: JSON naming
every input with its dtype, shape and the sha256 of its npy bytes (as :mod:`oracle.golden`
would have stored them, bfloat16 as uint16 bit patterns). :func:`oracle.golden.load` rebuilds
the inputs from the case spec (:func:`oracle.catalogue.make_inputs`: SplitMix64 streams keyed
by the case seed, documented in :mod:`oracle.catalogue.seeding` and
:mod:`oracle.catalogue.attention_long_inputs`) and refuses a fixture whose regenerated input
differs by one bit from the recorded hash. Everything else (truth members, case, meta) is as in
every fixture; fixtures of other cases are byte-identical to earlier releases.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping

import numpy as np

from ._atomic import FixtureError
from .catalogue.case import Case

__all__ = ["MEMBER", "is_compact", "regeneration_record", "regenerate"]

#: The npz member (0-d unicode JSON) listing the regenerated inputs.
MEMBER = "regenerated"


def is_compact(case: Case) -> bool:
    """Whether ``case``'s fixture stores its inputs as a regeneration record."""
    return bool(case.recipe.get("compact"))


def regeneration_record(
    inputs: Mapping[str, np.ndarray], npy_bytes: Callable, storable: Callable
) -> dict:
    """name -> {"dtype", "shape", "sha256" of the npy bytes the input would be stored as}."""
    record = {}
    for name in sorted(inputs):
        array = np.asarray(inputs[name])
        stored, _ = storable(array)
        record[name] = {
            "dtype": array.dtype.name,
            "shape": [int(n) for n in array.shape],
            "sha256": hashlib.sha256(npy_bytes(stored)).hexdigest(),
        }
    return record


def regenerate(
    case: Case, member, npy_bytes: Callable, storable: Callable, file_name: str
) -> dict[str, np.ndarray]:
    """The inputs of ``case`` rebuilt from its spec and checked against the record."""
    from . import catalogue  # the catalogue's builders; imported here to keep load() light

    record = json.loads(str(member))
    inputs = catalogue.make_inputs(case)
    if sorted(inputs) != sorted(record):
        raise FixtureError(
            f"{file_name}: regenerated inputs {sorted(inputs)} differ from the recorded "
            f"{sorted(record)} (fixture written by another catalogue version)"
        )
    for name, expected in record.items():
        stored, _ = storable(inputs[name])
        got = hashlib.sha256(npy_bytes(stored)).hexdigest()
        if got != expected["sha256"]:
            raise FixtureError(
                f"{file_name}: regenerated input {name!r} ({inputs[name].dtype.name}, "
                f"{inputs[name].shape}) has sha256 {got}, the fixture recorded "
                f"{expected['sha256']}: this refattn does not rebuild the inputs it was "
                "written with"
            )
    return inputs
