"""The pytest plugin speaks the CLI's ``--signature`` / ``--causal-align`` / ``--keyword``
(``--refattn-signature``, ``--refattn-causal-align``, ``--refattn-keyword`` and their
environment twins): a function written with a library's own keyword names and conventions is
tested as it stands."""

from __future__ import annotations

import pytest

from oracle.pytest_plugin import settings
from tests.meta.test_plugin_session import _BASE, _TWO, _pytest
from tests.meta.test_validate import _plugin_args


class _Config:
    """The part of a pytest config that :func:`oracle.pytest_plugin.settings` reads."""

    def __init__(self, **options):
        self.options = {f"refattn_{name}": value for name, value in options.items()}

    def getoption(self, name, default=None):
        return self.options.get(name, default)


def test_signature_options_reach_the_convention(monkeypatch):
    for env in ("REFATTN_SIGNATURE", "REFATTN_CAUSAL_ALIGN", "REFATTN_KEYWORD"):
        monkeypatch.delenv(env, raising=False)
    preset = settings(_Config(impl="m:f", signature="flash_attn"))["convention"]
    assert preset["signature"] == "flash_attn" and preset["layout"] == "blhd"
    declared = settings(
        _Config(
            impl="m:f",
            causal_align="bottom_right",
            keyword=["scale=softmax_scale", "softcap=logit_cap,window=window_size"],
        )
    )["convention"]
    assert declared["causal_align"] == "bottom_right"
    assert declared["keywords"] == ["scale=softmax_scale", "softcap=logit_cap,window=window_size"]
    monkeypatch.setenv("REFATTN_KEYWORD", "scale=softmax_scale")
    monkeypatch.setenv("REFATTN_CAUSAL_ALIGN", "bottom_right")
    from_env = settings(_Config(impl="m:f"))["convention"]
    assert from_env["keywords"] == "scale=softmax_scale"
    assert from_env["causal_align"] == "bottom_right"
    monkeypatch.delenv("REFATTN_KEYWORD")
    monkeypatch.delenv("REFATTN_CAUSAL_ALIGN")
    with pytest.raises(pytest.UsageError, match="--refattn-signature"):
        settings(_Config(impl="m:f", signature="flash"))
    with pytest.raises(pytest.UsageError, match="--refattn-keyword"):
        settings(_Config(impl="m:f", keyword=["scale"]))
    with pytest.raises(pytest.UsageError, match="--refattn-signature"):
        settings(_Config(impl="m:f", signature="flash_attn", causal_align="top_left"))


@pytest.mark.slow
def test_plugin_passes_a_function_that_declares_its_conventions():
    args = (*_plugin_args(), *_BASE, *_TWO, "-rs")
    impl = ("--refattn-impl", "tests.planted.plugin_impls:flash_attn_numpy")
    declared = _pytest(
        *args,
        *impl,
        "--refattn-causal-align",
        "bottom_right",
        "--refattn-keyword",
        "scale=softmax_scale",
    )
    assert declared.returncode == 0 and "2 passed" in declared.stdout, declared.stdout


@pytest.mark.slow
@pytest.mark.peers("torch")
def test_plugin_passes_flash_attn_with_its_signature():
    run = _pytest(
        *_plugin_args(),
        *_BASE,
        *_TWO,
        "--refattn-impl",
        "tests.planted.flash_attn_like:flash_attn_func",
        "--refattn-signature",
        "flash_attn",
    )
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout
