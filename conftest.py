"""The suite tests the installed ``tpu_embedding``, not this checkout's files.

``python -m pytest`` puts the current directory first on ``sys.path``, so
``import tpu_embedding`` would find the source tree next to this file
instead of the installed distribution (the wheel CI installs, or an
editable install). This root conftest, which pytest loads before any test
module, takes the checkout off ``sys.path`` and makes only its ``tests``
namespace package importable (``from tests.conftest import ...``): the
packages ``tpu_embedding`` and ``model_garden`` come from wherever they are
installed. ``tests/test_installed_package.py`` checks that they do; the
report header says which copy is tested.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent


def _is_root(entry: str) -> bool:
  try:
    return pathlib.Path(entry or os.curdir).resolve() == ROOT
  except OSError:
    return False


def import_tests_package(root: pathlib.Path) -> None:
  """Registers ``root/tests`` as the ``tests`` package, off ``sys.path``.

  ``tests`` has no ``__init__.py`` (a namespace package); its subpackages
  (``tests.layers``, ``tests.distributed``) resolve through its
  ``__path__``. Child scripts that need ``tests`` do the same
  (``tests/distributed/mwms_keras_fit.py``).

  Args:
    root: the checkout's root directory.
  """
  spec = importlib.machinery.ModuleSpec("tests", None, is_package=True)
  spec.submodule_search_locations = [str(root / "tests")]
  sys.modules["tests"] = importlib.util.module_from_spec(spec)


sys.path[:] = [entry for entry in sys.path if not _is_root(entry)]
import_tests_package(ROOT)


def pytest_report_header(config):
  """Which ``tpu_embedding`` and ``model_garden`` the tests import."""
  del config  # unused
  lines = []
  for name in ("tpu_embedding", "model_garden"):
    spec = importlib.util.find_spec(name)  # locates without importing
    origin = spec.origin if spec else "NOT INSTALLED"
    lines.append(f"{name} under test: {origin}")
  return lines
