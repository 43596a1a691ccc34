"""Meta tests of the variant suites (oracle.catalogue.variants): catalogue, truths, bytes, judge."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import time

import mpmath
import numpy as np
import pytest

from oracle import catalogue
from oracle.catalogue import merge_families
from oracle.catalogue import variants as vc
from oracle.fixtures import golden
from oracle.reading.baseline import textbook_attention
from oracle.run import validate as V
from refattn import gmm, hopfield, meanfield, mgk
from tests.helpers import assert_same_bits
from tests.naive.gmm import DPS, naive_adapt_keys, naive_adapt_priors, naive_gmm
from tests.naive.hopfield import naive_energy, naive_retrieve
from tests.naive.meanfield import exact_naive_step, mp_inverse, mp_ising, mp_solve
from tests.naive.mgk import naive_linear, naive_mgk
from tests.naive.rounding import round_nested

# merge_states rides on the variant machinery with suites of its own (merge-*; tested in
# tests/meta/test_merge_cases.py): the variants-* suites cover the other functions
VARIANT_FUNCTIONS = sorted(set(vc.FUNCTIONS) - {merge_families.FUNCTION})
SMOKE = "variants-smoke"
DEFAULT = "variants-default"


# ----------------------------------------------------------------------------- catalogue


def test_names_unique_prefixed_and_disjoint_from_attention():
    default = catalogue.suite(DEFAULT)
    names = [c.name for c in default]
    assert len(set(names)) == len(names), "variants-default: duplicate case names"
    attention = {c.name for c in catalogue.suite("full")}
    clash = sorted(set(names) & attention)
    assert not clash, f"variant names collide with the attention catalogue: {clash}"
    smoke = {c.name for c in catalogue.suite(SMOKE)}
    assert smoke <= set(names), f"smoke not within default: {sorted(smoke - set(names))}"
    for case in default:
        prefix = vc.PREFIXES[case.function]
        assert fnmatch.fnmatchcase(case.name, f"{prefix}-*"), (case.name, prefix)
        others = [
            p
            for f, p in vc.PREFIXES.items()
            if f != case.function and fnmatch.fnmatchcase(case.name, f"{p}-*")
        ]
        assert not others, f"{case.name}: also matched by prefixes {others}"


def test_every_variant_function_covered_in_every_dtype():
    seen = {(c.function, c.dtype) for c in catalogue.suite(DEFAULT)}
    missing = [(f, d) for f in VARIANT_FUNCTIONS for d in catalogue.DTYPES if (f, d) not in seen]
    assert not missing, f"variants-default lacks {missing}"
    smoke_functions = {c.function for c in catalogue.suite(SMOKE)}
    assert smoke_functions == set(VARIANT_FUNCTIONS), set(VARIANT_FUNCTIONS) - smoke_functions


def test_specs_round_trip_and_get():
    for case in catalogue.suite(DEFAULT):
        again = catalogue.Case.from_spec(json.loads(case.spec_json()))
        assert again == case and again.spec() == case.spec(), case.name
    name = catalogue.suite(SMOKE)[0].name
    assert catalogue.get(name).name == name


#: sha256 over every variants-default input (name, dtype, shape, bytes) of the forward cases
#: (``grads=False``); computed once on x86-64 Linux. The inputs are built from integers and
#: correctly rounded operations only, so this must hold on every machine and NumPy version; a
#: deliberate catalogue change updates it. The gradient cases are pinned per function below:
#: a function's gradient cases exist once its module has a ``<function>_vjp``.
PINNED_INPUTS_SHA256 = "fe4388d2af4a9683242000c8daa3db03c296ec6611eaf72f696fb887c397af74"
PINNED_GRAD_INPUTS_SHA256 = {
    "gmm.adapt_keys": "77c3a62caaf59ba8e7205c93150098d221c83f28a93d6870b9ad410f4b173688",
    "gmm.adapt_priors": "22c79716741bb95aaec90059d64b9cf204777d6d8ff05d0df98f61f4d247a84d",
    "gmm.attention": "ab6e4f4bc865336e901e0549597cf3d5025179fc586279c700031f0867ecf533",
    "hopfield.retrieve": "e6f6383a04c19d15c36e892bb3e0f36c79488358967e4b1bbbf2720a107a74e1",
    "meanfield.adaptive_tap": "b675130bdc190d361ce45ba87103c8beda6b1adfbbc37234e0f6fdd50fba47b6",
    "meanfield.deq_attention": "cef3fc82a949563cfa2f10da84cda8a2f63a9a1280c56bcae187bdc8712c355e",
    "meanfield.ising_tap": "a69b217dfa61d69c611f2482d377dce27752566609f4e1a75cf5ecd78707fada",
    "mgk.attention": "6f5b59ded42c950cd1400db818812f7f48ae0537e054fc377fca3c194987586c",
    "mgk.linear_attention": "668216bc05c98a81c5be548e6ec5b2662586b80ca7e356b64c86e6180b391680",
}


def _inputs_digest(cases):
    digest = hashlib.sha256()
    for case in cases:
        for name, x in sorted(catalogue.make_inputs(case).items()):
            for part in (case.name, name, str(x.dtype), repr(x.shape)):
                digest.update(part.encode())
            digest.update(x.tobytes())
    return digest.hexdigest()


def test_inputs_are_pinned():
    cases = catalogue.suite(DEFAULT)
    found = _inputs_digest([c for c in cases if not c.grads])
    assert found == PINNED_INPUTS_SHA256, (
        f"variants-default inputs changed: sha256 {found}, pinned {PINNED_INPUTS_SHA256}"
    )
    for function in sorted({c.function for c in cases if c.grads}):
        found = _inputs_digest([c for c in cases if c.grads and c.function == function])
        assert found == PINNED_GRAD_INPUTS_SHA256.get(function), (
            f"{function} gradient-case inputs: sha256 {found}, pinned "
            f"{PINNED_GRAD_INPUTS_SHA256.get(function)}"
        )


# ----------------------------------------------------------------------------- truths


def _slices(lead):
    return list(np.ndindex(*lead))


def _reference(case, inputs):
    """Independent mpmath/Fraction evaluation (the variants' own test references), rounded
    to the case dtype, as {output: float64 array}."""
    x = {k: (v if v.dtype == bool else np.asarray(v).astype(np.float64)) for k, v in inputs.items()}
    o, fn, dtype = case.options, case.function, case.dtype
    if fn.startswith("meanfield."):
        return _meanfield_reference(case, x)
    lead = next(iter(x.values())).shape[:2]
    out = []
    for index in _slices(lead):
        s = {k: v[index] for k, v in x.items()}
        if fn == "gmm.attention":
            values, _ = naive_gmm(
                s["q"],
                s["keys"],
                s["values"],
                alpha=s.get("alpha", o.get("alpha")),
                beta=s.get("beta", o.get("beta", 0.0)),
                prior=s.get("prior", o.get("prior", "uniform")),
                v_init=s.get("v_init"),
                iters=o.get("iters", 1),
            )
        elif fn == "gmm.adapt_keys":
            values = naive_adapt_keys(
                s["queries"],
                s["keys0"],
                alpha=o["alpha"],
                gamma=o["gamma"],
                prior=o.get("prior", "uniform"),
                iters=o["iters"],
                form=o["form"],
            )
        elif fn == "gmm.adapt_priors":
            values = naive_adapt_priors(
                s["queries"],
                s["keys"],
                alpha=o["alpha"],
                eta=o["eta"],
                pi0=list(s["pi0"]),
                iters=o["iters"],
                form=o["form"],
            )
        elif fn == "mgk.attention":
            values = naive_mgk(
                s["q"],
                s["keys"],
                s["v"],
                log_pi=s.get("log_pi"),
                sigma2=s.get("sigma2", o.get("sigma2", 1.0)),
                mode=o.get("mode", "soft"),
                normalized=o.get("normalized", False),
                mask=s.get("mask"),
                causal=o.get("causal", False),
                window=o.get("window"),
                align=o.get("align", "top_left"),
            )
        elif fn == "mgk.linear_attention":
            values = naive_linear(
                s["q"], s["keys"], s["v"], pi=s["pi"], causal=o.get("causal", False)
            )
        elif fn == "hopfield.retrieve":
            values, _ = naive_retrieve(s["xi"], s["X"], o["beta"], o["steps"])
        elif fn == "hopfield.energy":
            with mpmath.workdps(DPS):
                patterns = [[mpmath.mpf(float(a)) for a in row] for row in s["X"]]
                values = [
                    naive_energy(
                        [mpmath.mpf(float(a)) for a in row],
                        patterns,
                        o["beta"],
                        o.get("constant", False),
                    )
                    for row in s["xi"]
                ]
        out.append(round_nested(values, dtype))
    result = np.stack(out)
    return {"out": result.reshape(*lead, *result.shape[1:])}


def _big(J):
    n, _, d, _ = J.shape
    return np.swapaxes(J, 1, 2).reshape(n * d, n * d)


def _meanfield_reference(case, x):
    fn, dtype = case.function, case.dtype
    if fn == "meanfield.naive_step":
        exact = [exact_naive_step(m, x["J"], xb) for m, xb in zip(x["m"], x["x"], strict=True)]
        return {"out": round_nested(exact, dtype)}
    if fn == "meanfield.ising_tap":
        res = meanfield.ising_tap(x["x"], x["J"])  # the root near the float64 solution
        outs = [
            mp_ising(xb, x["J"], m0, v0)
            for xb, m0, v0 in zip(x["x"], res.means, res.cavity_var, strict=True)
        ]
        return {
            name: round_nested([o[k].tolist() for o in outs], dtype)
            for k, name in enumerate(("means", "cavity_var", "chi_diag"))
        }
    J = x["J"]
    N, d = J.shape[0], J.shape[2]
    prior = x.get("prior_precision", np.eye(d))
    P = np.kron(np.eye(N), prior)
    means = [mp_solve(P, _big(J), xb.ravel()).reshape(N, d).tolist() for xb in x["x"]]
    result = {"means": round_nested(means, dtype)}
    if fn == "meanfield.adaptive_tap":
        chi = mp_inverse(P, _big(J))
        with mpmath.workdps(DPS):
            blocks = [chi[i * d : (i + 1) * d, i * d : (i + 1) * d] for i in range(N)]
            cavity = [
                (mpmath.matrix(prior.tolist()) - mpmath.matrix(b.tolist()) ** -1).tolist()
                for b in blocks
            ]
        batch = x["x"].shape[0]
        result["chi_diag"] = round_nested([[b.tolist() for b in blocks]] * batch, dtype)
        result["cavity_var"] = round_nested([cavity] * batch, dtype)
    return result


def _reference_cases():
    # every smoke case, plus one default case per function/option family in float32/bfloat16
    chosen = list(catalogue.suite(SMOKE))
    seen = set()
    for case in catalogue.suite(DEFAULT):
        family = case.name.rsplit("-", 1)[0]
        if case.dtype in ("float32", "bfloat16") and family not in seen and case not in chosen:
            seen.add(family)
            chosen.append(case)
    return chosen


@pytest.mark.parametrize("case", _reference_cases(), ids=lambda c: c.name)
def test_truth_equals_independent_reference(case):
    fixture = golden.build(case)
    reference = _reference(case, fixture.inputs)
    assert set(reference) == set(vc.FUNCTIONS[case.function].outputs), case.name
    for name, expected in reference.items():
        stored = fixture.truth[name]
        assert np.dtype(stored.dtype).name == case.dtype, (case.name, name, stored.dtype)
        assert_same_bits(
            np.asarray(stored).astype(np.float64), expected, what=f"{case.name} truth/{name}"
        )


# ----------------------------------------------------------------------------- files


def _shas(directory):
    manifest = json.loads((directory / golden.MANIFEST).read_text())
    return {e["name"]: e["sha256"] for e in manifest["cases"]}


def test_generate_is_deterministic_verifies_and_loads(tmp_path, capsys):
    start = time.perf_counter()
    first = golden.generate(SMOKE, tmp_path / "a", progress=False)
    seconds = time.perf_counter() - start
    second = golden.generate(SMOKE, tmp_path / "b", progress=False, workers=2)
    shas = _shas(first)
    assert shas == _shas(second), "regeneration changed some sha256"
    for name in shas:
        a, b = (first / f"{name}.npz").read_bytes(), (second / f"{name}.npz").read_bytes()
        assert hashlib.sha256(a).hexdigest() == shas[name] and a == b, name
    assert golden.verify(first) == []
    loaded = {f.name: f for f in golden.load(first)}
    assert sorted(loaded) == sorted(c.name for c in catalogue.suite(SMOKE))
    for case in catalogue.suite(SMOKE):
        built = golden.build(case)
        fixture = loaded[case.name]
        assert fixture.case == case and fixture.case.function == case.function
        for group in ("inputs", "truth"):
            ours, theirs = getattr(built, group), getattr(fixture, group)
            assert sorted(ours) == sorted(theirs), (case.name, group)
            for key in ours:
                assert ours[key].dtype == theirs[key].dtype, (case.name, key)
                assert ours[key].tobytes() == theirs[key].tobytes(), (case.name, key)
    with capsys.disabled():
        print(f"\n[variants-smoke: {len(shas)} cases generated in {seconds:.2f} s]")


def test_verify_names_a_missing_truth_member(tmp_path):
    case = next(c for c in catalogue.suite(SMOKE) if c.function == "meanfield.adaptive_tap")
    out = golden.generate(SMOKE, tmp_path, progress=False, cases=[case])
    fixture = golden.build(case)
    del fixture.truth["chi_diag_f64"]
    path = out / f"{case.name}.npz"
    path.write_bytes(golden.fixture_bytes(fixture))
    manifest = json.loads((out / golden.MANIFEST).read_text())
    manifest["cases"][0]["sha256"] = golden.sha256_of(path)
    (out / golden.MANIFEST).write_text(json.dumps(manifest))
    problems = golden.verify(out)
    assert problems and "truth/chi_diag_f64" in problems[0], problems


@pytest.mark.xslow  # the smoke suite's twin above runs by default (1 vs 2 workers)
def test_default_generation_is_deterministic(tmp_path, capsys):
    start = time.perf_counter()
    first = golden.generate(DEFAULT, tmp_path / "a", progress=False, workers=2)
    seconds = time.perf_counter() - start
    second = golden.generate(DEFAULT, tmp_path / "b", progress=False, workers=1)
    assert _shas(first) == _shas(second)
    assert golden.verify(first) == []
    with capsys.disabled():
        print(
            f"\n[variants-default: {len(_shas(first))} cases generated in {seconds:.2f} s "
            f"on 2 workers]"
        )


# ----------------------------------------------------------------------------- judge


def _linear_attention_slices(q, keys, v, pi, **options):
    # refattn's non-causal float64 linear_attention mis-broadcasts batch dimensions: one
    # (batch, head) slice at a time
    lead = q.shape[:-2]
    rows = [
        mgk.linear_attention(q[i], keys[i], v[i], pi=pi[i], **options) for i in np.ndindex(*lead)
    ]
    return np.stack(rows).reshape(*lead, *rows[0].shape)


REFATTN64 = {
    "gmm.attention": gmm.attention,
    "gmm.adapt_keys": gmm.adapt_keys,
    "gmm.adapt_priors": gmm.adapt_priors,
    "mgk.attention": mgk.attention,
    "mgk.linear_attention": _linear_attention_slices,
    "hopfield.retrieve": hopfield.retrieve,
    "hopfield.energy": hopfield.energy,
    "meanfield.naive_step": meanfield.naive_step,
    "meanfield.adaptive_tap": meanfield.adaptive_tap,
    "meanfield.ising_tap": meanfield.ising_tap,
    "meanfield.deq_attention": meanfield.deq_attention,
}


def _only(suite, function, dtypes=None):
    return [
        c
        for c in catalogue.suite(suite)
        if c.function == function and (dtypes is None or c.dtype in dtypes)
    ]


def _explain(report):
    return "\n".join(r.explain() for r in report.results if r.verdict != "pass")


@pytest.mark.parametrize("function", VARIANT_FUNCTIONS)
def test_refattn_float64_paths_pass_smoke(function):
    report = V.validate(
        REFATTN64[function], suite=_only(SMOKE, function), dtype=None, progress=False
    )
    assert report.results and report.passed, _explain(report)
    assert all(r.verdict == "pass" and r.checks for r in report.results), _explain(report)


def test_validate_by_name_runs_variant_suite():
    report = V.validate(
        mgk.attention, suite=SMOKE, dtype="float32", cases=["mgk-*"], progress=False
    )
    assert [r.name for r in report.results] == [
        c.name for c in _only(SMOKE, "mgk.attention", ("float32",))
    ]
    assert report.passed, _explain(report)


def _textbook_retrieve(xi, X, *, beta, steps):
    # a genuine low-precision implementation: steps x textbook attention in the input dtype
    # (float32 accumulation for half types, every stage stored in the dtype)
    for _ in range(steps):
        xi = textbook_attention(xi, X, X, scale=beta).out
    return xi


def test_low_precision_textbook_passes_in_every_dtype():
    report = V.validate(
        _textbook_retrieve, suite=_only(DEFAULT, "hopfield.retrieve"), dtype=None, progress=False
    )
    assert len(report.results) == len(_only(DEFAULT, "hopfield.retrieve")) and report.passed, (
        _explain(report)
    )


def _mgk_numpy(q, keys, v, *, sigma2=1.0, sign=-1.0, dtype=np.float64):
    q, keys, v = (np.asarray(a).astype(dtype) for a in (q, keys, v))
    sigma2, log_r = dtype(sigma2), dtype(np.log(keys.shape[-2]))
    diff = q[..., :, None, None, :] - keys[..., None, :, :, :]
    comps = dtype(sign) * (diff * diff).sum(-1) / (dtype(2) * sigma2) - log_r
    top = comps.max(-1, keepdims=True)
    scores = (top + np.log(np.exp(comps - top).sum(-1, keepdims=True)))[..., 0]
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def test_float32_arithmetic_mgk_passes():
    # an honest implementation computing everything in float32 is no false alarm
    chosen = [
        c
        for c in _only(DEFAULT, "mgk.attention", ("float32",))
        if set(c.recipe) <= {"R"} and set(c.options) == {"sigma2"}
    ]
    assert chosen
    report = V.validate(
        lambda **kw: _mgk_numpy(**kw, dtype=np.float32), suite=chosen, dtype=None, progress=False
    )
    assert report.passed, _explain(report)
    worst = max(r.worst.error / r.worst.threshold for r in report.results)
    assert worst > 0, "float32 arithmetic should not be exact"


def _deq_transposed(x, J, **options):
    return meanfield.deq_attention(x, np.swapaxes(np.swapaxes(J, 0, 1), 2, 3), **options)


BROKEN = [
    (
        "mgk without the minus sign",
        "mgk.attention",
        lambda q, keys, v, sigma2: _mgk_numpy(q, keys, v, sigma2=sigma2, sign=1.0),
        lambda q, keys, v, sigma2: _mgk_numpy(q, keys, v, sigma2=sigma2),
    ),
    (
        "gmm with beta ignored",
        "gmm.attention",
        lambda **kw: gmm.attention(**{**kw, "beta": 0.0}),
        gmm.attention,
    ),
    (
        "hopfield with beta squared",
        "hopfield.retrieve",
        lambda xi, X, beta, steps: hopfield.retrieve(xi, X, beta=beta * beta, steps=steps),
        hopfield.retrieve,
    ),
    ("deq with J_ji for J_ij", "meanfield.deq_attention", _deq_transposed, meanfield.deq_attention),
]


@pytest.mark.parametrize("label, function, broken, correct", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_variant_fails(label, function, broken, correct):
    chosen = [
        c
        for c in _only(DEFAULT, function, ("float64", "float32"))
        if set(c.recipe) <= {"R"}
        and c.options.get("mode", "soft") == "soft"
        and not c.options.get("causal")
        and c.options.get("window") is None
    ][:2]
    if function == "gmm.attention":  # beta only acts from the second EM step on
        chosen = [
            c
            for c in _only(DEFAULT, function, ("float64", "float32"))
            if c.options.get("iters", 1) > 1 and not c.recipe
        ]
    assert chosen, f"no case for {label}"
    good = V.validate(correct, suite=chosen, dtype=None, progress=False)
    assert good.passed, f"the correct twin of {label} fails:\n{_explain(good)}"
    bad = V.validate(broken, suite=chosen, dtype=None, progress=False)
    verdicts = {r.name: r.verdict for r in bad.results}
    assert all(v == "fail" for v in verdicts.values()), f"{label}: {verdicts}"
    worst = bad.results[0].worst
    assert worst is not None and worst.error > worst.threshold, bad.results[0].explain()


def test_unsupported_and_error_verdicts():
    chosen = _only(SMOKE, "hopfield.energy", ("float32",))

    def unsupported(**kw):
        raise NotImplementedError("no energy here")

    report = V.validate(unsupported, suite=chosen, dtype=None, progress=False)
    assert [r.verdict for r in report.results] == ["unsupported"] and report.passed
    report = V.validate(lambda **kw: np.zeros(3), suite=chosen, dtype=None, progress=False)
    assert [r.verdict for r in report.results] == ["fail"], _explain(report)
    assert "shape" in report.results[0].message
