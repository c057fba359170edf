"""model_garden bad_records: raise on, drop and count, or drop bad lines."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking import inputs
from model_garden.ranking import train
from model_garden.ranking.data import bad_records
from model_garden.ranking.data import text_files
from tests.model_garden import test_data_options as data_options


def _write(directory, name: str, lines: list[str]) -> str:
  path = os.path.join(directory, name)
  with open(path, "w") as f:
    f.write("".join(line + "\n" for line in lines))
  return path


def _chunk(lines: list[str]) -> dict[str, tf.Tensor]:
  return {
    "file": tf.constant(["data.tsv"] * len(lines)),
    "line_number": tf.range(1, len(lines) + 1, dtype=tf.int64),
    "line": tf.constant(lines),
  }


def test_count_drops_bad_records_and_counts_first_problem():
  counter = bad_records.BadRecordCounter(["columns", "label"])
  problems = tf.constant(
    [
      [False, False],
      [True, True],  # counted once, as "columns"
      [False, True],
      [False, False],
    ]
  )
  values = {
    "x": tf.constant([10, 11, 12, 13]),
    "y": tf.constant([[1], [2], [3], [4]]),
  }
  kept = bad_records.apply_bad_record_policy(
    values, problems, _chunk(["a", "b", "c", "d"]), "count", counter
  )
  assert kept["x"].numpy().tolist() == [10, 13]
  assert kept["y"].numpy().tolist() == [[1], [4]]
  assert counter.counts() == {"columns": 1, "label": 1}
  assert counter.total == 2
  counter.reset()
  assert counter.total == 0


def test_raise_names_file_line_kind_and_text():
  counter = bad_records.BadRecordCounter(["columns", "label"])
  problems = tf.constant([[False, False], [False, True], [True, False]])
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match=r"data\.tsv:2: invalid label\. The line starts with: second",
  ):
    bad_records.apply_bad_record_policy(
      tf.constant([1, 2, 3]),
      problems,
      _chunk(["first", "second", "third"]),
      "raise",
      counter,
    )
  assert counter.total == 0


def test_raise_passes_good_records_through():
  counter = bad_records.BadRecordCounter(["columns"])
  out = bad_records.apply_bad_record_policy(
    tf.constant([5, 6]), tf.zeros([2, 1], tf.bool), _chunk(["a", "b"]),
    bad_records.BadRecordPolicy.RAISE, counter,
  )  # fmt: skip
  assert out.numpy().tolist() == [5, 6]


def test_bad_record_policy_rejects_unknown_names():
  with pytest.raises(ValueError):
    bad_records.BadRecordPolicy("ignore")


def test_policy_inside_a_dataset_map(tmp_path):
  path = _write(tmp_path, "n.txt", ["1", "2", "x", "4", "y"])
  counter = bad_records.BadRecordCounter(["number"])

  def parse(chunk):
    ok = tf.strings.regex_full_match(chunk["line"], "[0-9]+")
    values = tf.strings.to_number(tf.where(ok, chunk["line"], "0"), tf.int64)
    return bad_records.apply_bad_record_policy(
      values, tf.logical_not(ok)[:, None], chunk, "count", counter
    )

  ds = text_files.numbered_lines([path], 2).map(parse).rebatch(2)
  assert [b.tolist() for b in ds.as_numpy_iterator()] == [[1, 2], [4]]
  assert counter.counts() == {"number": 2}

  raising = bad_records.BadRecordCounter(["number"])

  def parse_or_raise(chunk):
    ok = tf.strings.regex_full_match(chunk["line"], "[0-9]+")
    return bad_records.apply_bad_record_policy(
      chunk["line"], tf.logical_not(ok)[:, None], chunk, "raise", raising
    )

  with pytest.raises(tf.errors.InvalidArgumentError, match=r"n\.txt:3"):
    list(text_files.numbered_lines([path], 2).map(parse_or_raise))


def test_skip_drops_bad_records_without_counting():
  counter = bad_records.BadRecordCounter(["columns", "label"])
  problems = tf.constant([[False, False], [True, False], [False, True]])
  kept = bad_records.apply_bad_record_policy(
    tf.constant([10, 11, 12]), problems, _chunk(["a", "b", "c"]), "skip",
    counter,
  )  # fmt: skip
  assert kept.numpy().tolist() == [10]
  assert counter.total == 0
  assert bad_records.BadRecordPolicy("skip").drops
  assert not bad_records.BadRecordPolicy("raise").drops


# --- each split its own policy, in the trainer's pipelines ------------------

#: (train_data's policy, validation_data's policy).
SPLIT_POLICIES = [
  ("count", "raise"),
  ("raise", "count"),
  ("skip", "count"),
  ("count", "skip"),
]


def _split_files(directory) -> tuple[str, str, list[float], list[float]]:
  """A training file with one bad label (line 4), a validation file with
  two bad dense values (lines 3 and 7); and their good lines' first dense
  feature, in order (the oracle of what each split yields)."""
  train_good = [float(i) for i in range(16)]
  validation_good = [float(100 + i) for i in range(8)]
  train_lines = [data_options.tsv_line(dense=str(int(v))) for v in train_good]
  train_lines.insert(3, data_options.tsv_line(label="2"))
  validation_lines = [
    data_options.tsv_line(dense=str(int(v))) for v in validation_good
  ]
  validation_lines.insert(2, data_options.tsv_line(dense="x"))
  validation_lines.insert(6, data_options.tsv_line(dense="y"))
  return (
    _write(directory, "train.tsv", train_lines),
    _write(directory, "validation.tsv", validation_lines),
    train_good,
    validation_good,
  )


def _first_dense(batches) -> list[float]:
  values = np.concatenate(
    [f["dense_features"].numpy()[:, 0] for f, _ in batches]
  )
  return np.round(np.expm1(values), 3).tolist()


@pytest.mark.parametrize(
  ("train_policy", "validation_policy"),
  SPLIT_POLICIES,
  ids=[f"{t}-{v}" for t, v in SPLIT_POLICIES],
)
def test_each_split_follows_its_own_policy(
  tmp_path, train_policy, validation_policy
):
  """The trainer's config and input pipelines (``train.build_config``,
  ``inputs.RankingInputs``) with a different ``on_bad_record`` per split:
  each split raises naming its own file and line, drops and counts, or
  drops uncounted, as its own policy says; counts are per split."""
  train_file, validation_file, train_good, validation_good = _split_files(
    tmp_path
  )
  config = train.build_config(
    "dlrm_criteo_cpu_small",
    params_override=data_options.SMALL
    + f",task.validation_data.input_path={validation_file},"
    f"task.train_data.on_bad_record={train_policy},"
    f"task.validation_data.on_bad_record={validation_policy}",
    data=train_file,
  )
  pipelines = inputs.RankingInputs(config.task)
  notes = {
    "count": "bad records are dropped and counted.",
    "skip": "bad records are dropped, uncounted.",
  }
  assert pipelines.policy_notes() == [
    f"{split}: {notes[policy]}"
    for split, policy in (
      ("train_data", train_policy),
      ("validation_data", validation_policy),
    )
    if policy in notes
  ]
  cases = (
    ("train_data", train_policy, pipelines.train_dataset_fn(), train_good,
     "train.tsv:4", {"label": 1}),
    ("validation_data", validation_policy, pipelines.eval_dataset_fn(),
     validation_good, "validation.tsv:3", {"dense": 2}),
  )  # fmt: skip
  for split, policy, dataset_fn, good, first_bad, bad in cases:
    dataset = dataset_fn(None)
    if split == "train_data":
      dataset = dataset.take(2)  # one pass of the 16 good lines
    if policy == "raise":
      with pytest.raises(tf.errors.InvalidArgumentError, match=first_bad):
        list(dataset)
      assert pipelines.bad_record_counts(split) is None
      continue
    assert _first_dense(dataset) == good, split
    counts = pipelines.bad_record_counts(split)
    if policy == "skip":
      assert counts is None, split
      continue
    found = {kind: n for kind, n in counts.items() if n}
    if split == "train_data":  # read ahead: at least its one bad line
      assert set(found) == set(bad) and found["label"] >= 1, found
    else:  # one pass: exactly its own
      assert found == bad, found


def test_the_trainer_applies_each_splits_policy(tmp_path, capsys):
  """``train.main``: training raises on bad records (its file has none),
  validation counts its two: the run ends, reporting validation's."""
  _, validation_file, _, _ = _split_files(tmp_path)
  clean = _write(
    tmp_path,
    "clean.tsv",
    [data_options.tsv_line(dense=str(i)) for i in range(16)],
  )
  out = data_options.run_main(
    [
      f"--model_dir={tmp_path / 'run'}",
      f"--data={clean}",
      "--params_override="
      + data_options.SMALL
      + f",task.validation_data.input_path={validation_file},"
      "task.train_data.on_bad_record=raise,"
      "task.validation_data.on_bad_record=count",
    ],
    capsys,
  )
  assert "validation_data: bad records are dropped and counted." in out
  assert "train_data: bad records" not in out
  assert "from train_data" not in out
  assert (
    "bad records dropped from validation_data so far: 2 (dense 2)" in out
  ), out
