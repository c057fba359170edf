"""model_garden bad_records: raise on, drop and count, or drop bad lines."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

from model_garden.ranking.data import bad_records
from model_garden.ranking.data import text_files


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
