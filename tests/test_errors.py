"""Bad input fails clearly, names the feature, and changes no table."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy

VOCAB = 6


def make_embedding(optimizer=None, **feature_kwargs):
  table = tpe.TableConfig(VOCAB, 2, name="items", combiner="sum")
  features = {
    "clicks": tpe.FeatureConfig(table, **feature_kwargs),
    "views": tpe.FeatureConfig(table),
  }
  return tpe.TPUEmbedding(features, optimizer or tpe.Adagrad(0.5))


def snapshot(emb):
  return {
    (table, slot): var.numpy().copy()
    for table, slots in emb.variables.items()
    for slot, var in slots.items()
  }


def train_step(emb, features, weights=None):
  emb.enqueue(features, weights, training=True)
  with tf.GradientTape() as tape:
    activations = emb.dequeue()
    tape.watch(activations)
    loss = sum(tf.reduce_sum(a) for a in tf.nest.flatten(activations))
  emb.apply_gradients(tape.gradient(loss, activations))


GOOD_VIEWS = tf.ragged.constant([[1], [2, 3]], dtype=tf.int64)

BAD_FEATURES = {
  "negative id": (tf.ragged.constant([[1, -1], [2]], dtype=tf.int64), None),
  "id too large": (
    tf.sparse.from_dense(tf.constant([[1, VOCAB], [2, 0]], tf.int64)),
    None,
  ),
  "weights with other row splits": (
    tf.ragged.constant([[1, 2], [3]], dtype=tf.int64),
    tf.ragged.constant([[1.0], [2.0, 3.0]]),
  ),
  "weights with other indices": (
    tf.SparseTensor([[0, 0], [1, 0]], tf.constant([1, 2], tf.int64), [2, 2]),
    tf.SparseTensor([[0, 0], [1, 1]], [1.0, 2.0], [2, 2]),
  ),
}


@pytest.mark.parametrize("run", ["eager", "function"])
@pytest.mark.parametrize("case", sorted(BAD_FEATURES))
def test_runtime_errors_name_the_feature_and_change_nothing(case, run):
  emb = make_embedding()
  train_step(emb, {"clicks": GOOD_VIEWS, "views": GOOD_VIEWS})
  before = snapshot(emb)
  ids, weights = BAD_FEATURES[case]
  step = train_step if run == "eager" else tf.function(train_step)
  features = {"clicks": ids, "views": GOOD_VIEWS}
  all_weights = None
  if weights is not None:
    all_weights = {"clicks": weights, "views": None}
  with pytest.raises(tf.errors.InvalidArgumentError, match="clicks"):
    step(emb, features, all_weights)
  after = snapshot(emb)
  for key, value in before.items():
    np.testing.assert_array_equal(after[key], value, err_msg=str(key))


def test_out_of_range_message_gives_table_vocabulary_and_ids():
  emb = make_embedding()
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    emb({"clicks": tf.constant([0, 9, 7]), "views": tf.constant([1, 2, 3])})
  message = str(info.value)
  assert "clicks" in message and "'items'" in message
  assert "vocabulary_size=6" in message and "9, 7" in message


def _many_features(count):
  table = tpe.TableConfig(VOCAB, 2, name="items", combiner="sum")
  return tpe.TPUEmbedding(
    {f"f{i}": tpe.FeatureConfig(table) for i in range(count)},
    tpe.Adagrad(0.5),
  )


@pytest.mark.parametrize("run", ["eager", "function"])
def test_the_first_failing_feature_is_named_with_its_own_ids(run):
  """Features 2 and 4 of 6 have bad ids: feature 2's are reported, and
  only its ids out of range (feature 4's never appear)."""
  emb = _many_features(6)
  good = tf.constant([0, 1, 5], tf.int64)
  features = {f"f{i}": good for i in range(6)}
  features["f2"] = tf.constant([3, 7, -2, 0, 6], tf.int64)
  features["f4"] = tf.constant([99, 98], tf.int64)
  step = train_step if run == "eager" else tf.function(train_step)
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    step(emb, features)
  # (without the stack's "File ..., line 199" lines that a graph error
  # lists first)
  message = "\n".join(
    line
    for line in str(info.value).splitlines()
    if not line.strip().startswith("File ")
  )
  assert "Input f2 has ids outside [0, 6)" in message, message
  assert re.search(r"\(first 10\):\]? \[?7,? -2,? 6\b", message), message
  # (TF's "[Op:__inference_train_step_N]" suffix carries a counter that
  # may hold "99": only the assertion's own text is checked)
  report = re.sub(r"\[Op:[^\]]*\]", "", message)
  assert "f4" not in report, message
  assert not re.search(r"\b9[89]\b", report), message


def _failure_branch_ops(count: int) -> int:
  """Ops of the traced step's failure path (the cond's false branch)."""
  emb = _many_features(count)
  features = {f"f{i}": tf.constant([0, 1], tf.int64) for i in range(count)}
  graph = tf.function(train_step).get_concrete_function(emb, features).graph
  branches = [
    f.definition for name, f in graph._functions.items() if "cond_false" in name
  ]
  assert len(branches) == 1, sorted(graph._functions)
  return len(branches[0].node_def)


def test_the_failure_path_does_not_grow_with_the_features():
  """It is traced and optimized with every step: a few ops per feature
  (it held some 47 per feature when each check built its own report,
  half the trace time of a 26-table step)."""
  per_feature = (_failure_branch_ops(20) - _failure_branch_ops(2)) / 18
  assert per_feature <= 5, per_feature


@pytest.mark.parametrize(
  "clicks, weights, match",
  [
    (tf.constant([1.0, 2.0]), None, "clicks has ids of dtype float32"),
    (tf.constant(1), None, "clicks: only rank 1 and above dense"),
    (
      tf.SparseTensor([[0]], tf.constant([1], tf.int64), [3]),
      None,
      "clicks: only rank 2 and above sparse",
    ),
    (
      tf.RaggedTensor.from_nested_row_lengths([1, 2], [[1], [2]]),
      None,
      "clicks: only rank 2 ragged",
    ),
    (
      tf.constant([1, 2]),
      tf.constant([1.0, 1.0]),
      "dense input clicks, which is not allowed",
    ),
    (
      tf.ragged.constant([[1], [2]]),
      tf.sparse.from_dense([[1.0], [1.0]]),
      "Weight for clicks is type .*SparseTensor.* RaggedTensor",
    ),
    (
      tf.ragged.constant([[1], [2]]),
      tf.ragged.constant([[1], [2]]),
      "Weight for clicks has dtype int32",
    ),
    ("ids", None, "Input clicks is of unknown type"),
  ],
)
def test_trace_time_errors_name_the_feature(clicks, weights, match):
  emb = make_embedding()
  views = tf.ragged.constant([[1], [2]])
  all_weights = None if weights is None else {"clicks": weights, "views": None}
  with pytest.raises(ValueError, match=match):
    emb.enqueue({"clicks": clicks, "views": views}, all_weights)


def test_weights_on_a_sequence_feature_are_rejected():
  emb = make_embedding(max_sequence_length=3)
  ids = tf.ragged.constant([[1, 2], [3]])
  weights = tf.ragged.constant([[1.0, 1.0], [1.0]])
  with pytest.raises(ValueError, match="clicks.*sequence feature"):
    emb.enqueue(
      {"clicks": ids, "views": ids}, {"clicks": weights, "views": None}
    )


@pytest.mark.parametrize(
  "features, error, match",
  [
    (
      {"clicks": tf.constant([1])},
      ValueError,
      r"missing feature\(s\) \['views'\]\. Expected the feature paths",
    ),
    (
      [tf.constant([1]), tf.constant([1])],
      (ValueError, TypeError),
      r"missing feature\(s\) \['clicks', 'views'\]; unexpected feature\(s\) "
      r"\['0', '1'\]",
    ),
    (
      {"clicks": tf.constant([1]), "views": tf.constant([1]), "x": 1},
      ValueError,
      r": unexpected feature\(s\) \['x'\]\. Expected the feature paths "
      r"\['clicks', 'views'\]",
    ),
    (
      {"click": tf.constant([1]), "views": tf.constant([1])},
      ValueError,
      r"missing feature\(s\) \['clicks'\]; unexpected feature\(s\) \['click'\]",
    ),
    (
      tf.constant([1]),
      ValueError,
      "got a single tensor where the config has 2 feature",
    ),
  ],
  ids=["missing", "list_for_dict", "extra", "misspelt", "bare_tensor"],
)
def test_wrong_structure_is_named_in_one_line(features, error, match):
  emb = make_embedding()
  with pytest.raises(error, match=match) as raised:
    emb.enqueue(features)
  assert "\n" not in str(raised.value)


def test_gradient_checks():
  emb = make_embedding()
  features = {"clicks": tf.constant([1, 2]), "views": tf.constant([3, 4])}
  emb.enqueue(features)
  activations = emb.dequeue()
  with pytest.raises(ValueError, match="Found gradient of shape .* clicks"):
    emb.apply_gradients(
      {"clicks": tf.zeros([3, 2]), "views": activations["views"]}
    )
  with pytest.raises(ValueError, match="non-tensor type.*views"):
    emb.apply_gradients(
      {"clicks": activations["clicks"], "views": np.ones([2, 2])}
    )
  with pytest.raises(ValueError, match=r"missing feature\(s\) \['views'\]"):
    emb.apply_gradients({"clicks": activations["clicks"]})
  with pytest.raises(
    ValueError, match=r"gradients .*: unexpected feature\(s\) \['other'\]"
  ) as raised:
    emb.apply_gradients({**activations, "other": activations["clicks"]})
  assert "\n" not in str(raised.value)


def test_loop_order_errors():
  emb = make_embedding()
  with pytest.raises(RuntimeError, match="unbuilt"):
    emb.dequeue()
  emb.build()
  with pytest.raises(RuntimeError, match="without a preceding enqueue"):
    emb.dequeue()
  features = {"clicks": tf.constant([1, 2]), "views": tf.constant([3, 4])}
  emb.enqueue(features)
  with pytest.raises(RuntimeError, match="without a preceding dequeue"):
    emb.apply_gradients({"clicks": tf.zeros([2, 2]), "views": tf.zeros([2, 2])})
  # An evaluation's enqueue: the message names training=False, the cause
  # (not a dequeue, which there was).
  emb.enqueue(features, training=False)
  activations = emb.dequeue()
  with pytest.raises(RuntimeError, match=r"after `enqueue\(\.\.\., training=F"):
    emb.apply_gradients(activations)
  # A training step afterwards works, and a training step's apply without
  # a dequeue is still a missing dequeue.
  emb.enqueue(features)
  emb.apply_gradients(emb.dequeue())
  emb.enqueue(features)
  with pytest.raises(RuntimeError, match="without a preceding dequeue"):
    emb.apply_gradients(activations)


def test_apply_after_an_evaluation_enqueue_names_training_false_mirrored():
  strategy = mirrored_strategy(2)
  with strategy.scope():
    emb = make_embedding()
  features = {"clicks": tf.constant([1, 2]), "views": tf.constant([3, 4])}
  dataset = tf.data.Dataset.from_tensors(features).repeat()
  batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

  @tf.function
  def step():
    emb.enqueue(batch, training=False)  # outside strategy.run
    strategy.run(lambda: emb.apply_gradients(emb.dequeue()))

  with pytest.raises(RuntimeError, match=r"training=False"):
    step()


def test_enqueue_in_one_function_and_dequeue_in_another_is_explained():
  emb = make_embedding()
  features = {"clicks": tf.constant([1, 2]), "views": tf.constant([3, 4])}
  tf.function(lambda: emb.enqueue(features))()
  with pytest.raises(RuntimeError, match="inside the same"):
    tf.function(emb.dequeue)()


def test_inconsistent_batch_shape_is_rejected():
  emb = make_embedding()
  emb.enqueue({"clicks": tf.constant([1, 2]), "views": tf.constant([3, 4])})
  with pytest.raises(ValueError, match="Inconsistent shape .* clicks") as e:
    emb.enqueue(
      {"clicks": tf.constant([1, 2, 3]), "views": tf.constant([3, 4, 5])}
    )
  # TensorFlow's words, then what to do.
  assert str(e.value).endswith(
    "But got incoming output shape (3,). Every step must give each replica "
    "the per-replica batch the embedding was built with: feed per-replica "
    "values (strategy.experimental_distribute_dataset), keep the batch size "
    "fixed (batch(..., drop_remainder=True)), or build with "
    "per_replica_input_shapes of unknown batch size."
  )
  # As it says: built with an unknown batch, any batch size is taken.
  flexible = make_embedding()
  flexible.build(
    per_replica_input_shapes={
      "clicks": tf.TensorShape([None]),
      "views": tf.TensorShape([None]),
    }
  )
  for n in (2, 3):
    ids = tf.range(n)
    flexible.enqueue({"clicks": ids, "views": ids}, training=False)
    assert flexible.dequeue()["clicks"].shape == (n, 2)


def test_table_without_optimizer_cannot_train():
  table = tpe.TableConfig(VOCAB, 2, name="frozen")
  emb = tpe.TPUEmbedding({"f": tpe.FeatureConfig(table)}, optimizer=None)
  emb.enqueue({"f": tf.constant([1])})
  activations = emb.dequeue()
  with pytest.raises(ValueError, match="'frozen' has no optimizer"):
    emb.apply_gradients(activations)


def test_use_under_another_strategy_is_rejected():
  emb = make_embedding()
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with strategy.scope():
    with pytest.raises(
      RuntimeError,
      match=r"created under the default strategy \(outside any "
      r"`strategy.scope\(\)`\) but is used under OneDeviceStrategy",
    ):
      emb({"clicks": tf.constant([1]), "views": tf.constant([1])})


WRONG_STRATEGY = (
  r"^TPUEmbedding was created under the default strategy \(outside any "
  r"`strategy.scope\(\)`\) but is used under {current}\. Create it under "
  r"the strategy that runs it: `with strategy.scope\(\): embedding = "
  r"tpe.TPUEmbedding\(...\)`\.$"
)


def _mirrored_batches(strategy):
  """Per-replica ``{"clicks", "views"}`` batches of ``strategy``."""
  ids = tf.data.Dataset.from_tensor_slices(
    {"clicks": [1, 2, 3, 4], "views": [0, 1, 2, 3]}
  )
  return iter(strategy.experimental_distribute_dataset(ids.batch(4)))


@pytest.mark.parametrize(
  "enqueue_where, current",
  [
    ("inside_run", "MirroredStrategy"),
    # TF's own loop: enqueue outside strategy.run (and outside any scope),
    # dequeue inside it. The engine used to see no strategy here and fail
    # on the per-replica values ("Input clicks is of unknown type").
    (
      "outside_run",
      r"a strategy of 2 replicas \(the features are its per-replica "
      r"values, e.g. from its distributed dataset\)",
    ),
  ],
  ids=["enqueue_inside_run", "enqueue_outside_run"],
)
def test_an_embedding_created_outside_the_scope_names_both_strategies(
  enqueue_where, current
):
  emb = make_embedding()  # under the default strategy
  strategy = mirrored_strategy(2)
  batches = _mirrored_batches(strategy)

  @tf.function
  def step(features):
    if enqueue_where == "outside_run":
      emb.enqueue(features, training=False)

    def replica_step(features):
      if enqueue_where == "inside_run":
        emb.enqueue(features, training=False)
      return emb.dequeue()

    return strategy.run(replica_step, args=(features,))

  with pytest.raises(RuntimeError) as raised:
    step(next(batches))
  # One line: the last line of TensorFlow's traced-function report.
  message = str(raised.value).strip().splitlines()[-1].strip()
  message = message.removeprefix("RuntimeError: ")
  assert re.match(WRONG_STRATEGY.format(current=current), message), message


def test_a_direct_lookup_of_another_strategys_values_names_both():
  emb = make_embedding()  # under the default strategy
  with pytest.raises(RuntimeError) as raised:
    emb(next(_mirrored_batches(mirrored_strategy(2))))
  current = (
    r"a strategy of 2 replicas \(the features are its per-replica "
    r"values, e.g. from its distributed dataset\)"
  )
  assert re.match(WRONG_STRATEGY.format(current=current), str(raised.value))


def test_unsupported_strategy_is_explained():
  strategy = tf.distribute.experimental.CentralStorageStrategy(
    ["/cpu:0", "/cpu:1"]
  )
  with strategy.scope():
    with pytest.raises(ValueError, match="CentralStorageStrategy"):
      make_embedding()


# --- direct lookups raise TensorFlow's lookup errors -------------------------


@pytest.mark.parametrize(
  "features",
  [
    (tf.constant([1]), tf.constant([2])),  # a tuple for a list: TypeError
    {"a": tf.constant([1])},  # in tf.nest; TensorFlow raises ValueError
    [tf.constant([1])],
  ],
  ids=["tuple_for_list", "dict_for_list", "missing_feature"],
)
def test_direct_lookup_structure_errors_are_value_errors(features):
  table = tpe.TableConfig(10, 2, name="t")
  emb = tpe.TPUEmbedding(
    [tpe.FeatureConfig(table), tpe.FeatureConfig(table)], tpe.SGD(0.1)
  )
  with pytest.raises(ValueError, match="do not match the structure"):
    emb(features)
  with pytest.raises(ValueError, match="do not match the structure"):
    emb.lookup_for_training(features)


def test_direct_lookup_refuses_dense_ids_for_a_sequence_feature():
  table = tpe.TableConfig(10, 2, name="t")
  emb = tpe.TPUEmbedding(
    {"s": tpe.FeatureConfig(table, max_sequence_length=3)}, tpe.SGD(0.1)
  )
  message = "Feature s is a sequence feature but a dense tensor was passed"
  with pytest.raises(ValueError, match=message):
    emb({"s": tf.constant([1, 2])})
  # TensorFlow's serving lookup says the same.
  tf_table = tf.tpu.experimental.embedding.TableConfig(10, 2, name="t")
  tf_features = {
    "s": tf.tpu.experimental.embedding.FeatureConfig(
      tf_table, max_sequence_length=3
    )
  }
  with pytest.raises(ValueError, match=message):
    tf.tpu.experimental.embedding.serving_embedding_lookup(
      {"s": tf.constant([1, 2])},
      None,
      {tf_table: tf.zeros([10, 2])},
      tf_features,
    )
  # enqueue follows the TPU's rules: one id per row, no sequence.
  emb.enqueue({"s": tf.constant([1, 2])}, training=False)
  assert emb.dequeue()["s"].shape == (2, 2)


@pytest.mark.parametrize("where", ["eager", "graph"])
def test_an_output_shape_the_batch_does_not_fill_is_one_line(where):
  emb = make_embedding(output_shape=[8])
  features = {"clicks": tf.constant([1, 2, 3, 4]), "views": tf.constant([1])}
  expected = (
    "Feature clicks: FeatureConfig.output_shape (8,) has 8 elements but "
    "the input gives 4 output rows."
  )
  if where == "graph":  # Known when the step runs: the assert says it.
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
      tf.function(emb.enqueue)(features, training=False)
    said, rows = expected.split(" 4 ")
    assert f"assertion failed: [{said}] [4] [{rows}]" in str(raised.value)
  else:  # Known at once: raised at once.
    with pytest.raises(ValueError) as raised:
      emb.enqueue(features, training=False)
    assert str(raised.value) == expected


def test_a_checkpoint_of_another_width_restored_before_build_is_named(
  tmp_path,
):
  def embedding(dim):
    table = tpe.TableConfig(VOCAB, dim, name="items")
    return tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.Adagrad(0.5))

  saved = embedding(2)
  saved.build()
  path = tf.train.Checkpoint(embedding=saved).save(str(tmp_path / "c"))
  wider = embedding(3)
  tf.train.Checkpoint(embedding=wider).restore(path)
  with pytest.raises(ValueError) as raised:
    wider.build()
  # The parameters are created first, so they are the ones named.
  assert str(raised.value) == (
    f"Table 'items': the checkpoint restored into this embedding holds its "
    f"parameters as ({VOCAB}, 2), but its TableConfig gives ({VOCAB}, 3) "
    "(vocabulary_size, dim): restore into tables configured as the "
    "checkpoint's."
  )


def test_a_nest_for_a_single_feature_config_is_named():
  emb = tpe.TPUEmbedding(
    tpe.FeatureConfig(tpe.TableConfig(VOCAB, 2, name="items")), tpe.SGD(0.1)
  )
  with pytest.raises(ValueError) as raised:
    emb.enqueue({"clicks": tf.constant([1])})
  assert str(raised.value) == (
    "The features passed to enqueue do not match the structure of the "
    "feature config: got a nest where the config has a single feature. "
    "Expected the feature paths ['']."
  )
