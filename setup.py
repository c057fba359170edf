"""Packaging for tpu_embedding (tool settings live in pyproject.toml)."""

import pathlib
import re

from setuptools import find_packages
from setuptools import setup

_HERE = pathlib.Path(__file__).parent
_VERSION = re.search(
  r'__version__ = "([^"]+)"',
  (_HERE / "tpu_embedding" / "__init__.py").read_text(),
).group(1)

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
  # The kernels' C++ sources, compiled against the installed TensorFlow
  # (python3 -m tpu_embedding.kernels build).
  package_data={"tpu_embedding.kernels": ["*.cc", "*.h"]},
  install_requires=[
    "tensorflow>=2.21,<2.22",
    "numpy",
    "absl-py",
    "tensorboard",
    "pyyaml",
  ],
  extras_require={
    "tpu": ["tensorflow-tpu>=2.21,<2.22"],
    "test": [
      "pytest>=8",
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
