"""Serving export: a trained ranking model as a SavedModel.

``export_from_checkpoint(config, checkpoint, export_dir)`` rebuilds the
experiment's tables (a ``tpu_embedding.TPUEmbeddingForServing``, whole
tables on this host) and dense model outside any strategy, restores them
from a training checkpoint (written on any strategy and replica count:
checkpoints hold whole tables) and writes a SavedModel with
``tpu_embedding.export.export_for_serving``. Its ``serving_default``
signature takes

.. code-block:: text

  dense_features  float32 (B, 13)   the transformed counts, as in training
  sparse_<i>      int64 (B,)        feature i's id (one-hot models), or
                  int64 (B, k_i)    its multi-hot ids, padded with -1

and returns ``predictions``, the click probability ``(B,)``. It loads
with TensorFlow alone (``tf.saved_model.load``, TF Serving). It records
the checkpoint it was made from, so that ``tools/export.py --apply_delta``
makes the next versions from the run's delta checkpoints.

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> import tensorflow as tf
  >>> from model_garden.ranking import configs, saved_model, task
  >>> config = configs.override(configs.get_config("dlrm_criteo_cpu_small"),
  ...   {"task.model.vocab_sizes": [20] * 26})
  >>> trained = task.RankingTask(config, tf.distribute.get_strategy())
  >>> path = trained.checkpoint.save(tempfile.mkdtemp() + "/ckpt")
  >>> result = saved_model.export_from_checkpoint(config, path,
  ...                                             tempfile.mkdtemp())
  >>> serve = tf.saved_model.load(result.export_dir).signatures[
  ...   "serving_default"]
  >>> inputs = saved_model.example_request(config, batch_size=2)
  >>> serve(**inputs)["predictions"].shape.as_list()
  [2]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

import tpu_embedding as tpe
from model_garden.ranking import embedding as ranking_embedding
from model_garden.ranking import model as ranking_model
from model_garden.ranking.configs import definitions
from tpu_embedding import export
from tpu_embedding.export.quantize import check_table_dtype


def input_name(index: int) -> str:
  """The signature input of categorical feature ``index``."""
  return f"sparse_{index}"


def input_signature(config: definitions.ModelConfig) -> dict[str, Any]:
  """The serving signature's inputs (see the module docstring)."""
  signature: dict[str, Any] = {
    "dense_features": tf.TensorSpec(
      [None, config.num_dense_features], tf.float32
    )
  }
  for i in range(len(config.vocab_sizes)):
    shape = (
      [None, config.multi_hot_sizes[i]] if config.use_multi_hot else [None]
    )
    signature[input_name(i)] = export.FeatureSpec(shape, feature=str(i))
  return signature


def serving_model(model: ranking_model.RankingModel, num_features: int) -> Any:
  """``model`` as the exported signature's body: inputs → probabilities."""

  def serve(inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    logits = model(
      {
        "dense_features": inputs["dense_features"],
        "embeddings": [inputs[input_name(i)] for i in range(num_features)],
      },
      training=False,
    )
    return {"predictions": tf.sigmoid(logits)}

  return serve


def export_from_checkpoint(
  config: definitions.ExperimentConfig,
  checkpoint: str,
  export_dir: str,
  table_dtype: str = "float32",
) -> export.ExportResult:
  """Writes the serving SavedModel of a training checkpoint.

  Args:
    config: the experiment the checkpoint was trained with.
    checkpoint: a save: a run directory (its latest save, the deltas
      after its last full checkpoint applied), a full checkpoint's prefix,
      or a delta's (applied after the saves it follows).
    export_dir: where to write the SavedModel.
    table_dtype: the type the tables are stored in (``export_for_serving``).

  Returns:
    ``tpu_embedding.export.ExportResult`` (``export_dir``, inputs, ...).

  Raises:
    ValueError: if no checkpoint is found, a delta's chain is not
      recorded, or for an unknown ``table_dtype``.
    AssertionError: the checkpoint lacks a table or model variable.
  """
  check_table_dtype(table_dtype)  # before restoring anything
  model_config = config.task.model
  tables = tpe.TPUEmbeddingForServing(
    ranking_embedding.feature_config(model_config), optimizer=None
  )
  model = ranking_model.build_model(model_config)
  model(ranking_model.example_inputs(model_config))
  checkpoint_objects = tf.train.Checkpoint(embedding=tables, model=model)
  path = export.restore_for_export(checkpoint_objects, checkpoint, tables)
  return export.export_for_serving(
    export_dir,
    tables,
    serving_model(model, len(model_config.vocab_sizes)),
    input_signature(model_config),
    table_dtype=table_dtype,
    # Recorded: the next versions are made from deltas of this run.
    source=export.ExportSource(path, checkpoint_objects),
  )


def example_request(
  config: definitions.ExperimentConfig, batch_size: int = 4, seed: int = 0
) -> dict[str, tf.Tensor]:
  """Random valid signature inputs (for smoke tests).

  Example:
    >>> from model_garden.ranking import configs, saved_model
    >>> request = saved_model.example_request(
    ...   configs.get_config("dlrm_dcn_v2_criteo_cpu_small"), batch_size=3)
    >>> request["sparse_20"].shape.as_list()
    [3, 4]
  """
  model = config.task.model
  rng = np.random.default_rng(seed)
  request = {
    "dense_features": tf.constant(
      rng.random((batch_size, model.num_dense_features)), tf.float32
    )
  }
  for i, size in enumerate(model.vocab_sizes):
    shape = (
      (batch_size, model.multi_hot_sizes[i])
      if model.use_multi_hot
      else (batch_size,)
    )
    request[input_name(i)] = tf.constant(rng.integers(0, size, shape), tf.int64)
  return request
