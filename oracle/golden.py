"""Golden fixtures: exact truths of the case catalogue on disk (API skeleton)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cases import Case

__all__ = ["Fixture", "SCHEMA_VERSION", "build", "generate", "verify", "load"]

SCHEMA_VERSION = 1


@dataclass
class Fixture:
    """One case with its inputs and its truth.

    ``options`` are the keywords to pass to an implementation besides q, k, v (arrays such as
    mask and bias included). ``truth`` holds "out", "out_f64", "lse", "lse_f64" and, for
    grads cases, "dq", "dk", "dv", "dbias" and their "_f64" twins.
    """

    case: Case
    inputs: dict[str, np.ndarray]
    options: dict[str, Any]
    truth: dict[str, np.ndarray]
    truth_kind: str = "exact-ziv"


def build(case: Case) -> Fixture:
    """Compute the fixture of ``case`` in memory (the exact path)."""
    raise NotImplementedError


def generate(suite: str, out_dir, *, dtypes: Iterable[str] | None = None, workers: int = 1,
             progress: bool = True, cases: Iterable[Case] | None = None) -> Path:
    """Write one .npz per case and manifest.json into ``out_dir``; return its path."""
    raise NotImplementedError


def verify(directory) -> list[str]:
    """Problems found in a fixture directory (empty list = valid)."""
    raise NotImplementedError


def load(directory, *, names: Iterable[str] | None = None) -> Iterator[Fixture]:
    """Yield the fixtures stored in ``directory`` (all, or those in ``names``)."""
    raise NotImplementedError
