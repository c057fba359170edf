"""PaddleRec's preprocessed Criteo format, and its installed 80-line sample.

PyPI ``paddle-rec==0.1.0`` ships 80 real Criteo records, already
preprocessed, in ``paddlerec/models/rank/dnn/data/sample_data/train/
sample_train.txt`` (install with ``pip install --no-deps
paddle-rec==0.1.0``). It is *not* raw TSV. Each line is 40
space-separated ``slot:value`` tokens::

  click:0 dense_feature:0.0 dense_feature:0.00497512437811 ... 1:737395 ...

* ``click:<0|1>``: the label;
* 13 × ``dense_feature:<float>``: count ``x`` of feature ``i`` min-max
  scaled by PaddleRec's Criteo reader, ``(x - CONT_MIN[i]) /
  CONT_DIFF[i]`` (no clipping, so values above 1 occur), and 0.0 when
  missing;
* ``1:<id>`` ... ``26:<id>``: ids already hashed by that reader,
  ``hash(str(column) + value) % 1000001`` with Python 2's string hash
  (``column`` is the raw TSV column, 14..39), so in ``[0, 1000001)``. A
  missing value hashes the column number alone: ``paddlerec_missing_ids``.

With ``dense_transform="log"`` the raw count is recovered exactly,
``round(v * CONT_DIFF[i] + CONT_MIN[i])``, and given Model Garden's
``log(1 + max(x, 0))``, so these records look like parsed raw Criteo (a
missing count becomes 0 either way). ``"none"`` keeps PaddleRec's scaled
values.

Example:
  >>> import tensorflow as tf
  >>> from model_garden.ranking.data import paddlerec
  >>> line = " ".join(["click:1"] + ["dense_feature:0.05"] * 13
  ...                 + [f"{i}:{i * 7}" for i in range(1, 27)])
  >>> p = paddlerec.parse_paddlerec_lines(tf.constant([line]),
  ...                                     paddlerec.VOCAB_SIZES, "none")
  >>> float(p.labels[0]), round(float(p.dense[0, 0]), 2), int(p.ids[0, 25])
  (1.0, 0.05, 182)
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import tensorflow as tf

from model_garden.ranking.data import criteo_schema

#: PaddleRec's Criteo reader: per-count minimum and scale (max - min).
CONT_MIN = (0, -3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
CONT_DIFF = (20, 603, 100, 50, 64000, 500, 100, 50, 500, 10, 10, 10, 50)
#: The hash space of PaddleRec's categorical ids.
HASH_DIM = 1000001
#: One vocabulary of ``HASH_DIM`` ids per categorical feature.
VOCAB_SIZES = (HASH_DIM,) * criteo_schema.NUM_SPARSE_FEATURES

SAMPLE_PATH = "models/rank/dnn/data/sample_data/train/sample_train.txt"
KEYS = (
  ("click",)
  + ("dense_feature",) * criteo_schema.NUM_DENSE_FEATURES
  + tuple(str(i) for i in range(1, criteo_schema.NUM_SPARSE_FEATURES + 1))
)
_FLOAT = r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"
_ID = "[0-9]{1,18}"


def find_sample_file() -> str:
  """Path of the 80-line Criteo sample installed by ``paddle-rec==0.1.0``.

  The package is located without importing it.

  Raises:
    FileNotFoundError: when paddle-rec (0.1.0) is not installed.

  Example:
    >>> from model_garden.ranking.data import paddlerec
    >>> paddlerec.find_sample_file().endswith("sample_train.txt")
    True
  """
  spec = importlib.util.find_spec("paddlerec")
  roots = list(spec.submodule_search_locations or []) if spec else []
  for root in roots:
    path = os.path.join(root, *SAMPLE_PATH.split("/"))
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
    "PaddleRec's Criteo sample was not found; install it with "
    "`pip install --no-deps paddle-rec==0.1.0`."
  )


def python2_str_hash(text: str) -> int:
  """Python 2's (unrandomised, 64-bit) ``hash(str)``.

  Example:
    >>> from model_garden.ranking.data import paddlerec
    >>> paddlerec.python2_str_hash("14") % paddlerec.HASH_DIM
    25204
  """
  data = text.encode("latin-1")
  if not data:
    return 0
  mask = 2**64 - 1
  x = (data[0] << 7) & mask
  for byte in data:
    x = ((1000003 * x) ^ byte) & mask
  x ^= len(data)
  if x >= 2**63:
    x -= 2**64
  return -2 if x == -1 else x


def paddlerec_missing_ids() -> tuple[int, ...]:
  """The id PaddleRec gave a missing value of each categorical feature.

  Its reader hashes ``str(column) + value``; an empty value leaves the
  column number (14..39) alone.

  Example:
    >>> from model_garden.ranking.data import paddlerec
    >>> paddlerec.paddlerec_missing_ids()[:2]
    (25204, 25203)
  """
  return tuple(
    python2_str_hash(str(column)) % HASH_DIM
    for column in range(14, 14 + criteo_schema.NUM_SPARSE_FEATURES)
  )


def parse_paddlerec_lines(
  lines: tf.Tensor,
  vocab_sizes: Sequence[int],
  dense_transform: str = "log",
) -> criteo_schema.ParsedLines:
  """Parses a batch of PaddleRec ``slot:value`` Criteo lines.

  Args:
    lines: ``[n]`` strings, one record each.
    vocab_sizes: 26 vocabulary sizes; ids are reduced modulo them (the
      file's ids are below ``HASH_DIM``).
    dense_transform: ``"log"`` (recover counts, ``log(1 + max(x, 0))``) or
      ``"none"`` (PaddleRec's scaled values).

  Returns:
    ``ParsedLines``. The ``columns`` problem covers a wrong token count and
    wrong slot names; ``label``, ``dense`` and ``categorical`` bad values.
  """
  if dense_transform not in ("log", "none"):
    raise ValueError(
      f'dense_transform must be "log" or "none", got {dense_transform!r}.'
    )
  num_dense = criteo_schema.NUM_DENSE_FEATURES
  num_columns = criteo_schema.NUM_COLUMNS
  tokens = tf.strings.split(lines, " ")
  bad_count = tokens.row_lengths() != num_columns
  tokens = tokens.to_tensor(default_value="", shape=[None, num_columns])
  pairs = tf.strings.split(tokens, ":", maxsplit=1)
  pairs = pairs.to_tensor(default_value="", shape=[None, num_columns, 2])
  keys, values = pairs[..., 0], pairs[..., 1]
  bad_keys = tf.reduce_any(keys != tf.constant(KEYS), axis=1)

  label_s = values[:, 0]
  dense_s = values[:, 1 : 1 + num_dense]
  ids_s = values[:, 1 + num_dense :]
  label_ok = tf.strings.regex_full_match(label_s, "[01]")
  dense_ok = tf.strings.regex_full_match(dense_s, _FLOAT)
  ids_ok = tf.strings.regex_full_match(ids_s, _ID)

  dense_s = tf.where(dense_ok, dense_s, "0")
  if dense_transform == "none":
    dense = tf.strings.to_number(dense_s, tf.float32)
  else:
    scaled = tf.strings.to_number(dense_s, tf.float64)
    diff = tf.constant(CONT_DIFF, tf.float64)
    counts = tf.round(scaled * diff + tf.constant(CONT_MIN, tf.float64))
    dense = criteo_schema.log_transform(counts)

  ids = tf.strings.to_number(tf.where(ids_ok, ids_s, "0"), tf.int64)
  ids = tf.math.floormod(ids, tf.constant(list(vocab_sizes), tf.int64))
  return criteo_schema.ParsedLines.from_checks(
    label_s,
    dense,
    ids,
    bad_columns=bad_count | bad_keys,
    label_ok=label_ok,
    dense_ok=dense_ok,
    ids_ok=ids_ok,
  )
