"""Trains ``tpu_embedding`` on CPU and checks it against the numpy oracle.

Every test drives the public API exactly as a TF user does on TPU
(``enqueue`` / ``dequeue`` / ``apply_gradients`` inside a ``tf.function``,
or a direct ``emb(features, weights)`` lookup) on the default strategy, then
compares tables and slot variables with ``tests/oracle.py``, which is written
from TF's TPU per-row equations, not from the package.
"""

import importlib.util
import itertools
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf


def _load_oracle():
  """Imports ``tests/oracle.py`` whatever the import mode/rootdir."""
  name = "tpu_embedding_test_oracle"
  if name not in sys.modules:
    path = pathlib.Path(__file__).parents[1] / "oracle.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up.
    spec.loader.exec_module(module)
  return sys.modules[name]


oracle = _load_oracle()
import tpu_embedding as tpe  # noqa: E402

V, D, B = 12, 3, 4
RTOL = ATOL = 1e-5
SEQ_LEN = 3
_SPARSE_WIDTH = 4  # dense_shape[1] of every SparseTensor batch.

# Three steps of per-sample ids: repeats within and across samples, an empty
# sample, a sample longer than SEQ_LEN; rows 4, 6, 8..11 are never looked up.
_LIST_BATCHES = [
  [[1, 3, 1], [], [3], [5, 1]],
  [[3, 3], [0, 5, 1], [], [7]],
  [[1], [3, 5, 5, 0], [2, 2], []],
]
_WEIGHT_BATCHES = [
  [[0.5, 2.0, 1.5], [], [3.0], [1.0, 0.25]],
  [[1.5, 0.5], [2.0, 1.0, 0.75], [], [4.0]],
  [[2.5], [0.5, 1.0, 2.0, 1.5], [1.0, 2.0], []],
]
_DENSE_BATCHES = [
  np.array([1, 1, 3, 5]),
  np.array([3, 3, 3, 0]),
  np.array([5, 1, 7, 7]),
]
_NUM_STEPS = len(_LIST_BATCHES)

_RNG = np.random.default_rng(1234)
_INIT = _RNG.uniform(-1.0, 1.0, (V, D)).astype(np.float32)
# Fixed random tensors of the loss sum(acts * r) + 0.5 * sum(acts ** 2).
_LOSS_R = _RNG.normal(size=(_NUM_STEPS, B, D)).astype(np.float32)
_LOSS_R_SEQ = _RNG.normal(size=(_NUM_STEPS, B, SEQ_LEN, D)).astype(np.float32)

_OPTIMIZER_CLASSES = {
  "sgd": "SGD",
  "adagrad": "Adagrad",
  "adagrad_momentum": "AdagradMomentum",
  "adam": "Adam",
  "ftrl": "FTRL",
}

# ---------------------------------------------------------------------------
# Shared helpers.
# ---------------------------------------------------------------------------


def _batch(kind, step):
  """Numpy ids and weights (or None) of one step for an input kind."""
  if kind == "dense":
    return _DENSE_BATCHES[step], None
  return _LIST_BATCHES[step], _WEIGHT_BATCHES[step]


def _to_tf(kind, ids, weights):
  """The TF input (and weights, or None) for numpy ids of one kind."""
  if kind == "dense":
    return tf.constant(ids, tf.int32), None
  if kind == "ragged":
    feat = tf.ragged.constant(ids, tf.int32, row_splits_dtype=tf.int64)
    wts = None
    if weights is not None:
      wts = tf.RaggedTensor.from_row_splits(
        tf.constant([x for r in weights for x in r], tf.float32),
        feat.row_splits,
      )
    return feat, wts
  indices = [[b, j] for b, row in enumerate(ids) for j in range(len(row))]
  indices = np.array(indices, np.int64).reshape(-1, 2)
  shape = [len(ids), _SPARSE_WIDTH]
  feat = tf.SparseTensor(
    indices, tf.constant([i for r in ids for i in r], tf.int32), shape
  )
  wts = None
  if weights is not None:
    wts = tf.SparseTensor(
      indices,
      tf.constant([x for r in weights for x in r], tf.float32),
      shape,
    )
  return feat, wts


def _loss(acts, r):
  return tf.reduce_sum(acts * r) + 0.5 * tf.reduce_sum(tf.square(acts))


def _make_embedding(opt_name, kwargs, combiner="sum", max_seq_len=0):
  """A one-table, one-feature ``tpe.TPUEmbedding`` and its TableConfig."""
  table = tpe.TableConfig(
    vocabulary_size=V,
    dim=D,
    initializer=tf.constant_initializer(_INIT),
    combiner=combiner,
    name="t",
  )
  feature = tpe.FeatureConfig(table=table, max_sequence_length=max_seq_len)
  optimizer = getattr(tpe, _OPTIMIZER_CLASSES[opt_name])(**kwargs)
  emb = tpe.TPUEmbedding(feature_config={"f": feature}, optimizer=optimizer)
  return emb, table


def _describe(opt_name, kwargs, kind, combiner, weighted):
  return (
    f"{opt_name}({kwargs}) input={kind} combiner={combiner} weights={weighted}"
  )


def _assert_close(got, want, what):
  got = np.asarray(got)
  if got.shape != want.shape:
    pytest.fail(f"{what}: shape {got.shape}, expected {want.shape}")
  bad = ~np.isclose(got, want, rtol=RTOL, atol=ATOL)
  if bad.any():
    rows = sorted({int(r) for r in np.argwhere(bad)[:, 0]})
    r = rows[0]
    pytest.fail(
      f"{what}: mismatch in rows {rows}; row {r}: got {got[r]}, "
      f"expected {want[r]} (max abs diff "
      f"{np.max(np.abs(got - want)):.3g})"
    )


def _train(
  opt_name,
  kwargs,
  kind,
  combiner="sum",
  weighted=False,
  lr_schedule=None,
  max_seq_len=0,
):
  """Trains package and oracle side by side and compares everything.

  Args:
    opt_name: Key of ``_OPTIMIZER_CLASSES``.
    kwargs: Optimizer keyword arguments, exactly as given to ``tpe``.
    kind: ``"dense"``, ``"sparse"`` or ``"ragged"``.
    combiner: The table's combiner.
    weighted: Whether to pass per-id weights.
    lr_schedule: Per-step learning rates; if set, ``learning_rate`` is a
      zero-arg callable reading a ``tf.Variable`` set before each step.
    max_seq_len: ``max_sequence_length`` of the feature.
  """
  what = _describe(opt_name, kwargs, kind, combiner, weighted)
  tpe_kwargs, oracle_kwargs = dict(kwargs), dict(kwargs)
  lr_var = None
  if lr_schedule is not None:
    lr_var = tf.Variable(lr_schedule[0], dtype=tf.float32)
    tpe_kwargs["learning_rate"] = lambda: lr_var
    oracle_kwargs["learning_rate"] = lr_schedule[0]
  emb, table = _make_embedding(opt_name, tpe_kwargs, combiner, max_seq_len)
  ref = oracle.Table(_INIT, oracle.Optimizer.create(opt_name, **oracle_kwargs))

  @tf.function
  def step(features, weights, r):
    emb.enqueue(features, weights, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = _loss(acts["f"], r)
    emb.apply_gradients(tape.gradient(loss, acts))
    return acts["f"]

  loss_r = _LOSS_R_SEQ if max_seq_len else _LOSS_R
  for s in range(_NUM_STEPS):
    ids, weights = _batch(kind, s)
    weights = weights if weighted else None
    lr = None
    if lr_var is not None:
      lr = lr_schedule[s]
      lr_var.assign(lr)
    feat, wts = _to_tf(kind, ids, weights)
    acts = step({"f": feat}, None if wts is None else {"f": wts}, loss_r[s])
    feature = {
      "ids": ids,
      "weights": weights,
      "combiner": combiner,
      "max_sequence_length": max_seq_len,
    }
    (want_acts,) = ref.step(
      [feature], lambda a, s=s: [loss_r[s] + a[0]], learning_rate=lr
    )
    _assert_close(acts, want_acts, f"{what}: step {s} activations")

  params = emb.embedding_tables[table].numpy()
  _assert_close(params, ref.params, f"{what}: parameters")
  slots = {
    name: emb.variables["t"][name].numpy() for name in ref.optimizer.slot_names
  }
  for name, got in slots.items():
    _assert_close(got, ref.slots[name], f"{what}: slot {name!r}")

  if ref.optimizer.lazy:
    rows = sorted(set(range(V)) - ref.touched)
    init_slots = ref.optimizer.init_slots((V, D))
    np.testing.assert_array_equal(
      params[rows], _INIT[rows], f"{what}: untouched rows changed"
    )
    for name, got in slots.items():
      np.testing.assert_array_equal(
        got[rows],
        init_slots[name][rows].astype(np.float32),
        f"{what}: untouched rows of slot {name!r} changed",
      )


# ---------------------------------------------------------------------------
# Parameterization.
# ---------------------------------------------------------------------------

_INPUTS = [("dense", "sum", False)] + [
  (kind, combiner, weighted)
  for kind in ("sparse", "ragged")
  for combiner in oracle.COMBINERS
  for weighted in (False, True)
]
_INPUT_IDS = [f"{k}-{c}-{'w' if w else 'nw'}" for k, c, w in _INPUTS]

# One non-default configuration per optimizer, crossed with every input.
_BASE = {
  "sgd": {"learning_rate": 0.1},
  "adagrad": {"learning_rate": 0.1, "initial_accumulator_value": 0.2},
  "adagrad_momentum": {
    "learning_rate": 0.1,
    "momentum": 0.9,
    "use_nesterov": True,
    "exponent": 3.0,
    "beta2": 0.9,
    "epsilon": 0.1,
  },
  "adam": {"learning_rate": 0.1, "epsilon": 0.01},
  "ftrl": {
    "learning_rate": 0.1,
    "l1_regularization_strength": 0.01,
    "l2_regularization_strength": 0.1,
    "beta": 0.2,
  },
}

# Option variants, each run on two inputs.
_VARIANTS = [
  ("adagrad_momentum", {"learning_rate": 0.1, "momentum": 0.5}),
  (
    "adagrad_momentum",
    {
      "learning_rate": 0.1,
      "momentum": 0.9,
      "exponent": 4.0,
      "epsilon": 1e-3,
    },
  ),
  (
    "adagrad_momentum",
    {"learning_rate": 0.1, "beta2": 0.99, "epsilon": 1e-4},
  ),
  ("adam", {"learning_rate": 0.1}),
  *[
    (
      "adam",
      {
        "learning_rate": 0.1,
        "epsilon": 0.01,
        "lazy_adam": lazy,
        "sum_inside_sqrt": inside,
      },
    )
    for lazy, inside in itertools.product((True, False), repeat=2)
  ],
  ("ftrl", {"learning_rate": 0.1}),
  ("ftrl", {"learning_rate": 0.1, "learning_rate_power": -0.3}),
  ("ftrl", {"learning_rate": 0.1, "learning_rate_power": 0.0}),
  (
    "ftrl",
    {
      "learning_rate": 0.1,
      "multiply_linear_by_learning_rate": True,
      "l1_regularization_strength": 0.01,
      "l2_regularization_strength": 0.1,
      "beta": 0.2,
    },
  ),
  (
    "ftrl",
    {
      "learning_rate": 0.1,
      "allow_zero_accumulator": True,
      "initial_accumulator_value": 0.5,
    },
  ),
]
_VARIANT_INPUTS = [("sparse", "sqrtn", True), ("ragged", "mean", False)]

# Shared hyper-parameters: (optimizer, kwargs, learning-rate schedule).
_SHARED = [
  ("sgd", {"learning_rate": 0.1, "clipvalue": 1.5}, None),
  ("adagrad", {"learning_rate": 0.1, "clipvalue": 1.5}, None),
  ("adam", {"learning_rate": 0.1, "clipvalue": (-0.3, None)}, None),
  ("ftrl", {"learning_rate": 0.1, "clipvalue": (None, 0.4)}, None),
  (
    "sgd",
    {"learning_rate": 0.5, "clip_weight_min": -0.4, "clip_weight_max": 0.3},
    None,
  ),
  ("adagrad", {"learning_rate": 0.5, "clip_weight_min": -0.5}, None),
  ("ftrl", {"learning_rate": 0.5, "clip_weight_max": 0.2}, None),
  (
    "adagrad",
    {
      "learning_rate": 0.1,
      "clipvalue": 0.5,
      "clip_weight_min": -0.5,
      "clip_weight_max": 0.5,
    },
    None,
  ),
  ("sgd", {"learning_rate": 0.1, "weight_decay_factor": 0.1}, None),
  ("adagrad", {"learning_rate": 0.1, "weight_decay_factor": 0.1}, None),
  (
    "adam",
    {
      "learning_rate": 0.1,
      "weight_decay_factor": 0.2,
      "multiply_weight_decay_factor_by_learning_rate": True,
    },
    None,
  ),
  (
    "adagrad_momentum",
    {"learning_rate": 0.1, "momentum": 0.5, "weight_decay_factor": 0.1},
    None,
  ),
  (
    "adagrad",
    {
      "learning_rate": 0.1,
      "weight_decay_factor": 0.5,
      "multiply_weight_decay_factor_by_learning_rate": True,
    },
    (0.1, 0.3, 0.05),
  ),
  ("sgd", {}, (0.1, 0.05, 0.2)),
  ("adagrad", {}, (0.1, 0.05, 0.2)),
  ("adagrad_momentum", {"momentum": 0.9}, (0.1, 0.05, 0.2)),
  ("adam", {"lazy_adam": False}, (0.1, 0.05, 0.2)),
  ("ftrl", {}, (0.1, 0.05, 0.2)),
  ("ftrl", {"multiply_linear_by_learning_rate": True}, (0.1, 0.05, 0.2)),
]


def _id(opt_name, kwargs, schedule=None):
  parts = [opt_name] + [
    f"{k}={v}" for k, v in kwargs.items() if k != "learning_rate"
  ]
  if schedule is not None:
    parts.append("lr_schedule")
  return ",".join(parts)


# ---------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("kind", "combiner", "weighted"), _INPUTS, ids=_INPUT_IDS
)
@pytest.mark.parametrize("opt_name", sorted(_BASE))
def test_training_matches_oracle(opt_name, kind, combiner, weighted):
  _train(opt_name, _BASE[opt_name], kind, combiner, weighted)


@pytest.mark.parametrize(
  ("kind", "combiner", "weighted"),
  _VARIANT_INPUTS,
  ids=[f"{k}-{c}-{'w' if w else 'nw'}" for k, c, w in _VARIANT_INPUTS],
)
@pytest.mark.parametrize(
  ("opt_name", "kwargs"), _VARIANTS, ids=[_id(*v) for v in _VARIANTS]
)
def test_optimizer_options_match_oracle(
  opt_name, kwargs, kind, combiner, weighted
):
  _train(opt_name, kwargs, kind, combiner, weighted)


@pytest.mark.parametrize(
  ("opt_name", "kwargs", "schedule"),
  _SHARED,
  ids=[_id(*v) for v in _SHARED],
)
def test_shared_hyperparameters_match_oracle(opt_name, kwargs, schedule):
  _train(opt_name, kwargs, "ragged", "sum", weighted=True, lr_schedule=schedule)


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
def test_sequence_feature_training_matches_oracle(opt_name, kind):
  _train(opt_name, _BASE[opt_name], kind, max_seq_len=SEQ_LEN)


@pytest.mark.parametrize(
  ("kind", "combiner", "weighted"), _INPUTS, ids=_INPUT_IDS
)
def test_direct_lookup_matches_oracle(kind, combiner, weighted):
  emb, _ = _make_embedding("sgd", {"learning_rate": 0.1}, combiner)
  for s in range(_NUM_STEPS):
    ids, weights = _batch(kind, s)
    weights = weights if weighted else None
    feat, wts = _to_tf(kind, ids, weights)
    got = emb({"f": feat}, None if wts is None else {"f": wts})["f"]
    want = oracle.lookup(_INIT, ids, weights, combiner)
    _assert_close(got, want, f"lookup {kind} {combiner} step {s}")


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_direct_sequence_lookup_matches_oracle(kind):
  emb, _ = _make_embedding("sgd", {"learning_rate": 0.1}, max_seq_len=SEQ_LEN)
  for s in range(_NUM_STEPS):
    ids, _ = _batch(kind, s)
    feat, _ = _to_tf(kind, ids, None)
    got = emb({"f": feat})["f"]
    want = oracle.lookup(_INIT, ids, max_sequence_length=SEQ_LEN)
    _assert_close(got, want, f"sequence lookup {kind} step {s}")


@pytest.mark.parametrize("opt_name", ["adagrad", "ftrl"])
def test_two_features_sharing_a_table_match_oracle(opt_name):
  """Row gradients of two features on one table are summed, then applied."""
  table = tpe.TableConfig(
    vocabulary_size=V,
    dim=D,
    initializer=tf.constant_initializer(_INIT),
    combiner="mean",
    name="t",
  )
  emb = tpe.TPUEmbedding(
    feature_config={
      "a": tpe.FeatureConfig(table=table),
      "b": tpe.FeatureConfig(table=table),
    },
    optimizer=getattr(tpe, _OPTIMIZER_CLASSES[opt_name])(**_BASE[opt_name]),
  )
  ref = oracle.Table(
    _INIT, oracle.Optimizer.create(opt_name, **_BASE[opt_name])
  )

  @tf.function
  def step(features, weights, r):
    emb.enqueue(features, weights, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = _loss(acts["a"], r) + _loss(acts["b"], 2.0 * r)
    emb.apply_gradients(tape.gradient(loss, acts))

  for s in range(_NUM_STEPS):
    ids, weights = _batch("ragged", s)
    feat, wts = _to_tf("ragged", ids, weights)
    dense = _DENSE_BATCHES[s]
    step(
      {"a": feat, "b": tf.constant(dense, tf.int32)},
      {"a": wts, "b": None},
      _LOSS_R[s],
    )
    features = [
      {"ids": ids, "weights": weights, "combiner": "mean"},
      {"ids": dense},
    ]
    ref.step(
      features,
      lambda a, s=s: [_LOSS_R[s] + a[0], 2.0 * _LOSS_R[s] + a[1]],
    )
  what = f"{opt_name} two features on one table"
  _assert_close(
    emb.embedding_tables[table].numpy(), ref.params, f"{what}: params"
  )
  for name in ref.optimizer.slot_names:
    _assert_close(
      emb.variables["t"][name].numpy(),
      ref.slots[name],
      f"{what}: slot {name!r}",
    )


@pytest.mark.parametrize("run", ["eager", "function"])
def test_each_learning_rate_callable_is_called_once_per_update(run):
  """As TPU's apply_gradients: tables on one schedule share its value (3
  tables, 2 callables: 2 calls per update, not 3), and the next update
  calls them again (a rate read from a variable follows it: SGD moves
  each looked-up row by -lr per step)."""
  calls = []
  lr = tf.Variable(0.5)

  def shared():
    calls.append("shared")
    return lr

  def own():
    calls.append("own")
    return 2.0 * lr

  optimizers = [tpe.SGD(shared), tpe.SGD(shared), tpe.SGD(own)]
  tables = [
    tpe.TableConfig(4, 1, name=f"t{i}", optimizer=optimizers[i],
                    initializer=tf.zeros_initializer())
    for i in range(3)
  ]  # fmt: skip
  emb = tpe.TPUEmbedding(
    {f"f{i}": tpe.FeatureConfig(t) for i, t in enumerate(tables)},
    table_stacking=None,
  )
  emb.build()
  features = {f"f{i}": tf.constant([1]) for i in range(3)}

  def step():
    emb.enqueue(features, training=True)
    emb.apply_gradients(
      tf.nest.map_structure(tf.ones_like, emb.dequeue())
    )  # fmt: skip

  if run == "function":
    step = tf.function(step)
  step()
  assert sorted(calls) == ["own", "shared"], calls
  lr.assign(0.25)
  step()
  parameters = [emb.embedding_tables[t].numpy()[1, 0] for t in tables]
  np.testing.assert_allclose(parameters, [-0.75, -0.75, -1.5])
