"""The doctests of every module of the installed packages.

``--doctest-modules`` would import the checkout's source files; this runs
the docstring examples of the modules of the installed ``tpu_embedding``
and ``model_garden`` (walked with ``pkgutil``), one test per module that
has any, with pytest's default option flag (``ELLIPSIS``) and the same
finder (docstrings of ``functools.cached_property`` included). A failure
shows doctest's report of every failing example of the module.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import io
import pkgutil
import sys
from types import ModuleType

import pytest

import model_garden
import tpu_embedding

PACKAGES = (tpu_embedding, model_garden)


class _Finder(doctest.DocTestFinder):
  """``doctest.DocTestFinder``, seeing ``cached_property`` docstrings.

  Before Python 3.13 doctest skips them (python/cpython#107995); pytest's
  own finder does not.
  """

  if sys.version_info < (3, 13):

    def _from_module(self, module, obj):
      if isinstance(obj, functools.cached_property):
        obj = obj.func
      return super()._from_module(module, obj)


def _import_error(name: str) -> None:
  raise ImportError(f"Cannot import {name} to look for doctests.")


def module_names(packages: tuple[ModuleType, ...] = PACKAGES) -> list[str]:
  """Every module of ``packages`` (but ``__main__``), sorted."""
  names = []
  for package in packages:
    names.append(package.__name__)
    for info in pkgutil.walk_packages(
      package.__path__, package.__name__ + ".", onerror=_import_error
    ):
      if info.name.rsplit(".", 1)[-1] != "__main__":
        names.append(info.name)
  return sorted(names)


def doctests(name: str) -> list[doctest.DocTest]:
  """The doctests with examples of module ``name`` (imported)."""
  module = importlib.import_module(name)
  return [test for test in _Finder().find(module, name) if test.examples]


MODULES = [name for name in module_names() if doctests(name)]


def test_modules_are_found():
  assert "tpu_embedding.config" in MODULES
  assert "model_garden.ranking.train" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS, verbose=False)
  report = io.StringIO()
  failed = []
  for test in doctests(name):
    if runner.run(test, out=report.write).failed:
      failed.append(test.name)
  if failed:
    pytest.fail(
      f"{len(failed)} failing doctest(s) in {name}: {', '.join(failed)}\n"
      + report.getvalue(),
      pytrace=False,
    )
