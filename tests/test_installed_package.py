"""The suite imports the installed distribution, not the checkout's files.

The root ``conftest.py`` takes the checkout off ``sys.path``; these checks
fail if ``tpu_embedding`` or ``model_garden`` (or any of their modules
imported so far) still come from somewhere other than the installed
``tpu_embedding`` distribution: its files in site-packages for a regular
install (``pip install .``, as CI does), or its source directory for an
editable one (``pip install -e .``), whichever directory that is.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re
import sys
import urllib.parse
import urllib.request
import warnings

import model_garden
import tpu_embedding

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"tpu_embedding": tpu_embedding, "model_garden": model_garden}


def _normalized(name: str) -> str:
  """A distribution name as PEP 503 compares them."""
  return re.sub(r"[-_.]+", "-", name).lower()


def _distribution() -> importlib.metadata.Distribution:
  return importlib.metadata.distribution("tpu_embedding")


def _editable_source(dist: importlib.metadata.Distribution):
  """The source directory of an editable install, or None."""
  text = dist.read_text("direct_url.json")
  info = json.loads(text) if text else {}
  if not info.get("dir_info", {}).get("editable", False):
    return None
  url = urllib.parse.urlparse(info["url"])
  return pathlib.Path(urllib.request.url2pathname(url.path)).resolve()


def _installed_dir(dist: importlib.metadata.Distribution, package: str):
  """Where the distribution's copy of ``package`` is."""
  source = _editable_source(dist)
  if source is not None:
    return source / package
  return pathlib.Path(dist.locate_file(package)).resolve()


def _where(dist: importlib.metadata.Distribution) -> str:
  source = _editable_source(dist)
  kind = f"editable install of {source}" if source else "regular install"
  return f"tpu_embedding {dist.version}, {kind}"


def test_packages_come_from_the_installed_distribution():
  dist = _distribution()
  for name, package in PACKAGES.items():
    # (Twice over in a venv with --system-site-packages over another
    # install: the first on sys.path is imported, and is ``dist``.)
    owners = importlib.metadata.packages_distributions()[name]
    assert {_normalized(owner) for owner in owners} == {"tpu-embedding"}
    installed = _installed_dir(dist, name)
    imported = pathlib.Path(package.__file__).resolve().parent
    assert imported == installed, (
      f"{name} is imported from {imported}, not from the installed "
      f"distribution ({_where(dist)}: {installed})"
    )
  if _editable_source(dist) is None:
    # The wheel's files, not this checkout's (the checkout may hold the
    # environment, as in ROOT/.venv, but not these files).
    for name, package in PACKAGES.items():
      assert pathlib.Path(package.__file__).resolve() != (
        ROOT / name / "__init__.py"
      )
    files = {str(f) for f in dist.files}
    assert "tpu_embedding/__init__.py" in files
    assert "model_garden/ranking/train.py" in files
  elif _editable_source(dist) != ROOT:
    warnings.warn(
      f"The tests in {ROOT} run against {_where(dist)}, another tree: "
      "install this one to test it.",
      stacklevel=1,
    )


def test_every_imported_module_is_the_installed_copy():
  dist = _distribution()
  for name in PACKAGES:
    installed = _installed_dir(dist, name)
    for module_name, module in list(sys.modules.items()):
      if module_name.split(".")[0] != name:
        continue
      path = getattr(module, "__file__", None)
      assert path is not None, module_name
      assert pathlib.Path(path).resolve().is_relative_to(installed), (
        f"{module_name} was imported from {path}, outside {installed}"
      )


def test_tests_package_is_this_checkout():
  import tests  # noqa: PLC0415

  assert list(tests.__path__) == [str(ROOT / "tests")]
  assert not any(
    pathlib.Path(entry or ".").resolve() == ROOT for entry in sys.path
  )


def test_installed_version_is_the_source_version():
  source = (ROOT / "tpu_embedding" / "__init__.py").read_text()
  version = re.search(r'__version__ = "([^"]+)"', source).group(1)
  assert _distribution().version == version
  assert tpu_embedding.__version__ == version
