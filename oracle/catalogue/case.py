"""A case of the catalogue: its sizes, dtype, options, input recipe and seed, as JSON.

Examples
--------
>>> case = Case("demo-f32", ("smoke",), "conformance", "float32", Shapes(1, 2, 2, 3, 5, 4, 4),
...             seed=seed_of("demo-f32"))
>>> Case.from_spec(case.spec()) == case, case.shapes.tag()
(True, 'H2K2-L3S5-D4E4')
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Shapes", "Case", "seed_of"]


class Shapes(NamedTuple):
    """Sizes of one case: q (batch, H, L, D), k (batch, K, S, D), v (batch, K, S, E)."""

    batch: int
    H: int
    K: int
    L: int
    S: int
    D: int
    E: int

    def tag(self) -> str:
        """Readable shape part of a case name, e.g. ``B2H8K2-L37S64-D16E8``."""
        batch = f"B{self.batch}" if self.batch != 1 else ""
        return f"{batch}H{self.H}K{self.K}-L{self.L}S{self.S}-D{self.D}E{self.E}"


@dataclass(frozen=True, eq=True)
class Case:
    """One named case: everything needed to rebuild its inputs and its truth.

    Attributes
    ----------
    name : str
        Unique, stable, readable: ``<tag>-<shapes>-<dtype>``.
    suites : tuple of str
        Suites the case belongs to (smoke is within default, default within full).
    category : {"conformance", "robustness"}
    dtype : {"float64", "float32", "float16", "bfloat16"}
        Dtype of the floating inputs and of the rounded truth ``out`` (an fp8 case, recipe
        key ``fp8``, is a bfloat16 case whose q, k, v are float8 with float32 descales).
    shapes : Shapes
    options : mapping
        Scalar keywords of ``refattn.attention`` (scale, causal, window, align, softcap, gqa,
        empty_rows, dropout_p); array keywords come from :func:`oracle.catalogue.make_inputs`.
    recipe : mapping
        How the inputs are built (see :mod:`oracle.catalogue.attention` and
        :mod:`oracle.catalogue.variants`).
    seed : int
        Derived from the name (sha256), so renumbering the catalogue changes nothing.
    grads : bool
        The fixture also holds the exact gradients (refattn.attention_vjp).
    description : str
        One line.
    function : str
        The refattn function whose exact path is the truth ("attention"; variants add more).
    """

    name: str
    suites: tuple[str, ...]
    category: str
    dtype: str
    shapes: Shapes
    options: Mapping[str, Any] = field(default_factory=dict)
    recipe: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    grads: bool = False
    description: str = ""
    function: str = "attention"

    def __hash__(self) -> int:
        return hash(self.name)

    def spec(self) -> dict:
        """JSON-ready description (tuples as lists); inverse of :meth:`from_spec`."""
        return {
            "name": self.name,
            "suites": list(self.suites),
            "category": self.category,
            "dtype": self.dtype,
            "shapes": dict(self.shapes._asdict()),
            "options": {k: _jsonable(v) for k, v in sorted(self.options.items())},
            "recipe": {k: _jsonable(v) for k, v in sorted(self.recipe.items())},
            "seed": self.seed,
            "grads": self.grads,
            "description": self.description,
            "function": self.function,
        }

    def spec_json(self) -> str:
        """Canonical JSON of :meth:`spec` (sorted keys, no whitespace variation)."""
        return json.dumps(self.spec(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_spec(cls, spec: Mapping) -> Case:
        """Rebuild a case from :meth:`spec` output (or its JSON, parsed)."""
        options = dict(spec.get("options", {}))
        if options.get("window") is not None:
            options["window"] = tuple(options["window"])
        return cls(
            name=spec["name"],
            suites=tuple(spec["suites"]),
            category=spec["category"],
            dtype=spec["dtype"],
            shapes=Shapes(**spec["shapes"]),
            options=options,
            recipe=dict(spec.get("recipe", {})),
            seed=int(spec["seed"]),
            grads=bool(spec.get("grads", False)),
            description=spec.get("description", ""),
            function=spec.get("function", "attention"),
        )


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        raise ValueError(f"case spec: non-finite value {value!r} is not JSON")
    return value


def seed_of(name: str) -> int:
    """The seed of a case: the first 8 bytes of sha256(name), little endian, as an int."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
