"""Turns one feature's ids (dense, sparse or ragged) into a flat id list.

Every input kind becomes a ``PreparedFeature``: for each id, the output row
("segment") it is added into and its weight. The activation of output row
``r`` is then the combiner applied to the ids whose segment is ``r``; see
``lookup.py``. Shapes follow TensorFlow's TPU rules:

=====================  ===========================  =========================
input (ids)            max_sequence_length = 0      max_sequence_length = L
=====================  ===========================  =========================
dense ``(B,)``         ``(B, dim)``                 ``(B, dim)``
dense ``(B, ..., 1)``  ``(B, ..., dim)``            ``(B, ..., dim)``
dense ``(B, ..., n)``  ``(B, ..., n, dim)``         ``(B, ..., n, dim)``
sparse ``(B, N)``      ``(B, dim)`` combined        ``(B, L, dim)``
sparse ``(B, S, N)``   ``(B, S, dim)`` combined     ``(B, S, dim)`` (L ignored)
ragged ``(B, None)``   ``(B, dim)`` combined        ``(B, L, dim)``
=====================  ===========================  =========================

A dense tensor whose last dimension is not 1 (e.g. fixed-length multi-hot
ids ``(B, n)``) is gathered as is, one activation per id and no combiner,
exactly as the serving lookup does; TensorFlow's TPU enqueue rejects it
(under TPUStrategy, pass a ``SparseTensor`` or ``RaggedTensor``).

``FeatureConfig.output_shape`` overrides the shape; for ragged input it may
differ from the batch size (see ``prepare_feature``).

Bad input raises an error that names the feature path: a ValueError at trace
time for wrong types, dtypes and ranks, and a ``tf.errors.InvalidArgumentError``
when the step runs for ids outside ``[0, vocabulary_size)`` or weights whose
indices or row splits differ from the ids'. Every id tensor returned here
depends on those runtime checks, so a failing step changes no table.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.inputs import prepare_feature
  >>> feature = tpe.FeatureConfig(tpe.TableConfig(10, 2, name="t"))
  >>> ids = tf.ragged.constant([[1, 2], [], [3]])
  >>> p = prepare_feature(ids, None, feature, "f")
  >>> p.segments.numpy().tolist(), p.output_shape.numpy().tolist()
  ([0, 0, 2], [3])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding import errors
from tpu_embedding.config import FeatureConfig
from tpu_embedding.kernels.static_unique import PADDING_ID
from tpu_embedding.resolved import key_mapping
from tpu_embedding.resolved import table_name
from tpu_embedding.types import FeatureInput

#: ``(ids, segments, weights, output_shape)`` of a flattened input.
_Flattened = tuple[tf.Tensor, tf.Tensor, tf.Tensor | None, tf.Tensor]


@dataclasses.dataclass(frozen=True)
class PreparedFeature:
  """One feature's ids, flattened, with the output row of each id.

  Attributes:
    path: the feature path (for messages).
    ids: ``[n]`` int64 ids (gated by ``checks`` once they have run, see
      ``gate_on_all_checks``).
    segments: ``[n]`` int64, the flattened output row of each id; None
      when id ``i`` is output row ``i`` (dense ids).
    weights: ``[n]`` float32 weights; None when none were given (ones).
    num_segments: int64 scalar, the number of flattened output rows.
    output_shape: ``[k]`` int64, the activation shape without ``dim``.
    static_shape: what is known statically of ``output_shape``.
    checks: runtime checks (id range, weights) not yet run.
  """

  path: str
  ids: tf.Tensor
  segments: tf.Tensor | None
  weights: tf.Tensor | None
  num_segments: tf.Tensor
  output_shape: tf.Tensor
  static_shape: tf.TensorShape
  checks: tuple[Check, ...] = ()


def check_input_type(
  inp: FeatureInput, weight: FeatureInput | None, path: str
) -> None:
  """Checks the kind and dtype of one feature's ids and weights.

  Raises:
    ValueError: for an unknown input type, non-integer ids, weights on a
      dense input, weights of another kind than the ids, non-float weights.
  """
  if not isinstance(inp, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
    raise ValueError(
      errors.UNKNOWN_INPUT_TYPE.format(path=path, type=type(inp))
    )
  if not inp.dtype.is_integer:
    raise ValueError(
      errors.NON_INTEGER_IDS.format(path=path, dtype=inp.dtype.name)
    )
  if weight is None:
    return
  if isinstance(inp, tf.Tensor):
    raise ValueError(errors.DENSE_WEIGHTS.format(path=path))
  if type(weight) is not type(inp):
    raise ValueError(
      errors.WEIGHT_TYPE.format(
        path=path, weight_type=type(weight), input_type=type(inp).__name__
      )
    )
  if not weight.dtype.is_floating:
    raise ValueError(
      errors.NON_FLOAT_WEIGHTS.format(path=path, dtype=weight.dtype.name)
    )


def is_sequence(feature: FeatureConfig, inp: FeatureInput) -> bool:
  """Whether ``max_sequence_length`` applies to this input (TPU rule)."""
  if feature.max_sequence_length <= 0 or feature.output_shape.rank:
    return False
  if isinstance(inp, tf.SparseTensor):
    return inp.shape.rank == 2
  return isinstance(inp, tf.RaggedTensor)


def static_output_shape(
  inp: FeatureInput, feature: FeatureConfig, path: str
) -> tf.TensorShape:
  """The activation shape (without ``dim``) implied by the input's shape.

  Raises:
    ValueError: for a rank that the input kind does not support.
  """
  shape = inp.shape
  if isinstance(inp, tf.Tensor):
    if shape.rank is None or shape.rank < 1:
      raise ValueError(errors.DENSE_RANK.format(path=path, rank=shape.rank))
    if shape.rank > 1 and shape[-1] == 1:
      return shape[:-1]  # TPU's rule: a trailing 1 is the one id per row.
    # One id per output row, any shape (e.g. fixed-length multi-hot
    # ``[batch, n]`` gives ``[batch, n, dim]``), as the serving lookup does.
    return shape
  if isinstance(inp, tf.SparseTensor):
    if shape.rank is None or shape.rank < 2:
      raise ValueError(errors.SPARSE_RANK.format(path=path, rank=shape.rank))
  elif shape.rank != 2:
    raise ValueError(errors.RAGGED_RANK.format(path=path, rank=shape.rank))
  if is_sequence(feature, inp):
    return tf.TensorShape([shape[0], feature.max_sequence_length])
  return shape[:-1]


@dataclasses.dataclass(frozen=True)
class Check:
  """One runtime input check of a step.

  Attributes:
    valid: scalar bool tensor, True when the input is good.
    message: what is wrong, naming the feature.
    ids: int64 ids the failure message reports those of outside
      ``[0, vocabulary_size)`` (the first 10); none for other checks.
    vocabulary_size: the end of the ids' valid range.
  """

  valid: tf.Tensor
  message: str
  ids: Any = ()
  vocabulary_size: int = 0


def ids_in_range_check(
  ids: tf.Tensor, vocabulary_size: int, path: str, table_name: str
) -> Check:
  """The check that all ``ids`` lie in ``[0, vocabulary_size)``."""
  # (An empty id list reduces to the dtype's max / min: valid.)
  valid = tf.logical_and(
    tf.reduce_min(ids) >= 0, tf.reduce_max(ids) < vocabulary_size
  )
  message = errors.IDS_OUT_OF_RANGE.format(
    path=path, vocabulary_size=vocabulary_size, table=table_name
  )
  return Check(valid, message, ids, vocabulary_size)


def _flat_int64(ids: Any) -> tf.Tensor:
  """``ids`` as an int64 vector (no op when they are one already)."""
  ids = tf.cast(ids, tf.int64)
  return ids if ids.shape.rank == 1 else tf.reshape(ids, [-1])


def _offending_ids(checks: list[Check], failing: tf.Tensor) -> tf.Tensor:
  """The first 10 ids out of range of check number ``failing``.

  One pass over every check's ids at once (ops per check: one ``Size``),
  so that a step's failure path stays small however many features it
  has: it is traced, and optimized, with every step.
  """
  ids = [_flat_int64(c.ids) for c in checks]
  sizes = tf.stack([tf.size(i, out_type=tf.int64) for i in ids])
  owner = tf.repeat(tf.range(len(checks), dtype=tf.int64), sizes)
  ends = tf.repeat(
    tf.constant([c.vocabulary_size for c in checks], tf.int64), sizes
  )
  every = tf.concat(ids, 0)
  bad = tf.logical_and(
    tf.equal(owner, tf.cast(failing, tf.int64)),
    tf.logical_or(every < 0, every >= ends),
  )
  return tf.boolean_mask(every, bad)[:10]


def run_checks(checks: list[Check]) -> tf.Tensor | None:
  """Runs ``checks``; returns a tensor to depend on (None when eager).

  Eagerly, the first failing check raises at once. In a graph, all checks
  are folded into one condition, so a passing step pays for a single
  branch; the failing branch raises with the first failing check's
  message and ids (found for all checks at once: a few ops per check).

  Raises:
    tf.errors.InvalidArgumentError: (eagerly) for the first failing check.
  """
  if not checks:
    return None
  valid = tf.stack([c.valid for c in checks])
  if tf.executing_eagerly():
    failing = [i for i, ok in enumerate(valid.numpy()) if not ok]
    if failing:
      ids = _offending_ids(checks, tf.constant(failing[0])).numpy()
      details = ", ".join(str(x) for x in ids.tolist())
      raise tf.errors.InvalidArgumentError(
        None, None, f"{checks[failing[0]].message} {details}".strip()
      )
    return None

  def fail() -> tf.Tensor:
    failing = tf.argmin(tf.cast(valid, tf.int32), output_type=tf.int32)
    offending = _offending_ids(checks, failing)
    asserts: list[tf.Operation] = []
    for check in checks:  # in turn: the first failing check raises
      with tf.control_dependencies(asserts):
        # The op itself: tf.debugging.Assert would wrap each in a cond.
        asserts = [
          tf.raw_ops.Assert(
            condition=check.valid,
            data=[check.message, offending],
            summarize=10,
          )
        ]
    with tf.control_dependencies(asserts):
      return tf.constant(False)

  return tf.cond(tf.reduce_all(valid), lambda: tf.constant(True), fail)


def check_ids_in_range(
  ids: tf.Tensor, vocabulary_size: int, path: str, table_name: str
) -> tf.Tensor:
  """Returns ``ids`` gated by a check that all lie in ``[0, vocab)``."""
  gate = run_checks(
    [ids_in_range_check(ids, vocabulary_size, path, table_name)]
  )
  if gate is None:
    return ids
  with tf.control_dependencies([gate]):
    return tf.identity(ids)


def _equal_check(a: tf.Tensor, b: tf.Tensor, path: str, what: str) -> Check:
  """The check that weights' ``what`` equal the ids'."""
  message = errors.WEIGHTS_MISMATCH.format(path=path, what=what)
  if (
    a.shape.is_fully_defined()
    and b.shape.is_fully_defined()
    and (a.shape != b.shape)
  ):
    raise ValueError(message)
  same_shape = tf.reduce_all(tf.equal(tf.shape(a), tf.shape(b)))
  same_values = tf.cond(
    same_shape,
    lambda: tf.reduce_all(tf.equal(a, tf.reshape(b, tf.shape(a)))),
    lambda: tf.constant(False),
  )
  return Check(same_values, message)


def _weight_checks(
  inp: FeatureInput, weight: FeatureInput | None, path: str
) -> list[Check]:
  if weight is None:
    return []
  if isinstance(inp, tf.SparseTensor):
    return [
      _equal_check(inp.indices, weight.indices, path, "indices"),
      _equal_check(inp.dense_shape, weight.dense_shape, path, "dense_shape"),
    ]
  return [
    _equal_check(inp.row_splits, weight.row_splits, path, "row_splits"),
    _equal_check(
      tf.shape(inp.values), tf.shape(weight.values), path, "number of values"
    ),
  ]


def _sequence_segments(
  rows: tf.Tensor, positions: tf.Tensor, length: int
) -> tuple[tf.Tensor, tf.Tensor]:
  """``(keep mask, segment)`` of ids at ``positions`` in sequences."""
  keep = positions < length
  return keep, rows * length + positions


def _truncated(
  ids: tf.Tensor, segments: tf.Tensor, keep: tf.Tensor, num_segments: Any
) -> tuple[tf.Tensor, tf.Tensor]:
  """``ids`` and ``segments`` without the ids past the sequence length.

  Traced for XLA, shapes stay static: those ids stay, as padding
  (``kernels/static_unique.py``) in an output row past the last, both of
  which XLA's segment sums and scatters drop.
  """
  if compat.in_xla_context():
    return (
      tf.where(keep, ids, tf.constant(PADDING_ID, tf.int64)),
      tf.where(keep, segments, tf.cast(num_segments, tf.int64)),
    )
  return tf.boolean_mask(ids, keep), tf.boolean_mask(segments, keep)


def prepare_feature(
  inp: FeatureInput,
  weight: FeatureInput | None,
  feature: FeatureConfig,
  path: str,
  check_ids: bool = True,
) -> PreparedFeature:
  """Flattens one feature's ids into a ``PreparedFeature``.

  Args:
    inp: the ids, a ``tf.Tensor``, ``tf.SparseTensor`` or ``tf.RaggedTensor``.
    weight: None, or per-id weights of the same kind as ``inp``.
    feature: the feature's config (its table must be named).
    path: the feature path, for messages.
    check_ids: whether to add the ``[0, vocabulary_size)`` range check
      (only where the table's inputs are rows: its key mapping's
      ``input_ids`` may make keys of them, ``keys``).

  Returns:
    The ``PreparedFeature``.

  Raises:
    ValueError: for wrong kinds, dtypes, ranks or weights (see module doc),
      or an unnamed table.
  """
  mapping = key_mapping(feature.table)
  inp, key_checks = mapping.input_ids(inp, path, feature.table.name)
  check_ids = check_ids and mapping.inputs_are_rows
  check_input_type(inp, weight, path)
  if weight is not None and is_sequence(feature, inp):
    raise ValueError(
      errors.SEQUENCE_WEIGHTS.format(
        path=path, length=feature.max_sequence_length
      )
    )
  static_shape = static_output_shape(inp, feature, path)
  if isinstance(inp, tf.Tensor):
    ids = tf.reshape(tf.cast(inp, tf.int64), [-1])
    segments = weights = None
    output_shape = _shape_tensor(
      static_shape,
      lambda: tf.shape(inp, out_type=tf.int64)[: static_shape.rank],
    )
  elif isinstance(inp, tf.SparseTensor):
    ids, segments, weights, output_shape = _flatten_sparse(inp, weight, feature)
  else:
    ids, segments, weights, output_shape = _flatten_ragged(
      inp, weight, feature, path
    )
  num_segments = tf.reduce_prod(output_shape)
  if feature.output_shape.rank:
    static_shape = feature.output_shape
    output_shape, num_segments = _apply_configured_shape(
      feature, path, num_segments
    )
  checks = _weight_checks(inp, weight, path)
  checks += [Check(valid, message) for valid, message in key_checks]
  if check_ids:
    checks.append(
      ids_in_range_check(
        ids, feature.table.vocabulary_size, path, table_name(feature.table)
      )
    )
  return PreparedFeature(
    path,
    ids,
    segments,
    weights,
    num_segments,
    output_shape,
    static_shape,
    tuple(checks),
  )


def _shape_tensor(
  static: tf.TensorShape, dynamic: Callable[[], tf.Tensor]
) -> tf.Tensor:
  """``static`` as an int64 constant when fully known, else ``dynamic()``."""
  if static.is_fully_defined():
    return tf.constant(static.as_list(), tf.int64)
  return dynamic()


def _flatten_sparse(
  inp: tf.SparseTensor, weight: tf.SparseTensor | None, feature: FeatureConfig
) -> _Flattened:
  """ids, segments, weights and output shape of a sparse input."""
  ids = tf.cast(inp.values, tf.int64)
  weights = None if weight is None else tf.cast(weight.values, tf.float32)
  dense_shape = tf.cast(inp.dense_shape, tf.int64)
  indices = tf.cast(inp.indices, tf.int64)
  if is_sequence(feature, inp):
    length = feature.max_sequence_length
    keep, segments = _sequence_segments(indices[:, 0], indices[:, 1], length)
    ids, segments = _truncated(ids, segments, keep, dense_shape[0] * length)
    output_shape = tf.stack([dense_shape[0], tf.constant(length, tf.int64)])
    return ids, segments, weights, output_shape
  output_shape = dense_shape[:-1]
  if inp.shape.rank == 2:
    return ids, indices[:, 0], weights, output_shape
  # Row-major index of each id's example among the leading dimensions.
  strides = tf.math.cumprod(output_shape, exclusive=True, reverse=True)
  segments = tf.reduce_sum(indices[:, :-1] * strides[None, :], axis=1)
  return ids, segments, weights, output_shape


def _flatten_ragged(
  inp: tf.RaggedTensor,
  weight: tf.RaggedTensor | None,
  feature: FeatureConfig,
  path: str,
) -> _Flattened:
  """ids, segments, weights and output shape of a rank-2 ragged input."""
  if inp.ragged_rank != 1:
    raise ValueError(errors.RAGGED_RANK.format(path=path, rank=inp.shape.rank))
  ids = tf.cast(inp.values, tf.int64)
  weights = None if weight is None else tf.cast(weight.values, tf.float32)
  rows = tf.cast(inp.value_rowids(), tf.int64)
  nrows = tf.cast(inp.nrows(), tf.int64)
  length = _ragged_sequence_length(inp, feature, path)
  if length is None:
    return ids, rows, weights, tf.reshape(nrows, [1])
  starts = tf.cast(inp.row_starts(), tf.int64)
  positions = tf.range(tf.size(ids, out_type=tf.int64)) - tf.gather(
    starts, rows
  )
  keep, segments = _sequence_segments(rows, positions, length)
  # Sequence features take no weights (checked in prepare_feature).
  ids, segments = _truncated(ids, segments, keep, nrows * length)
  return ids, segments, None, tf.stack([nrows, tf.constant(length, tf.int64)])


def _ragged_sequence_length(
  inp: tf.RaggedTensor, feature: FeatureConfig, path: str
) -> int | None:
  """The sequence length a ragged input is padded to, or None (combined).

  With ``FeatureConfig.output_shape`` set and a batch of ``B`` rows: a
  shape of ``B`` elements combines each row; ``k * B`` elements makes each
  row a sequence of ``k`` ids (TensorFlow's serving rule).
  """
  if is_sequence(feature, inp):
    return feature.max_sequence_length
  if not feature.output_shape.rank:
    return None
  batch = inp.shape[0]
  total = feature.output_shape.num_elements()
  if batch is None or total is None:
    return None
  if total == batch:
    return None
  if total > batch and total % batch == 0:
    return total // batch
  raise ValueError(
    f"Output shape set in the FeatureConfig should be the factor of the "
    f"input data batch size. But instead got output shape "
    f"{feature.output_shape}, input data batch size {batch} (feature "
    f"{path})."
  )


def _apply_configured_shape(
  feature: FeatureConfig, path: str, num_segments: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
  """Output shape and row count from ``FeatureConfig.output_shape``."""
  configured = feature.output_shape
  if not configured.is_fully_defined():
    raise ValueError(
      f"Input Feature {path} has output shape set as {configured} which is "
      "not fully defined. Please specify the fully defined shape in "
      "FeatureConfig."
    )
  expected = configured.num_elements()
  said = (
    f"Feature {path}: FeatureConfig.output_shape {configured} has "
    f"{expected} elements but the input gives"
  )
  known = tf.get_static_value(num_segments)  # Eagerly: raised at once.
  if known is not None:
    if int(known) != expected:
      raise ValueError(f"{said} {int(known)} output rows.")
    return (
      tf.constant(configured.as_list(), tf.int64),
      tf.constant(expected, tf.int64),
    )
  # Plain strings and the count (no string op: XLA compiles the step).
  check = tf.debugging.Assert(
    tf.equal(num_segments, expected), [said, num_segments, "output rows."]
  )
  with tf.control_dependencies([check]):
    num_segments = tf.identity(tf.constant(expected, tf.int64))
  return tf.constant(configured.as_list(), tf.int64), num_segments


def gate_on_all_checks(
  prepared: list[PreparedFeature],
) -> list[PreparedFeature]:
  """Runs every feature's checks; every feature's ids wait for all of them.

  Bad ids in one feature thus stop the lookups and updates of every table,
  not only its own; a step that fails changes nothing.
  """
  gate = run_checks([c for p in prepared for c in p.checks])
  if gate is None:
    return [dataclasses.replace(p, checks=()) for p in prepared]
  gated = []
  for p in prepared:
    with tf.control_dependencies([gate]):
      gated.append(dataclasses.replace(p, ids=tf.identity(p.ids), checks=()))
  return gated
