"""oracle.conventions.signatures: a function written with a library's real signature and
conventions is
validated as it stands (--signature), or declares its own (--causal-align, --keyword);
packed/paged layouts carry ragged key lengths; the first cases' failures name the flag."""

from __future__ import annotations

import re

import numpy as np
import pytest

from oracle.conventions import signatures
from oracle.conventions.layouts import NOT_EXPRESSIBLE, check_convention, wrap
from oracle.conventions.signatures import Call, get
from oracle.diagnose.guidance import ConventionError, hint
from oracle.judging.passing import passed_options
from oracle.run.validate import validate
from refattn import attention


def _short(name):
    """A case name without its shape and dtype."""
    return re.split(r"-[BH]\d", name)[0]


def _call(options, L=3, S=5, H=2, K=2, D=4, E=4, batch=1):
    q = np.zeros((batch, H, L, D))
    k = np.zeros((batch, K, S, D))
    v = np.zeros((batch, K, S, E))
    return Call.of(q, k, v, options)


# ---------------------------------------------------------------------------------------------
# The table: names, defaults and conventions
# ---------------------------------------------------------------------------------------------


def test_flash_attn_speaks_flash_attention():
    options = {"scale": 0.25, "causal": True, "window": (3, None), "softcap": 30.0}
    spoken = get("flash_attn").translate({**options, "align": "bottom_right"}, _call(options))
    assert spoken == {
        "softmax_scale": 0.25,
        "causal": True,
        "window_size": (3, -1),
        "softcap": 30.0,
    }
    assert get("flash_attn").translate({"return_lse": True}, _call({})) == {
        "return_attn_probs": True
    }
    kvcache = get("flash_attn_with_kvcache").translate({"return_lse": True}, _call({}))
    assert kvcache == {"return_softmax_lse": True}


@pytest.mark.parametrize(
    ("name", "options", "why"),
    [
        ("flash_attn", {"causal": True}, "bottom-right aligned"),  # top-left, L != S
        ("flash_attn", {"mask": np.ones((3, 5), bool)}, "no mask"),
        ("flash_attn", {"kv_lengths": np.array([2])}, "cache_seqlens"),
        ("flash_attn", {"gqa": "tile"}, "h // G"),
        ("torch_sdpa", {"causal": True, "align": "bottom_right"}, "top-left aligned"),
        ("torch_sdpa", {"return_lse": True}, "return_lse"),
        ("jax", {"softcap": 5.0}, "has no keyword"),
        ("xformers", {"return_lse": True}, "return_lse"),
    ],
)
def test_what_a_library_cannot_express_is_unsupported(name, options, why):
    with pytest.raises(NotImplementedError, match=why):
        get(name).translate(options, _call(options))


def test_top_left_is_fine_where_alignment_does_not_matter():
    options = {"causal": True}
    assert get("flash_attn").translate(options, _call(options, L=5, S=5)) == {"causal": True}


def test_torch_and_jax_speak_their_own_names():
    options = {"causal": True, "scale": 0.5}
    assert get("torch_sdpa").translate(options, _call(options, H=4, K=2)) == {
        "is_causal": True,
        "scale": 0.5,
        "enable_gqa": True,
    }
    options = {"causal": True, "window": (2, None), "kv_lengths": np.array([4])}
    spoken = get("jax").translate(options, _call(options, L=5, S=5))
    assert spoken["is_causal"] is True and spoken["local_window_size"] == (2, 10)
    assert spoken["key_value_seq_lengths"].tolist() == [4]


def test_flashinfer_speaks_its_names_and_refuses_what_it_lacks():
    options = {"causal": True, "align": "bottom_right", "window": (2, None), "softcap": 3.0}
    assert get("flashinfer").translate(options, _call(options)) == {
        "causal": True,
        "window_left": 2,
        "logits_soft_cap": 3.0,
    }
    with pytest.raises(NotImplementedError, match="one sequence"):
        get("flashinfer").translate({}, _call({}, batch=2))
    # its lse is base 2: asked for, and brought to the natural log (test_signatures_adapt.py)
    assert get("flashinfer").translate({"return_lse": True}, _call({})) == {"return_lse": True}
    assert get("flashinfer").lse_base == 2
    with pytest.raises(NotImplementedError, match="window_left is its only window side"):
        get("flashinfer").translate({"window": (2, 3)}, _call({"window": (2, 3)}, L=5, S=5))


def test_jax_refuses_d_ne_e_as_unsupported():
    with pytest.raises(NotImplementedError, match="E = 8 != query/key head dim D = 4"):
        get("jax").translate({}, _call({}, E=8))


def test_jax_averages_masked_rows_and_refuses_rows_a_bias_empties():
    """JAX masks with a large finite negative: a row the mask empties holds the average of v
    (the preset's empty_rows="average", judged so); a -inf bias makes the row NaN: not
    expressible, not a fail."""
    assert get("jax").empty_rows == "average"
    mask = np.ones((1, 2, 3, 5), dtype=bool)
    mask[0, 1, 2] = False
    assert "mask" in get("jax").translate({"mask": mask}, _call({"mask": mask}))
    bias = np.zeros((1, 2, 3, 5))
    bias[0, 0, 1] = -np.inf
    with pytest.raises(NotImplementedError, match="no allowed key"):
        get("jax").translate({"bias": bias}, _call({"bias": bias}))


def test_xformers_gets_the_allowed_set_as_an_exact_bias():
    options = {"causal": True, "align": "bottom_right"}
    spoken = get("xformers").translate(options, _call(options, L=2, S=3))
    bias = spoken["attn_bias"]
    assert bias.shape == (1, 2, 2, 3)
    assert np.isneginf(bias[0, 0]).tolist() == [[False, False, True], [False, False, False]]


def test_declared_conventions_and_bad_declarations():
    declared = signatures.declared("bhld", "bottom_right", ["scale=softmax_scale"])
    options = {"scale": 0.5, "causal": True, "align": "bottom_right", "mask": None}
    assert declared.translate(options, _call(options)) == {
        "softmax_scale": 0.5,
        "causal": True,
        "mask": None,
    }
    assert signatures.declared() is None
    with pytest.raises(ValueError, match="keyword: expected OPTION=NAME"):
        signatures.declared(keywords=["scale"])
    with pytest.raises(ValueError, match="unknown refattn option"):
        signatures.declared(keywords=["scaling=softmax_scale"])
    with pytest.raises(ValueError, match="layout: 'bhld' conflicts|layout: 'packed' conflicts"):
        check_convention(layout="packed", signature="flash_attn")
    with pytest.raises(ValueError, match="signature: expected one of"):
        check_convention(signature="flash")


def test_options_differing_from_the_function_defaults_are_passed():
    def bottom_right(q, k, v, *, causal=False, align="bottom_right"):
        raise AssertionError("not called")

    # refattn's default align (top_left) differs from this function's: it is passed
    assert passed_options({"causal": True, "align": "top_left"}, bottom_right) == {
        "causal": True,
        "align": "top_left",
    }
    assert passed_options({"causal": True, "align": "bottom_right"}, bottom_right) == {
        "causal": True
    }
    assert passed_options({"align": "top_left"}) == {}  # no function: refattn's defaults


# ---------------------------------------------------------------------------------------------
# A function with jax.nn.dot_product_attention's signature, NumPy underneath (jax is not
# installed here): the jax preset's mapping, judged on causal cases
# ---------------------------------------------------------------------------------------------


def fake_jax_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
):
    """(B, T, N, H) NumPy arrays, JAX's conventions: top-left causal and window, a bool mask
    (True = attend), a (B, T, N) residual."""
    assert query.shape[-1] == value.shape[-1], "jax refuses D != E"
    q, k, v = (np.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (query, key, value))
    length, keys = q.shape[2], k.shape[2]
    allowed = np.ones((q.shape[0], 1, length, keys), bool)
    rows, cols = np.arange(length)[:, None], np.arange(keys)[None, :]
    if is_causal:
        allowed &= cols <= rows
    if local_window_size is not None:
        left, right = local_window_size
        allowed &= (cols >= rows - left) & (cols <= rows + right)
    if key_value_seq_lengths is not None:
        allowed &= cols < np.asarray(key_value_seq_lengths)[:, None, None, None]
    if mask is not None:
        allowed = allowed & mask
    out, lse = attention(
        q,
        k,
        v,
        scale=scale,
        mask=allowed,
        bias=None if bias is None else np.asarray(bias, np.float64),
        return_lse=True,
    )
    out = np.swapaxes(out, 1, 2).astype(query.dtype)
    return (out, np.swapaxes(lse, 1, 2)) if return_residual else out


def test_jax_signature_judged_on_causal_cases():
    preset = get("jax").replace(framework="numpy")  # no jax here: NumPy arrays
    report = validate(
        wrap(fake_jax_attention, signature=preset),
        suite="default",
        dtype="float32",
        cases=["causal-*-L1*", "window-left-*", "kv-lengths-causal-*", "mask-random-*", "d-ne-e-*"],
        progress=False,
        isolate=False,
    )
    verdicts = {_short(r.name): r.verdict for r in report.results}
    assert report.passed, [r.explain() for r in report.failures]
    assert verdicts["causal-tl"] == verdicts["kv-lengths-causal-tl"] == "pass", verdicts
    assert verdicts["causal-br"] == "unsupported"  # top-left only (L != S)
    assert verdicts["window-left"] == "unsupported"  # a bottom-right window, L != S
    assert verdicts["mask-random"] == "pass"
    assert verdicts["d-ne-e"] == "unsupported"  # JAX's own shape refusal
    assert "causal" not in report.untested


# ---------------------------------------------------------------------------------------------
# Layouts: ragged key lengths, masks not expressible
# ---------------------------------------------------------------------------------------------


@pytest.mark.peers("torch")
@pytest.mark.parametrize("layout", ["packed", "paged"])
def test_ragged_key_lengths_reach_packed_and_paged(layout):
    impl = {
        "packed": "tests.planted.convention_impls:flash_attn_varlen_func",
        "paged": "tests.planted.convention_impls:flash_attn_with_kvcache",
    }[layout]
    report = validate(
        impl,
        suite="default",
        dtype="float32",
        cases=["kv-lengths-B3*", "kv-lengths-causal-tl-*", "mask-random-*"],
        layout=layout,
        framework="torch",
        progress=False,
        isolate=False,
    )
    verdicts = {_short(r.name): r for r in report.results}
    assert verdicts["kv-lengths"].verdict == "pass", verdicts["kv-lengths"].message
    assert verdicts["kv-lengths-causal-tl"].verdict == "pass"
    assert NOT_EXPRESSIBLE in verdicts["mask-random"].message
    assert "mask" in report.not_expressible and "mask" not in report.untested


# ---------------------------------------------------------------------------------------------
# FlashAttention's own signatures (tests/planted/flash_attn_like.py) pass with --signature
# ---------------------------------------------------------------------------------------------

FLASH = {
    "flash_attn": "tests.planted.flash_attn_like:flash_attn_func",
    "flash_attn_varlen": "tests.planted.flash_attn_like:flash_attn_varlen_func",
    "flash_attn_with_kvcache": "tests.planted.flash_attn_like:flash_attn_with_kvcache",
}


@pytest.mark.peers("torch")
@pytest.mark.parametrize("preset", list(FLASH))
def test_flash_attention_signatures_pass_as_they_stand(preset):
    report = validate(
        FLASH[preset],
        suite="default",
        dtype="bfloat16",
        cases=["causal-br-H2K2-L12*", "causal-tl-H2K2-L12*", "window-both-br-*", "softcap-H*"],
        signature=preset,
        progress=False,
        isolate=False,
    )
    verdicts = {_short(r.name): r.verdict for r in report.results}
    assert report.passed, [r.explain() for r in report.failures]
    assert verdicts["causal-br"] == verdicts["window-both-br"] == verdicts["softcap"] == "pass"
    assert verdicts["causal-tl"] == "unsupported"  # bottom-right only, L != S


@pytest.mark.slow
@pytest.mark.peers("torch")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", list(FLASH))
def test_flash_attention_signatures_pass_default(preset, dtype):
    report = validate(FLASH[preset], suite="default", dtype=dtype, signature=preset, progress=False)
    assert report.passed, [r.explain() for r in report.failures]
    assert sum(r.verdict == "pass" for r in report.results) >= 40


# ---------------------------------------------------------------------------------------------
# First-case guidance
# ---------------------------------------------------------------------------------------------

NUMPY = {"layout": "bhld", "framework": "numpy", "device": "cpu"}


def test_hint_names_the_missing_flag():
    said = hint(None, ["error: ValueError: axes don't match array"], NUMPY)
    assert "--framework torch (passed: --framework numpy)" in said
    said = hint(
        None,
        ["error: RuntimeError: Number of heads in key and value must divide the number"],
        {**NUMPY, "framework": "torch"},
    )
    assert "--layout blhd (passed: --layout bhld)" in said
    assert hint(None, ["error: ZeroDivisionError: boom"], NUMPY) is None


@pytest.mark.peers("torch")
def test_flash_attention_without_flags_gets_guidance():
    with pytest.raises(ConventionError, match="--framework torch") as caught:
        validate(
            FLASH["flash_attn"],
            suite="smoke",
            dtype="float32",
            progress=False,
            isolate=False,
        )
    assert "--signature flash_attn" in str(caught.value)
    with pytest.raises(ConventionError, match="--layout blhd"):
        validate(
            "tests.planted.convention_impls:flash_attn_func",
            suite="smoke",
            dtype="float32",
            framework="torch",
            progress=False,
            isolate=False,
        )


# ---------------------------------------------------------------------------------------------
# The documented FlashAttention functions (docs/presets-and-layouts.md) pass with their presets
# ---------------------------------------------------------------------------------------------


def _readme_functions() -> dict:
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "presets-and-layouts.md"
    text = page.read_text()
    start = text.index("## Signature presets")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    namespace: dict = {}
    exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 (the page's own code)
    return namespace


@pytest.mark.peers("torch")
@pytest.mark.parametrize(
    ("preset", "function"),
    [
        ("flash_attn", "flash_attn_func"),
        ("flash_attn_varlen", "flash_attn_varlen_func"),
        ("flash_attn_with_kvcache", "flash_attn_with_kvcache"),
    ],
)
def test_readme_flash_attention_examples_pass(preset, function):
    report = validate(
        _readme_functions()[function],
        suite="default",
        dtype="bfloat16",
        cases=["causal-br-H2K2-L12*", "window-both-br-*", "gqa-interleave-H8*", "kv-lengths-B3*"],
        signature=preset,
        progress=False,
        isolate=False,
    )
    verdicts = {_short(r.name): r.verdict for r in report.results}
    assert report.passed, [r.explain() for r in report.failures]
    assert verdicts["causal-br"] == verdicts["window-both-br"] == "pass", verdicts
    assert verdicts["kv-lengths"] == ("unsupported" if preset == "flash_attn" else "pass")


@pytest.mark.peers("torch")
@pytest.mark.parametrize(
    ("preset", "function", "judged"),
    [
        ("flashinfer", "single_prefill_with_kv_cache", ["causal-br", "softcap", "window-left"]),
        ("xformers", "memory_efficient_attention", ["causal-br", "kv-lengths", "mask-random"]),
    ],
)
def test_flashinfer_and_xformers_signatures(preset, function, judged):
    report = validate(
        f"tests.planted.library_like:{function}",
        suite="default",
        dtype="float32",
        cases=["causal-br-H2K2-L12*", "softcap-H*", "window-left-*", "kv-lengths-B3*", "mask-r*"],
        signature=preset,
        progress=False,
        isolate=False,
    )
    verdicts = {_short(r.name): r.verdict for r in report.results}
    assert report.passed, [r.explain() for r in report.failures]
    assert all(verdicts[name] == "pass" for name in judged), verdicts
