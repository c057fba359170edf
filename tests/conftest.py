"""Shared test setup: quiet TensorFlow, logical CPU devices, fixtures."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: Ahead of site-packages on the ``PYTHONPATH`` of every process the tests
#: start: ``import jax`` fails there, as where JAX is not installed (it is
#: only test_fdo's oracle, and importing TensorFlow otherwise imports it:
#: about 1.3 s of CPU per process). Not on this process's own path, where
#: the oracle runs (an xdist worker inherits the variable).
NO_JAX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no_jax")
_path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if NO_JAX not in _path:
  os.environ["PYTHONPATH"] = os.pathsep.join([NO_JAX, *filter(None, _path)])
while NO_JAX in sys.path:
  sys.path.remove(NO_JAX)

#: The tuned kernel library's cache (``TPU_EMBEDDING_KERNEL_DIR``): an
#: empty directory of the test run's own, unless the caller set one, for
#: this process and every process the tests start. A library the user
#: once built into ``~/.cache/tpu_embedding/kernels`` (``python3 -m
#: tpu_embedding.kernels build``) would load before the installed ones,
#: and the tests must not depend on what that cache holds.
if "TPU_EMBEDDING_KERNEL_DIR" not in os.environ:
  import atexit  # noqa: E402
  import shutil  # noqa: E402
  import tempfile  # noqa: E402

  os.environ["TPU_EMBEDDING_KERNEL_DIR"] = tempfile.mkdtemp(
    prefix="tpe_test_kernel_cache_"
  )
  atexit.register(
    shutil.rmtree, os.environ["TPU_EMBEDDING_KERNEL_DIR"], ignore_errors=True
  )

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

#: Logical CPU devices for multi-replica tests (set before TF initializes).
NUM_LOGICAL_CPUS = 4

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
  _cpus[0],
  [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS,
)


@pytest.fixture
def rng() -> np.random.Generator:
  """A seeded numpy generator, fresh for each test."""
  return np.random.default_rng(1234)


def constant_table(rng: np.random.Generator, rows: int, dim: int):
  """Random table values and an initializer that reproduces them."""
  values = rng.normal(size=(rows, dim)).astype(np.float32)
  return values, tf.constant_initializer(values)


def op_types(function, *args) -> set[str]:
  """Op types of a traced ``tf.function``, its nested functions' included."""
  graph = function.get_concrete_function(*args).graph
  types = {op.type for op in graph.get_operations()}
  for nested in graph._functions.values():  # pylint: disable=protected-access
    types |= {node.op for node in nested.definition.node_def}
  return types


_STRATEGIES: dict[int, tf.distribute.MirroredStrategy] = {}


def mirrored_strategy(replicas: int) -> tf.distribute.MirroredStrategy:
  """One cached MirroredStrategy per replica count over logical CPUs.

  Strategies over different device sets in one process need distinct
  collective group keys, or their collectives collide; each replica count
  gets its own key range.
  """
  if replicas not in _STRATEGIES:
    tf.distribute.MirroredStrategy._collective_key_base = 1000 * replicas
    _STRATEGIES[replicas] = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(replicas)]
    )
  return _STRATEGIES[replicas]


def pytest_sessionstart(session):
  """Under CI (``CI=true``) the kernels the install built must load.

  A run that asks for the TensorFlow path (``TPU_EMBEDDING_KERNELS=0``,
  CI's second pass) is exempt; any other run without the installed
  package's library stops here, before a test could skip for it.
  """
  del session  # unused
  from tpu_embedding import kernels
  from tpu_embedding.kernels import library

  choice = library.choose()
  if os.environ.get("CI") != "true" or choice.asked:
    return
  if choice.origin.startswith("package:") and kernels.load() is not None:
    return
  pytest.exit(
    "CI: the kernels the install built did not load "
    f"({choice.reason or choice.origin}: {choice.path}); "
    "see `python3 -m tpu_embedding.kernels status`",
    returncode=1,
  )


#: The files that take longest (about 250 s down to 30 s each on 2 cores,
#: measured 2026-11), run first. Three workers each take a whole file at a
#: time (pyproject.toml's addopts): started heaviest first, the last files
#: handed out are short ones, and the workers end at about the same time.
#: Only the order changes; a file missing here runs after these.
HEAVIEST_FIRST = (
  "test_colabs.py",
  "test_tools.py",
  "test_memory.py",
  "vocabularies/test_dynamic_tables.py",
  "model_garden/test_train.py",
  "backends/test_multi_worker.py",
  "checkpointing/test_checkpoint_kill.py",
  "test_stacking.py",
  "test_doctests.py",
  "model_garden/test_train_modes.py",
  "model_garden/test_drift_comparison.py",
  "model_garden/test_launcher.py",
  "kernels/test_kernel_delivery.py",
  "test_readme.py",
  "backends/test_sharded.py",
  "vocabularies/test_vocabulary.py",
  "backends/test_exchanges.py",
  "optimizers/test_optimizer_oracle.py",
  "checkpointing/test_delta_distributed.py",
)


def pytest_collection_modifyitems(items):
  """Orders the test files heaviest first (``HEAVIEST_FIRST``)."""
  tests = os.path.dirname(os.path.abspath(__file__))
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  items.sort(
    key=lambda item: rank.get(os.path.relpath(str(item.path), tests), len(rank))
  )


@pytest.fixture(autouse=True)
def _backends_keep_their_update_guard():
  """Fails a test that leaves the backends' update guard changed (then
  every later embedding of its process would lock its blocks: XLA
  cannot compile that), and puts it back."""
  yield
  from tpu_embedding.backends.base import Backend
  from tpu_embedding.backends.local import LocalBackend
  from tpu_embedding.backends.sharded import ShardedBackend
  from tpu_embedding.tables.update_guards import UNGUARDED

  changed = [
    c.__name__
    for c in (Backend, LocalBackend, ShardedBackend)
    if c.update_guard is not UNGUARDED
  ]
  for c in (LocalBackend, ShardedBackend):
    if "update_guard" in c.__dict__:
      delattr(c, "update_guard")
  Backend.update_guard = UNGUARDED
  if changed:
    pytest.fail(f"the test left {changed}.update_guard changed")
