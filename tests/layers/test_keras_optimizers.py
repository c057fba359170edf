"""Keras optimizers train the tables as the equal ``tpu_embedding`` ones.

Every check runs on the optimizer classes of the Keras this process has:
Keras 3's; or, when ``test_tf_keras_in_a_subprocess`` re-runs this module
in a fresh interpreter with ``TF_USE_LEGACY_KERAS=1``, tf-keras' v2 and
legacy (``tf_keras.optimizers.legacy``) ones. For each: the translation
equals the hand-written ``tpu_embedding`` optimizer, one training step
through the layer updates the rows and slots as the numpy oracle
(``tests/oracle.py``) does, learning rate schedules (and legacy ``decay``)
give step ``k`` the rate of step ``k`` inside ``model.fit``, and what has
no equivalent is refused by name.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any
from typing import NamedTuple

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import oracle
from tests.layers.tf_keras_pytest import run_pytest_under_tf_keras
from tpu_embedding.layers import PartialTPUEmbedding
from tpu_embedding.layers import TPUEmbedding
from tpu_embedding.layers.keras_compat import IS_KERAS_3
from tpu_embedding.layers.keras_compat import keras
from tpu_embedding.layers.keras_optimizers import KerasLearningRate
from tpu_embedding.layers.keras_optimizers import embedding_optimizer
from tpu_embedding.layers.keras_optimizers import to_embedding_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The optimizer modules under test in this process.
FAMILIES: dict[str, Any] = (
  {"keras_3": keras.optimizers}
  if IS_KERAS_3
  else {
    "tf_keras": keras.optimizers,
    "tf_keras_legacy": keras.optimizers.legacy,
  }
)

VOCAB, DIM = 8, 3
#: Ragged ids with duplicates within and across examples, and an empty row.
IDS = [[1, 3, 1], [3], [], [5, 0, 6]]


class Case(NamedTuple):
  """A Keras optimizer and the ``tpu_embedding`` one it must become.

  ``ours`` uses TensorFlow's keyword names, which the oracle takes too.
  """

  keras_class: str
  keras_kwargs: dict[str, Any]
  ours: str
  ours_kwargs: dict[str, Any]


CASES = {
  "sgd": Case(
    "SGD",
    {"learning_rate": 0.3, "clipvalue": 0.5},
    "sgd",
    {"learning_rate": 0.3, "clipvalue": 0.5},
  ),
  "adagrad": Case(
    "Adagrad",
    {"learning_rate": 0.2, "initial_accumulator_value": 0.5},
    "adagrad",
    {"learning_rate": 0.2, "initial_accumulator_value": 0.5},
  ),
  "adam": Case(
    "Adam",
    {"learning_rate": 0.05, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-3},
    "adam",
    {"learning_rate": 0.05, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-3},
  ),
  "ftrl": Case(
    "Ftrl",
    {
      "learning_rate": 0.4,
      "learning_rate_power": -0.6,
      "l1_regularization_strength": 0.01,
      "l2_regularization_strength": 0.02,
      "beta": 0.3,
      "initial_accumulator_value": 0.2,
    },
    "ftrl",
    {
      "learning_rate": 0.4,
      "learning_rate_power": -0.6,
      "l1_regularization_strength": 0.01,
      "l2_regularization_strength": 0.02,
      "beta": 0.3,
      "initial_accumulator_value": 0.2,
    },
  ),
  # Keras' decoupled weight decay (Keras 3 and tf-keras v2): w -= d lr w.
  "adagrad_weight_decay": Case(
    "Adagrad",
    {"learning_rate": 0.2, "weight_decay": 0.1},
    "adagrad",
    {
      "learning_rate": 0.2,
      "weight_decay_factor": 0.1,
      "multiply_weight_decay_factor_by_learning_rate": True,
    },
  ),
}

OURS = {
  "sgd": tpe.SGD,
  "adagrad": tpe.Adagrad,
  "adam": tpe.Adam,
  "ftrl": tpe.FTRL,
}


def make_keras(family: str, name: str, **kwargs: Any) -> Any:
  """A Keras optimizer, or a skip if this Keras lacks one of the kwargs."""
  try:
    return getattr(FAMILIES[family], name)(**kwargs)
  except TypeError as e:  # e.g. weight_decay on a legacy optimizer
    pytest.skip(f"{family} {name} does not take {sorted(kwargs)}: {e}")


def one_step(optimizer: Any, rng: np.random.Generator):
  """One custom-loop training step; returns (layer, init, upstream)."""
  init = rng.normal(size=(VOCAB, DIM))
  table = tpe.TableConfig(
    VOCAB,
    DIM,
    name="t",
    combiner="sum",
    initializer=tf.constant_initializer(init),
  )
  layer = TPUEmbedding({"f": tpe.FeatureConfig(table)}, optimizer)
  upstream = rng.normal(size=(len(IDS), DIM))
  ids = tf.ragged.constant(IDS, dtype=tf.int64)
  with tf.GradientTape() as tape:
    activations = layer({"f": ids}, training=True)["f"]
    loss = tf.reduce_sum(activations * upstream)
  tape.gradient(loss, layer.trainable_variables)
  return layer, init, upstream


@pytest.mark.parametrize("used", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_translation_equals_the_hand_written_optimizer(family, case, used):
  spec = CASES[case]
  optimizer = make_keras(family, spec.keras_class, **spec.keras_kwargs)
  if used:  # tf-keras legacy then holds its hyper-parameters in float32
    variable = tf.Variable([1.0, 2.0])
    optimizer.apply_gradients([(tf.constant([0.5, 0.5]), variable)])
  translated = to_embedding_optimizer(optimizer)
  assert translated == OURS[spec.ours](**spec.ours_kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_step_through_the_layer_equals_the_oracle(family, case, rng):
  spec = CASES[case]
  optimizer = make_keras(family, spec.keras_class, **spec.keras_kwargs)
  layer, init, upstream = one_step(optimizer, rng)

  want = oracle.Table(
    init, oracle.Optimizer.create(spec.ours, **spec.ours_kwargs)
  )
  want.step([{"ids": IDS, "combiner": "sum"}], lambda acts: [upstream])
  got = layer.mid_level_api.variables["t"]
  np.testing.assert_allclose(
    got["parameters"].numpy(), want.params, rtol=1e-5, atol=1e-6
  )
  for slot, value in want.slots.items():
    np.testing.assert_allclose(
      got[slot].numpy(), value, rtol=1e-5, atol=1e-6, err_msg=slot
    )
  assert not np.allclose(got["parameters"].numpy(), init)


@pytest.mark.parametrize("name", sorted(OURS))
def test_names_are_the_default_optimizers(name):
  assert embedding_optimizer(name) == OURS[name]()
  assert embedding_optimizer(name.upper()) == OURS[name]()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_both_layers_take_keras_optimizers(family):
  big = tpe.TableConfig(20, 2, name="big")
  small = tpe.TableConfig(5, 2, name="small")
  features = {"a": tpe.FeatureConfig(big), "b": tpe.FeatureConfig(small)}
  optimizer = make_keras(family, "Adagrad", learning_rate=0.5)
  partial = PartialTPUEmbedding(features, optimizer, size_threshold=10)
  assert partial.placements == {"a": "tpu_embedding", "b": "replicated"}
  assert partial.get_config()["optimizer"] == {
    "class_name": "Adagrad",
    "config": tpe.Adagrad(0.5).get_config(),
  }
  variables = partial.tpu_embedding.mid_level_api.variables
  assert sorted(variables["big"]) == ["accumulators", "parameters"]


# --- learning rate schedules ------------------------------------------------

BATCHES = [[1, 3, 1, 5], [3, 3, 0, 2], [5, 1, 1, 4]]
BATCH = len(BATCHES[0])


class LookupModel(keras.Model):
  """The activations of feature ``f`` as the model's output."""

  def __init__(self, layer):
    super().__init__()
    self.embedding = layer

  def call(self, inputs, training=None):
    return self.embedding(inputs, training=training)["f"]


def fit_three_steps(optimizer: Any, rng: np.random.Generator) -> tuple:
  """``model.fit`` on ``BATCHES`` with ``optimizer`` for model and tables."""
  init = rng.normal(size=(VOCAB, DIM))
  table = tpe.TableConfig(
    VOCAB, DIM, name="t", initializer=tf.constant_initializer(init)
  )
  layer = TPUEmbedding({"f": tpe.FeatureConfig(table)}, optimizer)
  model = LookupModel(layer)
  model.compile(optimizer=optimizer, loss="mse")
  x = {"f": np.array(BATCHES, np.int64).reshape(-1)}
  y = np.zeros((x["f"].size, DIM), np.float32)
  model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
  assert int(optimizer.iterations.numpy()) == len(BATCHES)
  return layer.mid_level_api.variables["t"]["parameters"].numpy(), init


def oracle_sgd(init: np.ndarray, rates: list[float]) -> np.ndarray:
  """SGD on ``BATCHES`` with Keras' mse against 0: grad = 2 a / (B D)."""
  table = oracle.Table(init, oracle.Optimizer.create("sgd"))
  for ids, rate in zip(BATCHES, rates, strict=True):
    table.step(
      [{"ids": np.array(ids)}],
      lambda acts: [2.0 * acts[0] / (BATCH * DIM)],
      learning_rate=rate,
    )
  return table.params


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_schedule_gives_step_k_its_rate_in_fit(family, rng):
  schedule = keras.optimizers.schedules.ExponentialDecay(
    2.0, decay_steps=1, decay_rate=0.5
  )
  optimizer = make_keras(family, "SGD", learning_rate=schedule)
  translated = to_embedding_optimizer(optimizer)
  assert isinstance(translated.learning_rate, KerasLearningRate)
  assert (
    translated.learning_rate == to_embedding_optimizer(optimizer).learning_rate
  )

  got, init = fit_three_steps(optimizer, rng)

  rates = [2.0 * 0.5**k for k in range(len(BATCHES))]
  np.testing.assert_allclose(got, oracle_sgd(init, rates), rtol=1e-5)
  # Not the first rate throughout, nor the rates one step late.
  for wrong in ([2.0] * 3, [1.0, 0.5, 0.25]):
    assert not np.allclose(got, oracle_sgd(init, wrong), rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_legacy_decay_divides_the_rate_by_one_plus_decay_step(family, rng):
  if family != "tf_keras_legacy":
    pytest.skip("only legacy optimizers have a time decay (Keras 3 warns)")
  optimizer = make_keras(family, "SGD", learning_rate=1.5, decay=0.5)
  got, init = fit_three_steps(optimizer, rng)
  rates = [1.5 / (1.0 + 0.5 * k) for k in range(len(BATCHES))]
  np.testing.assert_allclose(got, oracle_sgd(init, rates), rtol=1e-5)


# --- refusals ---------------------------------------------------------------

REFUSED = {
  "rmsprop": ("RMSprop", {}, r"RMSprop .*has no embedding-table equivalent"),
  "adamw": ("AdamW", {}, r"AdamW .*has no embedding-table equivalent"),
  "momentum": ("SGD", {"momentum": 0.9}, r"SGD\(momentum=0.9\).*no momentum"),
  "nesterov": ("SGD", {"nesterov": True}, r"SGD\(nesterov=True\)"),
  "amsgrad": ("Adam", {"amsgrad": True}, r"Adam\(amsgrad=True\).*AMSGrad"),
  "l2_shrinkage": (
    "Ftrl",
    {"l2_shrinkage_regularization_strength": 0.1},
    r"l2_shrinkage_regularization_strength=0.1\).*no L2 shrinkage",
  ),
  "adagrad_epsilon": (
    "Adagrad",
    {"epsilon": 1e-3},
    r"Adagrad\(epsilon=0.001\).*Only epsilon=1e-07 is accepted",
  ),
  "clipnorm": ("SGD", {"clipnorm": 1.0}, r"SGD\(clipnorm=1.0\).*clipvalue"),
  "global_clipnorm": ("Adam", {"global_clipnorm": 1.0}, r"global_clipnorm"),
  "use_ema": ("Adam", {"use_ema": True}, r"use_ema=True\).*moving average"),
  "loss_scale_factor": ("SGD", {"loss_scale_factor": 2.0}, "loss_scale"),
  "gradient_accumulation": (
    "SGD",
    {"gradient_accumulation_steps": 2},
    "gradient_accumulation_steps=2",
  ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_has_no_equivalent_is_refused_by_name(family, case):
  name, kwargs, message = REFUSED[case]
  if not hasattr(FAMILIES[family], name):
    pytest.skip(f"{family} has no {name}")
  optimizer = make_keras(family, name, **kwargs)
  for make in (TPUEmbedding, PartialTPUEmbedding):
    with pytest.raises(ValueError, match=message) as error:
      make({"a": tpe.FeatureConfig(tpe.TableConfig(20, 2))}, optimizer)
    assert "SGD, Adagrad, Adam or Ftrl" in str(error.value)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_subclass_is_refused(family):
  class MySGD(FAMILIES[family].SGD):
    pass

  with pytest.raises(ValueError, match="MySGD .*Subclasses are refused"):
    embedding_optimizer(MySGD(0.1))


# --- tf-keras ---------------------------------------------------------------


@pytest.mark.skipif(not IS_KERAS_3, reason="already the tf-keras run")
def test_tf_keras_in_a_subprocess(tmp_path):
  """This module under tf-keras: its v2 and legacy optimizers."""
  suite, _ = run_pytest_under_tf_keras(
    [str(pathlib.Path(__file__).relative_to(ROOT))], ROOT, tmp_path
  )
  ran = [
    case.get("name", "")
    for case in suite.iter("testcase")
    if case.find("skipped") is None
  ]
  # Both tf-keras families trained through the layer, schedules included.
  for family in ("tf_keras", "tf_keras_legacy"):
    param = re.compile(rf"[\[-]{family}[\]-]")
    for test in ("one_step", "schedule", "refused"):
      assert any(test in n and param.search(n) for n in ran), (family, ran)
