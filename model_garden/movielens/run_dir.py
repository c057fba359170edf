"""A MovieLens run's directory: per-epoch checkpoints, resume, TensorBoard.

``RunDirectory(model_dir, model)`` checkpoints everything a Keras model
of ``ranking`` or ``retrieval`` trains: the ``tpu_embedding`` tables and
their optimizer slots, every Keras weight, the Keras optimizer's state,
and the number of epochs done. On creation it restores the latest
checkpoint of ``model_dir`` (a killed or finished run continues from
there; epochs shuffle with ``seed + epoch``, so a resumed run sees the
batches an uninterrupted one would). ``end_epoch`` writes TensorBoard
scalars to ``model_dir/train`` and ``model_dir/validation`` and saves.

Build the model (call it on a batch) and its optimizer before creating
the directory, so that every variable exists to be restored.

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> from model_garden.movielens import ranking, run_dir
  >>> model = ranking.build_model(10, 20, ranking.RankingConfig(
  ...   embedding_dim=4, mlp_units=(8,)))
  >>> ids = {"user_id": np.array([1, 2]), "movie_id": np.array([3, 4])}
  >>> _ = model.fit(ids, np.array([0.5, 0.2]), verbose=0)
  >>> directory = tempfile.mkdtemp()
  >>> run = run_dir.RunDirectory(directory, model)
  >>> run.epochs_done, run.restored
  (0, None)
  >>> run.end_epoch(1, {"loss": 0.1}, {"rmse": 0.2}).endswith("ckpt-1")
  True
  >>> run_dir.RunDirectory(directory, model).epochs_done
  1
"""

from __future__ import annotations

import os
from typing import Any

import keras
import tensorflow as tf


class RunDirectory:
  """Checkpoints and summaries of a Keras model trained epoch by epoch.

  Args:
    model_dir: where checkpoints (``ckpt-<epoch>``) and summaries go (any
      TensorFlow filesystem).
    model: a built, compiled model whose ``embedding`` is a
      ``tpu_embedding.layers.TPUEmbedding``.
    max_to_keep: checkpoints kept.

  Attributes:
    restored: the checkpoint restored on creation, or None.
    manager: the ``tf.train.CheckpointManager``.
  """

  def __init__(self, model_dir: str, model: keras.Model, max_to_keep: int = 3):
    self.model_dir = model_dir
    self._epochs = tf.Variable(0, dtype=tf.int64, trainable=False)
    weights = {f"{i:03d}": w.value for i, w in enumerate(model.weights)}
    self.checkpoint = tf.train.Checkpoint(
      tables=model.embedding.mid_level_api,
      weights=weights,
      optimizer=model.optimizer,
      epochs=self._epochs,
    )
    self.manager = tf.train.CheckpointManager(
      self.checkpoint, model_dir, max_to_keep=max_to_keep
    )
    self.restored = self.manager.latest_checkpoint
    if self.restored:
      self.checkpoint.restore(self.restored).assert_existing_objects_matched()
    self._writers: dict[str, Any] = {}

  @property
  def epochs_done(self) -> int:
    """Epochs trained so far (restored, then counted by ``end_epoch``)."""
    return int(self._epochs.numpy())

  def _write(self, name: str, values: dict[str, float], step: int) -> None:
    if name not in self._writers:
      self._writers[name] = tf.summary.create_file_writer(
        os.path.join(self.model_dir, name)
      )
    with self._writers[name].as_default(step=step):
      for key, value in values.items():
        tf.summary.scalar(key, value)
    self._writers[name].flush()

  def end_epoch(
    self,
    epoch: int,
    train: dict[str, float],
    validation: dict[str, float],
  ) -> str:
    """Records that ``epoch`` epochs are done; returns the checkpoint.

    Args:
      epoch: epochs done (the TensorBoard step and checkpoint number).
      train: scalars for ``model_dir/train`` (e.g. the loss).
      validation: scalars for ``model_dir/validation``.
    """
    self._write("train", train, epoch)
    self._write("validation", validation, epoch)
    self._epochs.assign(epoch)
    return self.manager.save(checkpoint_number=epoch)


def build(model: keras.Model, features: dict[str, Any]) -> None:
  """Creates a compiled model's variables and its optimizer's (to restore
  a checkpoint into them before ``fit``)."""
  model(features)
  model.optimizer.build(model.trainable_variables)
