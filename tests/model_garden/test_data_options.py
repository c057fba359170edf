"""Ranking data options: the bad-record policy flag, the PaddleRec sample's
splits and batches, the TFRecord reader and its converter.

The end-to-end checks run ``model_garden.ranking.train.main`` in this
process, its absl flags parsed from a command line, on tiny tables.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import tensorflow as tf
from absl import flags
from tensorboard.backend.event_processing import event_accumulator

from model_garden.ranking import configs
from model_garden.ranking import inputs
from model_garden.ranking import train
from model_garden.ranking.data import criteo
from model_garden.ranking.data import criteo_tfrecord
from model_garden.ranking.data import paddlerec
from tests.scripts import run_tool

VOCAB = [97] * 26
#: Tiny tables and runs (the cpu_small model's structure).
SMALL = (
  f"task.model.vocab_sizes={VOCAB},"
  "task.train_data.global_batch_size=8,"
  "task.validation_data.global_batch_size=8,"
  "trainer.train_steps=6,"
  "trainer.checkpoint_interval=6,"
  "trainer.summary_interval=3,"
  "trainer.time_history.log_steps=3,"
  "trainer.export_saved_model=false"
)


def run_main(argv: list[str], capsys) -> str:
  """``train.main`` with these flags, in this process; returns its stdout."""
  train.define_flags()
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train", "--progress_bar=off", *argv])
  try:
    train.main([])
  finally:
    flags.FLAGS.unparse_flags()
  return capsys.readouterr().out


def tsv_line(label: str = "1", dense: str = "3", cat: str = "a1") -> str:
  return "\t".join([label] + [dense] * 13 + [cat] * 26)


def write_lines(path, lines: list[str]) -> str:
  with open(path, "w") as f:
    f.write("".join(line + "\n" for line in lines))
  return str(path)


def scalars(directory, tag: str) -> list[float]:
  """A TensorBoard scalar's values, in step order."""
  events = event_accumulator.EventAccumulator(
    str(directory), size_guidance={event_accumulator.TENSORS: 0}
  )
  events.Reload()
  if tag not in events.Tags()["tensors"]:
    return []
  return [float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]


# --- on_bad_record ---------------------------------------------------------


def test_count_policies_from_the_config_are_applied_and_reported(
  tmp_path, capsys
):
  """One run counting both splits' bad records: the training file's at
  the log steps, the validation file's after its one pass."""
  good = [tsv_line(label=str(i % 2), dense=str(i)) for i in range(40)]
  bad_label = tsv_line(label="2")
  bad_dense = tsv_line(dense="x")
  train_file = write_lines(
    tmp_path / "train.tsv", good[:3] + [tsv_line(cat="z")] + good[3:16]
  )
  validation_file = write_lines(
    tmp_path / "validation.tsv",
    good[:5] + [bad_label, bad_dense, bad_dense] + good[5:16],
  )
  model_dir = tmp_path / "run"
  out = run_main(
    [
      f"--model_dir={model_dir}",
      f"--data={train_file}",
      "--params_override="
      + SMALL
      + f",task.validation_data.input_path={validation_file},"
      "task.train_data.on_bad_record=count,"
      "task.validation_data.on_bad_record=count",
    ],
    capsys,
  )
  assert "train_data: bad records are dropped and counted." in out
  assert "validation_data: bad records are dropped and counted." in out
  # The training files repeat (and are read ahead): one bad line a pass.
  lines = [x for x in out.splitlines() if "from train_data" in x]
  assert len(lines) == 2, out  # at the log steps 3 and 6
  for line in lines:
    count = int(line.split("so far: ")[1].split(" ")[0])
    assert count >= 1 and line.endswith(f"(categorical {count})")
  totals = scalars(model_dir / "train", "bad_records/categorical")
  assert len(totals) == 2 and totals[0] >= 1 and totals[1] >= totals[0]
  # One pass over the validation file: exactly its three bad lines.
  assert (
    "bad records dropped from validation_data so far: 3 (label 1, dense 2)"
  ) in out
  assert "(16 examples" in out  # its 16 good lines, 2 batches of 8
  assert scalars(model_dir / "validation", "bad_records/total") == [3.0]
  assert scalars(model_dir / "validation", "bad_records/dense") == [2.0]
  # Each split has its own counter: the training file's bad line is not
  # the validation file's.
  assert scalars(model_dir / "validation", "bad_records/categorical") == [0.0]


def test_skip_policy_drops_bad_records_uncounted(tmp_path):
  """``skip`` from the config: the inputs drop the bad lines and keep no
  count, so the trainer (which reports ``policy_notes``,
  ``bad_record_note`` and ``bad_record_scalars``, as the run above
  shows) notes the policy and reports nothing."""
  good = [tsv_line(label=str(i % 2), dense=str(i)) for i in range(16)]
  path = write_lines(
    tmp_path / "t.tsv",
    good[:5] + [tsv_line(label="2"), tsv_line(dense="x")] + good[5:],
  )
  config = train.build_config(
    "dlrm_criteo_cpu_small",
    params_override=SMALL + ",task.train_data.on_bad_record=skip,"
    # Every record trains (none held out for validation).
    f"task.validation_data.input_path={path}",
    data=path,
  )
  pipelines = inputs.RankingInputs(config.task)
  assert pipelines.policy_notes() == [
    "train_data: bad records are dropped, uncounted."
  ]
  dataset = pipelines.train_dataset_fn()(None)
  dense = np.concatenate(
    [f["dense_features"].numpy()[:, 0] for f, _ in dataset.take(2)]
  )
  np.testing.assert_allclose(np.expm1(dense), np.arange(16.0), rtol=1e-5)
  assert pipelines.bad_record_counts("train_data") is None
  assert pipelines.bad_record_note("train_data") is None
  assert pipelines.bad_record_scalars("train_data") == {}


def test_default_policy_raises_naming_the_line(tmp_path, capsys):
  path = write_lines(tmp_path / "t.tsv", [tsv_line()] * 8 + [tsv_line("x")])
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"t\.tsv:9"):
    run_main(
      [f"--model_dir={tmp_path / 'run'}", f"--data={path}", "--mode=train",
       "--params_override=" + SMALL],
      capsys,
    )  # fmt: skip


def test_unknown_policy_is_rejected_naming_the_key():
  with pytest.raises(ValueError, match=r"task\.train_data\.on_bad_record"):
    train.build_config(
      "dlrm_criteo_cpu_small",
      params_override="task.train_data.on_bad_record=ignore",
    )


# --- the PaddleRec sample --------------------------------------------------


def test_paddlerec_defaults_to_batches_that_fit_its_splits():
  config = train.build_config("dlrm_criteo_cpu_small", data="paddlerec")
  assert config.task.train_data.global_batch_size == 16
  assert config.task.validation_data.global_batch_size == 16
  kept = train.build_config(
    "dlrm_criteo_cpu_small",
    params_override="task.train_data.global_batch_size=8,"
    "task.validation_data.global_batch_size=8",
    data="paddlerec",
  )
  assert kept.task.train_data.global_batch_size == 8
  assert kept.task.validation_data.global_batch_size == 8


def test_paddlerec_batch_too_large_says_what_to_set():
  with pytest.raises(
    ValueError,
    match=r"validation_data\.global_batch_size=32: .* 16 records "
    r"\(lines 65-80\); set it to at most 16",
  ):
    train.build_config(
      "dlrm_criteo_cpu_small",
      params_override="task.train_data.global_batch_size=32,"
      "task.validation_data.global_batch_size=32",
      data="paddlerec",
    )


def test_paddlerec_validates_on_records_it_does_not_train_on():
  config = configs.override(
    train.build_config("dlrm_criteo_cpu_small", data="paddlerec"),
    {"task.model.vocab_sizes": paddlerec.VOCAB_SIZES},
  )
  pipelines = inputs.RankingInputs(config.task)
  reader = criteo.CriteoReader(
    criteo.CriteoConfig(
      vocab_sizes=paddlerec.VOCAB_SIZES, file_format="paddlerec"
    )
  )
  every = next(iter(reader.dataset(paddlerec.find_sample_file(), 80)))
  every_dense = every[0]["dense_features"].numpy()

  def dense_of(dataset, batches):
    return np.concatenate(
      [f["dense_features"].numpy() for f, _ in dataset.take(batches)]
    )

  train_dense = dense_of(pipelines.train_dataset_fn()(None), 4)
  validation_dense = dense_of(pipelines.eval_dataset_fn()(None), 10)
  np.testing.assert_array_equal(train_dense, every_dense[:64])
  np.testing.assert_array_equal(validation_dense, every_dense[64:])


def test_paddlerec_trains_and_validates_with_the_default_batches(
  tmp_path, capsys
):
  out = run_main(
    [
      f"--model_dir={tmp_path}",
      "--data=paddlerec",
      "--params_override=trainer.train_steps=4,"
      "trainer.export_saved_model=false",
    ],
    capsys,
  )
  assert "global batch 16, paddlerec data" in out
  assert "(16 examples" in out  # the 16 validation records
  assert "Validation AUC" in out


# --- TFRecord --------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_tfrecords(tmp_path_factory):
  config = criteo.CriteoConfig(
    vocab_sizes=VOCAB, file_format="paddlerec", multi_hot_sizes=[1, 3] * 13
  )
  out = tmp_path_factory.mktemp("tfrecord")
  result = criteo_tfrecord.convert(
    paddlerec.find_sample_file(), str(out), config, num_shards=1
  )
  return config, result


def _all_batches(dataset):
  return [
    tf.nest.map_structure(lambda t: t.numpy(), batch) for batch in dataset
  ]


def test_tfrecord_reader_yields_the_text_readers_batches(sample_tfrecords):
  config, result = sample_tfrecords
  assert result.examples == 80 and result.bad_records == {}
  text = criteo.CriteoReader(config).dataset(paddlerec.find_sample_file(), 16)
  records = criteo_tfrecord.CriteoTFRecordReader(
    VOCAB, multi_hot_sizes=[1, 3] * 13
  ).dataset(result.files, 16)
  want, got = _all_batches(text), _all_batches(records)
  assert len(got) == len(want) == 5
  for (want_features, want_labels), (got_features, got_labels) in zip(
    want, got, strict=True
  ):
    np.testing.assert_array_equal(got_labels, want_labels)
    np.testing.assert_array_equal(
      got_features["dense_features"], want_features["dense_features"]
    )
    for key, ids in want_features["sparse_features"].items():
      assert got_features["sparse_features"][key].dtype == np.int32
      np.testing.assert_array_equal(got_features["sparse_features"][key], ids)
  # Multi-hot features are [B, k] (k = 3 for odd features), one-hot [B, 1].
  assert got[0][0]["sparse_features"]["1"].shape == (16, 3)


def test_tfrecord_examples_hold_model_gardens_keys(sample_tfrecords):
  _, result = sample_tfrecords
  record = next(iter(tf.data.TFRecordDataset(result.files[0])))
  example = tf.train.Example.FromString(record.numpy())
  keys = set(example.features.feature)
  assert keys == {"label"} | {f"dense-feature-{i}" for i in range(1, 14)} | {
    f"sparse-feature-{i}" for i in range(14, 40)
  }
  # The sample's first line: click:0, its first id 737395 (mod 97).
  assert example.features.feature["label"].int64_list.value == [0]
  ids = example.features.feature["sparse-feature-14"].int64_list.value
  assert list(ids) == [737395 % 97]


def test_tfrecord_bad_records_are_named_or_counted(tmp_path):
  good = criteo_tfrecord.serialize(
    {
      "dense_features": np.zeros((3, 13), np.float32),
      "sparse_features": {str(i): np.array([1, 2, 3]) for i in range(26)},
    },
    np.array([0, 1, 0]),
  )
  out_of_range = criteo_tfrecord.serialize(
    {
      "dense_features": np.zeros((1, 13), np.float32),
      "sparse_features": {str(i): np.array([97]) for i in range(26)},
    },
    np.array([1]),
  )
  path = str(tmp_path / "bad.tfrecord")
  with tf.io.TFRecordWriter(path) as writer:
    for record in good[:2] + out_of_range + good[2:]:
      writer.write(record)
  raising = criteo_tfrecord.CriteoTFRecordReader(VOCAB)
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"bad\.tfrecord:3: invalid categ"
  ):
    list(raising.dataset(path, 1))
  counting = criteo_tfrecord.CriteoTFRecordReader(VOCAB, on_bad_record="count")
  batches = _all_batches(counting.dataset(path, 3))
  assert [labels.tolist() for _, labels in batches] == [[0.0, 1.0, 0.0]]
  assert counting.bad_records.counts()["categorical"] == 1
  # A record of the wrong multi-hot length is a "columns" problem.
  wrong_length = criteo_tfrecord.CriteoTFRecordReader(
    VOCAB, multi_hot_sizes=[2] * 26, on_bad_record="count"
  )
  assert not _all_batches(wrong_length.dataset(path, 1))
  assert wrong_length.bad_records.counts()["columns"] == 4


def test_converter_tool_and_training_on_tfrecords(tmp_path, capsys):
  out_dir = tmp_path / "records"
  result = run_tool(
    "criteo_to_tfrecord.py",
    "--input=paddlerec",
    f"--output_dir={out_dir}",
    "--experiment=dlrm_criteo_cpu_small",
    "--num_shards=2",
    f"--json={tmp_path / 'result.json'}",
  )
  assert "wrote 80 examples to 2 file(s)" in result.stdout
  files = sorted(glob.glob(str(out_dir / "*.tfrecord")))
  assert len(files) == 2
  assert os.path.exists(tmp_path / "result.json")
  out = run_main(
    [
      f"--model_dir={tmp_path / 'run'}",
      "--params_override=task.use_synthetic_data=false,"
      "task.use_tf_record_reader=true,"
      f"task.train_data.input_path={out_dir}/*.tfrecord,"
      f"task.validation_data.input_path={files[1]},"
      "task.train_data.global_batch_size=8,"
      "task.validation_data.global_batch_size=8,"
      "trainer.train_steps=4,trainer.export_saved_model=false",
    ],
    capsys,
  )
  assert "tfrecord data, 4 steps" in out
  assert "(40 examples" in out  # the second file's 40 records


def test_validation_batch_must_equal_the_training_batch():
  with pytest.raises(ValueError, match=r"must equal task\.train_data"):
    train.build_config(
      "dlrm_criteo_cpu_small",
      params_override="task.validation_data.global_batch_size=1024",
    )
