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

and returns ``predictions``, the click probability ``(B,)``. Its
``serving_raw`` signature (``RAW_SIGNATURE``) takes a Criteo TSV line's
fields as they are, strings, and preprocesses them exactly as the
trainer reads TSV files (``data.criteo.parse_fields``, the reader's own
parser) before the same model:

.. code-block:: text

  counts       string (B, 13)  the integer counts; empty: missing (0),
                               negative: 0, then log(1 + x)
  categorical  string (B, 26)  the hex values; id int(v, 16) % vocab_size,
                               empty: missing (id 0); multi-hot models
                               expand the id as training does

A field the trainer's reader would reject (not an integer, not 1-16 hex
digits, holding a tab) fails the request, naming its rows. Models
trained on PaddleRec lines (``task.data_format=paddlerec``, ids hashed
by PaddleRec) get no ``serving_raw``. Both signatures load with
TensorFlow alone (``tf.saved_model.load``, TF Serving,
``saved_model_cli``). The export records the checkpoint it was made
from, so that ``tools/export.py --apply_delta`` makes the next versions
from the run's delta checkpoints.

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
  >>> raw = tf.saved_model.load(result.export_dir).signatures["serving_raw"]
  >>> raw(counts=tf.constant([["3"] + [""] * 12] * 2),
  ...     categorical=tf.constant([["68fd1e64"] * 26] * 2)
  ...     )["predictions"].shape.as_list()
  [2]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

import tpu_embedding as tpe
from model_garden.ranking import embedding as ranking_embedding
from model_garden.ranking import inputs as ranking_inputs
from model_garden.ranking import model as ranking_model
from model_garden.ranking.configs import definitions
from model_garden.ranking.data import criteo
from model_garden.ranking.data import criteo_schema
from tpu_embedding import export
from tpu_embedding.export.quantize import check_table_dtype
from tpu_embedding.sharding import DiskTier


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


#: The signature taking a Criteo line's raw fields.
RAW_SIGNATURE = "serving_raw"
#: Its inputs: the counts and the categorical values, as strings.
RAW_COUNTS, RAW_CATEGORICAL = "counts", "categorical"


def raw_input_signature() -> dict[str, tf.TensorSpec]:
  """``serving_raw``'s inputs (see the module docstring)."""
  return {
    RAW_COUNTS: tf.TensorSpec(
      [None, criteo_schema.NUM_DENSE_FEATURES], tf.string
    ),
    RAW_CATEGORICAL: tf.TensorSpec(
      [None, criteo_schema.NUM_SPARSE_FEATURES], tf.string
    ),
  }


def raw_preprocessing(
  config: definitions.ExperimentConfig,
) -> export.PreprocessedSignature | None:
  """``serving_raw``: raw fields → ``serving_default``'s inputs, as the
  trainer reads TSV files; None for PaddleRec-trained models.

  The fields are parsed by the reader's own parser with the trainer's
  ``inputs.criteo_config``, bad fields fail the request, and the counts
  are rounded to ``validation_data.dtype`` as evaluation feeds them.

  Example:
    >>> import tensorflow as tf
    >>> from model_garden.ranking import configs, saved_model
    >>> raw = saved_model.raw_preprocessing(
    ...   configs.get_config("dlrm_criteo_cpu_small"))
    >>> request = raw.preprocess({
    ...   "counts": tf.constant([["1"] + [""] * 12]),
    ...   "categorical": tf.constant([["ff"] * 26])})
    >>> request["sparse_0"].numpy().tolist(), request["sparse_5"].numpy()
    ([255], array([0]))
  """
  task = config.task
  if task.data_format == "paddlerec" and not (
    task.use_synthetic_data or task.use_tf_record_reader
  ):
    return None  # ids hashed by PaddleRec (TFRecords: converted from TSV)
  reader_config = ranking_inputs.criteo_config(task)
  dtype = task.validation_data.dtype
  num_features = len(task.model.vocab_sizes)

  def preprocess(raw: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    parsed = criteo.parse_fields(
      raw[RAW_COUNTS], raw[RAW_CATEGORICAL], reader_config
    )
    bad = tf.reduce_any(parsed.problems, axis=1)
    check = tf.debugging.Assert(
      tf.logical_not(tf.reduce_any(bad)),
      [
        f"{RAW_SIGNATURE}: fields the trainer's reader rejects (counts: "
        "integers of at most 18 digits or empty; categorical: 1-16 hex "
        "digits or empty; no tabs). Rows:",
        tf.where(bad)[:, 0],
      ],
      summarize=20,
    )
    with tf.control_dependencies([check]):
      features, _ = criteo.to_features(parsed, reader_config)
      dense = tf.cast(features["dense_features"], dtype)
    request = {"dense_features": tf.cast(dense, tf.float32)}
    for i in range(num_features):
      ids = features["sparse_features"][str(i)]
      request[input_name(i)] = tf.cast(ids, tf.int64)
    return request

  return export.PreprocessedSignature(raw_input_signature(), preprocess)


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
  with _export_disk(model_config) as disk:
    tables = tpe.TPUEmbeddingForServing(
      ranking_embedding.feature_config(model_config), optimizer=None, disk=disk
    )
    model = ranking_model.build_model(model_config)
    model(ranking_model.example_inputs(model_config))
    checkpoint_objects = tf.train.Checkpoint(embedding=tables, model=model)
    path = export.restore_for_export(checkpoint_objects, checkpoint, tables)
    raw = raw_preprocessing(config)
    return export.export_for_serving(
      export_dir,
      tables,
      serving_model(model, len(model_config.vocab_sizes)),
      input_signature(model_config),
      table_dtype=table_dtype,
      # Recorded: the next versions are made from deltas of this run.
      source=export.ExportSource(path, checkpoint_objects),
      extra_signatures=None if raw is None else {RAW_SIGNATURE: raw},
    )


#: The cache of each table an export keeps on disk.
_EXPORT_CACHE = 2**20


@contextlib.contextmanager
def _export_disk(model: definitions.ModelConfig) -> Iterator[DiskTier]:
  """The tables training keeps on disk stay on disk while exporting (so
  that tables larger than memory export), in files of their own in a new
  directory under ``disk_directory``, removed afterwards. Their caches
  are small: the export reads rows without caching them (``peek``)."""
  names = ranking_embedding.disk_table_names(model)
  if not names:
    yield DiskTier()
    return
  os.makedirs(model.disk_directory, exist_ok=True)
  directory = tempfile.mkdtemp(prefix="export-", dir=model.disk_directory)
  try:
    yield DiskTier(directory, min(model.disk_cache_bytes, _EXPORT_CACHE), names)
  finally:
    shutil.rmtree(directory, ignore_errors=True)


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
