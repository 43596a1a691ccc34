"""oracle.run.invariance: planted reproducibility bugs are caught, each by its own check, and
implementations without them pass."""

from __future__ import annotations

import fnmatch
import itertools

import numpy as np
import pytest

from oracle import catalogue
from oracle.cli import main
from oracle.fixtures import golden
from oracle.reading.batching import take_batch
from oracle.run.invariance import CHECKS, check_invariance, parse_checks
from oracle.run.validate import validate
from refattn import attention

CASES = [
    "basic-H2K2-L24S40-D32E32-f32",
    "causal-tl-H2K2-L24S24-D32E32-f32",
    "mask-padding-B2H2K2-L12S24-D16E16-f32",
]


def _kernel(
    q, k, v, *, chunk, order=None, mask=None, causal=False, align="top_left", scale=None, **options
):
    """float32 online softmax over key chunks of ``chunk`` (the reduction order under test)."""
    if options.get("window") is not None or options.get("bias") is not None:
        raise NotImplementedError("planted kernels take mask and causal only")
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    rows, keys = q.shape[-2], k.shape[-2]
    scale = np.float32(1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    allowed = np.ones((rows, keys), bool) if mask is None else np.asarray(mask, bool)
    if causal:
        offset = keys - rows if align == "bottom_right" else 0
        allowed = allowed & np.tri(rows, keys, k=offset, dtype=bool)
    allowed = np.broadcast_to(allowed, (*q.shape[:-1], keys))
    order = np.arange(keys) if order is None else order
    top = np.full(q.shape[:-1], -np.inf, np.float32)
    total = np.zeros(q.shape[:-1], np.float32)
    acc = np.zeros((*q.shape[:-1], v.shape[-1]), np.float32)
    for start in range(0, keys, chunk):
        cols = order[start : start + chunk]
        scores = np.zeros((*q.shape[:-1], len(cols)), np.float32)
        for d in range(q.shape[-1]):  # explicit order: no BLAS blocking keyed on the shapes
            scores += q[..., :, None, d] * k[..., None, cols, d]
        scores *= scale
        scores = np.where(allowed[..., cols], scores, -np.inf)
        new_top = np.maximum(top, scores.max(axis=-1))
        safe = np.where(np.isfinite(new_top), new_top, 0)
        rescale = np.exp(top - safe)
        weights = np.exp(scores - safe[..., None])
        total = total * rescale + weights.sum(axis=-1)
        acc = acc * rescale[..., None]
        for j, col in enumerate(cols):
            acc += weights[..., j, None] * v[..., None, col, :]
        top = new_top
    return acc / np.where(total > 0, total, 1)[..., None]


def fixed_order(q, k, v, **options):
    """Correct: chunks of 8 keys, whatever the call."""
    return _kernel(q, k, v, chunk=8, **options)


def batch_dependent(q, k, v, **options):
    """The chunk size depends on the batch size (a split heuristic keyed on the batch)."""
    return _kernel(q, k, v, chunk=3 + 2 * q.shape[0], **options)


_calls = itertools.count()


def racy(q, k, v, **options):
    """The key order changes from call to call (as a reduction racing between threads)."""
    keys = k.shape[-2]
    order = np.arange(keys) if next(_calls) % 2 == 0 else np.arange(keys)[::-1]
    return _kernel(q, k, v, chunk=4, order=order, **options)


def length_dependent(q, k, v, **options):
    """The chunk size depends on the number of query rows (a prefill/decode heuristic)."""
    return _kernel(q, k, v, chunk=4 if q.shape[-2] == 1 else 5, **options)


def key_count_dependent(q, k, v, **options):
    """The chunk size depends on S (tiles picked from the padded key length)."""
    return _kernel(q, k, v, chunk=5 if k.shape[-2] > 64 else 3, **options)


PLANTED = {
    batch_dependent: "batch-invariance",
    racy: "determinism",
    length_dependent: "decode",
    key_count_dependent: "padding-invariance",
}


@pytest.fixture(scope="module")
def fixtures():
    return [golden.build(catalogue.get(name)) for name in CASES]


@pytest.mark.parametrize("impl", list(PLANTED), ids=lambda f: f.__name__)
def test_planted_bug_is_caught_by_its_check_only(impl, fixtures):
    for fixture in fixtures:
        verdicts = {c: check_invariance(impl, fixture, c) for c in CHECKS}
        # bits that differ within the tolerance are a warning (issue 25): still caught
        failing = {c for c, r in verdicts.items() if r.verdict in ("fail", "warning")}
        assert PLANTED[impl] in failing, (fixture.name, {c: r.message for c, r in verdicts.items()})
        assert failing <= {PLANTED[impl]} | (
            {"determinism", "decode", "batch-invariance", "padding-invariance"}
            if impl is racy
            else set()
        )
        message = verdicts[PLANTED[impl]].message
        assert "[" in message and "vs" in message and "tolerance" in message


@pytest.mark.parametrize(
    "impl",
    [fixed_order, lambda q, k, v, **o: attention(q, k, v, **o, precision="exact")],
    ids=["fixed-order", "refattn-exact"],
)
def test_reproducible_implementations_pass(impl, fixtures):
    for fixture in fixtures:
        for check in CHECKS:
            result = check_invariance(impl, fixture, check)
            assert result.verdict == "pass", (fixture.name, check, result.message)


def test_numba_kernels_pass(fixtures):
    for fixture in fixtures:
        for check in CHECKS:
            result = check_invariance(
                lambda q, k, v, **o: attention(q, k, v, **o, backend="numba"), fixture, check
            )
            assert result.verdict == "pass", (fixture.name, check, result.message)


@pytest.mark.peers("torch")
def test_torch_sdpa_single_thread_is_deterministic_and_batch_invariant(fixtures):
    torch = pytest.importorskip("torch")
    from oracle.run.impls import resolve_impl

    impl, _ = resolve_impl("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fixture in fixtures:
            for check in ("determinism", "batch-invariance"):
                result = check_invariance(impl, fixture, check)
                assert result.verdict in ("pass", "unsupported"), result.message
    finally:
        torch.set_num_threads(threads)


def test_validate_runs_each_check_as_its_own_verdict():
    report = validate(
        batch_dependent,
        suite="smoke",
        dtype="float32",
        cases="basic-*",
        checks="determinism,batch-invariance",
        progress=False,
        isolate=False,
    )
    names = [r.name for r in report.results]
    assert any(n.endswith("::determinism") for n in names)
    warned = [r for r in report.results if r.verdict == "warning"]
    assert warned and all(
        r.category == "invariance" and r.name.endswith("::batch-invariance") for r in warned
    )
    assert "--check batch-invariance" in warned[0].reproduce


def test_within_tolerance_bits_warn_unless_strict_invariance():
    """A batch-dependent reduction order changes bits but stays within the tolerance: a
    warning with its own count (the run passes), a failure with strict_invariance."""
    kwargs = dict(
        suite="smoke",
        dtype="float32",
        cases="basic-*",
        checks="batch-invariance",
        progress=False,
        isolate=False,
    )
    lenient = validate(batch_dependent, **kwargs)
    assert lenient.passed and lenient.counts("invariance")["warning"] > 0, lenient.summary()
    assert "invariance warnings:" in lenient.summary()
    assert "within the tolerance: a warning" in lenient.summary()
    strict = validate(batch_dependent, strict_invariance=True, **kwargs)
    assert not strict.passed and strict.failures, strict.summary()


def test_help_lists_every_check(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for check in CHECKS:
        assert check in text, check
    assert "--strict-invariance" in text


def test_cli_check_flag(capsys):
    code = main(
        [
            "validate",
            "--adapter",
            "refattn-exact",
            "--suite",
            "smoke",
            "--dtype",
            "float32",
            "--case",
            "basic-*",
            "--check",
            "determinism,decode",
            "--quiet",
        ]
    )
    assert code == 0, capsys.readouterr()
    code = main(["validate", "--adapter", "refattn-exact", "--suite", "smoke", "--check", "nope"])
    assert code == 2
    assert "checks: unknown check(s) ['nope']" in capsys.readouterr().err


def test_parse_checks():
    assert parse_checks("decode, determinism") == ("decode", "determinism")
    assert parse_checks(["batch-invariance", "decode,decode"]) == ("batch-invariance", "decode")
    with pytest.raises(ValueError, match="checks: unknown"):
        parse_checks("speed")


def test_take_batch_keeps_broadcast_arrays():
    inputs = {
        "q": np.zeros((3, 2, 4, 8)),
        "k": np.zeros((1, 2, 5, 8)),
        "mask": np.ones((4, 5), bool),
        "bias": np.zeros((3, 1, 4, 5)),
    }
    part = take_batch(inputs, [2, 0, 2])
    assert part["q"].shape == (3, 2, 4, 8) and part["k"].shape == (1, 2, 5, 8)
    assert part["mask"] is inputs["mask"] and part["bias"].shape == (3, 1, 4, 5)
    with pytest.raises(ValueError, match="indices"):
        take_batch(inputs, [3])


def test_take_batch_moves_per_row_lengths_and_descales():
    """kv_lengths (B,) and the fp8 descales (B, K) follow their batch element, at B = 1 too."""
    inputs = {
        "q": np.zeros((3, 2, 4, 8)),
        "kv_lengths": np.array([4, 5, 6]),
        "k_descale": np.arange(6.0).reshape(3, 2),
    }
    part = take_batch(inputs, [2, 0])
    assert part["kv_lengths"].tolist() == [6, 4]
    assert part["k_descale"].tolist() == [[4.0, 5.0], [0.0, 1.0]]
    single = take_batch({"q": np.zeros((1, 2, 4, 8)), "kv_lengths": np.array([3])}, [0, 0])
    assert single["kv_lengths"].tolist() == [3, 3]


@pytest.mark.parametrize(
    "pattern", ["kv-lengths-causal-br-*-f32", "sinks-kv-decode-B*-f32", "fp8-e4m3-causal-gqa-*"]
)
def test_new_options_are_checked_for_invariance(pattern):
    """Cases with per-row key lengths, sinks and fp8 descales run every check (a batch
    surgery that left kv_lengths or the descales behind would be an error, not a verdict)."""
    (case,) = [
        c
        for c in catalogue.suite("default")
        if c.function == "attention" and fnmatch.fnmatchcase(c.name, pattern)
    ]
    fixture = golden.build(case)
    for check in CHECKS:
        result = check_invariance(
            lambda q, k, v, **o: attention(q, k, v, **o, precision="exact"), fixture, check
        )
        assert result.verdict == "pass", (case.name, check, result.message)
