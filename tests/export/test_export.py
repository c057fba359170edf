"""SavedModel export for TF Serving: real SavedModels, checked with TF alone.

One module fixture trains a ranking feature config (a dense, a weighted
multi-hot, a sequence feature on the query side; a dense and a multi-hot
feature on the candidate side) on one device and on 4 sharded replicas,
and writes the SavedModels: the ranking model (all tables), the query tower
alone (a subset), the same ranking model from the sharded run, and one via
``tools/export.py`` from a checkpoint. Three subprocesses then run at once:
``saved_model_cli show --all``, ``saved_model_cli run --input_exprs`` and a
Python loader that blocks ``tpu_embedding`` imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import processes
from tests.conftest import mirrored_strategy
from tests.scripts import ROOT
from tpu_embedding import export
from tpu_embedding.export import FeatureSpec

BATCH, STEPS = 8, 2
# In feature-config order (tf.nest sorts dict keys: genres, history, ...).
QUERY_TABLES = ("genres", "tokens", "users")
CANDIDATE_TABLES = ("items", "tags")
SHAPES = {  # table: (rows, dim)
  "users": (30, 4),
  "genres": (8, 3),  # below the row threshold: replicated
  "tokens": (25, 2),
  "items": (40, 4),
  "tags": (16, 2),
}


# --- configs, models, data ----------------------------------------------------


def make_feature_config(initial: dict[str, np.ndarray] | None = None):
  def table(name, combiner):
    rows, dim = SHAPES[name]
    init = None if initial is None else tf.constant_initializer(initial[name])
    return tpe.TableConfig(
      rows, dim, initializer=init, combiner=combiner, name=name
    )

  return {
    "user": tpe.FeatureConfig(table("users", "mean")),
    "genres": tpe.FeatureConfig(table("genres", "sqrtn")),
    "history": tpe.FeatureConfig(
      table("tokens", "mean"), max_sequence_length=3
    ),
    "item": tpe.FeatureConfig(table("items", "sum")),
    "tags": tpe.FeatureConfig(table("tags", "mean")),
  }


RANKING_SIGNATURE = {
  "user": FeatureSpec([None]),
  "genres": FeatureSpec([None, 4], weights=True),
  "history": FeatureSpec([None, None]),
  "item": FeatureSpec([None]),
  "tags": FeatureSpec([None, 3]),
  "age": tf.TensorSpec([None, 1], tf.float32),
}
QUERY_SIGNATURE = {
  k: RANKING_SIGNATURE[k] for k in ("user", "genres", "history", "age")
}


def _inputs(names):
  shapes = {
    "user": (4,),
    "genres": (3,),
    "history": (3, 2),
    "item": (4,),
    "tags": (2,),
    "age": (1,),
  }
  return {n: keras.Input(shapes[n], name=n) for n in names}


def make_ranking_model() -> keras.Model:
  inputs = _inputs(["user", "genres", "history", "item", "tags", "age"])
  flat = [
    keras.layers.Flatten()(inputs["history"]) if n == "history" else t
    for n, t in inputs.items()
  ]
  hidden = keras.layers.Dense(5, activation="relu")(
    keras.layers.Concatenate()(flat)
  )
  return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def make_query_tower() -> keras.Model:
  inputs = _inputs(["user", "genres", "history", "age"])
  flat = [
    keras.layers.Flatten()(inputs["history"]) if n == "history" else t
    for n, t in inputs.items()
  ]
  outputs = keras.layers.Dense(4)(keras.layers.Concatenate()(flat))
  return keras.Model(inputs, {"query_embedding": outputs})


def padded(rows, width, pad=-1, dtype=np.int64):
  out = np.full((len(rows), width), pad, dtype)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def make_requests(rng):
  """Padded serving inputs and their ragged equivalents."""
  genres = [list(rng.integers(0, 8, rng.integers(0, 5))) for _ in range(BATCH)]
  genres[0] = []
  genre_weights = [list(rng.uniform(0.5, 2.0, len(g))) for g in genres]
  history = [
    list(rng.integers(0, 25, rng.integers(0, 6))) for _ in range(BATCH)
  ]
  tags = [list(rng.integers(0, 16, rng.integers(0, 4))) for _ in range(BATCH)]
  requests = {
    "user": rng.integers(0, 30, BATCH).astype(np.int64),
    "genres": padded(genres, 4),
    "genres_weights": padded(genre_weights, 4, pad=9.0, dtype=np.float32),
    "history": padded(history, 6),
    "item": rng.integers(0, 40, BATCH).astype(np.int64),
    "tags": padded(tags, 3),
    "age": rng.uniform(18, 80, (BATCH, 1)).astype(np.float32),
  }

  def ragged(rows, dtype=tf.int64):
    return tf.ragged.constant(rows, dtype=dtype, ragged_rank=1)

  ids = {
    "user": tf.constant(requests["user"]),
    "genres": ragged(genres),
    "history": ragged(history),
    "item": tf.constant(requests["item"]),
    "tags": ragged(tags),
  }
  weights = {k: None for k in ids}
  weights["genres"] = ragged(genre_weights, tf.float32)
  return requests, ids, weights


def make_training_batches(rng):
  batches = []
  for _ in range(STEPS):
    _, ids, weights = make_requests(rng)
    batches.append((ids, weights))
  return batches


def projections(rng):
  dims = {"user": 4, "genres": 3, "item": 4, "tags": 2}
  proj = {
    k: tf.constant(rng.normal(size=(BATCH, d)), tf.float32)
    for k, d in dims.items()
  }
  proj["history"] = tf.constant(rng.normal(size=(BATCH, 3, 2)), tf.float32)
  return proj


def loss_fn(activations, proj):
  return sum(tf.reduce_sum(activations[k] * proj[k]) for k in sorted(proj))


def replica_slice(structure, replica, replicas):
  per = BATCH // replicas
  return tf.nest.map_structure(
    lambda t: None if t is None else t[replica * per : (replica + 1) * per],
    structure,
  )


def train(emb, batches, proj, strategy=None):
  """Adagrad steps on the global batches, on one device or sharded."""

  def replica_step(features, weights, proj):
    emb.enqueue(features, weights)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = loss_fn(activations, proj)
    emb.apply_gradients(tape.gradient(loss, activations))

  @tf.function
  def step(features, weights):
    if strategy is None:
      return replica_step(features, weights, proj)
    replicas = strategy.num_replicas_in_sync

    def replica_fn():
      r = tf.distribute.get_replica_context().replica_id_in_sync_group
      replica_step(
        *replica_slice((features, weights, proj), r, replicas),
      )

    strategy.run(replica_fn)

  for features, weights in batches:
    step(features, weights)


def make_embedding(initial, strategy=None):
  with (strategy or tf.distribute.get_strategy()).scope():
    emb = tpe.TPUEmbedding(
      make_feature_config(initial),
      tpe.Adagrad(0.2),
      row_sharding_threshold=10,
    )
  emb.build()  # not inside strategy.run
  return emb


def export_spec_for_cli() -> export.ExportSpec:
  """The spec tools/export.py rebuilds the ranking export from."""
  return export.ExportSpec(
    feature_config=make_feature_config(),
    input_signature=RANKING_SIGNATURE,
    model=make_ranking_model(),
  )


# --- the module fixture: train, export, run the subprocesses ------------------


def _load_tool():
  spec = importlib.util.spec_from_file_location(
    "export_tool", os.path.join(ROOT, "tools", "export.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_LOADER = textwrap.dedent(
  """
  import importlib.abc, json, sys
  import numpy as np

  class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
      if name.split(".")[0] == "tpu_embedding":
        raise ImportError("tpu_embedding is blocked in this process")

  sys.meta_path.insert(0, Block())
  import tensorflow as tf

  jobs = json.loads(sys.argv[1])
  report = {}
  for name, (export_dir, inputs_path, outputs_path) in jobs.items():
    loaded = tf.saved_model.load(export_dir)
    serve = loaded.signatures["serving_default"]
    inputs = dict(np.load(inputs_path))
    specs = serve.structured_input_signature[1]
    feed = {k: tf.constant(inputs[k], specs[k].dtype) for k in specs}
    np.savez(outputs_path, **{k: v.numpy() for k, v in serve(**feed).items()})
    variables = [
      (v.name, v.shape.as_list())
      for v in tf.train.TrackableView(loaded).descendants()
      if isinstance(v, tf.Variable)
    ]
    report[name] = sorted(variables)
  report["modules"] = sorted(
    m for m in sys.modules if m.split(".")[0] == "tpu_embedding"
  )
  print(json.dumps(report))
  """
)


def _input_exprs(requests) -> str:
  """Python literals (saved_model_cli casts them to the inputs' dtypes)."""
  return ";".join(f"{k}={v.tolist()!r}" for k, v in requests.items())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  base = tmp_path_factory.mktemp("export")
  rng = np.random.default_rng(7)
  initial = {
    name: rng.normal(size=shape).astype(np.float32)
    for name, shape in SHAPES.items()
  }
  batches, proj = make_training_batches(rng), projections(rng)
  requests, request_ids, request_weights = make_requests(rng)

  single = make_embedding(initial)
  train(single, batches, proj)
  sharded = make_embedding(initial, mirrored_strategy(4))
  train(sharded, batches, proj, mirrored_strategy(4))

  ranking, query = make_ranking_model(), make_query_tower()
  results = {
    "ranking": export.export_for_serving(
      str(base / "ranking"), single, ranking, RANKING_SIGNATURE
    ),
    "query": export.export_for_serving(
      str(base / "query"),
      single,
      query,
      QUERY_SIGNATURE,
      # By name and by TableConfig object.
      tables=["users", "genres", _table(single, "tokens")],
    ),
    "sharded": export.export_for_serving(
      str(base / "sharded"), sharded, ranking, RANKING_SIGNATURE
    ),
  }

  # tools/export.py from a checkpoint of the single-device run.
  checkpoint = tf.train.Checkpoint(embedding=single, model=ranking).save(
    str(base / "ckpt" / "ckpt")
  )
  spec_file = base / "serving_spec.py"
  spec_file.write_text(
    "from tests.export.test_export import export_spec_for_cli\n\n"
    "def build():\n  return export_spec_for_cli()\n"
  )
  tool = _load_tool()
  tool_args = [
    "--spec",
    f"{spec_file}:build",
    "--checkpoint",
    str(base / "ckpt"),
    "--export_dir",
    str(base / "cli"),
  ]
  assert tool.main(tool_args) == 0
  assert checkpoint

  # In-process predictions: the live lookups on ragged ids, then the model.
  single_lookup = export.ServingLookup(single)
  activations = single_lookup(request_ids, request_weights)
  dense = {"age": tf.constant(requests["age"])}
  want = {
    "ranking": ranking({**activations, **dense}).numpy(),
    "query": query(
      {
        k: v
        for k, v in {**activations, **dense}.items()
        if k in QUERY_SIGNATURE
      }
    )["query_embedding"].numpy(),
  }

  # Three subprocesses at once (2 cores): show, run, load without tpe.
  inputs_path = base / "requests.npz"
  np.savez(inputs_path, **requests)
  jobs = {
    name: [str(base / name), str(inputs_path), str(base / f"{name}_out.npz")]
    for name in ("ranking", "query", "sharded", "cli")
  }
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  cli = [os.path.join(os.path.dirname(sys.executable), "saved_model_cli")]
  if not os.path.exists(cli[0]):  # a venv using the system's TensorFlow
    cli = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
  procs = {
    "show": processes.Popen(
      [*cli, "show", "--all", "--dir", str(base / "ranking")],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    ),
    "run": processes.Popen(
      [
        *cli,
        "run",
        "--dir",
        str(base / "ranking"),
        "--tag_set",
        "serve",
        "--signature_def",
        "serving_default",
        "--input_exprs",
        _input_exprs(requests),
        "--outdir",
        str(base / "cli_run"),
        "--overwrite",
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    ),
    "load": processes.Popen(
      [sys.executable, "-c", _LOADER, json.dumps(jobs)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
      cwd=str(base),
    ),
  }
  outputs = {}
  for name, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{stderr[-3000:]}"
    outputs[name] = stdout
  loaded = json.loads(outputs["load"].strip().splitlines()[-1])
  served = {name: dict(np.load(base / f"{name}_out.npz")) for name in jobs}
  return {
    "base": base,
    "results": results,
    "single": single,
    "sharded": sharded,
    "want": want,
    "show": outputs["show"],
    "run": np.load(base / "cli_run" / "predictions.npy"),
    "loaded": loaded,
    "served": served,
    "requests": requests,
  }


def _table(emb, name):
  return next(t for t, n in emb.table_names.items() if n == name)


def _checkpoint_variables(export_dir):
  return dict(
    tf.train.list_variables(os.path.join(export_dir, "variables", "variables"))
  )


def _signature_block(show: str, name: str) -> str:
  block = show.split(f"signature_def['{name}']:")[1]
  return block.split("signature_def[")[0]


def _tensor_infos(block: str, kind: str) -> dict[str, tuple[str, str]]:
  pattern = (
    rf"{kind}\['(\w+)'\] tensor_info:\s+dtype: (\w+)\s+shape: (\([^)]*\))"
  )
  return {m[0]: (m[1], m[2]) for m in re.findall(pattern, block)}


# --- tests --------------------------------------------------------------------


def test_saved_model_cli_show_lists_the_signature(exported):
  block = _signature_block(exported["show"], "serving_default")
  assert _tensor_infos(block, "inputs") == {
    "user": ("DT_INT64", "(-1)"),
    "genres": ("DT_INT64", "(-1, 4)"),
    "genres_weights": ("DT_FLOAT", "(-1, 4)"),
    "history": ("DT_INT64", "(-1, -1)"),
    "item": ("DT_INT64", "(-1)"),
    "tags": ("DT_INT64", "(-1, 3)"),
    "age": ("DT_FLOAT", "(-1, 1)"),
  }
  assert _tensor_infos(block, "outputs") == {
    "predictions": ("DT_FLOAT", "(-1, 1)")
  }
  assert "tensorflow/serving/predict" in block


def test_saved_model_cli_run_equals_in_process_predictions(exported):
  np.testing.assert_allclose(
    exported["run"], exported["want"]["ranking"], rtol=1e-5, atol=1e-6
  )


def test_loads_and_serves_without_tpu_embedding(exported):
  assert exported["loaded"]["modules"] == []
  served = exported["served"]
  for name in ("ranking", "cli"):
    np.testing.assert_allclose(
      served[name]["predictions"],
      exported["want"]["ranking"],
      rtol=1e-5,
      atol=1e-6,
      err_msg=name,
    )
  np.testing.assert_allclose(
    served["query"]["query_embedding"],
    exported["want"]["query"],
    rtol=1e-5,
    atol=1e-6,
  )


def test_export_holds_table_copies_and_model_variables_only(exported):
  keys = _checkpoint_variables(exported["results"]["ranking"].export_dir)
  tables = {k.split("/")[1]: v for k, v in keys.items() if k.startswith("tab")}
  assert tables == {name: list(shape) for name, shape in SHAPES.items()}
  others = [k for k in keys if not k.startswith(("tables/", "model_var"))]
  assert others == ["_CHECKPOINTABLE_OBJECT_GRAPH"]
  assert not any("accumulators" in k for k in keys)
  # Copies of the trained values.
  trained = exported["single"].variables["users"]["parameters"].numpy()
  np.testing.assert_array_equal(
    tf.train.load_variable(
      os.path.join(exported["base"], "ranking", "variables", "variables"),
      "tables/users/.ATTRIBUTES/VARIABLE_VALUE",
    ),
    trained,
  )


def test_subset_export_has_no_variable_of_the_excluded_tables(exported):
  result = exported["results"]["query"]
  assert result.tables == QUERY_TABLES
  keys = _checkpoint_variables(result.export_dir)
  table_keys = sorted(k.split("/")[1] for k in keys if k.startswith("tables/"))
  assert table_keys == sorted(QUERY_TABLES)
  for excluded in CANDIDATE_TABLES:
    assert not any(excluded in k for k in keys)
  shapes = [tuple(v) for v in keys.values()]
  for excluded in CANDIDATE_TABLES:
    assert SHAPES[excluded] not in shapes
  # The loaded object (in the TF-only process) holds the same variables.
  loaded = exported["loaded"]["query"]
  loaded_tables = sorted(n.split(":")[0] for n, s in loaded if len(s) == 2)
  assert {tuple(s) for _, s in loaded} >= {SHAPES[t] for t in QUERY_TABLES}
  assert not {tuple(s) for _, s in loaded} & {
    SHAPES[t] for t in CANDIDATE_TABLES
  }
  assert not any(
    excluded in name for excluded in CANDIDATE_TABLES for name in loaded_tables
  )


# Kept and excluded tables, row-sharded (rows >= 10) and replicated.
PROOF_SHAPES = {"kept": (24, 4), "kept_small": (6, 3)}
PROOF_EXCLUDED = {"dropped": (40, 4), "dropped_small": (7, 2)}


def _saved_model_files(export_dir) -> dict[str, bytes]:
  """Every file of a SavedModel directory, as bytes."""
  files = {}
  for directory, _, names in os.walk(export_dir):
    for name in names:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        files[os.path.relpath(path, export_dir)] = f.read()
  return files


@pytest.mark.parametrize(
  "stacking", [[["kept", "dropped"]], None], ids=["stacked", "alone"]
)
@pytest.mark.parametrize("replicas", [1, 2], ids=["one_device", "sharded"])
def test_subset_export_holds_no_value_of_the_excluded_tables(
  tmp_path, replicas, stacking
):
  """The excluded tables' values are nowhere in the SavedModel's bytes.

  Not only no variable of theirs (checked by key above): no row of theirs
  in the variables, the graph (constants) or anywhere else, on one device
  and from 2 replicas with the big tables row-sharded, with the tables
  alone and stacked (kept and excluded tables in one variable). The kept
  tables' rows are found (the search works).
  """
  rng = np.random.default_rng(11)
  values = {
    name: rng.normal(size=shape).astype(np.float32)
    for name, shape in {**PROOF_SHAPES, **PROOF_EXCLUDED}.items()
  }
  config = {
    name: tpe.FeatureConfig(
      tpe.TableConfig(
        *values[name].shape,
        initializer=tf.constant_initializer(values[name]),
        name=name,
      )
    )
    for name in values
  }
  strategy = (
    mirrored_strategy(2) if replicas == 2 else tf.distribute.get_strategy()
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      config,
      tpe.Adagrad(0.1),
      row_sharding_threshold=10,
      table_stacking=stacking,
    )
  emb.build()
  held_in = {  # the store holding each table's rows (its stack's, if any)
    name: getattr(store, "stack", store).table.name
    for name, store in emb.table_stores.items()
  }
  if stacking:
    assert held_in["kept"] == held_in["dropped"] != "kept"
  if replicas == 2:
    placements = emb.backend.plan.placements
    assert placements[held_in["kept"]].sharded
    assert placements[held_in["dropped"]].sharded
    assert not placements[held_in["dropped_small"]].sharded
  result = export.export_for_serving(
    str(tmp_path / "subset"),
    emb,
    None,
    {name: FeatureSpec([None]) for name in PROOF_SHAPES},
    tables=sorted(PROOF_SHAPES),
  )
  assert result.tables == tuple(sorted(PROOF_SHAPES))

  files = _saved_model_files(result.export_dir)
  assert "saved_model.pb" in files
  assert any(name.startswith("variables/variables.data") for name in files)

  def rows_found(table: np.ndarray) -> tuple[bool, list[int]]:
    """Whether the whole table's bytes are in a file; which rows' are."""
    whole = any(table.tobytes() in data for data in files.values())
    rows = [
      i
      for i, row in enumerate(table)
      if any(row.tobytes() in data for data in files.values())
    ]
    return whole, rows

  for name in PROOF_SHAPES:  # the search works: every kept row is found
    whole, rows = rows_found(values[name].astype("<f4"))
    assert whole and rows == list(range(len(values[name]))), (name, rows)
  for name in PROOF_EXCLUDED:  # float32 (and float64 constants, to be safe)
    for dtype in ("<f4", "<f8"):
      whole, rows = rows_found(values[name].astype(dtype))
      assert not whole and not rows, f"{name} rows {rows} ({dtype}) leaked"


def test_two_tower_query_tower_signature(exported):
  result = exported["results"]["query"]
  assert sorted(result.inputs) == [
    "age",
    "genres",
    "genres_weights",
    "history",
    "user",
  ]
  assert {k: v.shape.as_list() for k, v in result.outputs.items()} == {
    "query_embedding": [None, 4]
  }


def test_sharded_training_exports_the_single_device_model(exported):
  single = _checkpoint_variables(exported["results"]["ranking"].export_dir)
  sharded = _checkpoint_variables(exported["results"]["sharded"].export_dir)
  assert single == sharded
  base = exported["base"]
  for name in SHAPES:
    key = f"tables/{name}/.ATTRIBUTES/VARIABLE_VALUE"
    np.testing.assert_allclose(
      tf.train.load_variable(str(base / "sharded/variables/variables"), key),
      tf.train.load_variable(str(base / "ranking/variables/variables"), key),
      atol=1e-5,
      err_msg=name,
    )
  np.testing.assert_allclose(
    exported["served"]["sharded"]["predictions"],
    exported["served"]["ranking"]["predictions"],
    atol=1e-5,
  )
  # The sharded embedding really was sharded (and genres replicated).
  plan = exported["sharded"].sharding_plan
  assert plan.placements["users"].sharded
  assert not plan.placements["genres"].sharded


def test_live_lookup_of_a_sharded_subset_equals_single_device(exported):
  ids = tf.constant([29, 0, 17, 3, 17], tf.int64)
  sharded = export.ServingLookup(exported["sharded"], tables=["users"])
  single = export.ServingLookup(exported["single"], tables=["users"])
  np.testing.assert_allclose(
    sharded({"user": ids})["user"], single({"user": ids})["user"], atol=1e-5
  )
  with pytest.raises(ValueError, match="not among the selected tables"):
    sharded({"item": ids})


# --- semantics: the padded convention equals serving_embedding_lookup ---------


def test_activations_equal_serving_embedding_lookup(tmp_path, rng):
  values = {n: rng.normal(size=(10, 2)).astype(np.float32) for n in "smq"}
  tables = {
    n: tpe.TableConfig(
      10, 2, initializer=tf.constant_initializer(values[n]), combiner=c
    )
    for n, c in (("s", "sum"), ("m", "mean"), ("q", "sqrtn"))
  }
  config = {
    "s": tpe.FeatureConfig(tables["s"]),
    "m": tpe.FeatureConfig(tables["m"]),
    "q": tpe.FeatureConfig(tables["q"]),
    "seq": tpe.FeatureConfig(tables["m"], max_sequence_length=2),
    "d": tpe.FeatureConfig(tables["q"]),
    "nv": tpe.FeatureConfig(tables["s"], validate_weights_and_indices=False),
  }
  serving = tpe.TPUEmbeddingForServing(config, optimizer=None)
  rows = [[1, 2, 2], [], [9, -3], [0]]  # -3: dropped by the safe lookup
  weights = [[0.5, 2.0, 1.0], [], [1.5, 1.0], [0.0]]
  ids, w = padded(rows, 4), padded(weights, 4, 7.0, np.float32)
  signature = {
    n: FeatureSpec([None, None], weights=True) for n in ("s", "m", "q")
  }
  signature["seq"] = FeatureSpec([None, 4])
  signature["d"] = FeatureSpec([None], tf.int32)
  signature["nv"] = FeatureSpec([None, 4], weights=True)
  result = export.export_for_serving(
    str(tmp_path / "act"), serving, None, signature
  )
  assert {k: v.shape.as_list() for k, v in result.outputs.items()} == {
    "s": [None, 2],
    "m": [None, 2],
    "q": [None, 2],
    "seq": [None, 2, 2],
    "d": [None, 2],
    "nv": [None, 2],
  }
  serve = tf.saved_model.load(result.export_dir).signatures["serving_default"]
  nv_rows, nv_weights = (
    [[1, 2], [], [9], [0, 4]],
    [[1.0, 0.5], [], [2.0], [1, 1]],
  )
  feed = {n: tf.constant(ids) for n in ("s", "m", "q")}
  feed.update({f"{n}_weights": tf.constant(w) for n in ("s", "m", "q")})
  feed["seq"] = tf.constant(padded([[3, 4, 5], [], [6], [7, 8]], 4))
  feed["d"] = tf.constant([1, 0, 9, 4], tf.int32)
  feed["nv"] = tf.constant(padded(nv_rows, 4))
  feed["nv_weights"] = tf.constant(padded(nv_weights, 4, 0.0, np.float32))
  got = serve(**feed)

  def sparse(rows, dtype=tf.int64):
    indices = [[i, j] for i, row in enumerate(rows) for j in range(len(row))]
    flat = [v for row in rows for v in row]
    return tf.SparseTensor(
      tf.constant(indices, tf.int64, [len(indices), 2]),
      tf.constant(flat, dtype),
      [len(rows), 4],
    )

  inputs = {n: sparse(rows) for n in ("s", "m", "q")}
  inputs["seq"] = sparse([[3, 4, 5], [], [6], [7, 8]])
  inputs["d"] = tf.constant([1, 0, 9, 4], tf.int32)
  inputs["nv"] = sparse(nv_rows)
  in_weights = {n: sparse(weights, tf.float32) for n in ("s", "m", "q")}
  in_weights.update(seq=None, d=None, nv=sparse(nv_weights, tf.float32))
  want = tpe.serving_embedding_lookup(
    inputs, in_weights, serving.embedding_tables, config
  )
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, atol=1e-6, err_msg=name)
  np.testing.assert_array_equal(got["m"][1], [0.0, 0.0])  # an empty row
  with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
    serve(**{**feed, "d": tf.constant([1, 0, 10, 4], tf.int32)})


def test_tf_module_model_and_list_outputs(tmp_path):
  class Scale(tf.Module):
    def __init__(self):
      self.scale = tf.Variable(3.0)

    def __call__(self, inputs):
      return [inputs["u"] * self.scale, inputs["n"] + 1.0]

  table = tpe.TableConfig(5, 2, initializer=tpe.RowIdInitializer())
  serving = tpe.TPUEmbeddingForServing({"u": tpe.FeatureConfig(table)}, None)
  result = export.export_for_serving(
    str(tmp_path / "m"),
    serving,
    Scale(),
    {"u": FeatureSpec([None]), "n": tf.TensorSpec([None], tf.float32)},
  )
  assert sorted(result.outputs) == ["predictions_0", "predictions_1"]
  keys = _checkpoint_variables(result.export_dir)
  assert sorted(k for k in keys if k != "_CHECKPOINTABLE_OBJECT_GRAPH") == [
    "model_variables/0/.ATTRIBUTES/VARIABLE_VALUE",
    "tables/table_0/.ATTRIBUTES/VARIABLE_VALUE",
  ]
  serve = tf.saved_model.load(result.export_dir).signatures["serving_default"]
  got = serve(u=tf.constant([4, 1], tf.int64), n=tf.constant([1.0, 2.0]))
  np.testing.assert_allclose(got["predictions_0"], [[12, 12], [3, 3]])
  np.testing.assert_allclose(got["predictions_1"], [2, 3])


# --- errors -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
  config = make_feature_config()
  return tpe.TPUEmbedding(config, tpe.SGD(0.1)), config


def test_unknown_table_in_the_subset(small, tmp_path):
  emb, _ = small
  with pytest.raises(ValueError, match=r"Unknown table 'nope'.*'users'"):
    export.export_for_serving(
      str(tmp_path), emb, None, {"user": FeatureSpec()}, tables=["nope"]
    )
  other = tpe.TableConfig(30, 4, name="users")
  with pytest.raises(ValueError, match="not a table of this embedding"):
    export.ServingLookup(emb, tables=[other])


def test_signature_feature_of_a_table_not_exported(small, tmp_path):
  emb, _ = small
  with pytest.raises(
    ValueError, match=r"'item' is looked up in table 'items'.*not among"
  ):
    export.export_for_serving(
      str(tmp_path),
      emb,
      None,
      {"user": FeatureSpec(), "item": FeatureSpec()},
      tables=QUERY_TABLES,
    )


def test_feature_missing_from_the_input(small, tmp_path):
  emb, _ = small
  with pytest.raises(ValueError, match=r"reads input 'age'.*missing"):
    export.export_for_serving(
      str(tmp_path),
      emb,
      make_query_tower(),
      {k: v for k, v in QUERY_SIGNATURE.items() if k != "age"},
    )
  with pytest.raises(ValueError, match=r"reads input 'genres'.*missing"):
    export.export_for_serving(
      str(tmp_path),
      emb,
      lambda x: x["user"] + x["genres"][:, :1],
      {"user": FeatureSpec()},
    )
  with pytest.raises(ValueError, match="Unknown feature 'usr'"):
    export.export_for_serving(str(tmp_path), emb, None, {"usr": FeatureSpec()})


def test_model_reading_the_embedding_itself_is_refused(small, tmp_path):
  emb, config = small
  table = emb.embedding_tables[config["user"].table]
  with pytest.raises(ValueError, match="reads the embedding's table 'users'"):
    export.export_for_serving(
      str(tmp_path),
      emb,
      lambda x: x["user"] + table[0],
      {"user": FeatureSpec()},
    )
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
  "signature, match",
  [
    ({"history": FeatureSpec()}, "sequence feature"),
    ({"history": FeatureSpec([None, 3], weights=True)}, "takes no weights"),
    ({"user": tf.TensorSpec([None], tf.float32)}, "dtype must be"),
    ({"user": FeatureSpec(feature="a/b")}, "Unknown feature 'a/b'"),
    ({"a/b": FeatureSpec(feature="user")}, "must start with a letter"),
    (
      {"genres": FeatureSpec([None, 2], weights=True), "genres_weights": 1},
      "used twice",
    ),
    ({"user": FeatureSpec(), "age": tf.TensorSpec([None])}, "need a model"),
  ],
)
def test_invalid_signatures(small, tmp_path, signature, match):
  emb, _ = small
  with pytest.raises((ValueError, TypeError), match=match):
    export.export_for_serving(str(tmp_path), emb, None, signature)


def test_invalid_feature_specs():
  with pytest.raises(ValueError, match="rank-1 id tensor"):
    FeatureSpec([None], weights=True)
  with pytest.raises(ValueError, match="dtype must be"):
    FeatureSpec([None], tf.float32)
  with pytest.raises(ValueError, match=r"shape must be \[batch\]"):
    FeatureSpec([])


def test_tool_reports_bad_tables_and_keys(exported, capsys):
  tool = _load_tool()
  base = exported["base"]
  common = ["--spec", f"{base / 'serving_spec.py'}:build"]
  common += ["--checkpoint", str(base / "ckpt")]
  assert (
    tool.main([*common, "--export_dir", str(base / "x"), "--tables", "nope"])
    == 1
  )
  assert "Unknown table 'nope'" in capsys.readouterr().err
  assert tool.main([*common, "--export_dir", str(base / "cli")]) == 1
  assert "not empty" in capsys.readouterr().err
  # A subset: only the query tables are restored and written.
  query_spec = base / "query_spec.py"
  query_spec.write_text(
    "from tests.export.test_export import QUERY_SIGNATURE\n"
    "from tests.export.test_export import make_feature_config\n"
    "from tests.export.test_export import make_query_tower\n"
    "from tpu_embedding.export import ExportSpec\n\n"
    "def build():\n"
    "  return ExportSpec(make_feature_config(), QUERY_SIGNATURE,\n"
    "                    make_query_tower(), model_key=None)\n"
  )
  argv = ["--spec", f"{query_spec}:build", "--checkpoint", str(base / "ckpt")]
  argv += ["--export_dir", str(base / "cli_query"), "--tables"]
  argv += [",".join(QUERY_TABLES)]
  assert tool.main(argv) == 0
  out = capsys.readouterr().out
  assert "tables: genres, tokens, users" in out
  assert "output query_embedding: float32 [None, 4]" in out
  keys = _checkpoint_variables(str(base / "cli_query"))
  assert sorted(k.split("/")[1] for k in keys if k.startswith("tables/")) == (
    sorted(QUERY_TABLES)
  )
  np.testing.assert_array_equal(
    tf.train.load_variable(
      str(base / "cli_query/variables/variables"),
      "tables/tokens/.ATTRIBUTES/VARIABLE_VALUE",
    ),
    exported["single"].variables["tokens"]["parameters"].numpy(),
  )
