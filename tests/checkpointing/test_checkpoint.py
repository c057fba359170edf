"""Checkpoints interoperate with TensorFlow's own embedding objects.

The oracle is TensorFlow's ``tf.tpu.experimental.embedding``
``TPUEmbeddingForServing`` (it runs on CPU): a checkpoint it saves restores
into our ``TPUEmbedding`` (before or after ``build``), and one of ours
restores into it with every table and slot. Keys are TensorFlow's:
``embedding/<table>/.ATTRIBUTES/VARIABLE_VALUE`` for a table and
``embedding/<table>.S<slot>/.ATTRIBUTES/VARIABLE_VALUE`` for a slot, each a
full ``[vocabulary_size, dim]`` tensor.

Two tables: ``a`` (named, shared by features ``f1`` and ``f2``) and an
unnamed one that both libraries name ``table_1``.

Tracing a training step costs about half a second, so each optimizer's
``tf.function`` is traced once, in the module fixture ``run``: TF saves
random tables and slots; ours restores them before it is built, its first
``enqueue`` builds it, it trains three steps and saves. The tests then
check each stage.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe

TFE = tf.tpu.experimental.embedding

#: Table name -> (vocabulary_size, dim, combiner).
TABLES = {"a": (8, 3, "sqrtn"), "table_1": (6, 2, "mean")}
#: Feature -> table name.
FEATURES = {"f1": "a", "f2": "a", "g": "table_1"}
#: Ids of each example of each feature at step 0 (batch 4); step k adds k
#: (mod the vocabulary size).
ROWS = {
  "f1": [[1, 2, 2], [7], [], [0, 3]],
  "f2": [[0], [1, 5], [3], [7, 7]],
  "g": [[0, 5], [5], [1, 2, 3], [4]],
}
KINDS = ("dense", "sparse", "ragged")

#: The same optimizer built with either API (``tpe`` or TensorFlow's).
OPTIMIZERS = {
  "sgd": lambda api, **kw: api.SGD(0.1, **kw),
  "adagrad": lambda api, **kw: api.Adagrad(
    0.1, initial_accumulator_value=0.2, **kw
  ),
  "adagrad_momentum": lambda api, **kw: api.AdagradMomentum(
    0.1, momentum=0.8, **kw
  ),
  "adam": lambda api, **kw: api.Adam(0.1, **kw),
  "adam_not_lazy": lambda api, **kw: api.Adam(0.1, lazy_adam=False, **kw),
  "ftrl": lambda api, **kw: api.FTRL(
    0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.02, **kw
  ),
}
#: TensorFlow's slot names, written out: they are part of the keys.
SLOTS = {
  "sgd": (),
  "adagrad": ("accumulators",),
  "adagrad_momentum": ("accumulators", "momenta"),
  "adam": ("momenta", "velocities"),
  "adam_not_lazy": ("momenta", "velocities"),
  "ftrl": ("accumulators", "linears"),
}
OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
SAVE_COUNTER = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"

State = dict[tuple[str, str], np.ndarray]


# --- configs, inputs, training ------------------------------------------------


def _key(table: str, slot: str) -> str:
  """TensorFlow's checkpoint key of a table (``parameters``) or a slot."""
  if slot == "parameters":
    return f"embedding/{table}/.ATTRIBUTES/VARIABLE_VALUE"
  return f"embedding/{table}.S{slot}/.ATTRIBUTES/VARIABLE_VALUE"


def _expected_keys(opt: str) -> set[str]:
  keys = {SAVE_COUNTER}
  for table in TABLES:
    keys |= {_key(table, s) for s in ("parameters", *SLOTS[opt])}
  return keys


def _config(api, initializers: dict | None = None):
  """``(feature_config, {table name: TableConfig})`` built with ``api``.

  Fresh objects on every call (TensorFlow names its configs in place).
  Tables start at zero unless ``initializers`` says otherwise.
  """
  initializers = initializers or {}
  tables = {}
  for name, (vocab, dim, combiner) in TABLES.items():
    tables[name] = api.TableConfig(
      vocabulary_size=vocab,
      dim=dim,
      combiner=combiner,
      # "table_1" is left unnamed: it gets the automatic name.
      name=name if name == "a" else None,
      initializer=initializers.get(name, tf.zeros_initializer()),
    )
  features = {f: api.FeatureConfig(tables[t]) for f, t in FEATURES.items()}
  return features, tables


def _random_tables(rng: np.random.Generator) -> dict[str, np.ndarray]:
  return {
    name: rng.normal(size=(vocab, dim)).astype(np.float32)
    for name, (vocab, dim, _) in TABLES.items()
  }


def _initializers(values: dict[str, np.ndarray]) -> dict:
  return {name: tf.constant_initializer(v) for name, v in values.items()}


def _inputs(kind: str, step: int = 0) -> dict:
  vocab = {f: TABLES[t][0] for f, t in FEATURES.items()}
  rows = {
    f: [[(i + step) % vocab[f] for i in row] for row in rows]
    for f, rows in ROWS.items()
  }
  if kind == "dense":
    return {f: tf.constant([(r or [0])[0] for r in v]) for f, v in rows.items()}
  ragged = {f: tf.ragged.constant(v, dtype=tf.int64) for f, v in rows.items()}
  if kind == "ragged":
    return ragged
  return {f: r.to_sparse() for f, r in ragged.items()}


def _step(emb, features) -> dict:
  """One TPU-style step: enqueue, dequeue, apply_gradients."""
  emb.enqueue(features, training=True)
  with tf.GradientTape() as tape:
    activations = emb.dequeue()
    tape.watch(activations)
    loss = tf.add_n(
      [tf.reduce_sum(tf.square(a - 0.5)) for a in activations.values()]
    )
  emb.apply_gradients(tape.gradient(loss, activations))
  return activations


def _trainer(emb):
  """``_step`` of ``emb`` in a ``tf.function`` (traced on first call)."""
  return tf.function(lambda features: _step(emb, features))


def _state(variables: dict) -> State:
  """``{(table, slot): value}`` of a ``variables`` dict (ours or TF's)."""
  return {
    (table, slot): v.numpy()
    for table, slots in variables.items()
    for slot, v in slots.items()
  }


def _checkpoint_state(path: str, opt: str) -> State:
  reader = tf.train.load_checkpoint(path)
  return {
    (t, s): reader.get_tensor(_key(t, s))
    for t in TABLES
    for s in ("parameters", *SLOTS[opt])
  }


def _checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint but the object graph and save counter."""
  reader = tf.train.load_checkpoint(path)
  return {
    key: reader.get_tensor(key)
    for key in reader.get_variable_to_shape_map()
    if key not in (OBJECT_GRAPH, SAVE_COUNTER)
  }


def _assert_state_equal(actual: State, expected: State) -> None:
  assert sorted(actual) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(actual[key], value, err_msg=str(key))


def _assert_state_close(actual: State, expected: State) -> None:
  assert sorted(actual) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_allclose(actual[key], value, 1e-6, 1e-6, err_msg=str(key))


def _assert_lookups_close(actual: dict, expected: dict) -> None:
  assert sorted(actual) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(
      np.asarray(actual[name]), np.asarray(value), 1e-6, 1e-6, err_msg=name
    )


def _tf_serving(opt: str | None, initializers: dict | None = None):
  """TF's serving object (with ``opt``'s slots unless None), unbuilt."""
  features, tables = _config(TFE, initializers)
  optimizer = None if opt is None else OPTIMIZERS[opt](TFE)
  return TFE.TPUEmbeddingForServing(features, optimizer), tables


def _save(obj, prefix) -> str:
  return tf.train.Checkpoint(embedding=obj).save(str(prefix))


def _tf_checkpoint(opt: str, rng: np.random.Generator, prefix):
  """TF's serving object with random tables and slots, saved."""
  serving, _ = _tf_serving(opt, _initializers(_random_tables(rng)))
  serving.build()
  for slots in serving._variables.values():
    for slot, variable in slots.items():
      if slot != "parameters":
        # Positive (valid for every optimizer), far from every default.
        variable.assign(rng.uniform(0.5, 2.0, variable.shape))
  path = _save(serving, prefix)
  return serving, path, _checkpoint_state(path, opt)


def _stepped_by_hand(opt: str, state: State, slots: bool = True) -> State:
  """Oracle: ours with ``state`` assigned by hand, after one eager step.

  With ``slots=False`` only the tables are assigned (default slots).
  """
  features, _ = _config(tpe)
  emb = tpe.TPUEmbedding(features, OPTIMIZERS[opt](tpe))
  emb.build()
  for (table, slot), value in state.items():
    if slots or slot == "parameters":
      emb.variables[table][slot].assign(value)
  _step(emb, _inputs("sparse", 0))
  return _state(emb.variables)


@dataclasses.dataclass
class Run:
  """One optimizer's journey TF checkpoint -> ours -> our checkpoint."""

  opt: str
  tf_serving: Any  # TF's object that saved tf_path (still holds tf_state).
  tf_path: str
  tf_state: State
  status: Any  # Of restoring tf_path into emb before it was built.
  first_activations: dict  # Of the enqueue that built emb.
  after_first_step: State
  emb: tpe.TPUEmbedding
  step: Any  # emb's traced training step.
  path: str  # emb saved after three steps.
  state: State  # emb's variables when saved.
  lookups: dict  # emb's lookups of _inputs(kind, 3) when saved.
  oracle: State  # tf_state assigned by hand, after one (eager) step.
  default_slots: State  # The same with default slots.


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def run(request, tmp_path_factory) -> Run:
  opt = request.param
  directory = tmp_path_factory.mktemp(opt)
  rng = np.random.default_rng(sorted(OPTIMIZERS).index(opt))
  tf_serving, tf_path, tf_state = _tf_checkpoint(opt, rng, directory / "tf")

  features, _ = _config(tpe)  # Zeros: any other value is restored.
  emb = tpe.TPUEmbedding(features, OPTIMIZERS[opt](tpe))
  status = tf.train.Checkpoint(embedding=emb).restore(tf_path)
  step = _trainer(emb)
  first = step(_inputs("sparse", 0))  # Builds emb: restore-on-create.
  after_first_step = _state(emb.variables)
  for k in (1, 2):
    step(_inputs("sparse", k))
  path = _save(emb, directory / "ours")
  return Run(
    opt=opt,
    tf_serving=tf_serving,
    tf_path=tf_path,
    tf_state=tf_state,
    status=status,
    first_activations=first,
    after_first_step=after_first_step,
    emb=emb,
    step=step,
    path=path,
    state=_state(emb.variables),
    lookups={kind: emb(_inputs(kind, 3)) for kind in KINDS},
    oracle=_stepped_by_hand(opt, tf_state),
    default_slots=_stepped_by_hand(opt, tf_state, slots=False),
  )


# --- TensorFlow -> ours -------------------------------------------------------


def _assert_used_restored_slots(run: Run, actual: State):
  """``actual`` is one step from TF's tables and slots (``run.tf_state``)."""
  _assert_state_close(actual, run.oracle)
  if SLOTS[run.opt]:
    # The oracle is sensitive to the slots: default slots give other rows.
    assert not np.allclose(
      run.default_slots[("a", "parameters")], run.oracle[("a", "parameters")]
    )


def test_tf_checkpoint_restores_before_build_at_enqueue(run):
  """Restore, then the first enqueue (in a tf.function) builds: TF's values.

  The first step's activations are TF's lookups, and its update is the
  one from TF's tables and slots.
  """
  run.status.assert_consumed()
  _assert_lookups_close(
    run.first_activations, run.tf_serving(_inputs("sparse", 0))
  )
  _assert_used_restored_slots(run, run.after_first_step)


@pytest.mark.parametrize("when", ["before_build_lookup", "after_build"])
def test_tf_checkpoint_restores_into_ours(run, when):
  """Restore before build (the first lookup builds) or after build."""
  features, _ = _config(tpe)
  emb = tpe.TPUEmbedding(features, OPTIMIZERS[run.opt](tpe))
  if when == "after_build":
    emb.build()
  status = tf.train.Checkpoint(embedding=emb).restore(run.tf_path)
  for kind in KINDS:
    _assert_lookups_close(emb(_inputs(kind)), run.tf_serving(_inputs(kind)))
  status.assert_consumed()
  _assert_state_equal(_state(emb.variables), run.tf_state)
  _step(emb, _inputs("sparse", 0))
  _assert_used_restored_slots(run, _state(emb.variables))


# --- ours -> TensorFlow -------------------------------------------------------


def test_checkpoint_keys_and_shapes_are_tfs(run):
  """Exactly the keys TF's own object saves, all ``[vocabulary, dim]``."""
  shapes = tf.train.load_checkpoint(run.path).get_variable_to_shape_map()
  shapes.pop(OBJECT_GRAPH)
  assert set(shapes) == _expected_keys(run.opt)
  for table, (vocab, dim, _) in TABLES.items():
    for slot in ("parameters", *SLOTS[run.opt]):
      assert shapes[_key(table, slot)] == [vocab, dim]
  tf_shapes = tf.train.load_checkpoint(run.tf_path).get_variable_to_shape_map()
  tf_shapes.pop(OBJECT_GRAPH)
  assert tf_shapes == shapes
  # The saved values are the trained ones.
  _assert_state_equal(_checkpoint_state(run.path, run.opt), run.state)
  assert not np.allclose(
    run.state[("a", "parameters")], run.tf_state[("a", "parameters")]
  )


def test_training_checkpoint_restores_into_tf_serving(run):
  """TF's serving object (with slots) restores everything; same lookups."""
  serving, tables = _tf_serving(run.opt)
  status = tf.train.Checkpoint(embedding=serving).restore(run.path)
  serving.build()
  status.assert_consumed()
  _assert_state_equal(_state(serving._variables), run.state)
  for name, table in tables.items():
    np.testing.assert_array_equal(
      serving.embedding_tables[table].numpy(), run.state[(name, "parameters")]
    )
  for kind in KINDS:
    _assert_lookups_close(run.lookups[kind], serving(_inputs(kind, 3)))


# --- our serving object -------------------------------------------------------


@pytest.mark.parametrize("with_optimizer", [True, False], ids=["slots", "none"])
def test_our_serving_restores_training_checkpoint(run, with_optimizer):
  """Our serving object restores our training checkpoint.

  With ``optimizer=None`` the checkpoint's slots have nowhere to go: as
  with TF's serving object (checked side by side), ``assert_consumed``
  fails while ``assert_existing_objects_matched`` passes, and the restore
  needs ``expect_partial()`` to silence the unrestored-values warning.
  """
  opt = run.opt if with_optimizer else None
  features, tables = _config(tpe)
  ours = tpe.TPUEmbeddingForServing(
    features, None if opt is None else OPTIMIZERS[opt](tpe)
  )
  theirs, _ = _tf_serving(opt)
  statuses = []
  for obj in (ours, theirs):
    status = tf.train.Checkpoint(embedding=obj).restore(run.path)
    statuses.append(status if with_optimizer else status.expect_partial())

  # Restored before build; the first lookup (of a subset) builds.
  subset = {"g": _inputs("ragged", 3)["g"]}
  _assert_lookups_close(ours(subset), {"g": run.lookups["ragged"]["g"]})
  theirs.build()
  for status in statuses:
    status.assert_existing_objects_matched()
    if with_optimizer or not SLOTS[run.opt]:
      status.assert_consumed()
    else:
      with pytest.raises(AssertionError, match="Unresolved object"):
        status.assert_consumed()

  expected = {
    key: value
    for key, value in run.state.items()
    if with_optimizer or key[1] == "parameters"
  }
  _assert_state_equal(_state(ours.variables), expected)
  for name, table in tables.items():
    np.testing.assert_array_equal(
      ours.embedding_tables[table].numpy(), run.state[(name, "parameters")]
    )
  for kind in KINDS:  # run.lookups are TF's too (tested above).
    _assert_lookups_close(ours(_inputs(kind, 3)), run.lookups[kind])


# --- slot_variable_creation_fn ------------------------------------------------


class _SlotFactory:
  """A user ``slot_variable_creation_fn`` that records what it makes."""

  def __init__(self):
    self.calls = []
    self.created = []

  def __call__(self, table, slot_names, slot_initializers):
    self.calls.append((tuple(table.shape), list(slot_names)))
    slots = {
      name: tf.Variable(
        init(shape=table.shape, dtype=table.dtype),
        name=f"user_{name}",
        trainable=False,
      )
      for name, init in zip(slot_names, slot_initializers, strict=True)
    }
    self.created.extend(slots.values())
    return slots


def _adagrad_with(factory: _SlotFactory, initializers: dict | None = None):
  features, _ = _config(tpe, initializers)
  optimizer = OPTIMIZERS["adagrad"](tpe, slot_variable_creation_fn=factory)
  return tpe.TPUEmbedding(features, optimizer)


def test_slot_variable_creation_fn_saves_standard_keys(rng, tmp_path):
  """User-made Adagrad slots are saved as ``<table>.Saccumulators``."""
  factory = _SlotFactory()
  emb = _adagrad_with(factory, _initializers(_random_tables(rng)))
  step = _trainer(emb)
  for k in range(2):
    step(_inputs("sparse", k))
  assert sorted(factory.calls) == [
    ((6, 2), ["accumulators"]),
    ((8, 3), ["accumulators"]),
  ]
  for table in TABLES:
    slot = emb.variables[table]["accumulators"]
    assert any(slot is v for v in factory.created)
  assert not np.allclose(emb.variables["a"]["accumulators"].numpy(), 0.2)

  path = _save(emb, tmp_path / "ckpt")
  keys = set(tf.train.load_checkpoint(path).get_variable_to_shape_map())
  assert keys - {OBJECT_GRAPH} == _expected_keys("adagrad")
  serving, _ = _tf_serving("adagrad")
  status = tf.train.Checkpoint(embedding=serving).restore(path)
  serving.build()
  status.assert_consumed()
  _assert_state_equal(_state(serving._variables), _state(emb.variables))


def test_slot_variable_creation_fn_restores_before_build(rng, tmp_path):
  """A TF checkpoint restores into user-made slots (restore, then build)."""
  serving, path, expected = _tf_checkpoint("adagrad", rng, tmp_path / "ckpt")
  factory = _SlotFactory()
  emb = _adagrad_with(factory)
  status = tf.train.Checkpoint(embedding=emb).restore(path)
  _assert_lookups_close(emb(_inputs("sparse")), serving(_inputs("sparse")))
  status.assert_consumed()
  assert len(factory.created) == len(TABLES)
  _assert_state_equal(_state(emb.variables), expected)


# --- a failing step -----------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["negative", "too_large"])
@pytest.mark.parametrize("bad_feature", sorted(FEATURES))
def test_failing_step_leaves_checkpoint_unchanged(
  run, bad_feature, bad_id, tmp_path
):
  """Ids out of range in one feature: the traced step fails, changes nothing.

  Every tensor of a checkpoint saved after the failed step equals the one
  saved before it, including the other table's (whose ids were valid).
  """
  checkpoint = tf.train.Checkpoint(embedding=run.emb)
  before = _checkpoint_tensors(checkpoint.save(str(tmp_path / "before")))

  features = _inputs("sparse", 1)
  ids = features[bad_feature]
  vocab = TABLES[FEATURES[bad_feature]][0]
  bad = -1 if bad_id == "negative" else vocab
  features[bad_feature] = tf.SparseTensor(
    ids.indices,
    tf.tensor_scatter_nd_update(ids.values, [[0]], [bad]),
    ids.dense_shape,
  )
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=re.escape(f"Input {bad_feature} ")
  ):
    run.step(features)  # Same signature: no retracing.

  after = _checkpoint_tensors(checkpoint.save(str(tmp_path / "after")))
  assert sorted(after) == sorted(before)
  changed = [k for k in before if not np.array_equal(before[k], after[k])]
  assert not changed, f"the failed step changed {changed}"


@pytest.mark.parametrize("chunk_bytes", [0, -4])
def test_sliced_checkpoints_refuse_chunks_without_bytes(chunk_bytes, tmp_path):
  checkpoint = tf.train.Checkpoint(step=tf.Variable(1))
  path = str(tmp_path / "ckpt")
  with pytest.raises(ValueError, match="chunk_bytes must be positive"):
    tpe.checkpoints.write(checkpoint, path, chunk_bytes=chunk_bytes)
  tpe.checkpoints.write(checkpoint, path, chunk_bytes=1)
  with pytest.raises(ValueError, match="chunk_bytes must be positive"):
    tpe.checkpoints.restore(checkpoint, path, chunk_bytes=chunk_bytes)
