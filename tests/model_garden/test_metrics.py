"""Ranking metrics from additive statistics equal Keras' metrics.

The oracle is Keras: ``AUC()``, ``BinaryAccuracy()`` and ``Mean()`` fed the
whole data at once. Our statistics are computed per batch (in any split,
any order) and added on the host; the results must match Keras whatever
the split, which is what makes them exact when parameter-server workers
run steps concurrently.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking.metrics import RankingMetrics
from model_garden.ranking.metrics import batch_statistics


def keras_metrics(labels, probabilities, losses):
  auc = keras.metrics.AUC()
  auc.update_state(labels, probabilities)
  accuracy = keras.metrics.BinaryAccuracy()
  accuracy.update_state(labels, probabilities)
  return {
    "auc": float(auc.result()),
    "accuracy": float(accuracy.result()),
    "prediction_mean": float(np.mean(probabilities, dtype=np.float64)),
    "label_mean": float(np.mean(labels, dtype=np.float64)),
    "loss": float(np.mean(losses, dtype=np.float64)),
  }


@pytest.mark.parametrize("batches", [1, 7])
def test_added_batch_statistics_equal_keras_metrics(batches, rng):
  n = 3500
  labels = (rng.random(n) < 0.3).astype(np.float32)
  # Informative, with exact 0, 1, 0.5 and threshold values among them.
  probabilities = np.clip(
    0.35 * labels + rng.random(n).astype(np.float32) * 0.65, 0, 1
  ).astype(np.float32)
  probabilities[:5] = [0.0, 1.0, 0.5, 1 / 199, 198 / 199]
  losses = rng.random(n).astype(np.float32)
  metrics = RankingMetrics()
  order = rng.permutation(n)
  for part in np.array_split(order, batches):
    metrics.add(
      batch_statistics(
        tf.constant(labels[part]),
        tf.constant(probabilities[part]),
        tf.constant(losses[part]),
      )
    )
  got = metrics.result()
  want = keras_metrics(labels, probabilities, losses)
  assert metrics.examples == n
  assert list(got) == list(want)
  for name, value in want.items():
    assert got[name] == pytest.approx(value, abs=2e-6), name
  assert 0.75 < got["auc"] < 1.0


def test_empty_and_reset():
  metrics = RankingMetrics()
  assert metrics.result()["auc"] == 0.0
  metrics.add(
    batch_statistics(tf.constant([1.0]), tf.constant([0.9]), tf.constant([1.0]))
  )
  assert metrics.result()["loss"] == 1.0
  metrics.reset()
  assert metrics.examples == 0
