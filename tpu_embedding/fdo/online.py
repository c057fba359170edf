"""FDO while training: ``FdoTracker``, ``keras_callback``, ``local_batch``.

A custom training loop hands each global batch to an ``FdoTracker``
(``local_batch`` joins a worker's per-replica features back into the
batch), which writes ``<stats_dir>/fdo_stats.json`` every N steps with
the cost of the statistics next to a training step's; ``keras_callback``
does the same under ``model.fit`` by tapping the dataset.

Example:
  >>> import os
  >>> import tempfile
  >>> import numpy as np
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.fdo.collector import FdoCollector
  >>> table = tpe.TableConfig(64, 8, name="t")
  >>> tracker = FdoTracker(
  ...     FdoCollector({"f": tpe.FeatureConfig(table)}, (1, 4),
  ...                  optimizer=tpe.SGD(0.1)),
  ...     tempfile.mkdtemp(), every_n_steps=2)
  >>> for _ in range(2):
  ...   tracker.observe({"f": np.arange(16) % 8})
  >>> os.path.basename(tracker.path), os.path.exists(tracker.path)
  ('fdo_stats.json', True)
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding.engines import fdo_file as files
from tpu_embedding.fdo import samples
from tpu_embedding.fdo.collector import FdoCollector


def _concat(parts: list[Any]) -> Any:
  if isinstance(parts[0], tf.SparseTensor):
    return tf.sparse.concat(0, parts, expand_nonconcat_dims=True)
  return tf.concat(parts, axis=0)


def local_batch(strategy: tf.distribute.Strategy, features: Any) -> Any:
  """This worker's per-replica ``features`` as one batch, in replica order
  (what ``experimental_distribute_dataset`` split)."""
  leaves = tf.nest.flatten(features, expand_composites=False)
  joined = []
  for leaf in leaves:
    parts = list(strategy.experimental_local_results(leaf))
    joined.append(parts[0] if len(parts) == 1 else _concat(parts))
  return tf.nest.pack_sequence_as(features, joined, expand_composites=False)


class FdoTracker:
  """An ``FdoCollector`` that writes its statistics every N steps.

  Attributes:
    collector: the ``FdoCollector``.
    seconds: time spent computing statistics.
    path: the file written (``<stats_dir>/fdo_stats.json``).
  """

  def __init__(
    self,
    collector: FdoCollector,
    stats_dir: str,
    every_n_steps: int = 100,
  ):
    if every_n_steps < 1:
      raise ValueError(f"every_n_steps must be >= 1; got {every_n_steps}.")
    self.collector = collector
    self.every_n_steps = int(every_n_steps)
    os.makedirs(stats_dir, exist_ok=True)
    self.path = os.path.join(stats_dir, "fdo_stats.json")
    self.seconds = 0.0
    self.train_seconds: float | None = None

  def observe(self, features: Any) -> None:
    """Adds one global batch; writes the file every ``every_n_steps``."""
    start = time.perf_counter()
    self.collector.update(features)
    self.seconds += time.perf_counter() - start
    if self.collector.steps % self.every_n_steps == 0:
      self.save()

  def save(self) -> str | None:
    """Writes the statistics (with the cost, if ``train_seconds`` is set);
    None before any batch."""
    if self.collector.steps == 0:
      return None
    data = self.collector.result().to_json()
    data["cost"] = self.cost()
    return files.save_json(data, self.path)

  def cost(self) -> dict[str, float | None]:
    """Seconds per batch of the statistics, and per training step when
    ``train_seconds`` (the steps' time without the statistics) is set."""
    steps = max(1, self.collector.steps)
    per_batch = self.seconds / steps
    step = None if self.train_seconds is None else self.train_seconds / steps
    return {
      "fdo_seconds_per_batch": per_batch,
      "train_step_seconds": step,
      "fdo_over_train_step": per_batch / step if step else None,
    }


def keras_callback(
  feature_config: Any,
  topology_spec: Any,
  stats_dir: str,
  *,
  every_n_steps: int = 100,
  features_fn: Any = None,
  **collector_kwargs: Any,
) -> Any:
  """A Keras callback that keeps FDO statistics while ``fit`` trains.

  A callback sees no batches, so it taps the dataset: pass
  ``callback.tap(dataset)`` to ``fit`` (a ``tf.data`` map that hands each
  global batch's ids to the collector on the input pipeline's thread), and
  the callback writes ``<stats_dir>/fdo_stats.json`` every
  ``every_n_steps`` batches and at the end of training.

  Args:
    feature_config: see ``FdoCollector``.
    topology_spec: the TPU the limits are for.
    stats_dir: where the statistics go.
    every_n_steps: write every this many batches.
    features_fn: the features of a dataset element (default: its first
      item of a tuple, else the element).
    **collector_kwargs: ``optimizer``, ``percentile``, ``limits``.

  Returns:
    The ``keras.callbacks.Callback``.
  """
  import keras  # noqa: PLC0415

  tracker = FdoTracker(
    FdoCollector(feature_config, topology_spec, **collector_kwargs),
    stats_dir,
    every_n_steps,
  )
  features_of = features_fn or samples.features_of

  class FdoCallback(keras.callbacks.Callback):
    """Writes FDO statistics of the tapped dataset while ``fit`` runs."""

    def __init__(self):
      super().__init__()
      self.tracker = tracker

    def tap(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
      spec = dataset.element_spec
      features_spec = features_of(spec)

      def observe(*flat):
        features = tf.nest.pack_sequence_as(
          features_spec, list(flat), expand_composites=True
        )
        tracker.collector.update(features)
        return np.int64(0)

      def fn(*element):
        element = element[0] if len(element) == 1 else element
        flat = tf.nest.flatten(features_of(element), expand_composites=True)
        token = tf.py_function(observe, flat, tf.int64)
        with tf.control_dependencies([token]):
          return tf.nest.map_structure(
            tf.identity, element, expand_composites=True
          )

      return dataset.map(fn)

    def on_train_batch_end(self, batch, logs=None):
      if tracker.collector.steps and (batch + 1) % every_n_steps == 0:
        tracker.save()

    def on_train_end(self, logs=None):
      tracker.save()

  return FdoCallback()
