"""Criteo reader: the real PaddleRec sample, raw TSV, bad lines, multi-hot."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking.data import criteo
from model_garden.ranking.data import hashing
from model_garden.ranking.data import multi_hot
from model_garden.ranking.data import paddlerec

VOCAB = (1000,) * 26


def _read_all(ds: tf.data.Dataset):
  """Concatenates a dataset's batches into numpy arrays."""
  dense, labels, sparse = [], [], {str(i): [] for i in range(26)}
  for features, label in ds:
    dense.append(features["dense_features"].numpy())
    labels.append(label.numpy())
    for key, ids in features["sparse_features"].items():
      sparse[key].append(ids.numpy())
  return (
    np.concatenate(dense),
    np.concatenate(labels),
    {k: np.concatenate(v) for k, v in sparse.items()},
  )


# --- The real 80-record sample shipped by paddle-rec 0.1.0 -----------------


@pytest.fixture(scope="module")
def sample_rows() -> list[list[tuple[str, str]]]:
  """The sample, split by hand: 40 (slot, value) pairs per line."""
  with open(paddlerec.find_sample_file()) as f:
    lines = f.read().splitlines()
  return [[tuple(t.split(":", 1)) for t in line.split(" ")] for line in lines]


def _paddle_reader(**kwargs) -> criteo.CriteoReader:
  config = dict(vocab_sizes=paddlerec.VOCAB_SIZES, file_format="paddlerec")
  config.update(kwargs)
  return criteo.CriteoReader(criteo.CriteoConfig(**config))


def test_sample_file_is_found_and_has_80_records(sample_rows):
  assert paddlerec.find_sample_file().endswith(
    os.path.join("sample_data", "train", "sample_train.txt")
  )
  assert len(sample_rows) == 80
  assert all(len(row) == 40 for row in sample_rows)


def test_sample_rows_parse_to_the_values_in_the_text(sample_rows):
  reader = _paddle_reader(dense_transform="none")
  ds = reader.dataset(paddlerec.find_sample_file(), 80, deterministic=True)
  dense, labels, sparse = _read_all(ds)
  assert labels.shape == (80,) and dense.shape == (80, 13)
  for r in (0, 1, 41, 79):
    row = sample_rows[r]
    assert labels[r] == float(row[0][1])
    np.testing.assert_array_equal(
      dense[r], np.array([float(v) for _, v in row[1:14]], np.float32)
    )
    for i in range(26):
      assert sparse[str(i)][r] == int(row[14 + i][1])
  # A few values read off the file by eye.
  assert labels[:2].tolist() == [0.0, 1.0]
  assert dense[0, 1] == np.float32(0.00497512437811)
  assert sparse["0"][1] == 715353 and sparse["25"][1] == 187951
  assert labels.sum() == sum(row[0][1] == "1" for row in sample_rows) == 23
  assert reader.bad_records.total == 0


def test_sample_log_transform_recovers_the_raw_counts(sample_rows):
  reader = _paddle_reader()
  dense, _, _ = _read_all(reader.dataset(paddlerec.find_sample_file(), 80))
  for r in (0, 1, 79):
    for i, (_, value) in enumerate(sample_rows[r][1:14]):
      count = float(value) * paddlerec.CONT_DIFF[i] + paddlerec.CONT_MIN[i]
      assert abs(count - round(count)) < 1e-6  # The scaling is exact.
      want = np.float32(math.log(max(round(count), 0) + 1))
      assert dense[r, i] == want
  # Row 1's second count is 0.932006633499 * 603 - 3 = 559.
  assert dense[1, 1] == np.float32(math.log(560))


def test_sample_ids_fold_into_smaller_vocabularies(sample_rows):
  vocab = tuple(range(1000, 1026))
  reader = _paddle_reader(vocab_sizes=vocab)
  _, _, sparse = _read_all(reader.dataset(paddlerec.find_sample_file(), 40))
  for i in range(26):
    raw = np.array([int(row[14 + i][1]) for row in sample_rows])
    np.testing.assert_array_equal(sparse[str(i)], raw % vocab[i])


def test_sample_missing_values_hash_to_python2_ids(sample_rows):
  missing = paddlerec.paddlerec_missing_ids()
  assert len(set(missing)) == 26
  # Criteo's C19, C20, C22, C25, C26 are often empty; their "missing" id
  # is the most frequent one in the sample.
  for feature in (18, 19, 21, 24, 25):
    column = [int(row[14 + feature][1]) for row in sample_rows]
    most_common = max(set(column), key=column.count)
    assert most_common == missing[feature]
    assert column.count(most_common) > 30


def test_python2_hash_matches_known_values():
  assert paddlerec.python2_str_hash("") == 0
  assert paddlerec.python2_str_hash("a") == 12416037344
  assert paddlerec.python2_str_hash("14") % paddlerec.HASH_DIM == 25204


def test_sample_distributes_over_input_pipelines():
  reader = _paddle_reader()
  fn = reader.dataset_fn(paddlerec.find_sample_file(), 16)
  labels = []
  for i in range(2):
    ctx = tf.distribute.InputContext(2, i, 2)
    shapes = [int(y.shape[0]) for _, y in fn(ctx)]
    assert shapes == [8] * 5
    labels += [y.numpy() for _, y in fn(ctx)]
  assert np.concatenate(labels).sum() == 23


# --- Raw Criteo TSV ---------------------------------------------------------


def _line(label="1", dense=None, cats=None) -> str:
  dense = dense if dense is not None else [str(i) for i in range(13)]
  cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
  return "\t".join([label, *dense, *cats])


def _write(tmp_path, lines: list[str], name: str = "day.tsv") -> str:
  path = os.path.join(tmp_path, name)
  with open(path, "w") as f:
    f.write("".join(line + "\n" for line in lines))
  return path


def test_tsv_hex_values_are_reduced_modulo_the_vocabulary(tmp_path):
  vocab = (2**31 - 1, 7, 1000, 39884406) + (97,) * 22
  cats = (
    ["ffffffffffffffff", "A", "a0", "68fd1e64"]
    + [
      "0123456789abcdef",
      "FfFf",
      "1",
      "",
      "00000000",
      "7fffffffffffffff",
    ]
    * 3
    + ["b", "c", "d", "e"]
  )
  path = _write(tmp_path, [_line(cats=cats)])
  config = criteo.CriteoConfig(vocab_sizes=vocab, missing_id=5)
  _, _, sparse = _read_all(criteo.CriteoReader(config).dataset(path, 1))
  for i, value in enumerate(cats):
    want = int(value, 16) % vocab[i] if value else 5
    assert sparse[str(i)][0] == want, (i, value)
    assert sparse[str(i)].dtype == np.int32


def test_tsv_dense_features_follow_model_garden(tmp_path):
  counts = ["", "-1", "0", "1", "2", "10", "100", "65535", "-3", "7", "", "3",
            "123456789012"]  # fmt: skip
  path = _write(tmp_path, [_line(dense=counts)])
  config = criteo.CriteoConfig(vocab_sizes=VOCAB)
  dense, labels, _ = _read_all(criteo.CriteoReader(config).dataset(path, 1))
  want = [np.float32(np.log(max(int(c or 0), 0) + 1)) for c in counts]
  assert dense[0].tolist() == want
  assert labels.tolist() == [1.0]
  raw = criteo.CriteoConfig(vocab_sizes=VOCAB, dense_transform="none")
  dense, _, _ = _read_all(criteo.CriteoReader(raw).dataset(path, 1))
  assert dense[0].tolist() == [np.float32(int(c or 0)) for c in counts]


def test_tsv_decimal_categorical_values(tmp_path):
  cats = ["-1", "12", "", "999999999999"] + ["5"] * 22
  path = _write(tmp_path, [_line(cats=cats)])
  config = criteo.CriteoConfig(vocab_sizes=VOCAB, categorical_encoding="int")
  _, _, sparse = _read_all(criteo.CriteoReader(config).dataset(path, 1))
  assert [int(sparse[str(i)][0]) for i in range(4)] == [999, 12, 0, 999]


def test_tsv_batches_cross_file_boundaries(tmp_path):
  paths = [
    _write(tmp_path, [_line(label=str(i % 2)) for i in range(n)], f"{n}.tsv")
    for n in (5, 3, 4)
  ]
  reader = criteo.CriteoReader(criteo.CriteoConfig(vocab_sizes=VOCAB))
  sizes = [int(y.shape[0]) for _, y in reader.dataset(paths, 5)]
  assert sizes == [5, 5]
  sizes = [
    int(y.shape[0]) for _, y in reader.dataset(paths, 5, drop_remainder=False)
  ]
  assert sizes == [5, 5, 2]
  spec = reader.dataset(paths, 5).element_spec
  assert spec[1].shape.as_list() == [5]
  assert spec[0]["dense_features"].shape.as_list() == [5, 13]


BAD_LINES = {
  "columns": _line().rsplit("\t", 1)[0],  # 39 fields.
  "columns_extra": _line() + "\t0",
  "columns_empty_line": "",
  "label": _line(label=""),
  "label_value": _line(label="2"),
  "dense": _line(dense=["abc"] + ["1"] * 12),
  "dense_float": _line(dense=["1.5"] + ["1"] * 12),
  "categorical": _line(cats=["xyz"] + ["a"] * 25),
  "categorical_too_long": _line(cats=["1" * 17] + ["a"] * 25),
}


@pytest.mark.parametrize("name", sorted(BAD_LINES))
def test_bad_line_raises_with_file_and_line_number(tmp_path, name):
  lines = [_line(), _line(), BAD_LINES[name], _line()]
  path = _write(tmp_path, lines)
  reader = criteo.CriteoReader(criteo.CriteoConfig(vocab_sizes=VOCAB))
  kind = name.split("_")[0]
  pattern = rf"day\.tsv:3: invalid {kind}\."
  with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
    list(reader.dataset(path, 2))


@pytest.mark.parametrize("name", sorted(BAD_LINES))
def test_bad_line_is_dropped_and_counted(tmp_path, name):
  good = [_line(label=str(i % 2)) for i in range(6)]
  lines = good[:3] + [BAD_LINES[name]] + good[3:]
  path = _write(tmp_path, lines)
  reader = criteo.CriteoReader(
    criteo.CriteoConfig(vocab_sizes=VOCAB), on_bad_record="count"
  )
  _, labels, _ = _read_all(reader.dataset(path, 3))
  assert labels.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
  kind = name.split("_")[0]
  assert reader.bad_records.counts() == {
    k: int(k == kind) for k in ("columns", "label", "dense", "categorical")
  }


def test_count_counts_every_bad_line_of_a_file(tmp_path):
  lines = [_line()] * 3 + list(BAD_LINES.values()) + [_line()] * 2
  path = _write(tmp_path, lines)
  reader = criteo.CriteoReader(
    criteo.CriteoConfig(vocab_sizes=VOCAB), on_bad_record="count"
  )
  _, labels, _ = _read_all(reader.dataset(path, 5))
  assert len(labels) == 5
  assert reader.bad_records.counts() == {
    "columns": 3, "label": 2, "dense": 2, "categorical": 2,
  }  # fmt: skip


def test_paddlerec_bad_lines(tmp_path):
  with open(paddlerec.find_sample_file()) as f:
    good = f.read().splitlines()[:4]
  bad = [
    good[0].replace("click:0", "clack:0"),
    good[0].replace("dense_feature:0.0 ", "dense_feature:zero ", 1),
    good[0].replace(" 1:737395", " 1:-5"),
    good[0].replace("click:0", "click:"),
  ]
  path = _write(tmp_path, good[:2] + bad + good[2:], "paddle.txt")
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"paddle\.txt:3"):
    list(_paddle_reader().dataset(path, 8))
  reader = criteo.CriteoReader(
    criteo.CriteoConfig(
      vocab_sizes=paddlerec.VOCAB_SIZES, file_format="paddlerec"
    ),
    on_bad_record="count",
  )
  _, labels, _ = _read_all(reader.dataset(path, 4))
  assert len(labels) == 4
  assert reader.bad_records.counts() == {
    "columns": 1, "label": 1, "dense": 1, "categorical": 1,
  }  # fmt: skip


def test_config_validation():
  with pytest.raises(ValueError, match="26 sizes"):
    criteo.CriteoConfig(vocab_sizes=[10] * 25)
  with pytest.raises(ValueError, match=r"vocab_sizes\[3\]"):
    criteo.CriteoConfig(vocab_sizes=[10] * 3 + [2**31] + [10] * 22)
  with pytest.raises(ValueError, match="missing_id"):
    criteo.CriteoConfig(vocab_sizes=[10] * 26, missing_id=10)
  with pytest.raises(ValueError, match="categorical_encoding"):
    criteo.CriteoConfig(categorical_encoding="base64")
  with pytest.raises(ValueError, match="multi_hot_sizes"):
    criteo.CriteoConfig(multi_hot_sizes=[0] * 26)
  with pytest.raises(ValueError):
    criteo.CriteoConfig(file_format="parquet")


# --- Multi-hot --------------------------------------------------------------


def test_multi_hot_shapes_ranges_and_first_column(tmp_path):
  vocab = tuple(10 + 3 * i for i in range(26))
  lines = [
    _line(cats=[f"{(r * 31 + i) * 977:x}" for i in range(26)]) for r in range(6)
  ] + [_line(cats=[f"{i * 977:x}" for i in range(26)])] * 2
  path = _write(tmp_path, lines)
  one_hot = criteo.CriteoReader(criteo.CriteoConfig(vocab_sizes=vocab))
  _, _, ids = _read_all(one_hot.dataset(path, 8))
  config = criteo.CriteoConfig(
    vocab_sizes=vocab, multi_hot_sizes=multi_hot.MLPERF_MULTI_HOT_SIZES
  )
  _, _, multi = _read_all(criteo.CriteoReader(config).dataset(path, 8))
  for i, k in enumerate(multi_hot.MLPERF_MULTI_HOT_SIZES):
    m = multi[str(i)]
    assert m.shape == (8, k)
    assert m.dtype == np.int32
    assert ((0 <= m) & (m < vocab[i])).all()
    np.testing.assert_array_equal(m[:, 0], ids[str(i)])
    np.testing.assert_array_equal(m[6], m[7])  # Same id, same expansion.
    for j in range(1, k):  # A hash of (seed, feature, id, position).
      want = hashing.hash_to_range_np(vocab[i], 0, i, ids[str(i)], j)
      np.testing.assert_array_equal(m[:, j], want)


def test_multi_hot_model_garden_mode_depends_on_the_example(tmp_path):
  path = _write(tmp_path, [_line()] * 4)
  config = criteo.CriteoConfig(
    vocab_sizes=(100_000,) * 26,
    multi_hot_sizes=(1,) * 3 + (20,) + (1,) * 22,
    multi_hot_mode="model_garden",
    seed=7,
  )
  _, _, first = _read_all(criteo.CriteoReader(config).dataset(path, 4))
  _, _, again = _read_all(criteo.CriteoReader(config).dataset(path, 4))
  m = first["3"]
  assert (m[:, 0] == 3).all()
  assert not (m[0, 1:] == m[1, 1:]).all()  # Same id, other example.
  np.testing.assert_array_equal(m, again["3"])  # Reproducible.


def test_multi_hot_expand_checks_arguments():
  ids = tf.constant([1, 2])
  with pytest.raises(ValueError, match="mode"):
    multi_hot.expand(ids, 2, 10, 0, mode="zipf")
  with pytest.raises(ValueError, match="row_keys"):
    multi_hot.expand(ids, 2, 10, 0, mode="model_garden")
  assert multi_hot.expand(ids, 1, 10, 0).numpy().tolist() == [[1], [2]]


def test_hashing_is_identical_in_numpy_and_tensorflow():
  keys = np.array([0, 1, 2**40, 2**62 + 12345], np.int64)
  a = hashing.hash_np(3, 5, keys)
  b = hashing.hash_tf(3, 5, tf.constant(keys)).numpy()
  np.testing.assert_array_equal(a, b)
  assert len(set(a.tolist())) == 4
  np.testing.assert_array_equal(
    hashing.hash_to_range_np(1000, 1, keys),
    hashing.hash_to_range_tf(1000, 1, tf.constant(keys)).numpy(),
  )
