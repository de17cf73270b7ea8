"""Every example in the library's docstrings runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import sdc_guard

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(sdc_guard.__path__, "sdc_guard.")
    if not name.endswith("__main__")
)


#: modules whose import takes seconds (Lightning, transformers): slow, as their suites are
FRAMEWORK_MODULES = {"sdc_guard.integrations.lightning", "sdc_guard.integrations.transformers"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=(pytest.mark.slow,) if n in FRAMEWORK_MODULES else ())
                                  for n in MODULES])
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
