"""A worker judging a fixture directory: its fixture reader waits while the implementation runs
(oracle.judging.quiet), and without ``keep_arrays`` the passing checks travel without their
per-element arrays, with the same report."""

from __future__ import annotations

import copy
import gc
import json
import os
import threading
import time

import numpy as np
import pytest

from oracle import catalogue
from oracle.fixtures import golden
from oracle.judging import quiet
from oracle.judging.judge import call_forward, check_fixture
from oracle.run.prefetch import Prefetched
from oracle.run.validate import validate
from refattn.attention import attention

PASSING = "basic-H2K2-L5S7-D8E8-f64"
FAILING = "causal-br-H2K2-L4S7-D8E8-f32"


def off_in_float32(q, k, v, **options):
    """refattn's attention, its float32 outputs 1% too large (fails every float32 case)."""
    found = attention(q, k, v, **options)
    out, rest = (found[0], found[1:]) if isinstance(found, tuple) else (found, ())
    if q.dtype == np.float32:
        out = out * 1.01
    return (out, *rest) if rest else out


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixtures")
    golden.generate(
        "smoke", out, progress=False, cases=[catalogue.get(PASSING), catalogue.get(FAILING)]
    )
    return out


def test_the_reader_waits_while_the_implementation_runs():
    read = []

    def source():
        for item in range(3):
            read.append(item)
            yield item

    with quiet.implementation_call():
        assert quiet.running() and not quiet.wait_quiet(0)
        items = Prefetched(source(), 3, pause=quiet.wait_quiet)
        time.sleep(0.05)
        assert read == []  # nothing read while the call runs
    assert list(items) == [0, 1, 2] and not quiet.running()


def test_the_judge_marks_the_forward_as_the_implementation_call():
    seen = []

    def impl(q, k, v, **options):
        seen.append(quiet.running())
        return attention(q, k, v, **options)

    q = np.ones((1, 1, 2, 4))
    call_forward(impl, q, q, q, {})
    assert seen == [True, True] or seen == [True]
    assert not quiet.running()


def test_concurrent_calls_keep_the_reader_waiting_until_the_last_ends():
    entered, leave = threading.Event(), threading.Event()

    def other():
        with quiet.implementation_call():
            entered.set()
            leave.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(5)
    with quiet.implementation_call():
        pass
    assert quiet.running()  # the other call still runs
    leave.set()
    thread.join()
    assert quiet.wait_quiet(1)


def test_a_lightened_passing_check_reports_the_same(directory):
    (fixture,) = golden.load(directory, names=[PASSING])
    result = check_fixture(attention, fixture, tolerance="both")
    assert result.verdict == "pass"
    for found in (result, result.tight):
        for check in found.checks.values():
            light = copy.deepcopy(check)
            light.lighten()
            assert light.errors is None and np.ndim(light.threshold.floor) == 0
            assert light.to_dict() == check.to_dict()
            assert light.grade is not None  # the report pools the ulps


def _report(directory, keep_arrays, tolerance="default"):
    report = validate(
        f"{__name__}:off_in_float32",
        fixtures=directory,
        dtype=None,
        tolerance=tolerance,
        progress=False,
        keep_arrays=keep_arrays,
    )
    assert report.isolated
    return report


def _without_times(text):
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("seconds", "generated")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(json.loads(text))


@pytest.mark.parametrize("tolerance", ["default", "both"])
def test_without_arrays_the_report_is_the_same(directory, tolerance):
    kept, light = _report(directory, True, tolerance), _report(directory, False, tolerance)
    pairs = [(kept, light)] + ([(kept.tight, light.tight)] if tolerance == "both" else [])
    for full, lean in pairs:
        assert _without_times(lean.to_json()) == _without_times(full.to_json())
        verdicts = {r.name: r.verdict for r in lean.results}
        assert verdicts == {PASSING: "pass", FAILING: "fail"}
        for result in lean.results:
            for check in result.checks.values():
                # a failing check keeps its arrays: its explanation and plots read them
                assert (check.errors is None) == check.passed, (result.name, check.quantity)
        assert [r.explain() for r in lean.results] == [r.explain() for r in full.results]


def test_read_bytes_gives_the_file_in_one_writable_buffer(tmp_path):
    from oracle.fixtures.npz import read_bytes

    path = tmp_path / "data.bin"
    for content in (b"", b"x", bytes(range(256)) * 4099):
        path.write_bytes(content)
        found = read_bytes(path)
        assert isinstance(found, bytearray) and found == content


def _report_freeze_count(read_fd, write_fd):
    os.write(write_fd, str(gc.get_freeze_count()).encode())


def test_a_forked_worker_leaves_the_parents_objects_to_the_parent():
    from oracle.run.forked import fork_worker

    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    before = gc.get_freeze_count()
    child = fork_worker(_report_freeze_count, to_child_r, to_parent_w, (to_child_w, to_parent_r))
    os.close(to_parent_w)
    os.close(to_child_r)
    try:
        frozen = int(os.read(to_parent_r, 64) or b"0")
        assert child.wait(60) == 0
    finally:
        os.close(to_parent_r)
        os.close(to_child_w)
    assert frozen > 0  # the child's collections skip the objects it shares with the parent
    assert gc.get_freeze_count() == before  # the parent's collect them as before
