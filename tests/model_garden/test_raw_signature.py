"""The exported ranking model's ``serving_raw`` signature: a Criteo line's
fields as they are, preprocessed as the trainer reads TSV files.

A trainer run on raw TSV files (made by the synthetic generator) exports
its SavedModel; lines it never trained on (synthetic, plus edge cases:
upper-case, 16-digit and 1-digit hex, leading zeros, negative, huge and
missing counts, missing values) are read by the trainer's own input
pipeline (``inputs.RankingInputs``) and evaluated by the restored model
in-process, the reference. Then:

* ``serving_raw``'s preprocessing gives the pipeline's features exactly
  (dense values and ids, bit for bit);
* ``serving_raw`` fed the lines' fields serves what ``serving_default``
  serves fed the pipeline's features, bit for bit (one concrete function
  on identical inputs), and the trainer's predictions within 1e-6 (the
  same float32 weights and inputs; only TensorFlow's kernels differ
  between the eager model and the SavedModel's graph: summation order);
* ``saved_model_cli run`` with the fields of two lines does too;
* ``tools/export.py --model_dir`` writes both, also as int8 tables;
* a multi-hot model (``dlrm_dcn_v2_criteo_cpu_small``) expands the raw
  ids as training does;
* a field the reader rejects fails the request naming the row.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking import configs
from model_garden.ranking import inputs
from model_garden.ranking import saved_model
from model_garden.ranking.configs import params_file
from model_garden.ranking.data import synthetic
from model_garden.ranking.task import RankingTask
from tests import processes
from tests.model_garden.test_train import finish
from tests.model_garden.test_train import start
from tests.scripts import run_tool

STEPS = 12
PARAMS = (
  "task.train_data.global_batch_size=64,"
  f"trainer.train_steps={STEPS},"
  f"trainer.validation_interval={STEPS},"
  "trainer.optimizer_config.lr_config.learning_rate=20,"
  "trainer.optimizer_config.lr_config.warmup_steps=2"
)


def _edge_lines(line: str) -> list[str]:
  """Variants of a TSV line with the values the parser must get right."""
  fields = line.split("\t")
  variants = []
  for counts, cats in (
    ({1: "-5", 2: "123456789012345678"}, {0: "68FD1E64", 1: "0"}),
    ({1: "", 5: "0"}, {2: "ffffffffffffffff", 3: "000000ab", 4: ""}),
    ({i: "" for i in range(1, 14)}, {i: "" for i in range(26)}),
    ({3: "007"}, {25: "FfFfFfFf0", 19: "a"}),
  ):
    new = list(fields)
    for i, value in counts.items():
      new[i] = value
    for i, value in cats.items():
      new[14 + i] = value
    variants.append("\t".join(new))
  return variants


def _fields(lines):
  rows = [line.split("\t") for line in lines]
  return {
    "counts": np.array([r[1:14] for r in rows], object),
    "categorical": np.array([r[14:] for r in rows], object),
  }


def _pipeline_batch(config, path, count):
  """The trainer's own input pipeline over ``path``: one batch."""
  task = configs.override(
    config,
    {
      "task.use_synthetic_data": False,
      "task.use_tf_record_reader": False,
      "task.data_format": "tsv",
      "task.holdout_every": 0,
      "task.train_data.input_path": path,
      "task.validation_data.input_path": path,
      "task.validation_data.global_batch_size": count,
    },
  ).task
  dataset = inputs.RankingInputs(task).eval_dataset_fn()(None)
  batches = list(dataset)
  assert len(batches) == 1
  return batches[0][0]


def _trainer_predictions(config, checkpoint, features):
  """What the trainer's evaluation computes on ``features``."""
  trained = RankingTask(config, tf.distribute.get_strategy())
  trained.checkpoint.restore(checkpoint).assert_existing_objects_matched()
  activations = trained.embedding(features["sparse_features"])
  logits = trained._logits(  # noqa: SLF001  (the evaluation's own path)
    features["dense_features"], activations, training=False
  )
  return tf.sigmoid(logits).numpy()


def _default_request(features):
  """``serving_default``'s inputs: the pipeline's features as they are."""
  request = {"dense_features": features["dense_features"]}
  for key, ids in features["sparse_features"].items():
    if isinstance(ids, tf.SparseTensor):
      ids = tf.sparse.to_dense(ids)  # every multi-hot id is there
    request[saved_model.input_name(int(key))] = tf.cast(ids, tf.int64)
  return request


def _signatures(export_dir):
  loaded = tf.saved_model.load(str(export_dir))
  return loaded.signatures["serving_raw"], loaded.signatures["serving_default"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("raw")
  config = configs.get_config("dlrm_criteo_cpu_small")
  generator = synthetic.SyntheticCriteo(config.task.model.vocab_sizes, seed=7)
  generator.write_tsv(str(root / "data"), 2000, num_shards=2)
  lines = generator.tsv_lines(5000, 200)
  lines += _edge_lines(lines[0]) + _edge_lines(lines[1])
  compare = root / "compare.tsv"
  compare.write_text("".join(line + "\n" for line in lines))
  model_dir = root / "run"
  process = start(
    [
      sys.executable,
      "-m",
      "model_garden.ranking.train",
      "--experiment=dlrm_criteo_cpu_small",
      f"--model_dir={model_dir}",
      f"--data={root / 'data'}/criteo-*.tsv",
      f"--params_override={PARAMS}",
      "--seed=3",
      "--mode=train",
    ],
    root,
  )
  code, stdout, stderr = finish(process, timeout=400)
  assert code == 0, f"{stdout[-2000:]}\n{stderr[-3000:]}"
  config = params_file.read_params(str(model_dir))
  features = _pipeline_batch(config, str(compare), len(lines))
  return {
    "root": root,
    "config": config,
    "model_dir": model_dir,
    "export_dir": model_dir / "saved_model" / str(STEPS),
    "lines": lines,
    "compare": str(compare),
    "features": features,
    "want": _trainer_predictions(
      config, tf.train.latest_checkpoint(str(model_dir)), features
    ),
  }


def test_raw_preprocessing_gives_the_pipelines_features_exactly(run):
  raw = saved_model.raw_preprocessing(run["config"])
  got = raw.preprocess(
    {k: tf.constant(v.tolist()) for k, v in _fields(run["lines"]).items()}
  )
  want = _default_request(run["features"])
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key].numpy(), value.numpy(), key)
  # The edge lines are there: missing (id 0), 16-digit hex, big counts.
  ids = got["sparse_2"].numpy()
  vocab = run["config"].task.model.vocab_sizes[2]
  assert (2**64 - 1) % vocab in ids[-8:]
  dense = got["dense_features"].numpy()
  assert dense[-8, 0] == 0.0  # "-5" counts as 0
  assert np.isclose(dense[-8, 1], np.log(123456789012345678 + 1))


def test_both_signatures_serve_the_trainers_predictions(run):
  serve_raw, serve_default = _signatures(run["export_dir"])
  fields = _fields(run["lines"])
  raw = serve_raw(
    counts=tf.constant(fields["counts"].tolist()),
    categorical=tf.constant(fields["categorical"].tolist()),
  )["predictions"].numpy()
  default = serve_default(**_default_request(run["features"]))[
    "predictions"
  ].numpy()
  np.testing.assert_array_equal(raw, default)
  np.testing.assert_allclose(raw, run["want"], rtol=0, atol=1e-6)
  assert raw.std() > 1e-3  # a trained model, not a constant


def test_saved_model_cli_runs_the_raw_signature_on_a_lines_fields(run):
  cli = [os.path.join(os.path.dirname(sys.executable), "saved_model_cli")]
  if not os.path.exists(cli[0]):  # a venv using the system's TensorFlow
    cli = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
  fields = _fields(run["lines"][-5:-3])
  exprs = ";".join(f"{k}={v.tolist()!r}" for k, v in fields.items())
  outdir = run["root"] / "cli"
  process = processes.run(
    [
      *cli,
      "run",
      "--dir",
      str(run["export_dir"]),
      "--tag_set",
      "serve",
      "--signature_def",
      "serving_raw",
      "--input_exprs",
      exprs,
      "--outdir",
      str(outdir),
    ],
    capture_output=True,
    text=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    timeout=300,
    check=False,
  )
  assert process.returncode == 0, process.stderr[-3000:]
  got = np.load(outdir / "predictions.npy")
  np.testing.assert_allclose(got, run["want"][-5:-3], rtol=0, atol=1e-6)


def test_a_field_the_reader_rejects_fails_the_request_naming_its_row(run):
  serve_raw, _ = _signatures(run["export_dir"])
  fields = _fields(run["lines"][:3])
  fields["categorical"][2, 4] = "xyz"
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"(?s)reader rejects.*Rows.*\[2\]"
  ):
    serve_raw(
      counts=tf.constant(fields["counts"].tolist()),
      categorical=tf.constant(fields["categorical"].tolist()),
    )


def test_the_export_tool_writes_both_signatures_int8_too(run):
  export_dir = run["root"] / "int8"
  done = run_tool(
    "export.py",
    "--model_dir",
    str(run["model_dir"]),
    "--export_dir",
    str(export_dir),
    "--table_dtype",
    "int8",
  )
  assert "signature 'serving_raw':" in done.stdout
  serve_raw, serve_default = _signatures(export_dir)
  fields = _fields(run["lines"])
  raw = serve_raw(
    counts=tf.constant(fields["counts"].tolist()),
    categorical=tf.constant(fields["categorical"].tolist()),
  )["predictions"].numpy()
  default = serve_default(**_default_request(run["features"]))
  np.testing.assert_array_equal(raw, default["predictions"].numpy())
  np.testing.assert_allclose(raw, run["want"], rtol=0, atol=0.05)


def test_a_multi_hot_model_expands_raw_ids_as_training_does(run, tmp_path):
  config = configs.override(
    configs.get_config("dlrm_dcn_v2_criteo_cpu_small"),
    {"task.model.vocab_sizes": list(run["config"].task.model.vocab_sizes)},
  )
  assert config.task.model.use_multi_hot
  model = RankingTask(config, tf.distribute.get_strategy())
  checkpoint = model.checkpoint.save(str(tmp_path / "ckpt"))
  saved_model.export_from_checkpoint(config, checkpoint, str(tmp_path / "m"))
  features = _pipeline_batch(config, run["compare"], len(run["lines"]))
  want = _trainer_predictions(config, checkpoint, features)
  serve_raw, serve_default = _signatures(tmp_path / "m")
  fields = _fields(run["lines"])
  raw = serve_raw(
    counts=tf.constant(fields["counts"].tolist()),
    categorical=tf.constant(fields["categorical"].tolist()),
  )["predictions"].numpy()
  default = serve_default(**_default_request(features))["predictions"]
  np.testing.assert_array_equal(raw, default.numpy())
  np.testing.assert_allclose(raw, want, rtol=0, atol=1e-6)


def test_paddlerec_models_get_no_raw_signature():
  config = configs.override(
    configs.get_config("dlrm_criteo_cpu_small"),
    {"task.use_synthetic_data": False, "task.data_format": "paddlerec"},
  )
  assert saved_model.raw_preprocessing(config) is None
  tfrecords = configs.override(config, {"task.use_tf_record_reader": True})
  assert saved_model.raw_preprocessing(tfrecords) is not None
