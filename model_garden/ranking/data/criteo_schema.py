"""The Criteo record: its columns, vocabularies and parsed form.

A Criteo click log record is a label, 13 integer ("dense") features and
26 categorical ("sparse") features. Model Garden's ranking models take a
batch as ``({"dense_features": [B, 13] float32, "sparse_features":
{"0": ids, ..., "25": ids}}, labels)``; the readers here produce that.

Example:
  >>> from model_garden.ranking.data import criteo_schema
  >>> len(criteo_schema.CRITEO_1TB_VOCAB_SIZES), criteo_schema.NUM_COLUMNS
  (26, 40)
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

NUM_DENSE_FEATURES = 13
NUM_SPARSE_FEATURES = 26
#: label + dense + sparse.
NUM_COLUMNS = 1 + NUM_DENSE_FEATURES + NUM_SPARSE_FEATURES

#: Model Garden's vocabulary sizes for Criteo 1TB (``configs/config.py``),
#: after its preprocessing assigned each feature's distinct values ids.
CRITEO_1TB_VOCAB_SIZES = (
  39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
  2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295,
  39664984, 585935, 12972, 108, 36,
)  # fmt: skip

#: The problems a Criteo parser checks, in order
#: (``bad_records.BadRecordCounter``).
BAD_RECORD_KINDS = ("columns", "label", "dense", "categorical")

#: Largest vocabulary the parsers accept (ids are int32).
MAX_VOCAB_SIZE = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class ParsedLines:
  """A batch of parsed lines, good and bad together.

  Attributes:
    labels: ``[n]`` float32, 0 or 1.
    dense: ``[n, 13]`` float32 dense features (transformed).
    ids: ``[n, 26]`` int64 ids, feature ``f`` in ``[0, vocab_sizes[f])``.
    problems: ``[n, len(BAD_RECORD_KINDS)]`` bool, True where line ``i``
      fails check ``k``. Values of a line with a problem are meaningless.
  """

  labels: tf.Tensor
  dense: tf.Tensor
  ids: tf.Tensor
  problems: tf.Tensor

  @classmethod
  def from_checks(
    cls,
    label_text: tf.Tensor,
    dense: tf.Tensor,
    ids: tf.Tensor,
    *,
    bad_columns: tf.Tensor,
    label_ok: tf.Tensor,
    dense_ok: tf.Tensor,
    ids_ok: tf.Tensor,
  ) -> ParsedLines:
    """A reader's parsed lines, ``problems`` in ``BAD_RECORD_KINDS`` order.

    Args:
      label_text: ``[n]`` the label fields (``"1"`` is a click).
      dense, ids: the parsed values.
      bad_columns: ``[n]`` lines with the wrong number of fields.
      label_ok: ``[n]``; dense_ok ``[n, 13]``; ids_ok ``[n, 26]``: which
        fields parsed.
    """
    problems = tf.stack(
      [
        bad_columns,
        tf.logical_not(label_ok),
        tf.logical_not(tf.reduce_all(dense_ok, axis=1)),
        tf.logical_not(tf.reduce_all(ids_ok, axis=1)),
      ],
      axis=1,
    )
    return cls(
      labels=tf.cast(label_text == "1", tf.float32),
      dense=dense,
      ids=ids,
      problems=problems,
    )


def log_transform(counts: tf.Tensor) -> tf.Tensor:
  """Model Garden's dense transform: ``log(1 + max(x, 0))`` as float32.

  Computed in float64 and rounded once, like Model Garden's
  ``np.log(int(x) + 1)`` preprocessing, so the values are identical.

  Args:
    counts: integer (or integral float) counts; negatives count as 0.

  Returns:
    float32 tensor of the same shape.

  Example:
    >>> import tensorflow as tf
    >>> from model_garden.ranking.data import criteo_schema
    >>> x = criteo_schema.log_transform(tf.constant([-1, 0, 1], tf.int64))
    >>> [round(float(v), 4) for v in x]
    [0.0, 0.0, 0.6931]
  """
  x = tf.maximum(tf.cast(counts, tf.float64), 0.0)
  return tf.cast(tf.math.log(x + 1.0), tf.float32)


def check_vocab_sizes(vocab_sizes: tuple[int, ...]) -> None:
  """Raises ValueError unless there are 26 sizes in ``[1, 2**31)``."""
  if len(vocab_sizes) != NUM_SPARSE_FEATURES:
    raise ValueError(
      f"vocab_sizes needs {NUM_SPARSE_FEATURES} sizes, got {len(vocab_sizes)}."
    )
  for i, size in enumerate(vocab_sizes):
    if not 1 <= size <= MAX_VOCAB_SIZE:
      raise ValueError(
        f"vocab_sizes[{i}] must be in [1, {MAX_VOCAB_SIZE}], got {size}."
      )
