"""``tools/export.py --apply_delta``: fresh SavedModel versions from deltas.

One module fixture trains two tables (Adagrad: the deltas hold slots too)
and two small models (a ranker on both tables, a tower on one), writes a
full checkpoint at step 1, then a delta and, as the oracle, a full
checkpoint (TensorFlow's own ``write``) at steps 2 and 3, and a delta of
another run. Version 1 is exported from step 1 (float32, both tables; and
int8, the tower's table only). Each version made by ``--apply_delta``
equals an export of the full checkpoint at the delta's step: every
variable bit for bit, the signature's outputs on a batch, the tables'
values against the checkpoint (numpy). Refusals leave version 1 as it was
and no new directory; a write killed by the file-size limit leaves the
previous versions intact and the next run cleans up after it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import resource
import sys

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import processes
from tests.scripts import ROOT
from tests.scripts import run_tool
from tpu_embedding import export
from tpu_embedding.checkpointing.parts import save_id

SHAPES = {"users": (40, 4), "items": (30, 3)}  # table: (rows, dim)
BATCH = 4
VARIABLES = os.path.join("variables", "variables")


# --- models, specs, training --------------------------------------------------


def feature_config(seed: int = 0) -> dict[str, tpe.FeatureConfig]:
  init = tf.random_uniform_initializer(-1.0, 1.0, seed=seed)
  tables = {
    name: tpe.TableConfig(rows, dim, name=name, initializer=init)
    for name, (rows, dim) in SHAPES.items()
  }
  return {
    "user": tpe.FeatureConfig(tables["users"]),
    "item": tpe.FeatureConfig(tables["items"]),
  }


class Ranker(tf.Module):
  """Both features' activations, concatenated, to one score."""

  def __init__(self, seed: int = 0):
    super().__init__()
    rng = np.random.default_rng(seed)
    dims = sum(dim for _, dim in SHAPES.values())
    self.kernel = tf.Variable(rng.normal(size=[dims, 1]).astype(np.float32))
    self.bias = tf.Variable(tf.zeros([1]))

  def __call__(self, inputs):
    both = tf.concat([inputs["user"], inputs["item"]], axis=1)
    return both @ self.kernel + self.bias


class Tower(tf.Module):
  """The user's activation to a 2-d query embedding."""

  def __init__(self, seed: int = 0):
    super().__init__()
    rng = np.random.default_rng(seed + 1)
    shape = [SHAPES["users"][1], 2]
    self.kernel = tf.Variable(rng.normal(size=shape).astype(np.float32))

  def __call__(self, inputs):
    return {"query": inputs["user"] @ self.kernel}


def ranker_spec() -> export.ExportSpec:
  return export.ExportSpec(
    feature_config(),
    {"user": export.FeatureSpec(), "item": export.FeatureSpec()},
    model=Ranker(),
  )


def tower_spec() -> export.ExportSpec:
  return export.ExportSpec(
    feature_config(),
    {"user": export.FeatureSpec()},
    model=Tower(),
    tables=["users"],
    model_key="tower",
  )


def _trainer(emb, models):
  variables = [v for m in models for v in m.trainable_variables]

  @tf.function
  def step(batch):
    emb.enqueue(batch, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(models[0](acts) ** 2) + tf.reduce_sum(
        models[1](acts)["query"] ** 2
      )
    grads = tape.gradient(loss, {"acts": acts, "dense": variables})
    emb.apply_gradients(grads["acts"])
    for variable, grad in zip(variables, grads["dense"], strict=True):
      variable.assign_sub(0.05 * grad)

  return step


def _train_run(directory, seed, steps_between=2, saves=3):
  """Full checkpoint ``ckpt-1``; ``delta-<n>`` and the oracle ``full-<n>``
  (TensorFlow's write: not in the chain) for n = 2 .. saves."""
  rng = np.random.default_rng(seed)
  emb = tpe.TPUEmbedding(feature_config(seed), tpe.Adagrad(0.2))
  emb.build()
  models = [Ranker(seed), Tower(seed)]
  checkpoint = tf.train.Checkpoint(
    embedding=emb, model=models[0], tower=models[1]
  )
  step = _trainer(emb, models)

  def train():
    for _ in range(steps_between):
      step(
        {
          "user": tf.constant(rng.integers(0, 40, BATCH), tf.int64),
          "item": tf.constant(rng.integers(0, 30, BATCH), tf.int64),
        }
      )

  train()
  paths = {1: tpe.checkpoints.write(checkpoint, f"{directory}/ckpt-1")}
  for n in range(2, saves + 1):
    train()
    delta = tpe.checkpoints.write_delta(checkpoint, f"{directory}/delta-{n}")
    checkpoint.write(f"{directory}/full-{n}")
    paths[n] = delta
  return paths


def _load_tool():
  spec = importlib.util.spec_from_file_location(
    "export_tool_apply_delta", os.path.join(ROOT, "tools", "export.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  base = tmp_path_factory.mktemp("apply_delta")
  paths = _train_run(base / "run", seed=0)
  other = _train_run(base / "other", seed=1, saves=2)
  spec_file = base / "specs.py"
  spec_file.write_text(
    "from tests.export.test_apply_delta import ranker_spec, tower_spec\n"
  )
  tool = _load_tool()

  def export_checkpoint(checkpoint, export_dir, tower=False):
    args = [
      "--spec",
      f"{spec_file}:{'tower_spec' if tower else 'ranker_spec'}",
      "--checkpoint",
      str(checkpoint),
      "--export_dir",
      str(export_dir),
    ]
    assert tool.main(args + (["--table_dtype", "int8"] if tower else [])) == 0

  for n, checkpoint in ((1, base / "run" / "ckpt-1"),) + tuple(
    (n, base / "run" / f"full-{n}") for n in (2, 3)
  ):
    kind = "v" if n == 1 else "full"
    export_checkpoint(checkpoint, base / f"f32_{kind}" / str(n))
    export_checkpoint(checkpoint, base / f"int8_{kind}" / str(n), tower=True)
  v1_files = _files(base / "f32_v" / "1")
  # The float32 version 2 by the tool in its own process (TensorFlow alone).
  applied = run_tool(
    "export.py",
    "--apply_delta",
    paths[2],
    "--base_export",
    str(base / "f32_v" / "1"),
    "--export_dir",
    str(base / "f32_v" / "2"),
    "--json",
    str(base / "f32_2.json"),
  )
  assert (
    tool.main(
      [
        "--apply_delta",
        paths[2],
        "--base_export",
        str(base / "int8_v" / "1"),
        "--export_dir",
        str(base / "int8_v" / "2"),
      ]
    )
    == 0
  )
  for kind in ("f32", "int8"):
    assert (
      tool.main(
        [
          "--apply_delta",
          paths[3],
          "--base_export",
          str(base / f"{kind}_v" / "2"),
          "--export_dir",
          str(base / f"{kind}_v" / "3"),
        ]
      )
      == 0
    )
  return {
    "base": base,
    "paths": paths,
    "other": other,
    "tool": tool,
    "applied": applied,
    "json": json.loads((base / "f32_2.json").read_text()),
    "v1_files": v1_files,
  }


# --- helpers ------------------------------------------------------------------


def _files(directory) -> dict[str, str]:
  """``{relative path: sha256}`` of every file under ``directory``."""
  found = {}
  for folder, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      found[os.path.relpath(path, directory)] = digest
  return found


def _variables(export_dir) -> dict[str, np.ndarray]:
  reader = tf.train.load_checkpoint(os.path.join(str(export_dir), VARIABLES))
  return {
    key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
  }


def _assert_bit_equal(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert got[key].dtype == value.dtype, key
    assert got[key].shape == value.shape, key
    assert got[key].tobytes() == value.tobytes(), key


def _by_source_key(export_dir) -> dict[str, np.ndarray]:
  """The SavedModel's table and model variables, keyed by what they are:
  ``tables/...`` as saved (named by table), model variables by their
  training checkpoint key (an export may list them in another order)."""
  saved = _variables(export_dir)
  record = export.read_source(str(export_dir))
  named = {key: saved.pop(key) for key in list(saved) if key.startswith("tab")}
  named.update({t: saved.pop(s) for t, s in record["model"].items()})
  assert list(saved) == ["_CHECKPOINTABLE_OBJECT_GRAPH"]
  return named


def _assert_same_export(got_dir, want_dir) -> None:
  _assert_bit_equal(_by_source_key(got_dir), _by_source_key(want_dir))


def _checkpoint_table(path, name) -> np.ndarray:
  return tf.train.load_variable(
    str(path), f"embedding/{name}/.ATTRIBUTES/VARIABLE_VALUE"
  )


def _request(seed=3):
  rng = np.random.default_rng(seed)
  return {
    "user": tf.constant(rng.integers(0, 40, 16), tf.int64),
    "item": tf.constant(rng.integers(0, 30, 16), tf.int64),
  }


def _serve(export_dir, names):
  serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
  request = _request()
  return {
    k: v.numpy() for k, v in serve(**{n: request[n] for n in names}).items()
  }


def _quantize_oracle(rows: np.ndarray) -> dict[str, np.ndarray]:
  """Row-wise int8 in numpy (``quantize``'s formulas, float32)."""
  low = rows.min(axis=1, keepdims=True)
  scale = (rows.max(axis=1, keepdims=True) - low) / np.float32(255.0)
  with np.errstate(divide="ignore"):
    inverse = np.where(scale == 0, 0, np.float32(1.0) / scale)
  steps = np.clip(np.round((rows - low) * inverse.astype(np.float32)), 0, 255)
  return {
    "values": (steps - 128).astype(np.int8),
    "scale": scale,
    "offset": low + np.float32(128.0) * scale,
  }


# --- tests --------------------------------------------------------------------


@pytest.mark.parametrize("step", [2, 3])
def test_float32_version_equals_a_full_export_bit_for_bit(run, step):
  base = run["base"]
  _assert_same_export(base / "f32_v" / str(step), base / "f32_full" / str(step))
  got = _by_source_key(base / "f32_v" / str(step))
  # Against the checkpoint itself (numpy), and not vacuous: rows changed.
  for name in SHAPES:
    key = f"tables/{name}/.ATTRIBUTES/VARIABLE_VALUE"
    want = _checkpoint_table(base / "run" / f"full-{step}", name)
    np.testing.assert_array_equal(got[key], want)
    before = _variables(base / "f32_v" / str(step - 1))[key]
    assert (before != want).any(axis=1).sum() > 0  # rows changed
  before = _by_source_key(base / "f32_v" / str(step - 1))
  kernel = "model/kernel/.ATTRIBUTES/VARIABLE_VALUE"
  assert not np.array_equal(before[kernel], got[kernel])
  np.testing.assert_array_equal(
    got[kernel],
    tf.train.load_variable(str(base / "run" / f"full-{step}"), kernel),
  )


def test_int8_subset_version_equals_a_full_int8_export(run):
  base = run["base"]
  for step in (2, 3):
    _assert_same_export(
      base / "int8_v" / str(step), base / "int8_full" / str(step)
    )
    got = _variables(base / "int8_v" / str(step))
    assert not any("items" in key for key in got)  # not exported: ignored
    table = _checkpoint_table(base / "run" / f"full-{step}", "users")
    for part, want in _quantize_oracle(table).items():
      np.testing.assert_array_equal(
        got[f"tables/users/{part}/.ATTRIBUTES/VARIABLE_VALUE"], want, part
      )


@pytest.mark.parametrize(
  ("kind", "names"), [("f32", ("user", "item")), ("int8", ("user",))]
)
def test_signature_outputs_equal_a_full_export(run, kind, names):
  base = run["base"]
  for step in (2, 3):
    got = _serve(base / f"{kind}_v" / str(step), names)
    want = _serve(base / f"{kind}_full" / str(step), names)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_versions_record_their_source(run):
  base, paths = run["base"], run["paths"]
  v1 = export.read_source(str(base / "f32_v" / "1"))
  assert v1["source"] == save_id(paths[1])
  assert v1["history"] == ["ckpt-1"]
  v3 = export.read_source(str(base / "f32_v" / "3"))
  assert v3["source"] == save_id(paths[3])
  assert v3["history"] == ["ckpt-1", "delta-2", "delta-3"]
  assert sorted(v3["model"]) == [
    "model/bias/.ATTRIBUTES/VARIABLE_VALUE",
    "model/kernel/.ATTRIBUTES/VARIABLE_VALUE",
  ]
  assert all(k.startswith("model_variables/") for k in v3["model"].values())
  assert v3["unmapped_model_variables"] == 0
  # The tool's report: the rows the delta holds (those that changed).
  report = run["json"]
  assert report["source"] == save_id(paths[2])
  assert report["parent"] == v1["source"]
  for name in SHAPES:
    before = _checkpoint_table(paths[1], name)
    after = _checkpoint_table(base / "run" / "full-2", name)
    changed = int((before != after).any(axis=1).sum())
    assert report["rows"][name] == changed
  assert report["model_variables"] == 2
  assert not [p for p in os.listdir(base / "f32_v") if "_temp" in p]


def _assert_refused(run, stderr: str, names: list[str]) -> None:
  lines = [line for line in stderr.strip().splitlines() if line.strip()]
  last = lines[-1]
  assert "Traceback" not in stderr
  for name in names:
    assert name in last, (name, last)
  base = run["base"]
  assert _files(base / "f32_v" / "1") == run["v1_files"]
  assert sorted(os.listdir(base / "f32_v")) == ["1", "2", "3"]


def test_a_skipped_delta_is_refused_in_one_line(run):
  paths = run["paths"]
  process = run_tool(
    "export.py",
    "--apply_delta",
    paths[3],
    "--base_export",
    str(run["base"] / "f32_v" / "1"),
    "--export_dir",
    str(run["base"] / "f32_v" / "9"),
    returncode=1,
  )
  _assert_refused(
    run,
    process.stderr,
    [
      save_id(paths[2]),  # the delta's parent
      save_id(paths[1]),  # version 1's source
      "delta-3",
    ],
  )


def _main(run, capsys, *args) -> tuple[int, str]:
  capsys.readouterr()
  code = run["tool"].main(list(args))
  return code, capsys.readouterr().err


def test_another_runs_delta_is_refused_in_one_line(run, capsys):
  other = run["other"]
  code, err = _main(
    run,
    capsys,
    "--apply_delta",
    other[2],
    "--base_export",
    str(run["base"] / "f32_v" / "1"),
    "--export_dir",
    str(run["base"] / "f32_v" / "9"),
  )
  assert code == 1
  _assert_refused(
    run,
    err,
    [
      save_id(other[1]),
      save_id(run["paths"][1]),
    ],
  )


@pytest.mark.parametrize(
  ("args", "code", "names"),
  [
    (["--base_export", "{v1}"], 2, ["--apply_delta", "--base_export"]),
    (["--apply_delta", "{d2}"], 2, ["--base_export"]),
    (
      ["--apply_delta", "{d2}", "--base_export", "{v1}", "--spec", "x:y"],
      2,
      ["--spec"],
    ),
    (
      ["--apply_delta", "{full2}", "--base_export", "{v1}"],
      1,
      ["full-2", "is not a delta checkpoint"],
    ),
    (
      ["--apply_delta", "{d2}", "--base_export", "{plain}"],
      1,
      ["records no source"],
    ),
    (
      ["--apply_delta", "{d2}", "--base_export", "{v1}", "--tables", "users"],
      2,
      ["--tables"],
    ),
  ],
)
def test_usage_and_input_errors(run, capsys, tmp_path, args, code, names):
  base = run["base"]
  plain = tmp_path / "plain"
  if "{plain}" in args:  # an export that records no source
    emb = tpe.TPUEmbedding(feature_config(), tpe.SGD(0.1))
    export.export_for_serving(
      str(plain), emb, None, {"user": export.FeatureSpec()}
    )
  values = {
    "v1": str(base / "f32_v" / "1"),
    "d2": run["paths"][2],
    "full2": str(base / "run" / "full-2"),
    "plain": str(plain),
  }
  args = [a.format(**values) for a in args]
  got, err = _main(
    run, capsys, *args, "--export_dir", str(base / "f32_v" / "9")
  )
  assert got == code, err
  _assert_refused(run, err, names)


def test_a_non_empty_export_dir_needs_overwrite(run, capsys):
  base, paths = run["base"], run["paths"]
  args = [
    "--apply_delta",
    paths[2],
    "--base_export",
    str(base / "f32_v" / "1"),
    "--export_dir",
    str(base / "f32_v" / "3"),
  ]
  before = _files(base / "f32_v" / "3")
  code, err = _main(run, capsys, *args)
  assert code == 1 and "--overwrite" in err
  assert _files(base / "f32_v" / "3") == before
  # With --overwrite: version 3 becomes version 1 plus delta 2 (= 2).
  code, err = _main(run, capsys, *args, "--overwrite")
  assert code == 0, err
  _assert_same_export(base / "f32_v" / "3", base / "f32_v" / "2")
  assert not [p for p in os.listdir(base / "f32_v") if "_" in p]
  # Back to the chain's version 3, for the other tests.
  assert (
    _main(
      run,
      capsys,
      "--apply_delta",
      paths[3],
      "--base_export",
      str(base / "f32_v" / "2"),
      "--export_dir",
      str(base / "f32_v" / "3"),
      "--overwrite",
    )[0]
    == 0
  )


def test_a_failed_write_leaves_the_previous_versions(run, capsys):
  base, paths = run["base"], run["paths"]
  target = base / "int8_v" / "7"
  args = [
    "--apply_delta",
    paths[2],
    "--base_export",
    str(base / "int8_v" / "1"),
    "--export_dir",
    str(target),
  ]
  before = _files(base / "int8_v" / "1")

  def limit_file_size():  # a file beyond 1 KiB fails to be written
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

  process = processes.run(
    [sys.executable, os.path.join(ROOT, "tools", "export.py"), *args],
    capture_output=True,
    text=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONDONTWRITEBYTECODE="1"),
    preexec_fn=limit_file_size,
    timeout=300,
    check=False,
  )
  assert process.returncode == 1, process.stderr
  assert "Traceback" not in process.stderr
  last = process.stderr.strip().splitlines()[-1]
  assert "File too large" in last and "previous versions are as they" in last
  assert _files(base / "int8_v" / "1") == before
  assert sorted(os.listdir(base / "int8_v")) == ["1", "2", "3"]
  # A killed write leaves its temporary directory (never loaded by TF
  # Serving: not a number); the next run removes it and writes the version.
  (target.parent / "7_temp" / "variables").mkdir(parents=True)
  (target.parent / "7_temp" / "saved_model.pb").write_bytes(b"partial")
  code, err = _main(run, capsys, *args)
  assert code == 0, err
  assert sorted(os.listdir(base / "int8_v")) == ["1", "2", "3", "7"]
  _assert_same_export(target, base / "int8_full" / "2")


def test_dynamic_vocabulary_tables_are_refused_in_one_line(
  run, capsys, tmp_path
):
  table = tpe.TableConfig(
    16,
    2,
    name="dyn",
    vocabulary=tpe.DynamicVocabulary(bucket_size=4),
  )
  emb = tpe.TPUEmbedding({"key": tpe.FeatureConfig(table)}, tpe.SGD(0.1))
  emb.build()
  checkpoint = tf.train.Checkpoint(embedding=emb)

  @tf.function
  def step(keys):
    emb.enqueue({"key": keys}, training=True)
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, emb.dequeue()))

  step(tf.constant([1000, 1001], tf.int64))
  full = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-1"))
  export.export_for_serving(
    str(tmp_path / "1"),
    emb,
    None,
    {"key": export.FeatureSpec()},
    source=export.ExportSource(full, checkpoint),
  )
  step(tf.constant([1002, 1003], tf.int64))
  delta = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-2"))
  code, err = _main(
    run,
    capsys,
    "--apply_delta",
    delta,
    "--base_export",
    str(tmp_path / "1"),
    "--export_dir",
    str(tmp_path / "2"),
  )
  assert code == 1
  assert "DynamicVocabulary" in err.strip().splitlines()[-1]
  assert "dyn" in err.strip().splitlines()[-1]
  assert not (tmp_path / "2").exists()
  assert not (tmp_path / "2_temp").exists()


# --- one changed row, and deltas of another model ---------------------------


def _one_run(directory, table_dtype):
  """A fresh embedding and ranker, ``ckpt-1`` and version 1 from it."""
  emb = tpe.TPUEmbedding(feature_config(), tpe.Adagrad(0.2))
  emb.build()
  model = Ranker()
  checkpoint = tf.train.Checkpoint(embedding=emb, model=model)
  full = tpe.checkpoints.write(checkpoint, str(directory / "ckpt-1"))
  signature = {"user": export.FeatureSpec(), "item": export.FeatureSpec()}
  export.export_for_serving(
    str(directory / "v" / "1"),
    emb,
    model,
    signature,
    table_dtype=table_dtype,
    source=export.ExportSource(full, checkpoint),
  )
  return emb, model, checkpoint, full, signature


@pytest.mark.parametrize("table_dtype", ["float32", "int8"])
def test_a_delta_of_exactly_one_changed_row(tmp_path, table_dtype):
  """One row of one table written since ``ckpt-1``: the new version is
  version 1 with that row rewritten (requantized for int8: numpy's
  formulas), bit for bit everything else, and equals a fresh export of
  the live state."""
  emb, model, checkpoint, _, signature = _one_run(tmp_path, table_dtype)
  row = np.array([[0.5, -1.25, 2.0, 0.125]], np.float32)
  emb.table_stores["users"].write_rows(7, tf.constant(row))
  delta = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-2"))
  result = export.apply_delta(
    str(tmp_path / "v" / "1"), delta, str(tmp_path / "v" / "2")
  )
  assert result.rows == {"users": 1, "items": 0}
  before = _by_source_key(tmp_path / "v" / "1")
  got = _by_source_key(tmp_path / "v" / "2")
  if table_dtype == "float32":
    parts = {"values": row}
  else:
    parts = _quantize_oracle(row)
  record = export.read_source(str(tmp_path / "v" / "1"))
  written = {
    key: part for part, key in record["tables"]["users"]["variables"].items()
  }
  assert sorted(written.values()) == sorted(parts)
  assert sorted(got) == sorted(before)
  for key, value in got.items():
    want = before[key].copy()
    if key in written:
      want[7] = parts[written[key]][0]
    assert value.tobytes() == want.tobytes(), key
  fresh = tmp_path / "fresh"
  export.export_for_serving(
    str(fresh),
    emb,
    model,
    signature,
    table_dtype=table_dtype,
    source=export.ExportSource(
      tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-3")), checkpoint
    ),
  )
  _assert_same_export(tmp_path / "v" / "2", fresh)


@pytest.mark.parametrize(
  ("shape", "row", "words"),
  [
    ((40, 5), 3, ["shape (1, 5)", "rows have 4 values"]),
    ((45, 4), 42, ["writes row 42", "has 40 rows"]),
    ((41, 4), 40, ["writes row 40", "has 40 rows"]),
  ],
  ids=["wider", "rows_past_the_end", "one_past_the_end"],
)
def test_a_delta_of_another_model_is_refused_and_nothing_written(
  tmp_path, capsys, shape, row, words
):
  """A delta naming version 1's source as its parent but written by a
  model whose ``users`` table is wider or longer: one line naming the
  delta and the table, exit 1 from the tool, nothing written."""
  _one_run(tmp_path, "float32")
  config = feature_config()
  config["user"].table = tpe.TableConfig(*shape, name="users")
  other = tpe.TPUEmbedding(config, tpe.Adagrad(0.2))
  other.build()
  checkpoint = tf.train.Checkpoint(embedding=other, model=Ranker())
  tpe.checkpoints.write(checkpoint, str(tmp_path / "other-1"))
  other.table_stores["users"].write_rows(row, tf.ones([1, shape[1]]))
  delta = tpe.checkpoints.write_delta(
    checkpoint, str(tmp_path / "delta-2"), previous=str(tmp_path / "ckpt-1")
  )
  version_1 = _files(tmp_path / "v" / "1")
  target = tmp_path / "v" / "2"
  with pytest.raises(ValueError) as raised:
    export.apply_delta(str(tmp_path / "v" / "1"), delta, str(target))
  message = str(raised.value)
  assert "\n" not in message
  for word in [delta, "'users'", "not a delta of this model", *words]:
    assert word in message, (word, message)
  capsys.readouterr()
  code = _load_tool().main(
    [
      "--apply_delta",
      delta,
      "--base_export",
      str(tmp_path / "v" / "1"),
      "--export_dir",
      str(target),
    ]
  )
  err = capsys.readouterr().err
  assert code == 1
  assert "Traceback" not in err
  assert err.strip().splitlines()[-1] == message
  assert _files(tmp_path / "v" / "1") == version_1
  assert sorted(os.listdir(tmp_path / "v")) == ["1"]
