"""The time budget of a failing case's diagnosis, bounded by the case's own judging time.

A diagnosis re-evaluates the case under each named alternative reading
(:mod:`oracle.diagnose.diagnosis`): one float64 textbook evaluation per reading (pairs of
readings on small cases), each as costly as the float64 truth the judge already computed. On
long rows (S up to 128k keys) dozens of readings cost minutes where the judging took seconds.
The budget bounds them:

* a diagnosis may take ``multiple`` times the case's judging time (the implementation's call
  and the judge; :data:`DEFAULT_MULTIPLE`, 1.5), and at least :data:`FLOOR_SECONDS` (one
  second);
* readings are evaluated cheapest and likeliest first; every reading whose evaluation is cheap
  (:data:`CHEAP_WORK` multiply-adds or fewer) is always tried, so the diagnosis of a small case
  never depends on the machine's load;
* a reading that is not cheap is started only when the time left covers it: its work times
  the slowest rate (seconds per multiply-add) the case's evaluations have shown so far
  (:meth:`CaseBudget.allows`), so the reading in progress seldom runs past the deadline;
* the first reading that explains the failure on the whole case ends the search for further
  costly readings (:func:`oracle.diagnose.diagnosis.diagnose`; cheap readings are still all
  tried, so a small case keeps every name it matches);
* the steps of a diagnosis outside the readings (the lse readings, the lower-precision models,
  the readings at a narrower precision, where the failing rows concentrate, the
  narrow-accumulation models, the fp4 misreadings) draw on the same budget
  (:meth:`CaseBudget.step`): the budget is for the whole diagnosis of a case. The steps that
  come after the readings keep their time from them (:meth:`CaseBudget.reserve`), and every
  step of a case whose readings are cheap is cheap too;
* a diagnosis that ran out of budget says so in one line with what it tried
  (:meth:`CaseBudget.notes`), e.g. "diagnosis stopped after 4.5 s (budget 1.5x judging): tried
  7 of 23 readings on 2 of 2 rows, concentration; skipped narrow accumulation; none matched".

The per-case record also keeps each reading's evaluation (``CaseBudget.memo``): the judge asks
the same readings again at narrower working precisions, which then cost nothing; and, while the
case is open, its k and v as every reading converts them (:meth:`CaseBudget.prepared`, a
:class:`~oracle.reading.baseline.PreparedKV`), dropped when the case closes.

:func:`case_budget` opens the record around one case's diagnosis (the judge does,
:func:`oracle.judging.judge.check_fixture`); :func:`current` is the open one, or an unbounded
record outside a case. :func:`set_reporter` installs a function that receives one-line progress
notes ("diagnosing <case>: reading 7 of 23"): the progress bar of :func:`oracle.run.validate`.
:func:`recording` collects the closed records (judging and diagnosis seconds of each case):
tools/bench_diagnose.py's per-case ratios.

Examples
--------
>>> with case_budget(DiagnosisBudget(multiple=5.0), judging_seconds=2.0, name="c") as spent:
...     spent.seconds
10.0
>>> DiagnosisBudget.of(True).multiple == DEFAULT_MULTIPLE, DiagnosisBudget.of(math.inf).bounded
(True, False)
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

from oracle.reading.baseline import PreparedKV

__all__ = [
    "DiagnosisBudget",
    "CaseBudget",
    "case_budget",
    "current",
    "set_reporter",
    "recording",
    "DEFAULT_MULTIPLE",
    "FLOOR_SECONDS",
    "CHEAP_WORK",
]

#: A diagnosis may take this many times its case's judging time (``diagnose_budget=`` of
#: :func:`oracle.run.validate`, ``--diagnose-budget`` of ``refattn-oracle validate``). A case
#: whose failure no reading explains spends its whole budget, and the step in progress runs up
#: to a sixth past it (measured): a kernel whose every case fails unexplained makes ``validate``
#: take at most about 1 + 1.5 x 1.15 = 2.7 times its time without diagnoses, under the 3x a
#: diagnosing run may cost. At 2 that bound was 3.3x, and the planted long-row kernels of
#: ``power``, two thirds of whose judging time goes to cases no reading explains, measured
#: 2.35-2.55x within one run and just over 3x when the load rose between the two runs; at 1.5,
#: 1.5-2.25x (tools/bench_diagnose.py; docs/validating.md has the names it costs).
DEFAULT_MULTIPLE = 1.5
#: Seconds a diagnosis may take whatever its judging took (a case judged in milliseconds). It
#: matters only to a case judged in under ``FLOOR_SECONDS / multiple`` whose readings are not
#: cheap (cheap ones run whatever the budget): it gives such long-row cases about 3x their
#: judging time, under a second per kernel in all (0.02-0.04 of a kernel's ratio,
#: tools/bench_diagnose.py's per-case figures). A quarter of a second was tried and left a
#: 130-row, 300-key case of a planted split-KV kernel (5 M multiply-adds a reading, over
#: :data:`CHEAP_WORK`) unnamed under a loaded test run: the floor keeps the diagnoses of small
#: and mid-sized cases independent of the machine's load.
FLOOR_SECONDS = 1.0
#: Multiply-adds (rows x S x (D + E)) of one reading's evaluation under which it is always
#: tried, budget or not: the diagnosis of a small case is the same on any machine.
CHEAP_WORK = 2**21
#: Seconds between two progress notes of one diagnosis.
NOTE_INTERVAL = 1.0


@dataclass(frozen=True)
class DiagnosisBudget:
    """How long a failing case's diagnosis may take: ``multiple`` times its judging time
    (``math.inf``: unbounded), at least ``floor`` seconds. Picklable: it travels to the
    supervised worker as the ``diagnose`` argument of the judge."""

    multiple: float = DEFAULT_MULTIPLE
    floor: float = FLOOR_SECONDS

    def __post_init__(self):
        if isinstance(self.multiple, bool) or not (
            isinstance(self.multiple, (int, float)) and self.multiple > 0
        ):
            raise ValueError(
                f"diagnose_budget: expected a multiple of the judging time > 0 (math.inf: "
                f"unbounded), got {self.multiple!r}"
            )

    @classmethod
    def of(cls, setting) -> DiagnosisBudget:
        """The budget a ``diagnose`` / ``diagnose_budget`` setting names: True or None the
        default, a number the multiple, a budget itself."""
        if isinstance(setting, cls):
            return setting
        if setting is True or setting is None:
            return cls()
        return cls(multiple=setting)

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.multiple)

    def seconds(self, judging_seconds: float) -> float:
        """The seconds a diagnosis of a case judged in ``judging_seconds`` may take."""
        return max(self.multiple * max(judging_seconds, 0.0), self.floor)


@dataclass
class CaseBudget:
    """The diagnosis of one case: its deadline (``seconds`` from ``start``), what it tried, the
    memo of its readings, and once closed its ``judging`` and ``elapsed`` seconds."""

    budget: DiagnosisBudget
    seconds: float
    name: str = ""
    start: float = field(default_factory=time.perf_counter)
    tried: int = 0
    total: int = 0
    rows: tuple = (0, 0)
    stopped: bool = False
    memo: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    reserved: dict = field(default_factory=dict)
    rate: float = 0.0
    judging: float = 0.0
    elapsed: float = 0.0
    _noted: float = 0.0
    _prepared: dict = field(default_factory=dict)

    def prepared(self, k, v) -> PreparedKV:
        """The case's :class:`~oracle.reading.baseline.PreparedKV` of ``k`` and ``v`` (one per
        pair of arrays, kept with them until the case closes)."""
        key = (id(k), id(v))
        if key not in self._prepared:
            self._prepared[key] = PreparedKV(k, v)
        return self._prepared[key]

    def left(self) -> float:
        """Seconds left (inf when unbounded)."""
        return self.seconds - (time.perf_counter() - self.start)

    def allows(self, work: float) -> bool:
        """May a reading costing ``work`` multiply-adds be evaluated now? Cheap ones always;
        others while the time left covers ``work`` at the slowest rate seen so far. A refusal
        marks the diagnosis as stopped."""
        if work <= CHEAP_WORK or self._covers(work):
            return True
        self.stopped = True
        return False

    def _covers(self, work: float) -> bool:
        """Does the time left cover ``work`` and the steps reserved, at the slowest rate?"""
        return self.left() > self.rate * (work + sum(self.reserved.values()))

    def measured(self, work: float, seconds: float) -> None:
        """Record that an evaluation of ``work`` multiply-adds took ``seconds``."""
        if work > 0:
            self.rate = max(self.rate, seconds / work)

    def reserve(self, name: str, work: float) -> None:
        """Keep time for the step ``name`` to come (about ``work`` multiply-adds at the
        readings' rate): the readings before it stop short of it (:meth:`allows`)."""
        if work > CHEAP_WORK:
            self.reserved[name] = work

    def step(self, name: str, work: float) -> bool:
        """May the step ``name`` (outside the readings, about ``work`` multiply-adds) run?
        As :meth:`allows` (cheap steps always); a step with time reserved for it runs while
        the deadline has not passed. Records it as tried or skipped."""
        kept = self.reserved.pop(name, None) is not None
        allowed = work <= CHEAP_WORK or (self.left() > 0 if kept else self._covers(work))
        if not allowed:
            self.stopped = True
        self.steps.setdefault(name, allowed)
        return allowed

    def reading(self, index: int, total: int) -> None:
        """Record that reading ``index`` (1-based) of ``total`` is being evaluated."""
        self.tried, self.total = max(self.tried, index), max(self.total, total)
        now = time.perf_counter()
        if _reporter is not None and self.name and now - self._noted >= NOTE_INTERVAL:
            self._noted = now
            _reporter(f"diagnosing {self.name}: reading {index} of {total}")

    def notes(self, found: bool) -> list[str]:
        """One line when the diagnosis stopped on its budget, else none."""
        if not self.stopped:
            return []
        spent = time.perf_counter() - self.start
        sampled, rows = self.rows
        on = f" on {sampled} of {rows} rows" if rows else ""
        tried = "".join(f", {n}" for n, ran in self.steps.items() if ran)
        skipped = [n for n, ran in self.steps.items() if not ran]
        return [
            f"diagnosis stopped after {spent:.1f} s (budget {self.budget.multiple:g}x judging): "
            f"tried {self.tried} of {self.total} readings{on}{tried}; "
            + (f"skipped {', '.join(skipped)}; " if skipped else "")
            + ("the readings above matched" if found else "none matched")
        ]


_UNBOUNDED = DiagnosisBudget(multiple=math.inf)
_open: list[CaseBudget] = []
_reporter = None
_recorders: list[list] = []


def current() -> CaseBudget:
    """The open case's budget, or a fresh unbounded one (a direct call of a diagnosis)."""
    return _open[-1] if _open else CaseBudget(_UNBOUNDED, math.inf)


@contextlib.contextmanager
def case_budget(setting, judging_seconds: float, name: str = ""):
    """Open the budget of one case's diagnosis (``setting`` as :meth:`DiagnosisBudget.of`)."""
    budget = DiagnosisBudget.of(setting)
    spent = CaseBudget(budget, budget.seconds(judging_seconds), name)
    spent.judging = max(judging_seconds, 0.0)
    if _reporter is not None and name:
        _reporter(f"diagnosing {name}")
        spent._noted = time.perf_counter()
    _open.append(spent)
    try:
        yield spent
    finally:
        _open.remove(spent)
        spent._prepared.clear()  # the case's prepared arrays go with it
        spent.elapsed = time.perf_counter() - spent.start
        for kept in _recorders:
            kept.append(spent)


@contextlib.contextmanager
def recording():
    """Collect the record (:class:`CaseBudget`) of every case diagnosed in this process while
    open, closed: its ``judging`` and ``elapsed`` seconds, its budget ``seconds`` and whether
    it ``stopped`` (tools/bench_diagnose.py's per-case ratios)."""
    kept: list[CaseBudget] = []
    _recorders.append(kept)
    try:
        yield kept
    finally:
        _recorders.remove(kept)


def set_reporter(reporter) -> object:
    """Install ``reporter(note)`` for progress notes (None: none); returns the previous one."""
    global _reporter
    previous, _reporter = _reporter, reporter
    return previous
