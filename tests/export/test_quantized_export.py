"""Quantized serving exports: float16, bfloat16 and row-wise int8 tables.

One module fixture exports the same tables (a ``sum`` table read by a
dense feature, a ``mean`` and an ``sqrtn`` table read by weighted
multi-hot features, a sequence feature) with every ``table_dtype``, and
serves the same padded requests from all four SavedModels in a process
that blocks ``tpu_embedding`` imports; ``saved_model_cli run`` serves the
int8 one and ``tools/export.py`` is given a bad ``--table_dtype`` at the
same time. The oracle (numpy, float64) computes the activations from the
float32 tables and the documented bound of each type: per element
``|x| 2**-11`` (float16), ``|x| 2**-8`` (bfloat16) and
``(row max - row min) / 510`` (int8), summed with the combiner's weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import processes
from tests.scripts import ROOT
from tpu_embedding import export
from tpu_embedding.export import FeatureSpec
from tpu_embedding.export import quantize

TYPES = ("float32", "float16", "bfloat16", "int8")
QUANTIZED = TYPES[1:]
BATCH = 64
#: table: (rows, dim, combiner)
TABLES = {
  "users": (3000, 32, "sum"),
  "tags": (1000, 64, "mean"),
  "tokens": (500, 32, "sqrtn"),
}
#: feature: (table, signature width or None for one id, weighted, sequence)
FEATURES = {
  "user": ("users", None, False, 0),
  "tags": ("tags", 5, True, 0),
  "words": ("tokens", 4, True, 0),
  "history": ("tokens", 6, False, 3),
}
SIGNATURE = {
  name: FeatureSpec([None] if width is None else [None, width], weights=w)
  for name, (_, width, w, _) in FEATURES.items()
}


def make_tables(rng) -> dict[str, np.ndarray]:
  """Rows on very different scales; a constant row; tiny and large values."""
  tables = {}
  for name, (rows, dim, _) in TABLES.items():
    row_scale = np.exp(rng.uniform(-6.0, 3.0, (rows, 1)))
    offset = rng.normal(size=(rows, 1)) * row_scale
    table = rng.normal(size=(rows, dim)) * row_scale + offset
    table[1] = 0.375  # constant: int8 stores it exactly
    table[2, ::2] = 1e-7  # below float16's normal range
    tables[name] = table.astype(np.float32)
  tables["users"][3, 0] = 5e4  # large, still a float16
  return tables


def make_feature_config(tables: dict[str, np.ndarray] | None):
  configs = {
    name: tpe.TableConfig(
      rows,
      dim,
      name=name,
      combiner=combiner,
      initializer=None
      if tables is None
      else tf.constant_initializer(tables[name]),
    )
    for name, (rows, dim, combiner) in TABLES.items()
  }
  return {
    name: tpe.FeatureConfig(configs[table], max_sequence_length=seq)
    for name, (table, _, _, seq) in FEATURES.items()
  }


def make_embedding(tables):
  features = make_feature_config(tables)
  emb = tpe.TPUEmbedding(features, tpe.SGD(0.1))
  emb.build()
  return emb, features


def make_requests(rng) -> tuple[dict[str, np.ndarray], dict[str, list]]:
  """Padded requests, and the ``(ids, weights)`` lists per example."""
  requests, lists = {}, {}
  for name, (table, width, weighted, _) in FEATURES.items():
    rows = TABLES[table][0]
    if width is None:
      ids = rng.integers(0, rows, BATCH)
      ids[:4] = [1, 2, 3, 0]  # the special rows
      requests[name] = ids.astype(np.int64)
      lists[name] = [([i], [1.0]) for i in ids]
      continue
    padded = np.full((BATCH, width), -1, np.int64)
    weights = np.full((BATCH, width), 7.0, np.float32)  # ignored at pads
    lists[name] = []
    for b in range(BATCH):
      n = 0 if b == 0 else int(rng.integers(1, width + 1))
      ids = rng.integers(0, rows, n)
      w = rng.uniform(0.2, 2.0, n).astype(np.float32)
      padded[b, :n], weights[b, :n] = ids, w
      lists[name].append((list(ids), list(w) if weighted else [1.0] * n))
    requests[name] = padded
    if weighted:
      requests[f"{name}_weights"] = weights
  return requests, lists


# --- the oracle (numpy) -------------------------------------------------------


def element_bound(table: np.ndarray, table_dtype: str) -> np.ndarray:
  """The documented per-element error bound of ``table`` in a type."""
  x = np.abs(table.astype(np.float64))
  if table_dtype == "float32":
    return np.zeros_like(x)
  if table_dtype == "float16":
    return np.maximum(x * 2.0**-11, 2.0**-25)
  if table_dtype == "bfloat16":
    return x * 2.0**-8
  spread = table.max(axis=1, keepdims=True) - table.min(axis=1, keepdims=True)
  return np.broadcast_to(spread.astype(np.float64) / 510.0, x.shape)


def oracle(tables, lists, table_dtype):
  """``{feature: (activations, bound)}`` in float64."""
  out = {}
  for name, (table_name, width, _, seq) in FEATURES.items():
    table = tables[table_name].astype(np.float64)
    bound = element_bound(tables[table_name], table_dtype)
    combiner = TABLES[table_name][2]
    acts, bounds = [], []
    for ids, weights in lists[name]:
      if seq:
        a, b = np.zeros((seq, table.shape[1])), np.zeros((seq, table.shape[1]))
        n = min(len(ids), seq)
        a[:n], b[:n] = table[ids[:n]], bound[ids[:n]]
      elif width is None:
        a, b = table[ids[0]], bound[ids[0]]
      else:
        w = np.asarray(weights, np.float64)[:, None]
        a = (w * table[ids]).sum(0) if ids else np.zeros(table.shape[1])
        b = (np.abs(w) * bound[ids]).sum(0) if ids else a * 0
        norm = {
          "sum": 1.0,
          "mean": abs(w.sum()),
          "sqrtn": np.sqrt((w**2).sum()),
        }[combiner]
        if ids:
          a, b = a / norm, b / norm
      acts.append(a)
      bounds.append(b)
    out[name] = (np.stack(acts), np.stack(bounds))
  return out


def float32_slack(tables, lists):
  """float32 arithmetic's own rounding: a few ulps of the summed rows."""
  magnitude = oracle({k: np.abs(v) for k, v in tables.items()}, lists, "int8")
  return {name: 1e-6 * a + 1e-12 for name, (a, _) in magnitude.items()}


# --- the module fixture -------------------------------------------------------

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

  def nodes(graph_def):
    yield from graph_def.node
    for function in graph_def.library.function:
      yield from function.node_def

  base, requests = sys.argv[1], dict(np.load(sys.argv[2]))
  report = {}
  for table_dtype in sys.argv[3:]:
    loaded = tf.saved_model.load(f"{base}/{table_dtype}")
    serve = loaded.signatures["serving_default"]
    specs = serve.structured_input_signature[1]
    outputs = serve(**{k: tf.constant(requests[k], specs[k].dtype)
                       for k in specs})
    np.savez(f"{base}/{table_dtype}_out.npz",
             **{k: v.numpy() for k, v in outputs.items()})
    ops = {}
    for node in nodes(serve.graph.as_graph_def()):
      if node.op in ("ReadVariableOp", "ResourceGather"):
        dtype = tf.as_dtype(node.attr["dtype"].type).name
        ops.setdefault(node.op, set()).add(dtype)
    report[table_dtype] = {
      "variables": sorted(
        [v.name, v.dtype.name, v.shape.as_list()]
        for v in tf.train.TrackableView(loaded).descendants()
        if isinstance(v, tf.Variable)),
      "ops": {op: sorted(d) for op, d in ops.items()},
    }
  report["modules"] = sorted(
    m for m in sys.modules if m.split(".")[0] == "tpu_embedding")
  print(json.dumps(report))
  """
)


def _saved_model_cli() -> list[str]:
  cli = [os.path.join(os.path.dirname(sys.executable), "saved_model_cli")]
  if not os.path.exists(cli[0]):  # a venv using the system's TensorFlow
    cli = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
  return cli


def _variables_bytes(export_dir) -> int:
  """The bytes of the SavedModel's variables/ directory, on disk."""
  folder = os.path.join(export_dir, "variables")
  return sum(
    os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
  )


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  base = tmp_path_factory.mktemp("quantized")
  rng = np.random.default_rng(33)
  tables = make_tables(rng)
  requests, lists = make_requests(rng)
  emb, features = make_embedding(tables)
  results = {
    t: export.export_for_serving(
      str(base / t), emb, None, SIGNATURE, table_dtype=t
    )
    for t in TYPES
  }
  np.savez(base / "requests.npz", **requests)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  # The tool quiets TensorFlow itself (unless the user set the level).
  tool_env = {k: v for k, v in os.environ.items() if "TF_CPP" not in k}
  exprs = ";".join(f"{k}={v.tolist()!r}" for k, v in requests.items())
  procs = {
    "load": [
      *(sys.executable, "-c", _LOADER, str(base)),
      *(str(base / "requests.npz"), *TYPES),
    ],
    "run": [
      *_saved_model_cli(),
      "run",
      "--dir",
      str(base / "int8"),
      "--tag_set",
      "serve",
      "--signature_def",
      "serving_default",
      "--input_exprs",
      exprs,
      "--outdir",
      str(base / "cli_run"),
    ],
    "bad_dtype": [
      sys.executable,
      os.path.join(ROOT, "tools", "export.py"),
      "--model_dir",
      str(base / "nothing"),
      "--export_dir",
      str(base / "never"),
      "--table_dtype",
      "int4",
    ],
  }
  running = {
    name: processes.Popen(
      cmd,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=tool_env if name == "bad_dtype" else env,
      cwd=ROOT if name == "bad_dtype" else str(base),
    )
    for name, cmd in procs.items()
  }
  finished = {}
  for name, proc in running.items():
    stdout, stderr = proc.communicate(timeout=300)
    finished[name] = (proc.returncode, stdout, stderr)
  for name in ("load", "run"):
    code, _, stderr = finished[name]
    assert code == 0, f"{name} failed:\n{stderr[-3000:]}"
  return {
    "base": base,
    "tables": tables,
    "lists": lists,
    "requests": requests,
    "emb": emb,
    "features": features,
    "results": results,
    "loaded": json.loads(finished["load"][1].strip().splitlines()[-1]),
    "served": {t: dict(np.load(base / f"{t}_out.npz")) for t in TYPES},
    "bad_dtype": finished["bad_dtype"],
  }


# --- tests --------------------------------------------------------------------


def test_float32_export_equals_the_oracle(exported):
  want = oracle(exported["tables"], exported["lists"], "float32")
  slack = float32_slack(exported["tables"], exported["lists"])
  for name, (activations, _) in want.items():
    got = exported["served"]["float32"][name]
    assert np.all(np.abs(got - activations) <= slack[name]), name


@pytest.mark.parametrize("table_dtype", QUANTIZED)
def test_activations_within_the_types_error_bound(exported, table_dtype):
  want = oracle(exported["tables"], exported["lists"], table_dtype)
  slack = float32_slack(exported["tables"], exported["lists"])
  reference = exported["served"]["float32"]
  ratios = []
  for name, (_, bound) in want.items():
    got = exported["served"][table_dtype][name].astype(np.float64)
    error = np.abs(got - reference[name])
    assert got.shape == bound.shape
    over = error > bound + slack[name]
    assert not over.any(), (
      f"{name}: {int(over.sum())} activations beyond the {table_dtype} "
      f"bound, e.g. error {error[over][0]:.3g} > {bound[over][0]:.3g}"
    )
    ratios.append(np.max(error / (bound + slack[name])))
  # Quantized for real, and the bound is not loose.
  assert max(ratios) > 0.3, ratios


def test_constant_rows_are_exact_in_int8(exported):
  served = exported["served"]["int8"]["user"]
  np.testing.assert_array_equal(served[0], np.full(32, 0.375, np.float32))


def test_table_bytes_on_disk(exported):
  sizes = {
    t: _variables_bytes(r.export_dir) for t, r in exported["results"].items()
  }
  ratio = {t: sizes[t] / sizes["float32"] for t in QUANTIZED}
  assert 0.49 < ratio["float16"] < 0.51, ratio
  assert 0.49 < ratio["bfloat16"] < 0.51, ratio
  # int8: dim bytes and a float32 scale and offset per row.
  float32 = sum(r * d * 4 for r, d, _ in TABLES.values())
  int8 = sum(r * (d + 8) for r, d, _ in TABLES.values())
  assert 0.25 < int8 / float32 < 0.31
  assert abs(ratio["int8"] - int8 / float32) < 0.01, ratio


def test_saved_models_hold_the_tables_in_their_type(exported):
  loaded = exported["loaded"]
  assert loaded["modules"] == []  # TensorFlow alone
  for name, (rows, dim, _) in TABLES.items():
    assert [f"{name}:0", "float32", [rows, dim]] in (
      loaded["float32"]["variables"]
    )
    for t in ("float16", "bfloat16"):
      assert loaded[t]["variables"] == sorted(
        [f"{n}/values:0", t, [r, d]] for n, (r, d, _) in TABLES.items()
      )
  want = []
  for name, (rows, dim, _) in TABLES.items():
    want += [
      [f"{name}/offset:0", "float32", [rows, 1]],
      [f"{name}/scale:0", "float32", [rows, 1]],
      [f"{name}/values:0", "int8", [rows, dim]],
    ]
  assert loaded["int8"]["variables"] == sorted(want)


@pytest.mark.parametrize("table_dtype", QUANTIZED)
def test_only_the_looked_up_rows_are_read_and_dequantized(
  exported, table_dtype
):
  # Every variable is a table: any whole read (ReadVariableOp) would be a
  # whole table; the rows come from gathers, dequantized after.
  ops = exported["loaded"][table_dtype]["ops"]
  assert "ReadVariableOp" not in ops, ops
  want = [table_dtype] if table_dtype != "int8" else ["float32", "int8"]
  assert ops["ResourceGather"] == sorted(want)


def test_saved_model_cli_run_equals_the_loaded_model(exported):
  for name in FEATURES:
    np.testing.assert_array_equal(
      np.load(exported["base"] / "cli_run" / f"{name}.npy"),
      exported["served"]["int8"][name],
    )


def test_quantized_serving_lookup_on_ragged_ids_equals_the_export(exported):
  lookup = export.ServingLookup(exported["emb"], copy=True, table_dtype="int8")
  ids = {
    n: tf.ragged.constant([i for i, _ in exported["lists"][n]], tf.int64)
    for n in ("tags", "words")
  }
  weights = {
    n: tf.ragged.constant([w for _, w in exported["lists"][n]], tf.float32)
    for n in ids
  }
  got = lookup(ids, weights)
  for name in ids:
    np.testing.assert_allclose(
      got[name].numpy(), exported["served"]["int8"][name], rtol=1e-6, atol=1e-7
    )


def test_unknown_table_dtype_is_one_line(exported, tmp_path):
  message = (
    "Unknown table_dtype 'int4': expected one of 'float32', 'float16', "
    "'bfloat16', 'int8'."
  )
  with pytest.raises(ValueError) as e:
    export.export_for_serving(
      str(tmp_path / "m"), exported["emb"], None, SIGNATURE, table_dtype="int4"
    )
  assert str(e.value) == message
  assert not (tmp_path / "m").exists()
  with pytest.raises(ValueError, match="needs copy=True"):
    export.ServingLookup(exported["emb"], table_dtype="int8")
  code, stdout, stderr = exported["bad_dtype"]
  assert code == 2
  assert "Traceback" not in stderr
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert len(lines) == 1, stderr
  assert "--table_dtype" in lines[0] and "'int4'" in lines[0]
  assert "float16" in lines[0] and "int8" in lines[0]


def test_float16_refuses_values_beyond_its_range(tmp_path):
  table = tpe.TableConfig(
    4, 2, name="big", initializer=tf.constant_initializer(7e4)
  )
  emb = tpe.TPUEmbedding({"f": tpe.FeatureConfig(table)}, tpe.SGD(0.1))
  emb.build()
  with pytest.raises(ValueError, match=r"Table 'big' has values up to 70000"):
    export.export_for_serving(
      str(tmp_path / "m"),
      emb,
      None,
      {"f": FeatureSpec()},
      table_dtype="float16",
    )


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("table_dtype", QUANTIZED)
def test_tables_holding_nan_or_inf_are_refused_by_name(
  tmp_path, table_dtype, value
):
  """A non-finite value has no quantized form (int8's row scale would be
  inf or nan, every value of the row lost; bfloat16 and float16 would
  serve it): the export is refused in one line naming the table, and
  nothing is written. The same rows quantized on their own (as
  ``apply_delta`` requantizes a delta's rows) are refused too."""
  good = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  bad = good.copy()
  bad[2, 1] = value
  tables = {
    name: tpe.TableConfig(
      4, 2, name=name, initializer=tf.constant_initializer(values)
    )
    for name, values in (("fine", good), ("broken", bad))
  }
  emb = tpe.TPUEmbedding(
    {name: tpe.FeatureConfig(table) for name, table in tables.items()},
    tpe.SGD(0.1),
  )
  emb.build()
  assert np.isnan(emb.table_stores["broken"].read().numpy()[2, 1]) == (
    np.isnan(value)
  )
  with pytest.raises(ValueError) as raised:
    export.export_for_serving(
      str(tmp_path / "m"),
      emb,
      None,
      {"fine": FeatureSpec(), "broken": FeatureSpec()},
      table_dtype=table_dtype,
    )
  message = str(raised.value)
  assert "\n" not in message
  assert "'broken'" in message and "non-finite" in message
  assert table_dtype in message and "'fine'" not in message
  assert not (tmp_path / "m").exists()
  with pytest.raises(ValueError, match="Table 'broken' holds non-finite"):
    quantize.quantize_rows(tf.constant(bad[1:3]), table_dtype, "broken")
  rows = quantize.quantize_rows(tf.constant(good), table_dtype, "fine")
  np.testing.assert_allclose(
    quantize.dequantize_rows(rows).numpy(), good, atol=0.02
  )


def export_spec_for_cli() -> export.ExportSpec:
  """What tools/export.py rebuilds: the tags table alone."""
  features = make_feature_config(None)
  return export.ExportSpec(
    features, {"tags": SIGNATURE["tags"]}, tables=["tags"]
  )


def test_tool_exports_int8_from_a_checkpoint(exported, tmp_path):
  checkpoint = tf.train.Checkpoint(embedding=exported["emb"]).save(
    str(tmp_path / "ckpt" / "ckpt")
  )
  spec = tmp_path / "spec.py"
  spec.write_text(
    "from tests.export.test_quantized_export import export_spec_for_cli\n\n"
    "def build():\n  return export_spec_for_cli()\n"
  )
  module_spec = importlib.util.spec_from_file_location(
    "export_tool", os.path.join(ROOT, "tools", "export.py")
  )
  tool = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(tool)
  out = tmp_path / "m"
  argv = ["--spec", f"{spec}:build", "--checkpoint", checkpoint]
  argv += ["--export_dir", str(out), "--table_dtype", "int8"]
  assert tool.main([*argv, "--json", str(tmp_path / "r.json")]) == 0
  report = json.loads((tmp_path / "r.json").read_text())
  assert (report["tables"], report["table_dtype"]) == (["tags"], "int8")
  served = tf.saved_model.load(str(out)).signatures["serving_default"]
  requests = exported["requests"]
  got = served(
    tags=tf.constant(requests["tags"]),
    tags_weights=tf.constant(requests["tags_weights"]),
  )["tags"]
  np.testing.assert_array_equal(got.numpy(), exported["served"]["int8"]["tags"])


def _load_report_tool():
  module_spec = importlib.util.spec_from_file_location(
    "quantized_export_report",
    os.path.join(ROOT, "tools", "quantized_export_report.py"),
  )
  tool = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(tool)
  return tool


def test_report_tools_auc_counts_every_pair():
  rng = np.random.default_rng(5)
  labels = rng.integers(0, 2, 300)
  scores = np.round(rng.uniform(size=300), 1)  # many ties
  pairs = scores[labels == 1][:, None] - scores[labels == 0][None, :]
  want = (np.sum(pairs > 0) + 0.5 * np.sum(pairs == 0)) / pairs.size
  got = _load_report_tool().exact_auc(labels, scores)
  assert abs(got - want) < 1e-12


@pytest.mark.parametrize("table_dtype", QUANTIZED)
def test_some_rows_quantize_as_in_the_whole_table(exported, table_dtype):
  # Row-wise: rows quantized alone (as a delta's would be) are stored
  # exactly as the whole table's; in a tf.function, within the bound.
  table = exported["tables"]["tags"]
  rows = [5, 17, 999]
  some = export.quantize_rows(tf.constant(table[rows]), table_dtype)
  whole = export.quantize_rows(tf.constant(table), table_dtype)
  for got, want in zip(some, whole, strict=True):
    if want is not None:
      np.testing.assert_array_equal(got.numpy(), tf.gather(want, rows).numpy())
  traced = tf.function(lambda r: export.quantize_rows(r, table_dtype))(
    tf.constant(table[rows])
  )
  bound = element_bound(table[rows], table_dtype)
  for quantized in (some, traced):
    error = np.abs(export.dequantize_rows(quantized).numpy() - table[rows])
    assert np.all(error <= bound * (1 + 1e-5) + 1e-7)
