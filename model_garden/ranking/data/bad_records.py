"""Bad-record bookkeeping for vectorised line parsers.

A parser checks a whole chunk of lines at once (``text_files``) and marks
each line's problems; ``apply_bad_record_policy`` then either raises at
the first bad line, naming its file and line number
(``BadRecordPolicy.RAISE``), drops the bad lines and counts them by kind
in a ``BadRecordCounter`` (``BadRecordPolicy.COUNT``), or drops them
without bookkeeping (``BadRecordPolicy.SKIP``). A bad record never
becomes a made-up example.

Example:
  >>> import tensorflow as tf
  >>> from model_garden.ranking.data import bad_records
  >>> counter = bad_records.BadRecordCounter(["number"])
  >>> chunk = {"file": tf.constant(["f"]),
  ...          "line_number": tf.constant([7], tf.int64),
  ...          "line": tf.constant(["x"])}
  >>> _ = bad_records.apply_bad_record_policy(
  ...   tf.constant([0]), tf.constant([[True]]), chunk, "count", counter)
  >>> counter.total
  1
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any

import tensorflow as tf


class BadRecordPolicy(str, enum.Enum):
  """What a parser does with a record that fails validation.

  ``RAISE``: stop with ``tf.errors.InvalidArgumentError`` naming the file,
  the line number, what is wrong and the start of the line. ``COUNT``:
  drop the record and count it, by kind of problem, in a
  ``BadRecordCounter`` (the training loop reports the counts). ``SKIP``:
  drop the record, uncounted (no per-chunk bookkeeping; for data known
  to hold bad lines). A bad record never becomes a made-up example.

  Example:
    >>> from model_garden.ranking.data import bad_records
    >>> policy = bad_records.BadRecordPolicy
    >>> policy("count") is policy.COUNT, [p.value for p in policy]
    (True, ['raise', 'count', 'skip'])
  """

  RAISE = "raise"
  COUNT = "count"
  SKIP = "skip"

  @property
  def drops(self) -> bool:
    """Whether bad records are dropped (not raised on)."""
    return self is not BadRecordPolicy.RAISE


class BadRecordCounter:
  """Counts skipped records by kind of problem, from inside tf.data.

  The counts live in a ``tf.Variable`` that the parsing function updates,
  so they are current for everything parsed so far (prefetching may have
  parsed ahead of what the training loop consumed; a repeated dataset
  counts each pass). Create it outside ``strategy.scope()``, as input
  pipelines are, so that it stays a plain host variable.

  Args:
    kinds: the names of the problems a parser checks, in its order.

  Example:
    >>> from model_garden.ranking.data import bad_records
    >>> counter = bad_records.BadRecordCounter(["columns", "label"])
    >>> counter.counts(), counter.total
    ({'columns': 0, 'label': 0}, 0)
  """

  def __init__(self, kinds: Sequence[str]):
    self.kinds = tuple(kinds)
    with tf.init_scope():
      self.variable = tf.Variable(
        tf.zeros([len(self.kinds)], tf.int64),
        trainable=False,
        name="bad_record_counts",
      )

  def counts(self) -> dict[str, int]:
    """Skipped records so far, by kind."""
    values = self.variable.numpy().tolist()
    return dict(zip(self.kinds, values, strict=True))

  @property
  def total(self) -> int:
    """Skipped records so far."""
    return int(self.variable.numpy().sum())

  def reset(self) -> None:
    """Sets every count back to zero."""
    self.variable.assign(tf.zeros_like(self.variable))


def apply_bad_record_policy(
  values: Any,
  problems: tf.Tensor,
  records: dict[str, tf.Tensor],
  policy: BadRecordPolicy | str,
  counter: BadRecordCounter,
) -> Any:
  """Raises on, or drops and counts, the records that have a problem.

  Meant for a parsing function that works on a batch of lines at once.

  Args:
    values: a nest of tensors whose first dimension is the record.
    problems: ``[n, len(counter.kinds)]`` bool, True where record ``i``
      fails check ``k``. A record is counted once, under its first problem.
    records: a ``text_files.numbered_lines`` chunk: ``file``,
      ``line_number`` and ``line``, each ``[n]``.
    policy: a ``BadRecordPolicy`` (or its value).
    counter: where ``COUNT`` counts.

  Returns:
    ``values`` (RAISE, after the check), or ``values`` without the bad
    records (COUNT, SKIP).

  Raises:
    tf.errors.InvalidArgumentError: when the dataset is iterated, for the
      first bad record of a batch under RAISE.

  Example:
    >>> import tensorflow as tf
    >>> from model_garden.ranking.data import bad_records
    >>> counter = bad_records.BadRecordCounter(["number"])
    >>> records = {"file": tf.constant(["f", "f"]),
    ...            "line_number": tf.constant([1, 2], tf.int64),
    ...            "line": tf.constant(["1", "x"])}
    >>> kept = bad_records.apply_bad_record_policy(
    ...   tf.constant([1, 0]), tf.constant([[False], [True]]), records,
    ...   "count", counter)
    >>> kept.numpy().tolist(), counter.counts()
    ([1], {'number': 1})
  """
  policy = BadRecordPolicy(policy)
  bad = tf.reduce_any(problems, axis=1)
  if policy is BadRecordPolicy.SKIP:
    keep = tf.logical_not(bad)
    return tf.nest.map_structure(lambda v: tf.boolean_mask(v, keep), values)
  if policy is BadRecordPolicy.COUNT:
    first_kind = tf.argmax(tf.cast(problems, tf.int32), axis=1)
    first_kind = tf.boolean_mask(first_kind, bad)
    counts = tf.math.bincount(
      tf.cast(first_kind, tf.int32),
      minlength=len(counter.kinds),
      maxlength=len(counter.kinds),
      dtype=tf.int64,
    )
    update = counter.variable.assign_add(counts)
    with tf.control_dependencies([update]):
      keep = tf.logical_not(bad)
      return tf.nest.map_structure(lambda v: tf.boolean_mask(v, keep), values)

  row = tf.argmax(tf.cast(bad, tf.int32))
  kind = tf.gather(
    tf.constant(counter.kinds), tf.argmax(tf.cast(problems[row], tf.int32))
  )
  message = tf.strings.join(
    [
      "Bad record at ",
      records["file"][row],
      ":",
      tf.strings.as_string(records["line_number"][row]),
      ": invalid ",
      kind,
      ". The line starts with: ",
      # Valid UTF-8 whatever the file holds (TensorFlow decodes the
      # message as UTF-8): undecodable bytes become U+FFFD.
      tf.strings.substr(
        tf.strings.unicode_transcode(
          records["line"][row],
          "UTF-8",
          "UTF-8",
          errors="replace",
          replacement_char=0xFFFD,
        ),
        0,
        120,
        unit="UTF8_CHAR",
      ),
    ]
  )
  check = tf.debugging.Assert(
    tf.logical_not(tf.reduce_any(bad)), [message], summarize=1
  )
  with tf.control_dependencies([check]):
    return tf.nest.map_structure(tf.identity, values)


_BAD_RECORD = re.compile(
  r"Bad record at (?P<file>.+?):(?P<line>\d+): invalid (?P<kind>\w+)\. "
  r"The line starts with: (?P<text>.*)"
)


def describe_bad_record(
  error: BaseException, key: str = "on_bad_record"
) -> str | None:
  """One line for the error a ``RAISE`` policy stopped on, or None.

  Args:
    error: what iterating the dataset raised.
    key: the config key that sets the policy, for the advice.

  Returns:
    ``"<file>:<line>: invalid <kind> (...); set <key>=count ..."``, or
    None if ``error`` is not a bad record's.

  Example:
    >>> import tensorflow as tf
    >>> from model_garden.ranking.data import bad_records
    >>> error = tf.errors.InvalidArgumentError(None, None,
    ...   "Assertion failed: [Bad record at /d/a.tsv:7: invalid dense. "
    ...   "The line starts with: 1 x 3]")
    >>> print(bad_records.describe_bad_record(error, "task.train_data."
    ...   "on_bad_record"))  # doctest: +NORMALIZE_WHITESPACE
    /d/a.tsv:7: invalid dense field (the line starts with: 1 x 3);
    to drop bad records set task.train_data.on_bad_record=count (counted
    in the logs) or skip
  """
  if not isinstance(error, tf.errors.InvalidArgumentError):
    return None
  found = _BAD_RECORD.search(str(getattr(error, "message", error)))
  if found is None:
    return None
  text = found["text"].split("\n")[0]
  text = re.sub(r"\]\s*(\[\[\{\{node .*)?$", "", text)[:60]
  file, line, kind = found["file"], found["line"], found["kind"]
  if "\ufffd" in text or re.search(r"\\[0-3][0-7]{2}", text):
    what = "not a line of text (a binary or compressed file?)"
  elif kind == "columns":
    what = "wrong number of tab-separated columns"
  else:
    what = f"invalid {kind} field"
  return (
    f"{file}:{line}: {what} (the line starts with: {text}); to drop bad "
    f"records set {key}=count (counted in the logs) or skip"
  )
