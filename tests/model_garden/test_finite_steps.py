"""A ranking step with non-finite gradients changes nothing; mixed precision.

A NaN in one dense feature of one example (on one replica of two) makes
that step's gradients non-finite: every table, slot, dense weight and dense
optimizer variable must be bit-identical after it (only the global step
advances), for an optimizer with slots (Adam) and one without (SGD), on
one device and (Adam) on 2 mirrored replicas with row-sharded tables. The
next step trains again. ``mixed_bfloat16`` / ``mixed_float16`` compute the dense
model in 16 bits with float32 tables; the float16 loss scale is divided
out of the embedding gradients too (the first update matches float32's)
and halves after a skipped step.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking import configs
from model_garden.ranking.inputs import RankingInputs
from model_garden.ranking.task import RankingTask
from tests.conftest import mirrored_strategy

STRATEGIES = {
  "default": tf.distribute.get_strategy,
  "mirrored_2": lambda: mirrored_strategy(2),
}


def small_config(**changes):
  return configs.override(
    configs.get_config("dlrm_criteo_cpu_small"),
    {
      "task.model.vocab_sizes": [40] * 26,
      "task.model.size_threshold": 20,  # all row-sharded on 2 replicas
      "task.train_data.global_batch_size": 16,
      "task.validation_data.global_batch_size": 16,
      "task.synthetic": {"num_train_examples": 64, "num_eval_examples": 16},
      **changes,
    },
  )


def state(task):
  """Every value a step may change, except the global step."""
  values = {
    f"{table}/{slot}": np.asarray(tf.convert_to_tensor(variable)).copy()
    for table, slots in task.embedding.variables.items()
    for slot, variable in slots.items()
  }
  for variable in task.model.variables + task.dense_optimizer.variables:
    values[variable.path] = np.asarray(variable).copy()
  return values


def batches(task, poisoned_step=None):
  """The training batches; with ``poisoned_step``, that step's first
  example on the last replica gets a NaN dense feature (so its gradients
  are not finite on that replica only)."""
  inputs = RankingInputs(task.config.task, task.strategy)
  dataset_fn = inputs.train_dataset_fn()
  replicas = task.strategy.num_replicas_in_sync
  poisoned = -1 if poisoned_step is None else (poisoned_step + 1) * replicas - 1

  def with_nan(context):
    def maybe_poison(index, batch):
      features, labels = batch
      dense = features["dense_features"]
      nan = tf.tensor_scatter_nd_update(dense, [[0, 0]], [np.nan])
      features = dict(
        features, dense_features=tf.where(index == poisoned, nan, dense)
      )
      return features, labels

    return dataset_fn(context).enumerate().map(maybe_poison)

  return iter(inputs.distribute(with_nan))


def check_non_finite_step(strategy_name, optimizer, **changes):
  """Trains a step, then a poisoned step that must change nothing, then a
  step that trains again; returns the first step's update of
  ``embedding_table_00``."""
  strategy = STRATEGIES[strategy_name]()
  config = small_config(
    **{"trainer.optimizer_config.embedding_optimizer": optimizer}, **changes
  )
  task = RankingTask(config, strategy, seed=1)
  data = batches(task, poisoned_step=1)
  initial = state(task)["embedding_table_00/parameters"]
  first = task.train_step(*next(data))
  assert float(first["skipped"]) == 0.0
  before = state(task)
  result = task.train_step(*next(data))
  assert float(result["skipped"]) == 1.0
  after = state(task)
  assert set(after) == set(before)
  slots = [k for k in before if not k.endswith("/parameters")]
  assert len(slots) == {"SGD": 0, "Adam": 52, "FTRL": 52}[optimizer] + len(
    task.model.variables
  ) + len(task.dense_optimizer.variables)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  assert int(tf.convert_to_tensor(task.step)) == 2
  assert int(tf.convert_to_tensor(task.dense_optimizer.iterations)) == 1

  result = task.train_step(*next(data))  # training goes on
  assert float(result["skipped"]) == 0.0
  changed = [
    k for k, v in state(task).items() if not np.array_equal(v, after[k])
  ]
  assert "embedding_table_00/parameters" in changed
  assert any("dense" in k for k in changed)
  return before["embedding_table_00/parameters"] - initial


# Adam (slots) on one device and on 2 replicas; SGD (no slots, the
# config's default) on one device in the float16 test below, whose float32
# reference it is. Every optimizer, FTRL included, skips a step at the
# mid-level API: tests/test_skip_updates.py.
@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_a_step_with_non_finite_gradients_changes_nothing(strategy_name):
  check_non_finite_step(strategy_name, "Adam")


def test_mixed_bfloat16_computes_in_16_bits_with_float32_tables():
  task = RankingTask(
    small_config(**{"runtime.mixed_precision_dtype": "mixed_bfloat16"}),
    tf.distribute.get_strategy(),
    seed=1,
  )
  layer = task.model.top_mlp.dense_layers[0]
  assert layer.compute_dtype == "bfloat16"
  assert layer.kernel.dtype == "float32"
  assert task.loss_scale is None
  tables = [v for s in task.embedding.variables.values() for v in s.values()]
  assert {tf.convert_to_tensor(v).dtype for v in tables} == {tf.float32}
  data = batches(task)
  losses = [float(task.train_step(*next(data))["loss"]) for _ in range(3)]
  assert all(np.isfinite(losses)), losses


def test_mixed_float16_loss_scale_divides_out_and_halves_on_overflow():
  def first_update(precision):
    task = RankingTask(
      small_config(**{"runtime.mixed_precision_dtype": precision}),
      tf.distribute.get_strategy(),
      seed=1,
    )
    data = batches(task, poisoned_step=1)
    before = state(task)["embedding_table_00/parameters"]
    task.train_step(*next(data))
    return task, data, state(task)["embedding_table_00/parameters"] - before

  task, data, fp16_delta = first_update("mixed_float16")
  # float32 with SGD: also the SGD case of the non-finite step test.
  fp32_delta = check_non_finite_step(
    "default", "SGD", **{"runtime.mixed_precision_dtype": "float32"}
  )
  assert np.abs(fp32_delta).max() > 0
  # Unscaled: the same update as float32 (not 2**15 times larger).
  np.testing.assert_allclose(fp16_delta, fp32_delta, atol=2e-3, rtol=0.05)
  assert float(tf.convert_to_tensor(task.loss_scale.scale)) == 2.0**15
  assert float(task.train_step(*next(data))["skipped"]) == 1.0
  assert float(tf.convert_to_tensor(task.loss_scale.scale)) == 2.0**14
