"""The Keras 3 ``fit`` fix is per model, bounded, logged once and undoable.

* Not requested, Keras is stock: its trainer holds its own function objects
  and a plain model fits bit-identically to a process that never imported
  ``tpu_embedding`` (``plain_keras_fit_script.py``), on the default strategy
  and on MirroredStrategy; requested, a plain model on one worker still
  fits bit-identically (the fix only differs where Keras raises).
* ``enable_distributed_fit`` installs the hook once (one log line),
  ``disable_distributed_fit`` puts the original object back, the context
  manager restores the previous state.
* The version gate: changed private functions warn and replace nothing; a
  newer Keras with the same functions gets the fix, one that no longer has
  the failing reductions is left alone.
* ``fix_distributed_fit(model)`` fixes one model (ragged inputs under
  MirroredStrategy, where stock Keras raises) and is undone; our layers'
  hook fixes their models only. (Across workers: test_multi_worker_fit.)
"""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import mirrored_strategy
from tests.distributed import cluster
from tests.layers import plain_keras_fit_script
from tests.layers import test_mirrored
from tpu_embedding import layers
from tpu_embedding.layers import distributed_fit
from tpu_embedding.layers.keras_compat import keras

pytestmark = pytest.mark.skipif(
  not distributed_fit.IS_KERAS_3, reason="the fix concerns Keras 3 only"
)

SCRIPT = pathlib.Path(plain_keras_fit_script.__file__)
INSTALLED = "replaced keras.src.backend.tensorflow.trainer.TensorFlowTrainer"


def trainer_module():
  from keras.src.backend.tensorflow import trainer

  return trainer


def keras_build_attribute():
  """What ``TensorFlowTrainer`` holds as ``_maybe_symbolic_build`` now."""
  return trainer_module().TensorFlowTrainer.__dict__["_maybe_symbolic_build"]


def assert_keras_own(function, qualname):
  assert function.__module__ == "keras.src.backend.tensorflow.trainer"
  assert function.__qualname__ == qualname


@pytest.fixture(autouse=True)
def stock_keras():
  """Each test starts with the fix off; the session's state comes back."""
  with distributed_fit.distributed_fit_enabled():  # Saves, then restores.
    distributed_fit.disable_distributed_fit()
    yield


@pytest.fixture
def absl_info(caplog):
  caplog.set_level(logging.INFO, logger="absl")
  caplog.clear()

  def messages(text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]

  return messages


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
  """The script's results, from a process without tpu_embedding."""
  out = tmp_path_factory.mktemp("stock") / "stock.npz"
  cluster.run_script([SCRIPT, out]).check()
  with np.load(out) as data:
    return {key: data[key] for key in data.files}


def allow_layers_to_install():
  """As in a fresh process (the fixture's disable forbids it)."""
  distributed_fit._Hook.layers_may_install = True


def strategies():
  return {
    "default": tf.distribute.get_strategy(),
    "mirrored": mirrored_strategy(2),
  }


def assert_identical(got, stock, name):
  keys = sorted(k.split("/", 1)[1] for k in stock if k.startswith(name))
  assert sorted(got) == keys
  for key in keys:
    np.testing.assert_array_equal(got[key], stock[f"{name}/{key}"], key)


# --- stock Keras when not requested -------------------------------------------


def test_keras_trainer_holds_its_own_functions_when_not_requested():
  trainer = trainer_module()
  assert_keras_own(
    keras_build_attribute(), "TensorFlowTrainer._maybe_symbolic_build"
  )
  assert_keras_own(trainer.reduce_per_replica, "reduce_per_replica")
  # Our layers on the default strategy need nothing and install nothing.
  test_mirrored.make_model("tpu_embedding")
  assert not distributed_fit.installed()
  assert_keras_own(
    keras_build_attribute(), "TensorFlowTrainer._maybe_symbolic_build"
  )


@pytest.mark.parametrize("name", ["default", "mirrored"])
def test_plain_model_fits_bit_identically_to_stock_keras(stock_run, name):
  strategy = strategies()[name]
  got = plain_keras_fit_script.run(strategy)
  assert_identical(got, stock_run, name)
  # Requested for every model: nothing changes on one worker either.
  with distributed_fit.distributed_fit_enabled() as installed:
    assert installed
    assert_identical(plain_keras_fit_script.run(strategy), stock_run, name)
  # Installed by our layers (for their models): other models get Keras' own.
  allow_layers_to_install()
  assert distributed_fit.install_for_layers(mirrored_strategy(2))
  assert_identical(plain_keras_fit_script.run(strategy), stock_run, name)


# --- enable, disable, context manager -----------------------------------------


def test_enable_logs_once_and_disable_restores_the_originals(absl_info):
  original = keras_build_attribute()
  reduce_per_replica = trainer_module().reduce_per_replica
  assert layers.enable_distributed_fit()
  assert layers.enable_distributed_fit()  # Idempotent.
  assert keras_build_attribute() is distributed_fit._hooked_build
  assert trainer_module().reduce_per_replica is reduce_per_replica
  (message,) = absl_info(INSTALLED)
  assert "_maybe_symbolic_build" in message
  assert distributed_fit.ISSUE in message
  assert "disable_distributed_fit" in message
  layers.disable_distributed_fit()
  layers.disable_distributed_fit()  # Idempotent.
  assert keras_build_attribute() is original
  assert not distributed_fit.installed()
  assert len(absl_info(INSTALLED)) == 1


def test_context_manager_restores_the_previous_state():
  original = keras_build_attribute()
  with layers.distributed_fit_enabled() as installed:
    assert installed
    assert keras_build_attribute() is distributed_fit._hooked_build
  assert keras_build_attribute() is original
  # From "our layers' models only" back to it, and to off.
  allow_layers_to_install()
  assert distributed_fit.install_for_layers(mirrored_strategy(2))
  with layers.distributed_fit_enabled():
    assert distributed_fit._Hook.mode == "all"
  assert distributed_fit._Hook.mode == "layers"
  layers.disable_distributed_fit()
  assert keras_build_attribute() is original


def test_disable_keeps_our_layers_from_installing_it_again():
  with mirrored_strategy(2).scope():
    test_mirrored.make_model("tpu_embedding")
  assert not distributed_fit.installed()
  layers.enable_distributed_fit()
  layers.disable_distributed_fit()
  assert not distributed_fit.installed()


# --- the version gate ---------------------------------------------------------


def reduce_per_replica_with_options(values, strategy, reduction, options=None):
  return values


def test_changed_function_warns_and_replaces_nothing(monkeypatch):
  trainer = trainer_module()
  original = keras_build_attribute()
  monkeypatch.setattr(
    trainer, "reduce_per_replica", reduce_per_replica_with_options
  )
  with pytest.warns(RuntimeWarning) as warned:
    assert not layers.enable_distributed_fit()
  (warning,) = warned
  text = str(warning.message)
  assert f"Keras {keras.__version__}" in text
  assert (
    "keras.src.backend.tensorflow.trainer.reduce_per_replica: expected "
    "(values, strategy, reduction), found "
    "(values, strategy, reduction, options)"
  ) in text
  assert "not installed" in text
  assert keras_build_attribute() is original
  assert not distributed_fit.installed()
  # Nor is any model fixed.
  model = keras.Sequential([keras.layers.Dense(1)])
  with pytest.warns(RuntimeWarning, match="reduce_per_replica"):
    assert not layers.fix_distributed_fit(model)
  assert not distributed_fit.is_fixed(model)


def test_changed_method_or_missing_function_is_named(monkeypatch):
  trainer = trainer_module()

  def build_with_steps(self, iterator=None, data_batch=None, steps=None):
    pass

  monkeypatch.setattr(
    trainer.TensorFlowTrainer, "_maybe_symbolic_build", build_with_steps
  )
  monkeypatch.delattr(trainer, "_collective_all_reduce_multi_worker")
  with pytest.warns(RuntimeWarning) as warned:
    assert not layers.enable_distributed_fit()
  text = str(warned[0].message)
  assert (
    "TensorFlowTrainer._maybe_symbolic_build: expected "
    "(self, iterator, data_batch), found "
    "(self, iterator, data_batch, steps)"
  ) in text
  assert (
    "_collective_all_reduce_multi_worker: expected (strategy), found "
    "missing" in text
  )
  assert keras_build_attribute() is build_with_steps


def test_newer_keras_with_the_same_functions_gets_the_fix(
  monkeypatch, absl_info
):
  monkeypatch.setattr(keras, "__version__", "3.99.0")
  assert layers.enable_distributed_fit()
  (message,) = absl_info(INSTALLED)
  assert "Keras 3.99.0" in message


def test_newer_keras_without_the_failing_reductions_is_left_alone(
  monkeypatch, absl_info
):
  trainer = trainer_module()
  original = keras_build_attribute()

  def fixed_build(self, iterator=None, data_batch=None):
    pass  # (A Keras that builds from one replica's batch.)

  def fixed_reduce(values, strategy, reduction):
    return values  # (A Keras that reduces scalars without an axis.)

  monkeypatch.setattr(
    trainer.TensorFlowTrainer, "_maybe_symbolic_build", fixed_build
  )
  monkeypatch.setattr(trainer, "reduce_per_replica", fixed_reduce)
  # Known to need it: the gate trusts the version range.
  assert layers.enable_distributed_fit()
  layers.disable_distributed_fit()
  assert keras_build_attribute() is fixed_build
  # Newer than the last known: left alone, with a log line.
  monkeypatch.setattr(keras, "__version__", "3.99.0")
  assert not layers.enable_distributed_fit()
  assert keras_build_attribute() is fixed_build
  (message,) = absl_info("no longer")
  assert "Keras 3.99.0" in message and "left alone" in message
  monkeypatch.undo()
  assert keras_build_attribute() is original


def test_version_parsing():
  assert distributed_fit._version("3.15.1") == (3, 15, 1)
  assert distributed_fit._version("3.16.0.dev2025010203") == (3, 16, 0)
  assert distributed_fit._version("4.0") > distributed_fit._version("3.15.1")


# --- per model ----------------------------------------------------------------


class SumOfValues(keras.Model):
  """``Dense(1)`` over the per-example sum of (ragged) float values."""

  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(
      1, kernel_initializer="ones", bias_initializer="zeros"
    )

  def call(self, values):
    return self.dense(tf.reduce_sum(values, axis=1, keepdims=True))


def ragged_dataset():
  rng = np.random.default_rng(5)
  rows = [list(rng.normal(size=rng.integers(1, 4))) for _ in range(16)]
  x = tf.ragged.constant(rows, dtype=tf.float32)
  y = rng.normal(size=(16, 1)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


def ragged_fit(strategy, fix):
  with strategy.scope():
    model = SumOfValues()
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
  if fix:
    assert layers.fix_distributed_fit(model)
  history = model.fit(ragged_dataset(), epochs=2, shuffle=False, verbose=0)
  return model, history.history["loss"]


def test_fix_one_model_where_keras_fails_and_undo():
  original = keras_build_attribute()
  strategy = mirrored_strategy(2)
  with strategy.scope():
    stock = SumOfValues()
    stock.compile(keras.optimizers.SGD(0.1), loss="mse")
  with pytest.raises(Exception, match="RaggedTensor"):
    stock.fit(ragged_dataset(), epochs=1, shuffle=False, verbose=0)
  model, loss = ragged_fit(strategy, fix=True)
  _, want_loss = ragged_fit(tf.distribute.get_strategy(), fix=False)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  # Only this instance was changed; Keras and other models were not.
  assert keras_build_attribute() is original
  assert not distributed_fit.installed()
  assert distributed_fit.is_fixed(model) and not distributed_fit.is_fixed(stock)
  assert "train_step" in model.__dict__ and "train_step" not in stock.__dict__
  assert layers.fix_distributed_fit(model)  # Idempotent.
  assert not layers.fix_distributed_fit(model, enabled=False)
  for name in ("_maybe_symbolic_build", "train_step", "test_step"):
    assert name not in model.__dict__, name
  assert model.train_step.__func__ is type(model).train_step
  assert model.train_function is None


def test_fix_keeps_a_custom_train_step():
  calls = []

  class CustomStep(SumOfValues):
    def train_step(self, data):
      calls.append(1)
      return super().train_step(data)

  with mirrored_strategy(2).scope():
    model = CustomStep()
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
  layers.fix_distributed_fit(model)
  model.fit(ragged_dataset(), epochs=1, shuffle=False, verbose=0)
  assert "train_step" in model.__dict__  # Our wrapper, around theirs.
  assert calls


def test_our_layers_hook_fixes_their_models_only(absl_info):
  strategy = mirrored_strategy(2)
  allow_layers_to_install()
  with strategy.scope():
    ours, _ = test_mirrored.make_model("tpu_embedding")
  (message,) = absl_info(INSTALLED)
  assert "tpu_embedding layers" in message
  x, y = test_mirrored.dense_data()
  ours.fit(x, y, batch_size=8, epochs=1, verbose=0)
  assert distributed_fit.is_fixed(ours)
  plain, _ = ragged_fit(tf.distribute.get_strategy(), fix=False)
  with strategy.scope():
    other = SumOfValues()
    other.compile(keras.optimizers.SGD(0.1), loss="mse")
  with pytest.raises(Exception, match="RaggedTensor"):
    other.fit(
      ragged_dataset(), epochs=1, shuffle=False, verbose=0
    )  # Keras' own build.
  assert not distributed_fit.is_fixed(other) and not distributed_fit.is_fixed(
    plain
  )
  layers.disable_distributed_fit()
  assert not distributed_fit.is_fixed(ours)
  assert_keras_own(
    keras_build_attribute(), "TensorFlowTrainer._maybe_symbolic_build"
  )
