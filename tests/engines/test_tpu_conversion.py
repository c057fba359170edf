"""Translation to TensorFlow's TPU configs, checked on CPU.

No TPU here, so the oracle is what TensorFlow builds on CPU from the
translated configs: its ``TPUEmbeddingForServing`` and its ``TPUEmbedding``
(which, outside a ``TPUStrategy``, creates its variables on the host) must
name the tables as we do, save the same checkpoint keys, restore our
checkpoints (and we theirs) and look up the same activations. Optimizers
must come out equal to the ones a user would write with TensorFlow's API,
down to the ``OptimizationParameters`` proto the TPU receives; every
TensorFlow constructor argument must be mapped or listed as unsupported.

The TPU engines need a TPU; here ``TPUEngine`` drives TensorFlow's
``TPUEmbedding`` in its CPU mode (build, tables, checkpoints) and a
recording stand-in for ``TPUEmbeddingV2`` (the SparseCore call protocol).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import itertools
import os
import sys
import types
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2
from tensorflow.core.protobuf.tpu import tpu_embedding_configuration_pb2
from tensorflow.python.distribute import values as distribute_values
from tensorflow.python.tpu import tpu_embedding_v2_utils as tf_utils

import tpu_embedding as tpe
from tpu_embedding.engines import tpu
from tpu_embedding.engines.base import EngineCheckpointOwner
from tpu_embedding.engines.tpu_conversion import FEATURE_ARGS
from tpu_embedding.engines.tpu_conversion import OPTIMIZER_MAPPINGS
from tpu_embedding.engines.tpu_conversion import TABLE_ARGS
from tpu_embedding.engines.tpu_conversion import to_tf_feature_config
from tpu_embedding.engines.tpu_conversion import to_tf_optimizer
from tpu_embedding.engines.tpu_conversion import to_tf_table
from tpu_embedding.engines.tpu_conversion import translate
from tpu_embedding.resolved import resolve

TFE = tf.tpu.experimental.embedding

TABLE_DESCRIPTOR = (
  tpu_embedding_configuration_pb2.TPUEmbeddingConfiguration.TableDescriptor
)
#: TensorFlow optimizer classes with no counterpart here (see README).
NOT_PROVIDED_OPTIMIZERS = {TFE.CustomOptimizer}


def _learning_rate() -> float:
  return 0.05


def _slot_fn(table, slot_names, initializers):
  del table, initializers
  return {name: None for name in slot_names}


#: Optimizer cases, built with either API from the same arguments. Together
#: the cases of one class give every constructor argument a non-default
#: value (``test_cases_set_every_argument``).
_COMMON = {
  "clip_weight_min": -0.5,
  "clip_weight_max": 0.75,
  "weight_decay_factor": 0.01,
  "multiply_weight_decay_factor_by_learning_rate": True,
  "low_dimensional_packing_status": True,
}
CASES = {
  "sgd": ("SGD", {"learning_rate": _learning_rate, "clipvalue": 2.0}),
  "sgd_no_accumulation": (
    "SGD",
    {"use_gradient_accumulation": False, **_COMMON},
  ),
  "adagrad": (
    "Adagrad",
    {
      "learning_rate": 0.2,
      "initial_accumulator_value": 0.3,
      "slot_variable_creation_fn": _slot_fn,
      "clipvalue": (-1.5, None),
      **_COMMON,
    },
  ),
  "adagrad_no_accumulation": ("Adagrad", {"use_gradient_accumulation": False}),
  "adagrad_momentum": (
    "AdagradMomentum",
    {
      "learning_rate": _learning_rate,
      "momentum": 0.9,
      "use_nesterov": True,
      "exponent": 3.0,
      "beta2": 0.99,
      "epsilon": 1e-6,
      "slot_variable_creation_fn": _slot_fn,
      "clipvalue": (None, 3.0),
      **_COMMON,
    },
  ),
  "adagrad_momentum_no_accumulation": (
    "AdagradMomentum",
    {"use_gradient_accumulation": False},
  ),
  "adam": (
    "Adam",
    {
      "learning_rate": 0.3,
      "beta_1": 0.8,
      "beta_2": 0.95,
      "epsilon": 1e-5,
      "lazy_adam": False,
      "sum_inside_sqrt": False,
      "slot_variable_creation_fn": _slot_fn,
      "clipvalue": (-1.0, 2.0),
      **_COMMON,
    },
  ),
  "adam_no_accumulation": ("Adam", {"use_gradient_accumulation": False}),
  "ftrl": (
    "FTRL",
    {
      "learning_rate": 0.4,
      "learning_rate_power": -0.25,
      "l1_regularization_strength": 0.01,
      "l2_regularization_strength": 0.02,
      "beta": 0.1,
      "initial_accumulator_value": 0.2,
      "slot_variable_creation_fn": _slot_fn,
      "clipvalue": 1.0,
      "multiply_linear_by_learning_rate": True,
      "allow_zero_accumulator": True,
      **_COMMON,
    },
  ),
  "ftrl_no_accumulation": ("FTRL", {"use_gradient_accumulation": False}),
}


def _arguments(cls) -> dict[str, Any]:
  """``{name: default}`` of a constructor's arguments."""
  params = inspect.signature(cls.__init__).parameters
  return {n: p.default for n, p in params.items() if n != "self"}


def _proto(tf_optimizer):
  """The optimization parameters TensorFlow sends to the TPU."""
  proto = optimization_parameters_pb2.OptimizationParameters()
  tf_optimizer._set_optimization_parameters(proto)  # noqa: SLF001
  return proto


# --- the optimizer table ------------------------------------------------------


@pytest.mark.parametrize(
  "ours", list(OPTIMIZER_MAPPINGS), ids=lambda c: c.__name__
)
def test_every_tensorflow_argument_is_mapped_or_listed_as_unsupported(ours):
  mapping = OPTIMIZER_MAPPINGS[ours]
  tf_args, our_args = _arguments(mapping.tf_class), _arguments(ours)
  supported = set(mapping.supported_kwargs)
  unsupported = set(mapping.unsupported_kwargs)
  assert not supported & unsupported
  # A new TensorFlow argument (or one of ours) fails here until it is
  # added to OPTIMIZER_MAPPINGS.
  assert set(tf_args) <= supported | unsupported, set(tf_args) - supported
  assert set(our_args) <= supported | unsupported, set(our_args) - supported
  assert supported <= set(tf_args) & set(our_args)
  for arg, required in mapping.unsupported_kwargs.items():
    # A one-sided argument translates only at the default of its side.
    default = tf_args[arg] if arg in tf_args else our_args[arg]
    assert required == default, arg


def test_every_tensorflow_optimizer_class_is_mapped():
  tf_optimizers = {
    obj
    for obj in vars(TFE).values()
    if inspect.isclass(obj) and issubclass(obj, tf_utils._Optimizer)  # noqa: SLF001
  }
  mapped = {m.tf_class for m in OPTIMIZER_MAPPINGS.values()}
  assert tf_optimizers - mapped == NOT_PROVIDED_OPTIMIZERS
  for ours, mapping in OPTIMIZER_MAPPINGS.items():
    assert ours.__name__ == mapping.tf_class.__name__


@pytest.mark.parametrize("cls", sorted({c for c, _ in CASES.values()}))
def test_cases_set_every_argument(cls):
  defaults = _arguments(getattr(tpe, cls))
  set_to_other = {
    arg
    for name, kwargs in CASES.values()
    if name == cls
    for arg, value in kwargs.items()
    if value is not defaults[arg] and value != defaults[arg]
  }
  assert set_to_other == set(defaults)


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_round_trips(case):
  cls, kwargs = CASES[case]
  ours = getattr(tpe, cls)(**kwargs)
  direct = getattr(TFE, cls)(**kwargs)  # What a TensorFlow user writes.
  translated = to_tf_optimizer(ours)
  assert type(translated) is type(direct)
  # Same attributes (clip_gradient_min/max, weight_decay_factor, beta_1,
  # learning_rate_power, ...), callables passed as the same objects.
  assert vars(translated) == vars(direct)
  assert vars(translated) == vars(ours)
  if callable(kwargs.get("learning_rate")):
    assert translated.learning_rate is kwargs["learning_rate"]
  if "slot_variable_creation_fn" in kwargs:
    assert translated.slot_variable_creation_fn is _slot_fn
  # The proto the TPU receives. TensorFlow's own optimizer cannot build it
  # under recent protobuf (see ARGUMENT_CONVERSIONS); built
  # with the int its bool used to be stored as, it can.
  packing = int(direct.low_dimensional_packing_status)
  direct_int = getattr(TFE, cls)(
    **{**kwargs, "low_dimensional_packing_status": packing}
  )
  assert _proto(translated) == _proto(direct_int)
  assert translated._slot_names() == list(ours.SLOT_NAMES)  # noqa: SLF001


def test_optimizer_subclass_is_not_translated():
  class MyAdagrad(tpe.Adagrad):
    pass

  with pytest.raises(ValueError, match="exactly tpu_embedding.SGD"):
    to_tf_optimizer(MyAdagrad(0.1))


def test_argument_missing_from_the_table_is_an_error(monkeypatch):
  mapping = OPTIMIZER_MAPPINGS[tpe.SGD]
  supported = tuple(a for a in mapping.supported_kwargs if a != "clipvalue")
  monkeypatch.setitem(
    OPTIMIZER_MAPPINGS, tpe.SGD, mapping._replace(supported_kwargs=supported)
  )
  with pytest.raises(ValueError, match="'clipvalue' is not in OPTIMIZER_MAP"):
    to_tf_optimizer(tpe.SGD(0.1))


def test_unsupported_argument_translates_only_at_its_value(monkeypatch):
  mapping = OPTIMIZER_MAPPINGS[tpe.SGD]
  monkeypatch.setitem(
    OPTIMIZER_MAPPINGS,
    tpe.SGD,
    mapping._replace(
      supported_kwargs=tuple(
        a for a in mapping.supported_kwargs if a != "weight_decay_factor"
      ),
      unsupported_kwargs={"weight_decay_factor": None},
    ),
  )
  assert to_tf_optimizer(tpe.SGD(0.1)).weight_decay_factor is None
  with pytest.raises(ValueError, match=r"SGD\(weight_decay_factor=0.5\)"):
    to_tf_optimizer(tpe.SGD(0.1, weight_decay_factor=0.5))


# --- tables and features ------------------------------------------------------


def test_table_and_feature_arguments_cover_both_classes():
  table = tpe.TableConfig(4, 2)
  assert set(TABLE_ARGS) == set(_arguments(TFE.TableConfig))
  # Ours has two more: ``vocabulary`` (dynamic tables, never on TPU) and
  # ``storage`` (16-bit rows: float32 only on TPU, refused otherwise).
  ours = set(TABLE_ARGS) | {"vocabulary", "storage"}
  assert ours == set(_arguments(tpe.TableConfig)) == set(vars(table))
  feature = tpe.FeatureConfig(table)
  assert set(FEATURE_ARGS) == set(_arguments(TFE.FeatureConfig))
  assert set(FEATURE_ARGS) == set(vars(feature))


def test_table_round_trips():
  layout = object()
  initializer = tpe.RowIdInitializer(offset=2)
  optimizer = tpe.Adam(0.1, beta_1=0.5)
  table = tpe.TableConfig(
    vocabulary_size=12,
    dim=5,
    initializer=initializer,
    optimizer=optimizer,
    combiner="sqrtn",
    name="items",
    quantization_config=tpe.QuantizationConfig(8, -2.0, 3.0),
    layout=layout,
  )
  tf_table = to_tf_table(table)
  assert isinstance(tf_table, TFE.TableConfig)
  assert (tf_table.vocabulary_size, tf_table.dim) == (12, 5)
  assert tf_table.initializer is initializer
  assert tf_table.layout is layout
  assert (tf_table.combiner, tf_table.name) == ("sqrtn", "items")
  assert tf_table.dtype == tf.float32
  assert vars(tf_table.optimizer) == vars(optimizer)
  quantization = tf_table.quantization_config
  assert isinstance(quantization, TFE.QuantizationConfig)
  assert vars(quantization) == {"num_buckets": 8, "lower": -2.0, "upper": 3.0}
  assert to_tf_table(table.replace(dtype=tf.int32)).dtype == tf.int32


@pytest.mark.parametrize("case", ["sgd", "adagrad_momentum", "ftrl"])
def test_table_descriptor_matches_tensorflow_built_directly(case):
  cls, kwargs = CASES[case]
  quantization = {"num_buckets": 5, "lower": -1.0, "upper": 1.0}
  ours = tpe.TableConfig(
    7,
    3,
    optimizer=getattr(tpe, cls)(**kwargs),
    name="t",
    quantization_config=tpe.QuantizationConfig(**quantization),
  )
  packing = int(kwargs.get("low_dimensional_packing_status", False))
  kwargs = {**kwargs, "low_dimensional_packing_status": packing}
  direct = TFE.TableConfig(
    7,
    3,
    optimizer=getattr(TFE, cls)(**kwargs),
    name="t",
    quantization_config=TFE.QuantizationConfig(**quantization),
  )
  descriptors = []
  for table in (to_tf_table(ours), direct):
    descriptor = TABLE_DESCRIPTOR()
    table._set_table_descriptor(  # noqa: SLF001
      descriptor, 2, {_learning_rate: 0}
    )
    descriptors.append(descriptor)
  assert descriptors[0] == descriptors[1]


def test_feature_round_trips():
  table = tpe.TableConfig(10, 4, name="t")
  feature = tpe.FeatureConfig(
    table,
    max_sequence_length=6,
    validate_weights_and_indices=False,
    output_shape=[16, 6],
    name="history",
  )
  [tf_feature] = to_tf_feature_config([feature])
  assert isinstance(tf_feature, TFE.FeatureConfig)
  assert tf_feature.max_sequence_length == 6
  assert tf_feature.validate_weights_and_indices is False
  assert tf_feature.output_shape == tf.TensorShape([16, 6])
  assert tf_feature.name == "history"
  assert tf_feature.table.name == "t"
  unknown = to_tf_feature_config(tpe.FeatureConfig(table))
  assert unknown.output_shape.rank is None


def _user_config():
  """A user's nest: a shared named table, two unnamed ones, a sequence."""
  items = tpe.TableConfig(12, 4, name="items", combiner="sum")
  users = tpe.TableConfig(7, 3, optimizer=tpe.Adagrad(0.2))
  tags = tpe.TableConfig(5, 2, combiner="sqrtn")
  return {
    "item": tpe.FeatureConfig(items),
    "context": [
      tpe.FeatureConfig(users, name="user"),
      (
        tpe.FeatureConfig(items, max_sequence_length=3),
        tpe.FeatureConfig(tags),
      ),
    ],
  }


def _snapshot(nest):
  """Everything about the user's configs that translation could change."""
  flat = tf.nest.flatten(nest)
  return [
    (
      id(f),
      id(f.table),
      id(f.table.optimizer),
      copy.copy(vars(f)),
      copy.copy(vars(f.table)),
      None if f.table.optimizer is None else copy.copy(vars(f.table.optimizer)),
    )
    for f in flat
  ]


def test_structure_sharing_and_names_are_preserved():
  user = _user_config()
  adam = tpe.Adam(0.1)
  tf_config = to_tf_feature_config(user, adam)
  tf.nest.assert_same_structure(user, tf_config)
  flat, tf_flat = tf.nest.flatten(user), tf.nest.flatten(tf_config)
  for i, j in itertools.product(range(len(flat)), repeat=2):
    assert (flat[i].table is flat[j].table) == (
      tf_flat[i].table is tf_flat[j].table
    )
  item, user_feature = tf_config["item"], tf_config["context"][0]
  history, tag = tf_config["context"][1]
  assert history.table is item.table
  # Named in first-appearance order of tf.nest.flatten ("context" first).
  assert [t.name for t in (item.table, user_feature.table, tag.table)] == [
    "items",
    "table_0",
    "table_2",
  ]
  # Tables without an optimizer share the one translated global optimizer.
  assert item.table.optimizer is tag.table.optimizer
  assert type(item.table.optimizer) is TFE.Adam
  assert type(user_feature.table.optimizer) is TFE.Adagrad
  assert user_feature.name == "user"


def test_a_single_feature_translates_to_a_single_feature():
  feature = tpe.FeatureConfig(tpe.TableConfig(3, 2))
  assert isinstance(to_tf_feature_config(feature), TFE.FeatureConfig)


def test_translate_returns_tables_parallel_to_the_resolved_ones():
  user, sgd = _user_config(), tpe.SGD(0.1)
  config = resolve(user, sgd)
  tf_configs = translate(config, sgd)
  assert [t.name for t in tf_configs.tables] == [t.name for t in config.tables]
  # "items" takes the global optimizer; "table_0" has its own Adagrad.
  assert tf_configs.optimizer is tf_configs.tables[1].optimizer
  assert isinstance(tf_configs.tables[0].optimizer, TFE.Adagrad)
  assert isinstance(tf_configs.optimizer, TFE.SGD)
  assert translate(config, None).optimizer is None


def test_to_tf_table_takes_a_table_config():
  feature = tpe.FeatureConfig(tpe.TableConfig(3, 2))
  with pytest.raises(ValueError, match="takes a tpu_embedding.TableConfig"):
    to_tf_table(feature)


def test_untranslatable_attribute_is_an_error():
  table = tpe.TableConfig(3, 2, name="t")
  table.hot_rows = 10  # An attribute TensorFlow has no argument for.
  with pytest.raises(
    ValueError, match=r"TableConfig attributes \['hot_rows'\]"
  ):
    to_tf_table(table)


def test_user_configs_are_unchanged_by_translation_and_by_tensorflow():
  user, adam = _user_config(), tpe.Adam(0.1)
  before, adam_before = _snapshot(user), copy.copy(vars(adam))
  tf_config = to_tf_feature_config(user, adam)
  assert _snapshot(user) == before
  serving = TFE.TPUEmbeddingForServing(tf_config, to_tf_optimizer(adam))
  serving.build()
  # TensorFlow sets missing optimizers and names in place: on its own
  # (translated) objects only.
  tf_config = to_tf_feature_config(user)  # No global optimizer.
  engine = TFE.TPUEmbedding(tf_config, to_tf_optimizer(adam))
  engine.build()
  assert isinstance(tf_config["item"].table.optimizer, TFE.Adam)
  tf_tags = to_tf_table(user["context"][1][1].table)  # Unnamed.
  TFE.TPUEmbeddingForServing(TFE.FeatureConfig(tf_tags), None).build()
  assert tf_tags.name == "table_0"
  assert _snapshot(user) == before
  assert vars(adam) == adam_before
  assert user["item"].table.name == "items"
  assert user["context"][0].table.name is None
  assert user["context"][1][1].table.optimizer is None


# --- parity with TensorFlow's TPUEmbeddingForServing --------------------------


def _inputs():
  """A batch of 4 for ``_user_config``: ragged, dense, sparse."""
  return {
    "item": tf.ragged.constant([[1, 2, 2], [5], [], [0, 11]]),
    "context": [
      tf.constant([0, 6, 3, 3]),
      (
        tf.sparse.from_dense(
          tf.constant([[3, 4, 5, 6], [1, 0, 0, 0], [0, 0, 0, 0], [7, 8, 0, 0]])
        ),
        tf.ragged.constant([[0, 4], [1], [2, 3, 4], []]),
      ),
    ],
  }


def _train_one_step(embedding):
  embedding.enqueue(_inputs(), training=True)
  with tf.GradientTape() as tape:
    activations = embedding.dequeue()
    tape.watch(activations)
    loss = tf.add_n(
      [tf.reduce_sum(a * a) for a in tf.nest.flatten(activations)]
    )
  embedding.apply_gradients(tape.gradient(loss, activations))


def _save(obj, directory) -> str:
  return tf.train.Checkpoint(embedding=obj).save(os.path.join(directory, "c"))


def _keys(path: str) -> set[str]:
  return {name for name, _ in tf.train.list_variables(path)}


def _values(variables) -> dict[tuple[str, str], np.ndarray]:
  """``{(table, slot): value}`` from ``{table: {slot: variable}}``."""
  return {
    (table, slot): var.numpy()
    for table, slots in variables.items()
    for slot, var in slots.items()
  }


def _assert_nests_close(actual, expected):
  tf.nest.assert_same_structure(actual, expected)
  for a, e in zip(
    tf.nest.flatten(actual), tf.nest.flatten(expected), strict=True
  ):
    np.testing.assert_allclose(a.numpy(), e.numpy(), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def ours_trained(tmp_path_factory):
  """Ours trained one step, saved; returns ``(embedding, checkpoint)``."""
  embedding = tpe.TPUEmbedding(_user_config(), tpe.Adam(0.1))
  _train_one_step(embedding)
  return embedding, _save(embedding, tmp_path_factory.mktemp("ours"))


def _tf_serving(user=None, optimizer=None):
  user = _user_config() if user is None else user
  optimizer = tpe.Adam(0.1) if optimizer is None else optimizer
  tf_configs = translate(resolve(user, optimizer), optimizer)
  return TFE.TPUEmbeddingForServing(
    tf_configs.feature_config, tf_configs.optimizer
  )


def test_same_tables_slots_and_checkpoint_keys(ours_trained, tmp_path):
  ours, ours_path = ours_trained
  theirs = _tf_serving()
  theirs.build()
  our_slots = {t: sorted(s) for t, s in ours.variables.items()}
  their_slots = {t: sorted(s) for t, s in theirs.variables.items()}
  assert (
    our_slots
    == their_slots
    == {
      "items": ["momenta", "parameters", "velocities"],
      "table_0": ["accumulators", "parameters"],
      "table_2": ["momenta", "parameters", "velocities"],
    }
  )
  our_serving = tpe.TPUEmbeddingForServing(_user_config(), tpe.Adam(0.1))
  our_serving.build()
  their_path = _save(theirs, tmp_path / "theirs")
  our_serving_path = _save(our_serving, tmp_path / "our_serving")
  assert _keys(ours_path) == _keys(their_path) == _keys(our_serving_path)


def test_our_checkpoint_restores_into_tensorflow(ours_trained):
  ours, path = ours_trained
  theirs = _tf_serving()
  theirs.build()
  tf.train.Checkpoint(embedding=theirs).restore(path).assert_consumed()
  expected = _values(ours.variables)
  actual = _values(theirs.variables)
  assert actual.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_array_equal(actual[key], value, err_msg=str(key))
  our_serving = tpe.TPUEmbeddingForServing(_user_config(), tpe.Adam(0.1))
  our_serving.build()
  tf.train.Checkpoint(embedding=our_serving).restore(path).assert_consumed()
  _assert_nests_close(theirs(_inputs()), ours(_inputs()))
  _assert_nests_close(theirs(_inputs()), our_serving(_inputs()))


def test_tensorflow_checkpoint_restores_into_ours(tmp_path, rng):
  theirs = _tf_serving()
  for slots in theirs.variables.values():
    for var in slots.values():  # Slots too, so every value is checked.
      var.assign(rng.normal(size=var.shape).astype(np.float32))
  path = _save(theirs, tmp_path)
  ours = tpe.TPUEmbedding(_user_config(), tpe.Adam(0.1))
  tf.train.Checkpoint(embedding=ours).restore(path)  # Before build.
  expected = _values(theirs.variables)
  actual = _values(ours.variables)
  assert actual.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_array_equal(actual[key], value, err_msg=str(key))
  _assert_nests_close(ours(_inputs()), theirs(_inputs()))


# --- TPU engines --------------------------------------------------------------


def _fake_strategy(feature):
  hardware = types.SimpleNamespace(embedding_feature=feature)
  return types.SimpleNamespace(
    extended=types.SimpleNamespace(tpu_hardware_feature=hardware)
  )


def test_tensorflow_class_follows_the_tpu_embedding_hardware():
  features = tf.tpu.experimental.HardwareFeature.EmbeddingFeature
  assert tpu.tf_embedding_class(_fake_strategy(features.V1)) is TFE.TPUEmbedding
  assert (
    tpu.tf_embedding_class(_fake_strategy(features.V2)) is TFE.TPUEmbeddingV2
  )
  with pytest.raises(ValueError, match="no embedding hardware"):
    tpu.tf_embedding_class(_fake_strategy(features.UNSUPPORTED))
  assert not tpu.is_tpu_strategy(tf.distribute.get_strategy())


def _parameter_names(function) -> list[str]:
  return [n for n in inspect.signature(function).parameters if n != "self"]


@pytest.mark.parametrize(
  "method", ["build", "enqueue", "dequeue", "apply_gradients"]
)
def test_forwarded_signatures_match_tensorflow(method):
  # The engine forwards positionally: the argument lists must agree (but
  # for our own `skip`, refused on TPU, and `step_id`, only checked).
  ours = _parameter_names(getattr(tpu.TPUEngine, method))
  extra = ["skip", "step_id"] if method == "apply_gradients" else []
  assert _parameter_names(getattr(TFE.TPUEmbedding, method)) + extra == ours
  sparse_core = {
    "build": [],
    "enqueue": ["features", "weights", "device"],
    "dequeue": ["partitioned_tensors"],
    "apply_gradients": ["gradients", "preserved_outputs"],
  }
  assert (
    _parameter_names(getattr(TFE.TPUEmbeddingV2, method))
    == (sparse_core[method])
  )


class _Owner(EngineCheckpointOwner):
  """What ``TPUEmbeddingV3`` looks like to checkpoints when on TPU."""

  def __init__(self, engine):
    self._engine = engine


def _engine_delegate(user=None):
  """An engine on TensorFlow's TPUEmbedding, in its CPU mode."""
  user = _user_config() if user is None else user
  adam = tpe.Adam(0.1)
  return tpu.TPUEngine(resolve(user, adam), adam, TFE.TPUEmbedding)


def test_delegate_tables_are_keyed_by_the_user_configs(ours_trained, tmp_path):
  user = _user_config()
  before = _snapshot(user)
  delegate = _engine_delegate(user)
  assert delegate.copies_tables_around_checkpoints
  delegate.build()
  users, items, tags = (
    user["context"][0].table,
    user["item"].table,
    user["context"][1][1].table,
  )
  assert list(delegate.embedding_tables) == [users, items, tags]
  assert delegate.embedding_tables[items].shape == (12, 4)
  assert delegate.table_names == {
    users: "table_0",
    items: "items",
    tags: "table_2",
  }
  assert _snapshot(user) == before
  _, ours_path = ours_trained
  assert _keys(_save(_Owner(delegate), tmp_path)) == _keys(ours_path)


@pytest.mark.parametrize("before_build", [True, False], ids=["before", "after"])
def test_delegating_trackable_restores(ours_trained, before_build):
  ours, path = ours_trained
  delegate = _engine_delegate()
  if not before_build:
    delegate.build()
  status = tf.train.Checkpoint(embedding=_Owner(delegate)).restore(path)
  delegate.build()
  status.assert_existing_objects_matched()
  expected = _values(ours.variables)
  actual = _values(delegate.tf_embedding._variables)  # noqa: SLF001
  assert actual.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_array_equal(actual[key], value, err_msg=str(key))


def test_tensorflow_retrieves_before_save_and_loads_after_restore(tmp_path):
  delegate = _engine_delegate()
  delegate.build()
  calls = []
  engine = delegate.tf_embedding
  # On CPU both are no-ops; on TPU they copy tables to and from the TPU.
  engine._retrieve_variables = lambda: calls.append("retrieve")  # noqa: SLF001
  engine._load_variables = lambda: calls.append("load")  # noqa: SLF001
  owner = _Owner(delegate)
  path = _save(owner, tmp_path)
  assert calls == ["retrieve"]
  tf.train.Checkpoint(embedding=owner).restore(path).assert_consumed()
  assert calls == ["retrieve", "load"]
  # Elsewhere the recorded callback is skipped and the tables restore.
  ours = tpe.TPUEmbedding(_user_config(), tpe.Adam(0.1))
  ours.build()
  tf.train.Checkpoint(embedding=ours).restore(path).assert_consumed()
  theirs = _tf_serving()
  theirs.build()
  tf.train.Checkpoint(embedding=theirs).restore(path).assert_consumed()
  names = delegate.table_names
  for user_table, variable in delegate.embedding_tables.items():
    np.testing.assert_array_equal(
      ours.variables[names[user_table]]["parameters"].numpy(), variable.numpy()
    )


def test_delegate_needs_an_optimizer_for_every_table():
  config = resolve(_user_config(), None)
  with pytest.raises(ValueError, match="Table 'items' has no optimizer"):
    tpu.TPUEngine(config, None, TFE.TPUEmbedding)


def test_sparse_core_config_is_refused_on_the_embedding_engine():
  sgd = tpe.SGD(0.1)
  with pytest.raises(ValueError, match="sparse_core_embedding_config"):
    tpu.TPUEngine(
      resolve(_user_config(), sgd),
      sgd,
      TFE.TPUEmbedding,
      sparse_core_embedding_config=TFE.SparseCoreEmbeddingConfig(),
    )


class _RecordingSparseCore(TFE.TPUEmbeddingV2):
  """Records the SparseCore protocol (the real class needs a TPU)."""

  def __init__(self, feature_config, optimizer, pipelining, config):
    # Deliberately no super().__init__: it requires a TPUStrategy.
    self.__dict__["calls"] = [("init", feature_config, optimizer, config)]

  def enqueue(self, features, weights=None, device=None):
    self.calls.append(("enqueue", features, weights, device))
    return "partitioned"

  def dequeue(self, partitioned_tensors):
    self.calls.append(("dequeue", partitioned_tensors))
    return "activations", "preserved"

  def apply_gradients(self, gradients, preserved_outputs):
    self.calls.append(("apply_gradients", gradients, preserved_outputs))


def test_sparse_core_protocol():
  sgd = tpe.SGD(0.1)
  sc_config = TFE.SparseCoreEmbeddingConfig(disable_table_stacking=True)
  delegate = tpu.SparseCoreEngine(
    resolve(_user_config(), sgd),
    sgd,
    _RecordingSparseCore,
    sparse_core_embedding_config=sc_config,
  )
  assert not delegate.copies_tables_around_checkpoints
  calls = delegate.tf_embedding.calls
  _, tf_features, tf_optimizer, config = calls[0]
  assert isinstance(tf_features["item"], TFE.FeatureConfig)
  assert isinstance(tf_optimizer, TFE.SGD)
  assert config is sc_config
  with pytest.raises(RuntimeError, match="dequeue called without"):
    delegate.dequeue()
  delegate.enqueue("features", "weights", training=False, device="d")
  assert delegate.dequeue() == "activations"
  with pytest.raises(ValueError, match=r"skip=\.\.\.\) is not available under"):
    delegate.apply_gradients("gradients", skip=True)
  with pytest.raises(ValueError, match="takes a scalar integer"):
    delegate.apply_gradients("gradients", step_id=1.5)
  # A step id is only checked: TPU steps are never re-run.
  delegate.apply_gradients("gradients", step_id=7)
  assert calls[1:] == [
    ("enqueue", "features", "weights", "d"),
    ("dequeue", "partitioned"),
    ("apply_gradients", "gradients", "preserved"),
  ]
  with pytest.raises(RuntimeError, match="apply_gradients called without"):
    delegate.apply_gradients("gradients")


def test_sparse_core_enqueue_refuses_per_replica_features():
  sgd = tpe.SGD(0.1)
  delegate = tpu.SparseCoreEngine(
    resolve(_user_config(), sgd), sgd, _RecordingSparseCore
  )
  # What a distributed dataset yields outside `strategy.run` (built
  # directly: a MirroredStrategy here could collide with other tests').
  per_replica = distribute_values.PerReplica(
    (tf.constant([1]), tf.constant([2]))
  )
  with pytest.raises(ValueError, match="inside `strategy.run`"):
    delegate.enqueue({"item": per_replica})


def test_module_is_importable_twice_without_registration_errors(monkeypatch):
  # pytest's importlib mode may import a module file a second time.
  spec = importlib.util.spec_from_file_location("tpu_again", tpu.__file__)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "tpu_again", module)
  spec.loader.exec_module(module)
  assert module.CHECKPOINT_SAVER == tpu.CHECKPOINT_SAVER


def test_dynamic_tables_have_no_tpu_translation():
  table = tpe.TableConfig(
    4, 2, name="users", vocabulary=tpe.DynamicVocabulary()
  )
  config = resolve(tpe.FeatureConfig(table), tpe.SGD(0.1))
  with pytest.raises(ValueError, match="'users' has a DynamicVocabulary"):
    translate(config, tpe.SGD(0.1))
