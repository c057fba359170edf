"""Validation held out of the training files (``task.holdout_every``).

Given training files alone (``--data GLOB``, or
``task.train_data.input_path``), the trainer validates on records ``N,
2N, ...`` of each file and trains on the others: the splits are disjoint
and together the whole data, for TSV and TFRecord files; the log says
which split validates and how; validation that reads the training files
themselves is warned about.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from model_garden.ranking import inputs
from model_garden.ranking import train
from model_garden.ranking.data import criteo_tfrecord
from model_garden.ranking.data import text_files
from tests.model_garden.test_data_options import run_main

VOCAB = [97] * 26
#: Two files of 40 records: every 10th held out, 72 train and 8 validate.
FILES, RECORDS, EVERY = 2, 40, 10
SMALL = (
  f"task.model.vocab_sizes={VOCAB},"
  "task.train_data.global_batch_size=8,"
  "task.validation_data.global_batch_size=8,"
  "trainer.train_steps=2,"
  "trainer.checkpoint_interval=2,"
  "trainer.validation_interval=2,"
  "trainer.export_saved_model=false"
)


def tsv_line(label: int, dense: int) -> str:
  return "\t".join([str(label)] + [str(dense)] * 13 + ["a1"] * 26)


def tsv_files(directory) -> str:
  """``FILES`` TSV files whose records' dense values are all distinct;
  returns their glob."""
  for f in range(FILES):
    with open(directory / f"day_{f}.tsv", "w") as out:
      for i in range(RECORDS):
        out.write(tsv_line(i % 2, f * RECORDS + i) + "\n")
  return str(directory / "day_*.tsv")


def tfrecord_files(directory) -> str:
  """The same records as TFRecord files; returns their glob."""
  for f in range(FILES):
    values = np.arange(f * RECORDS, (f + 1) * RECORDS, dtype=np.float32)
    features = {
      "dense_features": np.repeat(values[:, None], 13, axis=1),
      "sparse_features": {
        str(i): np.zeros(RECORDS, np.int64) for i in range(26)
      },
    }
    examples = criteo_tfrecord.serialize(features, np.arange(RECORDS) % 2)
    with tf.io.TFRecordWriter(str(directory / f"day_{f}.tfrecord")) as w:
      for example in examples:
        w.write(example)
  return str(directory / "day_*.tfrecord")


def first_dense(ds: tf.data.Dataset, batches: int | None = None) -> list:
  """The first dense feature of each example of ``batches`` batches."""
  if batches is not None:
    ds = ds.take(batches)
  return [
    float(v)
    for features, _ in ds.as_numpy_iterator()
    for v in features["dense_features"][:, 0]
  ]


@pytest.mark.parametrize("kind", ["tsv", "tfrecord"])
def test_training_files_alone_split_into_disjoint_parts_of_the_whole(
  kind, tmp_path
):
  if kind == "tsv":
    config = train.build_config(
      "dlrm_criteo_cpu_small", params_override=SMALL, data=tsv_files(tmp_path)
    )
  else:
    config = train.build_config(
      "dlrm_criteo_cpu_small",
      params_override=SMALL + ",task.use_synthetic_data=false,"
      "task.use_tf_record_reader=true,"
      f"task.train_data.input_path={tfrecord_files(tmp_path)}",
    )
  task = config.task
  assert task.holdout_every == EVERY and not task.validation_data.input_path
  splits = inputs.RankingInputs(task)
  held = RECORDS // EVERY * FILES
  # One pass of the (endless) training data: its batches of 8.
  trained = first_dense(
    splits.train_dataset_fn()(None), (FILES * RECORDS - held) // 8
  )
  validated = first_dense(splits.eval_dataset_fn()(None))
  assert len(validated) == held and len(set(validated)) == held
  assert len(set(trained)) == len(trained) == FILES * RECORDS - held
  assert not set(trained) & set(validated)
  # Together the whole data, as a reader of every record sees it.
  reader = splits._reader("train_data")
  whole = first_dense(
    reader.dataset(task.train_data.input_path, 8, drop_remainder=False)
  )
  assert sorted(trained + validated) == sorted(whole)
  assert len(whole) == FILES * RECORDS
  # The held-out records are each file's 10th, 20th, ...: the second and
  # the fourth of 40 per file.
  per_file = sorted(whole)
  expected = [per_file[f * RECORDS + n - 1] for f in range(FILES)
              for n in range(EVERY, RECORDS + 1, EVERY)]  # fmt: skip
  assert sorted(validated) == sorted(expected)


def test_holdout_selects_whole_and_disjoint_record_numbers(tmp_path):
  path = tmp_path / "f.txt"
  path.write_text("".join(f"{i}\n" for i in range(1, 24)))

  def read(validation: bool) -> list[int]:
    chunks = text_files.Holdout(5, validation).select(
      text_files.numbered_lines([str(path)], 4)
    )
    return [int(n) for c in chunks.as_numpy_iterator() for n in c["line"]]

  assert read(True) == [5, 10, 15, 20]
  assert read(False) == [n for n in range(1, 24) if n % 5]
  with pytest.raises(ValueError, match="must be > 1"):
    text_files.Holdout(1, True)


def test_the_trainer_says_which_split_validates(tmp_path, capsys):
  pattern = tsv_files(tmp_path)
  model_dir = tmp_path / "run"
  out = run_main(
    [
      f"--model_dir={model_dir}",
      f"--data={pattern}",
      f"--params_override={SMALL}",
    ],
    capsys,
  )
  assert (
    f"Validation split: records 10, 20, 30, ... of each file of {pattern}, "
    "held out of training (task.holdout_every=10)."
  ) in out.splitlines()
  assert "(8 examples" in out  # the 8 held-out records, one pass
  assert "Warning" not in out
  with open(model_dir / "params.yaml") as f:
    params = json.load(f)
  assert params["task"]["holdout_every"] == 10
  assert params["task"]["validation_data"]["input_path"] == ""
  # --help says so too.
  assert "held out of training" in flags.FLAGS["data"].help


def test_validation_on_the_training_files_is_warned_about(tmp_path, capsys):
  pattern = tsv_files(tmp_path)
  out = run_main(
    [
      f"--model_dir={tmp_path / 'run'}",
      f"--data={pattern}",
      f"--params_override={SMALL},task.validation_data.input_path={pattern}",
    ],
    capsys,
  )
  warnings = [line for line in out.splitlines() if "Warning" in line]
  assert warnings == [
    "Warning: task.validation_data.input_path reads the training files: "
    "validation metrics would measure records the model trained on; remove "
    "it to validate on records held out of the training files "
    "(task.holdout_every), or name other files."
  ]
  assert "Validation split" not in out


def test_holdout_and_a_validation_path_contradict():
  with pytest.raises(ValueError, match="remove one of them"):
    train.build_config(
      "dlrm_criteo_cpu_small",
      params_override="task.holdout_every=5,"
      "task.validation_data.input_path=/v/*.tsv",
      data="/t/*.tsv",
    )
