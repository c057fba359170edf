"""Packaging for tpu_embedding (tool settings live in pyproject.toml)."""

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys

from setuptools import Distribution
from setuptools import find_packages
from setuptools import setup
from setuptools.command.build_py import build_py

_HERE = pathlib.Path(__file__).parent
_VERSION = re.search(
  r'__version__ = "([^"]+)"',
  (_HERE / "tpu_embedding" / "__init__.py").read_text(),
).group(1)


def _tensorflow_version() -> str | None:
  """The TensorFlow the build compiles against (the build environment's:
  pyproject.toml's build requirements), or None where there is none."""
  try:
    return importlib.metadata.version("tensorflow")
  except importlib.metadata.PackageNotFoundError:
    return None


def _builder():
  """``tpu_embedding/kernels/build.py`` loaded on its own (importing the
  package would import all of it)."""
  path = _HERE / "tpu_embedding" / "kernels" / "build.py"
  spec = importlib.util.spec_from_file_location("_tpe_kernel_build", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # (its dataclasses look it up)
  spec.loader.exec_module(module)
  return module


class BuildPyWithKernels(build_py):
  """Copies the package, then compiles its kernels into it.

  The kernels are compiled against the build environment's TensorFlow,
  the one ``install_requires`` pins below. Without a compiler (or
  TensorFlow) the install still succeeds: the package then runs its
  TensorFlow ops path and says so once when first used. An editable
  install builds nothing (``python3 -m tpu_embedding.kernels build``).
  """

  def run(self):
    super().run()
    if getattr(self, "editable_mode", False):
      return
    target = os.path.join(self.build_lib, "tpu_embedding", "kernels")
    try:
      info = _builder().build_portable(target)
    except Exception as e:  # noqa: BLE001 - any failure: TensorFlow path.
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      print(
        f"tpu_embedding: kernels not built ({first}); the package will run "
        "its TensorFlow ops path (same numbers, slower).",
        file=sys.stderr,
      )
      return
    print(
      f"tpu_embedding: kernels built for TensorFlow "
      f"{info['tensorflow']['version']} ({', '.join(info['libraries'])}) "
      f"in {info['seconds']} s",
      file=sys.stderr,
    )


class BinaryDistribution(Distribution):
  """A platform wheel: it carries compiled libraries."""

  def has_ext_modules(self):
    return True


_TENSORFLOW = _tensorflow_version()

setup(
  name="tpu_embedding",
  version=_VERSION,
  description=(
    "TensorFlow's TPUEmbedding mid-level API on every "
    "tf.distribute strategy: sharded tables, TPU semantics."
  ),
  long_description=(_HERE / "README.md").read_text(),
  long_description_content_type="text/markdown",
  license="Apache-2.0",
  python_requires=">=3.10",
  packages=find_packages(
    include=[
      "tpu_embedding",
      "tpu_embedding.*",
      "model_garden",
      "model_garden.*",
    ]
  ),
  # The kernels' C++ sources (for a tuned rebuild); the libraries built
  # from them are added by BuildPyWithKernels.
  package_data={"tpu_embedding.kernels": ["*.cc", "*.h"]},
  cmdclass={"build_py": BuildPyWithKernels},
  distclass=BinaryDistribution,
  install_requires=[
    # Exactly the TensorFlow the kernels were compiled against.
    f"tensorflow=={_TENSORFLOW}" if _TENSORFLOW else "tensorflow>=2.21,<2.22",
    "numpy",
    "absl-py",
    "tensorboard",
    "pyyaml",
  ],
  extras_require={
    "tpu": ["tensorflow-tpu>=2.21,<2.22"],
    "test": [
      "pytest>=8",
      "pytest-xdist>=3.5",
      "ruff",
      "mypy==2.4.1",
      "tensorflow-datasets==4.9.10",
      "importlib_resources",
      "tf-keras==2.21.*",
      "tensorflow-recommenders==0.7.7",
      "nbclient==0.11.0",
      "nbformat==5.11.1",
      "ipykernel==7.4.0",
      "matplotlib",
      'keras-rs==0.4.0; python_version >= "3.11"',
      "ml-dtypes",
      # The JAX SparseCore stack's host preprocessing: tests/fdo/test_fdo.py
      # checks tpu_embedding.fdo against it (it pulls jax and jaxlib).
      'jax-tpu-embedding==0.1.0; python_version >= "3.11"',
    ],
    "fdo-check": ['jax-tpu-embedding==0.1.0; python_version >= "3.11"'],
    # tools/fdo_report.py --plot.
    "plot": ["matplotlib"],
    # tpu_embedding.fdo's stacking="jax" (keras-rs on JAX): keras-rs'
    # config conversion and jax-tpu-embedding's auto_stack_tables.
    "fdo-jax": [
      'keras-rs==0.4.0; python_version >= "3.11"',
      'jax-tpu-embedding==0.1.0; python_version >= "3.11"',
    ],
    "data": [
      "tensorflow-datasets==4.9.10",
      "importlib_resources",
    ],
  },
  classifiers=[
    "Programming Language :: Python :: 3",
    "License :: OSI Approved :: Apache Software License",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
  ],
)
