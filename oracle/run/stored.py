"""Cases of a fixture directory judged by a supervised worker that reads the fixtures itself.

Sending each fixture to the worker costs more than some implementations take on it: the
float32 cases of ``default`` pickle to about 220 MB (the long rows' inputs), copied through a
pipe case by case while the worker waits. When :func:`oracle.run.validate.validate` runs a
fixture directory in one supervised worker (no invariance checks, no memory limit), the
selected cases are :class:`StoredCases` instead: the worker is sent one :class:`Batch` (the
directory, the case names and each case's reproduce command), reads the fixtures itself with
:func:`oracle.fixtures.golden.load` (the same checks, the same errors) and streams the results
back, one message per case, while this process reports them.

Protocol, worker to parent, per case: progress notes, then one message, ``("result",
(features, CaseResult))`` or ``("error", (features, line))`` as for single cases
(:mod:`oracle.run.supervise`), ``features`` being the case's ``(features, shape classes)``
(the coverage table's entries); ``("raise", exception)`` when a fixture cannot be read (raised
here where the run reaches that case, as reading it here would have). A fixture whose reading
kept the worker waiting more than :data:`ANNOUNCE_AFTER` seconds is announced first, ``("case",
features)``, so that its case's timeout starts after the reading. One message a case, not
two (the 238 float32 cases of ``default``: 238 messages, not 476): each wakes this process,
which then competes with the worker for the machine's cores. Between cases the worker looks
for the parent's stop request (``None``).

Isolation is that of single cases: a case whose call exits, crashes, hangs (the timeout runs
from the previous case's answer, or from the case's ``"case"`` message: it includes at most
:data:`ANNOUNCE_AFTER` seconds of its fixture's reading) or exhausts memory is an "error"
with the reason (its features read here, from its fixture), and a new worker takes the batch
on from the next case.

Examples
--------
>>> import tempfile
>>> from oracle import catalogue
>>> from oracle.fixtures import golden
>>> from oracle.run.validate import validate
>>> out = golden.generate("smoke", tempfile.mkdtemp(), progress=False,
...                       cases=[catalogue.get("basic-H2K2-L5S7-D8E8-f64")])
>>> report = validate("refattn-float64", fixtures=out, dtype="float64", progress=False)
>>> [(r.name, r.verdict, r.features) for r in report.results]
[('basic-H2K2-L5S7-D8E8-f64', 'pass', [])]
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

__all__ = ["StoredCases", "Batch", "serve_batch", "ANNOUNCE_AFTER"]

#: seconds the worker may wait for a fixture's reading before it announces the case
#: (``("case", features)``): the case's timeout then starts after the reading
ANNOUNCE_AFTER = 0.05


class StoredCases:
    """The cases ``names`` (their :class:`~oracle.catalogue.Case` in ``cases``) of the fixture
    directory ``directory``, to be read by the worker that judges them."""

    def __init__(self, directory, names, cases):
        self.directory, self.names, self.cases = str(directory), list(names), list(cases)

    def __len__(self) -> int:
        return len(self.names)

    def __bool__(self) -> bool:
        return bool(self.names)

    def __iter__(self):
        return iter(self.cases)


@dataclass(frozen=True)
class Batch:
    """One request for the cases ``names`` of ``directory``: judge each (with its
    ``reproduce`` command) and answer case by case; without ``keep_arrays`` the passing
    checks travel without their per-element arrays."""

    directory: str
    names: tuple
    reproduce: tuple
    grads: bool
    diagnose: object
    tolerance: str
    keep_arrays: bool = True


def serve_batch(impl, batch, receive, send, judge, one_line) -> bool:  # pragma: no cover
    """Worker side: judge the batch's cases with ``judge(impl, request)`` (the worker's
    single-case request tuple), answering each; False when the parent asked to stop."""
    # worker side: loaded after the memory limit and only by a worker given a batch
    from oracle.fixtures import golden
    from oracle.judging import parts
    from oracle.reading.features import case_features

    # each fixture (hashed, its judging parts too) read here, before its case: the reading
    # is Python work under the interpreter lock, which a reading thread traded with the
    # judging thousands of times a run (2600-6400 voluntary context switches of the worker
    # over the float32 cases of default, against about 250 read here; wall 1.6-1.9 s against
    # 1.9-2.1 s for refattn-float64 at load 2); the implementation's calls are left alone
    names = _part_names(batch)
    fixtures = _keyed(golden.load(batch.directory, names=batch.names), names)
    for reproduce in batch.reproduce:
        if receive.poll():
            request = receive.recv()
            if request is None:
                return False
        waited = time.perf_counter()
        try:
            fixture = next(fixtures)
        except Exception as exc:  # noqa: BLE001 - the parent raises it where the run reaches it
            send(("raise", _picklable(exc, one_line)))
            return True
        features = case_features(fixture.case, batch.grads, fixture.inputs)
        if time.perf_counter() - waited > ANNOUNCE_AFTER:  # the case's timeout starts now
            send(("case", features))
        request = (fixture, batch.grads, batch.diagnose, reproduce, None, batch.tolerance)
        try:
            result = judge(impl, request)
        except BaseException as exc:  # noqa: BLE001 - the case's verdict is "error"
            send(("error", (features, f"the implementation raised {one_line(exc)}")))
        else:
            send(("result", (features, result if batch.keep_arrays else _lightened(result))))
        parts.forget_ahead(fixture.content_key, names)
    return True


def _lightened(result):  # pragma: no cover - worker side
    """``result`` (and its tight twin) with its passing checks lightened."""
    for found in (result, getattr(result, "tight", None)):
        for check in getattr(found, "checks", {}).values():
            check.lighten()
    return result


def _part_names(batch) -> tuple:
    """The judging parts (:mod:`oracle.judging.parts`) the batch's cases may use."""
    # worker side, as in serve_batch
    from oracle.judging.parts import with_models

    tiers = ("default", "tight") if batch.tolerance == "both" else (batch.tolerance,)
    return (*(with_models(t) for t in tiers), *(("grads",) if batch.grads else ()))


def _keyed(fixtures, names):  # pragma: no cover - worker side
    """The fixtures, each with its content key as ``content_key`` (computed once, as soon as
    it is read: :func:`oracle.reading.case.loaded_key`, from the sha256 of its file that
    :func:`oracle.fixtures.golden.load` checked, not by hashing its arrays again) and its
    judging parts ``names`` read ahead from the disk cache."""
    # worker side, as in serve_batch
    from oracle.judging import parts
    from oracle.reading.case import loaded_key

    for fixture in fixtures:
        fixture.content_key = loaded_key(fixture)
        parts.read_ahead(fixture, fixture.content_key, names)
        yield fixture


def _picklable(exc, one_line):  # pragma: no cover - worker side
    """``exc`` if it survives pickling, else a FixtureError with its line."""
    # worker side, as in serve_batch
    from oracle.fixtures.golden import FixtureError

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception that cannot travel is described
        return FixtureError(one_line(exc))
    return exc
