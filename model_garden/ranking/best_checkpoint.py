"""Keeping the best evaluated checkpoint, as Model Garden's
``BestCheckpointExporter``.

With ``trainer.best_checkpoint_export_subdir`` set, every evaluation
compares ``best_checkpoint_eval_metric`` (``auc``, ``loss``, ...) with the
best so far (``best_checkpoint_metric_comp``: ``"higher"`` or ``"lower"``
is better). A better checkpoint is copied to
``model_dir/<subdir>/best_ckpt`` (a checkpoint prefix; the directory's
``checkpoint`` file names it, so ``tf.train.latest_checkpoint`` finds it
too). A delta checkpoint (``trainer.checkpoint_delta_interval``) is kept
with what it follows: the full checkpoint as ``best_ckpt``, the deltas up
to it under their names, and the directory's ``deltas.json``, as in a
run's directory. Restore the directory with ``task.init_checkpoint`` or
``tpu_embedding.checkpoints.saved_chain`` (then ``restore(checkpoint,
base, deltas=deltas)``); ``tf.train.Checkpoint.restore`` alone reads the
full checkpoint, without the deltas. Its metrics, with
``best_ckpt_global_step``, the source checkpoint and the deltas kept, are
written to ``model_dir/<subdir>/info.json``. A
restarted run (or a continuous evaluator) reads ``info.json`` and only
replaces the checkpoint with a better one. All file operations go through
``tf.io.gfile`` (any TensorFlow filesystem).

Example:
  >>> import os, tempfile
  >>> import tensorflow as tf
  >>> from model_garden.ranking.best_checkpoint import BestCheckpointExporter
  >>> root = tempfile.mkdtemp()
  >>> path = tf.train.Checkpoint(v=tf.Variable(1.0)).write(root + "/ckpt-3")
  >>> exporter = BestCheckpointExporter(root + "/best", "auc", "higher")
  >>> exporter.maybe_export({"auc": 0.7, "loss": 0.5}, path, step=3)
  True
  >>> exporter.maybe_export({"auc": 0.6, "loss": 0.4}, path, step=4)
  False
  >>> sorted(os.listdir(root + "/best"))[:2], exporter.best["auc"]
  (['best_ckpt.data-00000-of-00001', 'best_ckpt.index'], 0.7)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

import tpu_embedding as tpe

#: ``best_checkpoint_metric_comp`` values.
COMPARISONS = ("higher", "lower")
#: The checkpoint prefix and metrics file in the export directory.
CHECKPOINT_NAME = "best_ckpt"
INFO_NAME = "info.json"


class BestCheckpointExporter:
  """Copies the best checkpoint so far to ``export_dir``.

  Args:
    export_dir: ``model_dir/<best_checkpoint_export_subdir>``.
    metric: the validation metric to compare.
    comparison: ``"higher"`` or ``"lower"`` (better).

  Attributes:
    best: the best evaluation's metrics (with ``best_ckpt_global_step``),
      or None before the first.

  Raises:
    ValueError: for an unknown comparison.
  """

  def __init__(self, export_dir: str, metric: str, comparison: str):
    if comparison not in COMPARISONS:
      raise ValueError(
        f"trainer.best_checkpoint_metric_comp must be one of {COMPARISONS}, "
        f"got {comparison!r}."
      )
    self.export_dir = export_dir
    self.metric = metric
    self.comparison = comparison
    self.best: dict[str, Any] | None = None
    info = os.path.join(export_dir, INFO_NAME)
    if tf.io.gfile.exists(info):
      with tf.io.gfile.GFile(info, "r") as f:
        self.best = json.load(f)

  @property
  def checkpoint_path(self) -> str:
    """The exported checkpoint's prefix."""
    return os.path.join(self.export_dir, CHECKPOINT_NAME)

  def is_better(self, metrics: Mapping[str, float]) -> bool:
    """Whether ``metrics`` beat the best so far.

    Raises:
      KeyError: if ``metrics`` lacks the compared metric.
    """
    if self.metric not in metrics:
      raise KeyError(
        f"trainer.best_checkpoint_eval_metric {self.metric!r} is not among "
        f"the validation metrics {sorted(metrics)}."
      )
    if self.best is None or self.metric not in self.best:
      return True
    value, best = float(metrics[self.metric]), float(self.best[self.metric])
    return value > best if self.comparison == "higher" else value < best

  def maybe_export(
    self, metrics: Mapping[str, float], checkpoint: str, step: int
  ) -> bool:
    """Exports ``checkpoint`` (a prefix) if ``metrics`` are the best yet.

    Returns:
      Whether it was exported.
    """
    if not self.is_better(metrics):
      return False
    base, deltas = tpe.checkpoints.saved_chain(checkpoint)
    tf.io.gfile.makedirs(self.export_dir)
    for stale in tf.io.gfile.glob(os.path.join(self.export_dir, "delta-*")):
      tf.io.gfile.remove(stale)  # the previous best's deltas
    kept = []
    for source_prefix, prefix in [
      (base, self.checkpoint_path),
      *(
        (d, os.path.join(self.export_dir, os.path.basename(d))) for d in deltas
      ),
    ]:
      for source in tf.io.gfile.glob(source_prefix + ".*"):
        suffix = source[len(source_prefix) :]
        tf.io.gfile.copy(source, prefix + suffix, overwrite=True)
      kept.append(prefix)
    # A delta is kept with the full checkpoint and deltas it follows, as
    # a run's directory keeps them (its digests name its parents).
    tpe.checkpoints.write_chain(self.export_dir, kept[0], kept[1:])
    tf.compat.v1.train.update_checkpoint_state(
      self.export_dir, self.checkpoint_path
    )
    best = {name: float(value) for name, value in metrics.items()}
    best["best_ckpt_global_step"] = int(step)
    best["source_checkpoint"] = checkpoint
    best["deltas"] = [os.path.basename(d) for d in kept[1:]]
    with tf.io.gfile.GFile(os.path.join(self.export_dir, INFO_NAME), "w") as f:
      json.dump(best, f, indent=2)
    self.best = best
    return True
