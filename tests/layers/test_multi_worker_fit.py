"""``model.fit`` with the layers on MultiWorkerMirroredStrategy, 2 processes.

Two real worker processes on 127.0.0.1 (``TF_CONFIG``), one replica each:
the big table is row-sharded across the workers. Both Keras versions:
Keras 3 (whose own ``fit`` fails there for every model; the layers'
hook fixes their models, see ``tpu_embedding.layers.distributed_fit``) and
tf-keras (the ``TPUEmbedding`` layer's model only: ``KINDS``). Each worker
fits, evaluates and predicts the ``test_mirrored`` models (and a plain
Keras model fixed with ``fix_distributed_fit`` alone), then checkpoints
them; a third process runs the same on one device and restores the chief's
checkpoints (see tests/distributed/mwms_keras_fit.py). Both workers must
end with the one-device tables, slots, dense weights, loss and predictions.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tests import sparse_access
from tests.conftest import mirrored_strategy
from tests.distributed import cluster
from tests.layers import builders
from tests.layers.test_mirrored import LAYERS
from tpu_embedding.layers import distributed_fit
from tpu_embedding.layers import keras_compat

SCRIPT = pathlib.Path(__file__).parents[1] / "distributed" / "mwms_keras_fit.py"
KERAS = {"keras_3": {}, "tf_keras": {"TF_USE_LEGACY_KERAS": "1"}}
#: The layer kinds each Keras version fits: both under Keras 3; under
#: tf-keras the ``TPUEmbedding`` layer only, with the plain model
#: (``PartialTPUEmbedding`` shares its Keras integration; it trains under
#: tf-keras in tests/layers/tf_keras_tfrs_script.py, test_tf_keras.py).
KINDS = {"keras_3": sorted(LAYERS), "tf_keras": ["tpu_embedding"]}

#: ``(Keras version, layer kind)`` of every model fitted.
FITTED = [
  (version, kind) for version in sorted(KERAS) for kind in KINDS[version]
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """``runs(keras_version)``: ``{run: {key: array}}`` for worker0, worker1
  and one_device (each Keras version's cluster launched once)."""
  launched = {}

  def launch(keras_version):
    if keras_version in launched:
      return launched[keras_version]
    out = tmp_path_factory.mktemp(keras_version)
    env = KERAS[keras_version]
    kinds = KINDS[keras_version]
    for worker in cluster.run_workers([SCRIPT, out, *kinds], env=env):
      worker.check()
    cluster.run_script([SCRIPT, out, *kinds], env=env).check()
    loaded = {}
    for run in ("worker0", "worker1", "one_device"):
      with np.load(out / f"{run}.npz") as data:
        loaded[run] = {key: data[key] for key in data.files}
    launched[keras_version] = loaded
    return loaded

  return launch


def trained_keys(values, kind):
  return sorted(
    key
    for key in values
    if key.startswith(f"{kind}/")
    and "/restored/" not in key
    and not key.endswith("big_rows_held")
  )


@pytest.mark.parametrize("keras_version, kind", FITTED)
@pytest.mark.parametrize("worker", ["worker0", "worker1"])
def test_workers_fit_like_one_device(runs, keras_version, kind, worker):
  values = runs(keras_version)
  want, got = values["one_device"], values[worker]
  keys = trained_keys(want, kind)
  assert f"{kind}/big/parameters" in keys and f"{kind}/kernel" in keys
  assert set(trained_keys(got, kind)) == set(keys)
  for key in keys:  # tables, slots, kernel, evaluate's loss, predictions
    np.testing.assert_allclose(
      got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key
    )
  initial_big, _ = builders.table_values()
  assert not np.allclose(want[f"{kind}/big/parameters"], initial_big)


@pytest.mark.parametrize("keras_version, kind", FITTED)
def test_fit_steps_touch_only_looked_up_rows(runs, keras_version, kind):
  """On each worker and on one device, the ops ``fit``'s traced steps gave
  the layer's tables and slots: row ops only (each process asserts it
  on the graphs, tests/sparse_access.py)."""
  values = runs(keras_version)
  for run in ("worker0", "worker1", "one_device"):
    ops = [str(op) for op in values[run][f"row_only_ops/{kind}"]]
    assert ops, run
    assert all(op.startswith(sparse_access.ROW_OPS) for op in ops), (run, ops)


@pytest.mark.parametrize("keras_version, kind", FITTED)
def test_big_table_is_sharded_across_the_workers(runs, keras_version, kind):
  values = runs(keras_version)
  half = [builders.V_BIG // 2]
  assert list(values["worker0"][f"{kind}/big_rows_held"]) == half
  assert list(values["worker1"][f"{kind}/big_rows_held"]) == half
  assert list(values["one_device"][f"{kind}/big_rows_held"]) == [builders.V_BIG]


@pytest.mark.parametrize("keras_version, kind", FITTED)
def test_chief_checkpoint_restores_on_one_device(runs, keras_version, kind):
  values = runs(keras_version)
  restored = {
    key.replace("/restored/", "/"): value
    for key, value in values["one_device"].items()
    if key.startswith(f"{kind}/restored/")
  }
  assert f"{kind}/big/parameters" in restored
  for key, value in restored.items():
    np.testing.assert_allclose(
      value, values["worker0"][key], rtol=1e-6, atol=1e-6, err_msg=key
    )


@pytest.mark.parametrize("keras_version", sorted(KERAS))
def test_fix_installed_only_for_keras_3_workers(runs, keras_version):
  values = runs(keras_version)
  keras_3 = keras_version == "keras_3"
  for worker in ("worker0", "worker1"):
    assert bool(values[worker]["fix_installed"]) == keras_3
    fitted_kinds = len(KINDS[keras_version])
    assert list(values[worker]["layer_models_fixed"]) == [keras_3] * (
      fitted_kinds
    )
    # The plain model was fixed per model, before any hook existed.
    assert bool(values[worker]["plain_fixed"]) == keras_3
    assert not values[worker]["plain_hook_installed"]
  assert not values["one_device"]["fix_installed"]
  assert not any(values["one_device"]["layer_models_fixed"])


@pytest.mark.parametrize("keras_version", sorted(KERAS))
@pytest.mark.parametrize("worker", ["worker0", "worker1"])
def test_plain_model_fixed_per_model_fits_like_one_device(
  runs, keras_version, worker
):
  # A model without our layers, with only fix_distributed_fit(model): both
  # Keras failures (build, scalar logs) are fixed without touching Keras.
  values = runs(keras_version)
  want, got = values["one_device"], values[worker]
  keys = sorted(key for key in want if key.startswith("plain/"))
  assert "plain/loss" in keys and "plain/weight0" in keys
  for key in keys:  # weights, fit's loss and mae per epoch, evaluate
    np.testing.assert_allclose(
      got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key
    )


def test_fix_does_what_keras_does_where_keras_works():
  # The suite runs under Keras 3 (tf-keras runs in subprocesses only).
  assert keras_compat.IS_KERAS_3
  from keras.src.backend.tensorflow import trainer

  strategy = mirrored_strategy(2)
  assert distributed_fit.needs_fix(strategy)
  assert not distributed_fit.needs_fix(tf.distribute.get_strategy())

  def replica_id():
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.fill([2], tf.cast(replica, tf.float32))

  values = strategy.run(replica_id)
  # Logged values on one worker: Keras' own mean (and concat for predict);
  # the fix leaves them alone there.
  mean = trainer.reduce_per_replica({"loss": values}, strategy, "auto")
  np.testing.assert_array_equal(mean["loss"], [0.5, 0.5])
  concat = trainer.reduce_per_replica(values, strategy, "concat")
  np.testing.assert_array_equal(concat, [0.0, 0.0, 1.0, 1.0])
  # Across workers the fix hands Keras' axis-0 mean scalars as [1] vectors:
  # that is the mean over the replicas, a scalar again.
  scalars = strategy.run(lambda: tf.reduce_mean(replica_id()))
  vectors = strategy.run(distributed_fit._scalar_as_vector, (scalars,))
  reduced = strategy.reduce("MEAN", vectors, axis=0)
  assert reduced.shape.rank == 0
  np.testing.assert_array_equal(
    reduced, strategy.reduce("MEAN", scalars, axis=None)
  )
  # Dense batches on one worker: built from Keras' mean over the replicas.
  batch = ({"x": values}, values)
  assert not distributed_fit.has_composite_values(strategy, batch)
  x, y = distributed_fit.keras_mean_batch(strategy, batch)
  np.testing.assert_array_equal(x["x"], [0.5, 0.5])
  first_x, _ = distributed_fit.first_replica_batch(strategy, batch)
  np.testing.assert_array_equal(first_x["x"], [0.0, 0.0])
