"""``refattn-oracle power`` (oracle/power.py): the negative control passes, planted bugs are
caught by the cases of their class, and the command prints the table."""

from __future__ import annotations

import pytest

from oracle import power as power_module
from oracle.cli import main
from oracle.power import KERNELS, power, render


@pytest.mark.slow
def test_control_and_a_bug_on_a_small_selection():
    result = power(
        suite="default",
        cases=["long-decode-H2K1-L1S2048-*", "long-late-max-H1K1-L4S9000-*"],
        dtypes=["float32"],
        kernels=["tiled", "no_late_rescale", "causal_top_left"],
        progress=False,
    )
    assert result.cases == {"float32": 2}
    assert result.failures["tiled"] == {"default": {}, "tight": {}}
    assert result.caught("no_late_rescale", "float32") >= 1
    assert result.caught("causal_top_left", "float32") >= 1
    text = render(result, need=1, list_cases=True)
    assert "control: no false alarm" in text and "causal_top_left float32:" in text


def test_module_is_callable_and_unknown_kernel_refused():
    with pytest.raises(ValueError, match="unknown"):
        power_module(suite="smoke", kernels=["no-such-bug"], progress=False)
    assert {"tiled", "positions16", "narrow_l_after_32k", "split_combine_4096"} <= set(KERNELS)


@pytest.mark.slow
def test_cli_power(capsys):
    code = main(
        ["power", "--suite", "smoke", "--dtype", "float32", "--kernel", "tiled", "--need", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "tiled" in out and "control: no false alarm" in out


def test_a_bug_of_an_unused_option_is_not_applicable():
    result = power(
        suite="smoke",
        cases=["basic-*"],
        dtypes=["float32"],
        kernels=["tiled", "softcap_order"],
        progress=False,
    )
    assert "softcap" not in result.options
    assert "not applicable: no case uses softcap" in render(result)
    assert "WEAK" not in render(result)
