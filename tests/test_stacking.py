"""Table stacking: plans, errors, and training equal to the numpy oracle.

Tables stacked into one store (``tpu_embedding/stacking.py``) must train,
save and restore exactly as when each is alone: checked against the
independent numpy oracle (``tests/oracle.py``) for every optimizer, with
stacking on and off, on 1, 2 and 4 replicas, and through checkpoints in
both directions and into TensorFlow's own ``TPUEmbeddingForServing``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import oracle
from tests.conftest import mirrored_strategy
from tpu_embedding import kernels
from tpu_embedding.planning import Planner
from tpu_embedding.resolved import resolve
from tpu_embedding.sharding import ROW_SHARDED
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.stacking import plan_stacks

D, B, STEPS = 3, 4, 3
ROWS = {"a": 7, "b": 11, "c": 5}
COMBINERS = {"a": "sum", "b": "mean", "c": "sqrtn"}
OPTIMIZERS = {
  "sgd": {"learning_rate": 0.1},
  "adagrad": {"learning_rate": 0.1, "initial_accumulator_value": 0.2},
  "adagrad_momentum": {"learning_rate": 0.1, "momentum": 0.9},
  "adam": {"learning_rate": 0.1, "epsilon": 0.01},
  "ftrl": {"learning_rate": 0.1, "l1_regularization_strength": 0.01},
}
CLASSES = {
  "sgd": tpe.SGD,
  "adagrad": tpe.Adagrad,
  "adagrad_momentum": tpe.AdagradMomentum,
  "adam": tpe.Adam,
  "ftrl": tpe.FTRL,
}
_RNG = np.random.default_rng(7)
INIT = {
  n: _RNG.uniform(-1, 1, (v, D)).astype(np.float32) for n, v in ROWS.items()
}
# Features: "a1" (ragged, weighted) and "a2" (dense) share table a; "b"
# ragged; "c" dense. Ids repeat within and across samples.
IDS = [
  {
    "a1": [[1, 3, 1], [], [6], [5, 1]],
    "a2": [2, 1, 1, 6],
    "b": [[10, 0], [3], [], [3, 3, 9]],
    "c": [4, 4, 0, 2],
  },
  {
    "a1": [[0], [1, 1], [2, 6, 5], []],
    "a2": [0, 0, 5, 1],
    "b": [[], [7, 7], [10], [0, 1]],
    "c": [1, 4, 4, 3],
  },
  {
    "a1": [[6, 6], [4], [], [3]],
    "a2": [3, 4, 4, 4],
    "b": [[2], [2, 9], [5, 5, 5], [8]],
    "c": [0, 0, 0, 0],
  },
]
WEIGHTS = [[[0.5, 2.0, 1.5], [], [3.0], [1.0, 0.25]], None, None]
FEATURE_TABLE = {"a1": "a", "a2": "a", "b": "b", "c": "c"}
R = {
  f: _RNG.normal(size=(STEPS, B, D)).astype(np.float32) for f in FEATURE_TABLE
}


def _config():
  tables = {
    n: tpe.TableConfig(
      ROWS[n],
      D,
      initializer=tf.constant_initializer(INIT[n]),
      combiner=COMBINERS[n],
      name=n,
    )
    for n in ROWS
  }
  return {f: tpe.FeatureConfig(tables[t]) for f, t in FEATURE_TABLE.items()}


def _inputs(step: int, start: int = 0, end: int = B):
  ids = IDS[step]
  features = {
    f: (
      tf.ragged.constant(ids[f][start:end], tf.int64, row_splits_dtype=tf.int64)
      if isinstance(ids[f][0], list)
      else tf.constant(ids[f][start:end], tf.int64)
    )
    for f in FEATURE_TABLE
  }
  weights = {f: None for f in FEATURE_TABLE}
  if step == 0:
    weights["a1"] = tf.ragged.constant(
      WEIGHTS[0][start:end], tf.float32, row_splits_dtype=tf.int64
    )
    weights["a1"] = tf.RaggedTensor.from_row_splits(
      weights["a1"].flat_values, features["a1"].row_splits
    )
  return features, weights


def _oracle_run(opt_name, pipelined=False):
  """Every table trained by the numpy oracle, as if alone.

  Pipelined (TPU semantics): step ``n`` looks up the tables as they were
  before step ``n - 1``'s update, which is applied right after that
  lookup; the last update is applied at the end (``flush_pipeline``).
  """
  kwargs = OPTIMIZERS[opt_name]
  tables = {
    n: oracle.Table(INIT[n], oracle.Optimizer.create(opt_name, **kwargs))
    for n in ROWS
  }
  held: dict = {name: None for name in tables}
  for s in range(STEPS):
    for name, table in tables.items():
      features = [f for f, t in FEATURE_TABLE.items() if t == name]
      specs = []
      for f in features:
        spec = {"ids": IDS[s][f], "combiner": COMBINERS[name]}
        if isinstance(IDS[s][f][0], list):
          if s == 0 and f == "a1":
            spec["weights"] = WEIGHTS[0]
        spec["ids"] = (
          IDS[s][f] if isinstance(IDS[s][f][0], list) else np.array(IDS[s][f])
        )
        specs.append(spec)
      loss_grad = lambda acts, s=s, features=features: [  # noqa: E731
        R[f][s] + act for f, act in zip(features, acts, strict=True)
      ]
      if not pipelined:
        table.step(specs, loss_grad)
        continue
      acts = [oracle.lookup(table.params, **spec) for spec in specs]
      if held[name] is not None:
        table.optimizer.apply(table.params, table.slots, held[name])
      total: dict = {}
      for spec, grad in zip(specs, loss_grad(acts), strict=True):
        for row, value in oracle.row_gradients(
          activation_grads=grad, **spec
        ).items():
          total[row] = total.get(row, 0.0) + value
      held[name] = total
  for name, table in tables.items():
    if pipelined and held[name] is not None:
      table.optimizer.apply(table.params, table.slots, held[name])
  return tables


def _stacking(stacking, replicas):
  """``"stacked"``: the tables that can stack on ``replicas`` replicas (b,
  11 rows, is row-sharded over several; a and c are replicated). On CPUs
  ``"auto"`` stacks nothing (see stacking.py), so stacks are explicit."""
  if stacking != "stacked":
    return stacking
  return [["a", "b", "c"]] if replicas == 1 else [["a", "c"]]


def _train(opt_name, stacking, replicas, pipelined=False):
  strategy = (
    mirrored_strategy(replicas)
    if replicas > 1
    else tf.distribute.get_strategy()
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      _config(),
      CLASSES[opt_name](**OPTIMIZERS[opt_name]),
      row_sharding_threshold=8,
      table_stacking=_stacking(stacking, replicas),
      pipeline_execution_with_tensor_core=pipelined,
    )
  emb.build()
  per_replica = B // replicas

  def replica_fn(r):
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.add_n(
        [
          tf.reduce_sum(acts[f] * r[f]) + 0.5 * tf.reduce_sum(acts[f] ** 2)
          for f in FEATURE_TABLE
        ]
      )
    emb.apply_gradients(tape.gradient(loss, acts))

  @tf.function
  def local_step(features, weights, r):
    emb.enqueue(features, weights)
    replica_fn(r)

  @tf.function
  def distributed_step(features, weights, r):
    emb.enqueue(features, weights)
    strategy.run(replica_fn, args=(r,))

  for s in range(STEPS):
    r_all = {f: R[f][s] for f in FEATURE_TABLE}
    if replicas == 1:
      local_step(*_inputs(s), r_all)
      continue

    def per_replica_values(ctx, s=s, r_all=r_all):
      start = ctx.replica_id_in_sync_group * per_replica
      features, weights = _inputs(s, start, start + per_replica)
      r = {f: v[start : start + per_replica] for f, v in r_all.items()}
      return features, weights, r

    distributed_step(
      *strategy.experimental_distribute_values_from_function(per_replica_values)
    )
  if pipelined:  # The last step's update, held until now.
    if replicas == 1:
      tf.function(emb.flush_pipeline)()
    else:
      tf.function(lambda: strategy.run(emb.flush_pipeline))()
  return emb


# Every optimizer on one device, stacked and alone; stacked and sharded
# with Adagrad on 4 replicas and FTRL (slots, and a rule that is not linear
# in its slots) on 2 (Adagrad stacked on 2 replicas: the pipelined test).
# Tables alone and sharded equal one device for every optimizer on 2 or 4
# replicas: tests/backends/test_sharded.py.
CASES = [
  (name, 1, stacking)
  for name in sorted(OPTIMIZERS)
  for stacking in ("stacked", None)
] + [("adagrad", 4, "stacked"), ("ftrl", 2, "stacked")]


@pytest.mark.parametrize(
  "opt_name, replicas, stacking",
  [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2] or 'alone'}")
    for case in CASES
  ],
)
def test_training_matches_oracle(opt_name, replicas, stacking):
  emb = _train(opt_name, stacking, replicas)
  stacks = {s.names for s in emb._engine.stacks}  # pylint: disable=protected-access
  if stacking:
    assert (("a", "b", "c") if replicas == 1 else ("a", "c")) in stacks
  else:
    assert stacks == {("a",), ("b",), ("c",)}
  expected = _oracle_run(opt_name)
  for name, table in expected.items():
    got = emb.variables[name]
    np.testing.assert_allclose(
      tf.convert_to_tensor(got["parameters"]).numpy(),
      table.params,
      rtol=1e-5,
      atol=1e-5,
      err_msg=name,
    )
    for slot, value in table.slots.items():
      np.testing.assert_allclose(
        tf.convert_to_tensor(got[slot]).numpy(),
        value,
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"{name}/{slot}",
      )


def _assert_matches(emb, expected):
  for name, table in expected.items():
    got = emb.variables[name]
    for key, value in [("parameters", table.params), *table.slots.items()]:
      np.testing.assert_allclose(
        tf.convert_to_tensor(got[key]).numpy(),
        value,
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"{name}/{key}",
      )


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_pipelined_training_is_one_step_stale(replicas):
  """Gradients depend on the activations (loss sum(act * r + act**2 / 2)),
  so a lookup that saw the previous step's update would give other
  numbers: the tables and Adagrad's accumulators must follow the stale
  schedule of the oracle, and differ from the unpipelined one."""
  emb = _train("adagrad", "stacked", replicas, pipelined=True)
  _assert_matches(emb, _oracle_run("adagrad", pipelined=True))
  fresh = _oracle_run("adagrad")["b"].params
  got = tf.convert_to_tensor(emb.variables["b"]["parameters"]).numpy()
  assert np.abs(got - fresh).max() > 1e-3  # the test can tell them apart


@pytest.mark.parametrize(
  "stacking", ["stacked", None], ids=["stacked", "alone"]
)
def test_kernels_spread_only_when_the_step_leaves_cores_idle(stacking):
  """One device: three tables alone run three chains of kernels at once
  (each its own deduplication, gather and update), one stack runs one. A
  chain's kernels spread their rows over the worker threads only while the
  chains are fewer than the cores (``kernels.ops.KernelOps.spread``)."""
  if kernels.load() is None:
    pytest.skip("the kernels did not build here")
  with tf.distribute.get_strategy().scope():
    emb = tpe.TPUEmbedding(
      _config(),
      tpe.Adagrad(0.1),
      table_stacking=_stacking(stacking, 1),
    )
  emb.build()

  @tf.function
  def step(features, weights):
    emb.enqueue(features, weights)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.add_n([tf.reduce_sum(a) for a in acts.values()])
    emb.apply_gradients(tape.gradient(loss, acts))

  graph = step.get_concrete_function(*_inputs(0)).graph
  updates = [
    o for o in graph.get_operations() if o.type == "TpeFusedSparseApply"
  ]
  chains = len(emb._engine.stacks)  # pylint: disable=protected-access
  assert len(updates) == chains == (1 if stacking else 3)
  cores = len(os.sched_getaffinity(0))
  assert {o.get_attr("spread") for o in updates} == {chains < cores}


def _values(emb):
  return {
    f"{name}/{key}": tf.convert_to_tensor(v).numpy()
    for name, variables in emb.variables.items()
    for key, v in variables.items()
  }


@pytest.mark.parametrize("before_build", [True, False], ids=["before", "after"])
@pytest.mark.parametrize(
  "saved, restored",
  [("stacked", None), (None, "stacked"), ("stacked", "stacked")],
)
def test_checkpoints_move_between_stacked_and_alone(
  saved, restored, before_build, tmp_path
):
  trained = _train("adagrad", saved, 1)
  path = tf.train.Checkpoint(embedding=trained).save(str(tmp_path / "ckpt"))
  shapes = dict(tf.train.list_variables(path))
  for name, rows in ROWS.items():  # TensorFlow's keys, full shapes
    assert shapes[f"embedding/{name}/.ATTRIBUTES/VARIABLE_VALUE"] == [rows, D]
    key = f"embedding/{name}.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"
    assert shapes[key] == [rows, D]
  assert not [k for k in shapes if "stack" in k]
  fresh = tpe.TPUEmbedding(
    _config(), tpe.Adagrad(0.5), table_stacking=_stacking(restored, 1)
  )
  if not before_build:
    fresh.build()
  status = tf.train.Checkpoint(embedding=fresh).restore(path)
  got = _values(fresh)
  status.assert_existing_objects_matched()
  for key, value in _values(trained).items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  # Training continues from the restored values.
  assert {s.stacked for s in fresh._engine.stacks} == {restored == "stacked"}  # pylint: disable=protected-access


def test_stacked_checkpoint_restores_into_tensorflow_serving(tmp_path):
  ours = _train("adagrad", "stacked", 1)
  path = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "ckpt"))
  tf_emb = tf.tpu.experimental.embedding
  tables = {
    n: tf_emb.TableConfig(ROWS[n], D, name=n, combiner=COMBINERS[n])
    for n in ROWS
  }
  serving = tf_emb.TPUEmbeddingForServing(
    {f: tf_emb.FeatureConfig(tables[t]) for f, t in FEATURE_TABLE.items()},
    tf_emb.Adagrad(0.1),
  )
  tf.train.Checkpoint(embedding=serving).restore(path).expect_partial()
  features, weights = _inputs(0)
  theirs = serving(features, weights)
  mine = ours(features, weights)
  for key in FEATURE_TABLE:
    np.testing.assert_allclose(mine[key], theirs[key], atol=1e-6, err_msg=key)


def test_stacked_views_read_write_and_report_their_own_rows():
  strategy = mirrored_strategy(2)
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      _config(),
      tpe.SGD(0.1),
      row_sharding_threshold=0,
      table_stacking=[["a", "b", "c"]],
    )
  emb.build()
  store = emb.table_stores["b"]
  # a (7 rows) then b (11) then c (5): 23 rows, blocks of 12 and 11, so b
  # spans both replicas' blocks.
  assert store.stack.table.vocabulary_size == 23 and store.offset == 7
  assert [b["parameters"].shape[0] for b in store.stack.blocks] == [12, 11]
  view = store.variables["parameters"]
  np.testing.assert_array_equal(view.numpy(), INIT["b"])
  np.testing.assert_array_equal(view[2].numpy(), INIT["b"][2])
  new = np.arange(11 * D, dtype=np.float32).reshape(11, D)
  view.assign(new)
  np.testing.assert_array_equal(tf.convert_to_tensor(view).numpy(), new)
  for name in ("a", "c"):  # the neighbours are untouched
    np.testing.assert_array_equal(
      emb.variables[name]["parameters"].numpy(), INIT[name]
    )
  with pytest.raises(ValueError, match=r"shape \[2, 3\].*\[11, 3\]"):
    view.assign(np.zeros((2, D), np.float32))
  plan = emb.sharding_plan
  assert plan.placements["b"].stack == store.stack.table.name
  assert plan.placements["b"].shard_sizes == (5, 6)
  assert plan.placements["a"].shard_sizes == (7, 0)
  assert sum(store.bytes_per_device().values()) == 11 * D * 4
  assert "stack_a_b_c" in plan.report()


def _tables(*specs):
  features = [
    tpe.FeatureConfig(tpe.TableConfig(10, dim, name=name, optimizer=opt))
    for name, dim, opt in specs
  ]
  return resolve(features, tpe.SGD(0.1)).tables


def test_auto_stacks_tables_that_update_alike():
  tables = _tables(
    ("a", 4, None),
    ("b", 8, None),
    ("c", 4, None),
    ("d", 4, tpe.Adagrad(0.1)),
    ("e", 4, tpe.Adagrad(0.1)),
    ("f", 4, tpe.Adagrad(0.2)),
  )
  stacks = plan_stacks(tables, "auto")
  assert [s.names for s in stacks] == [("a", "c"), ("b",), ("d", "e"), ("f",)]
  assert [s.offsets for s in stacks] == [(0, 10), (0,), (0, 10), (0,)]
  assert [s.names for s in plan_stacks(tables, None)] == [
    (n,) for n in "abcdef"
  ]
  assert [s.names for s in plan_stacks(tables, "auto", can_stack=False)] == [
    (n,) for n in "abcdef"
  ]
  # "auto" where it does not pay (CPUs): every table alone.
  assert [s.names for s in plan_stacks(tables, "auto", auto=False)] == [
    (n,) for n in "abcdef"
  ]
  emb = tpe.TPUEmbedding([tpe.FeatureConfig(t) for t in tables], tpe.SGD(0.1))
  assert all(not s.stacked for s in emb._engine.stacks)  # pylint: disable=protected-access
  # Different placements never stack.
  kinds = {"a": "row_sharded", "c": "replicated"}
  stacks = plan_stacks(tables, "auto", lambda t: kinds.get(t.name, "x"))
  assert ("a", "c") not in [s.names for s in stacks]


def test_explicit_stacks():
  tables = _tables(("a", 4, None), ("b", 4, None), ("c", 4, None))
  assert [s.names for s in plan_stacks(tables, [["c", "a"]])] == [
    ("c", "a"),
    ("b",),
  ]
  assert [s.names for s in plan_stacks(tables, ["a", "b"])] == [
    ("a", "b"),
    ("c",),
  ]


@pytest.mark.parametrize(
  "stacking, match",
  [
    ("yes", "must be 'auto', None or lists of table names"),
    ([["a", "zz"]], "names table 'zz', which is not among"),
    ([["a", "b"], ["b", "c"]], "puts table 'b' in more than one stack"),
    ([["a", "wide"]], "'wide' cannot be stacked with 'a': its dim is 8, not 4"),
    ([["a", "ada"]], "'ada' cannot be stacked with 'a': its optimizer"),
    ([[]], "empty stack"),
    ([[1, 2]], "must be 'auto', None or lists of table names"),
  ],
)
def test_bad_stacking_is_refused_naming_the_tables(stacking, match):
  tables = _tables(
    ("a", 4, None),
    ("b", 4, None),
    ("c", 4, None),
    ("wide", 8, None),
    ("ada", 4, tpe.Adagrad(0.1)),
  )
  with pytest.raises(ValueError, match=match):
    plan_stacks(tables, stacking)


def test_a_stack_is_placed_as_its_tables_in_the_same_pass():
  tables = _tables(("a", 4, None), ("b", 4, None), ("c", 4, None))
  planner = Planner(2, auto_stacks=True)
  planned = planner.plan(tables, PlacementPolicy(15, {"c": ROW_SHARDED}))
  assert [s.names for s in planned.stacks] == [("a", "b"), ("c",)]
  # a and b (10 rows each) are replicated: so is their stack of 20 > 15.
  assert planned.stores.placements["stack_a_b"].kind == "replicated"
  assert planned.tables.placements["b"].stack == "stack_a_b"
  assert planned.tables.placements["b"].shard_sizes == (10, 10)
  assert planned.tables.placements["c"].shard_sizes == (5, 5)
  assert "(placement fixed: c row_sharded)" in planned.tables.report()
  unknown = PlacementPolicy(15, {"a": ROW_SHARDED, "zz": ROW_SHARDED})
  with pytest.raises(ValueError, match=r"tables \['zz'\], which are not"):
    planner.plan(tables, unknown)
  assert Planner().plan(tables, unknown).tables is None  # one device


@pytest.mark.parametrize(
  "arguments, match",
  [
    ((-1,), "row_threshold must be >= 0. Received: -1"),
    ((5, {"t": "sparsecore"}), "Table 't': placement 'sparsecore' is neither"),
  ],
)
def test_bad_placement_policies_are_refused(arguments, match):
  with pytest.raises(ValueError, match=match):
    PlacementPolicy(*arguments)
  with pytest.raises(ValueError, match="row_threshold must be >= 0"):
    tpe.TPUEmbedding(  # refused where it is given, even on one device
      tpe.FeatureConfig(tpe.TableConfig(10, 2, name="t")),
      tpe.SGD(0.1),
      row_sharding_threshold=-1,
    )


def test_explicit_stacks_where_layouts_cannot_hold_them_are_refused():
  tables = _tables(("a", 4, None), ("b", 4, None))
  with pytest.raises(ValueError, match="cannot be stacked under X"):
    plan_stacks(tables, [["a", "b"]], can_stack=False, where="under X")
  with pytest.raises(ValueError, match="must be 'auto', None"):
    tpe.TPUEmbedding(
      [tpe.FeatureConfig(t) for t in tables], tpe.SGD(0.1), table_stacking=3
    )
