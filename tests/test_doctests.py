"""Every Examples block in refattn and oracle runs as a doctest (one test per module)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import oracle
import refattn

# a module whose import needs one of these (an extra, not the test extra) is skipped when the
# package is absent, so `pip install -e ".[test]" && pytest` passes without the peers
OPTIONAL_PACKAGES = {"torch", "jax", "jaxlib", "onnx", "onnxruntime", "matplotlib"}

SKIP = {
    "refattn.kernels.cuda",  # needs a GPU or NUMBA_ENABLE_CUDASIM set before numba's import
    "oracle.pytest_plugin",
    "oracle.pytest_plugin.test_conformance",
    "oracle.__main__",
    "oracle.cli.__main__",
    "refattn.__main__",
}


def _modules():
    names = []
    for package in (refattn, oracle):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name not in SKIP and not info.name.split(".")[-1].startswith("test_"):
                names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_module_doctests(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in OPTIONAL_PACKAGES:
            raise
        pytest.skip(f"{name} needs the optional package {error.name!r}")
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=False
    )
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
