"""The ranking metrics: AUC, accuracy, prediction mean, label mean, loss.

Model Garden's ranking task reports ``auc``, ``accuracy``,
``prediction_mean`` and ``label_mean`` (``tfrs.tasks.Ranking``); we add the
mean ``loss``. They are computed in two halves, so that they add up
exactly however steps run (one after another, on mirrored replicas, or
concurrently on parameter-server workers, where Keras metrics' ``assign(self
+ value)`` would lose counts):

* ``batch_statistics(labels, probabilities, losses)``: inside a step, a
  batch's sums (examples, labels, predictions, losses, correct
  predictions) and, for the AUC, its positives and negatives counted per
  bucket of Keras' 200 evenly spaced thresholds. Every entry is a sum, so
  replicas' and steps' statistics are simply added
  (``strategy.reduce(SUM, ...)``, then on the host).
* ``RankingMetrics``: adds statistics on the host (float64) and computes
  the metrics from the totals, with ``keras.metrics.AUC``'s thresholds and
  interpolation.

Example:
  >>> import tensorflow as tf
  >>> from model_garden.ranking.metrics import RankingMetrics
  >>> from model_garden.ranking.metrics import batch_statistics
  >>> m = RankingMetrics()
  >>> m.add(batch_statistics(tf.constant([0.0, 1.0, 1.0]),
  ...                        tf.constant([0.2, 0.9, 0.6]),
  ...                        tf.constant([0.1, 0.2, 0.3])))
  >>> {k: round(v, 3) for k, v in m.result().items()}
  {'auc': 1.0, 'accuracy': 1.0, 'prediction_mean': 0.567, \
'label_mean': 0.667, 'loss': 0.2}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

#: Keras ``AUC``'s default number of thresholds.
NUM_THRESHOLDS = 200
#: The metrics, in report order.
NAMES = ("auc", "accuracy", "prediction_mean", "label_mean", "loss")


def batch_statistics(
  labels: tf.Tensor, probabilities: tf.Tensor, per_example_loss: tf.Tensor
) -> dict[str, tf.Tensor]:
  """A batch's additive statistics (float32 sums).

  Args:
    labels: ``[b]`` 0/1 labels.
    probabilities: ``[b]`` predicted click probabilities.
    per_example_loss: ``[b]`` losses.

  Returns:
    ``{"count", "label_sum", "prediction_sum", "loss_sum", "correct"}``
    scalars and ``"positives"``, ``"negatives"`` ``[NUM_THRESHOLDS]``: the
    examples whose prediction lies in each threshold bucket (as Keras'
    AUC buckets them: bucket ``i`` holds predictions above threshold
    ``i`` and at most threshold ``i + 1``).
  """
  labels = tf.reshape(tf.cast(labels, tf.float32), [-1])
  probabilities = tf.reshape(tf.cast(probabilities, tf.float32), [-1])
  losses = tf.reshape(tf.cast(per_example_loss, tf.float32), [-1])
  buckets = tf.nn.relu(
    tf.cast(tf.math.ceil(probabilities * (NUM_THRESHOLDS - 1)), tf.int32) - 1
  )
  buckets = tf.minimum(buckets, NUM_THRESHOLDS - 1)
  predicted = tf.cast(probabilities > 0.5, tf.float32)
  return {
    "count": tf.cast(tf.size(labels), tf.float32),
    "label_sum": tf.reduce_sum(labels),
    "prediction_sum": tf.reduce_sum(probabilities),
    "loss_sum": tf.reduce_sum(losses),
    "correct": tf.reduce_sum(tf.cast(tf.equal(predicted, labels), tf.float32)),
    "positives": tf.math.unsorted_segment_sum(labels, buckets, NUM_THRESHOLDS),
    "negatives": tf.math.unsorted_segment_sum(
      1.0 - labels, buckets, NUM_THRESHOLDS
    ),
  }


def roc_auc(positives: np.ndarray, negatives: np.ndarray) -> float:
  """Keras ``AUC()``'s value from per-bucket positive and negative counts.

  The ROC curve at Keras' thresholds, integrated by the trapezoidal rule
  (``summation_method="interpolation"``).
  """
  tp = np.cumsum(positives[::-1])[::-1]  # predictions above threshold i
  fp = np.cumsum(negatives[::-1])[::-1]
  fn, tn = positives.sum() - tp, negatives.sum() - fp
  with np.errstate(divide="ignore", invalid="ignore"):
    recall = np.where(tp + fn > 0, tp / (tp + fn), 0.0)
    fp_rate = np.where(fp + tn > 0, fp / (fp + tn), 0.0)
  heights = (recall[:-1] + recall[1:]) / 2.0
  return float(np.sum((fp_rate[:-1] - fp_rate[1:]) * heights))


class RankingMetrics:
  """The metrics of one split, from statistics added on the host.

  Example:
    >>> from model_garden.ranking.metrics import RankingMetrics
    >>> m = RankingMetrics()
    >>> m.result()["loss"], m.examples
    (0.0, 0)
  """

  def __init__(self) -> None:
    self._totals: dict[str, np.ndarray] = {}

  def add(self, statistics: Mapping[str, Any]) -> None:
    """Adds ``batch_statistics`` (tensors, RemoteValues' values, arrays)."""
    for name, value in statistics.items():
      value = np.asarray(value, np.float64)
      if name in self._totals:
        self._totals[name] = self._totals[name] + value
      else:
        self._totals[name] = value

  @property
  def examples(self) -> int:
    """Examples added since the last reset."""
    return int(self._totals.get("count", 0))

  def result(self) -> dict[str, float]:
    """``{name: value}`` over everything added since the last reset (zeros
    before anything is added)."""
    totals = self._totals
    count = float(totals.get("count", 0.0))
    if not count:
      return dict.fromkeys(NAMES, 0.0)
    return {
      "auc": roc_auc(totals["positives"], totals["negatives"]),
      "accuracy": float(totals["correct"]) / count,
      "prediction_mean": float(totals["prediction_sum"]) / count,
      "label_mean": float(totals["label_sum"]) / count,
      "loss": float(totals["loss_sum"]) / count,
    }

  def reset(self) -> None:
    """Forgets everything added."""
    self._totals = {}
