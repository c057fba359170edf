"""Which config keys work here; the others are rejected, not ignored.

Model Garden's configs carry keys for its TPU and Keras ``fit`` paths that
have no counterpart here. ``check_supported(config)`` accepts each of them
only at its default value (so Model Garden's YAML files and our own
``params.yaml`` still load) and rejects any other value with a message
saying why it is not supported. It also rejects values of working keys
that do not fit together (``runtime.tpu`` without the ``tpu`` strategy,
``runtime.loss_scale`` without ``mixed_float16``, a best-checkpoint
export without a metric, ...).

``UNSUPPORTED`` lists those keys with the reason; ``IMPLEMENTED`` lists
every other key (``tests`` check that each key of the config is in
exactly one of them, so a new field must be classified).

Example:
  >>> from model_garden.ranking import configs
  >>> from model_garden.ranking.configs import support
  >>> config = configs.override(configs.get_config("dlrm_criteo"),
  ...                           {"runtime.num_gpus": 4})
  >>> try:
  ...   support.check_supported(config)
  ... except ValueError as e:
  ...   print(str(e)[:58])
  runtime.num_gpus=4 is not supported here: MirroredStrategy
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model_garden.ranking.configs import definitions
from model_garden.ranking.metrics import NAMES as METRIC_NAMES

_SPARSE_CORE = (
  "a TPU SparseCore setting that this package does not pass to "
  "TensorFlow's TPUEmbeddingV2"
)
_CALLBACKS = (
  "Model Garden's Keras fit callbacks; the custom loop here always "
  "checkpoints, resumes, writes TensorBoard summaries and logs examples/s"
)
_LOOP = (
  "steps are always tf.functions run one by one (read by the host every "
  "trainer.steps_per_loop steps)"
)

#: ``{dotted key: why only its default works here}``.
UNSUPPORTED: dict[str, str] = {
  "runtime.num_gpus": (
    "MirroredStrategy uses every visible GPU (choose them with "
    "CUDA_VISIBLE_DEVICES)"
  ),
  "task.model.max_ids_per_chip_per_sample": _SPARSE_CORE,
  "task.model.max_ids_per_table": _SPARSE_CORE,
  "task.model.max_unique_ids_per_table": _SPARSE_CORE,
  "task.model.allow_id_dropping": _SPARSE_CORE,
  "task.model.initialize_tables_on_host": _SPARSE_CORE,
  "trainer.callbacks.enable_checkpoint_and_export": _CALLBACKS,
  "trainer.callbacks.enable_backup_and_restore": _CALLBACKS,
  "trainer.callbacks.enable_tensorboard": _CALLBACKS,
  "trainer.callbacks.enable_time_history": _CALLBACKS,
  "trainer.use_orbit": "the training loop is always this package's own",
  "trainer.train_tf_function": _LOOP,
  "trainer.train_tf_while_loop": _LOOP,
  "trainer.eval_tf_function": _LOOP,
  "trainer.eval_tf_while_loop": _LOOP,
}
for _split in ("train_data", "validation_data"):
  UNSUPPORTED.update(
    {
      f"task.{_split}.shuffle_buffer_size": (
        "the readers keep the files' order (resuming replays the same "
        "batches); shuffle the files beforehand"
      ),
      f"task.{_split}.num_shards_per_host": (
        "input pipelines follow tf.distribute's input contexts"
      ),
      f"task.{_split}.use_cached_data": (
        "synthetic data is always in memory; files are streamed"
      ),
      f"task.{_split}.is_training": (
        "train_data is always the training split and validation_data the "
        "validation split"
      ),
    }
  )

#: Every other key: it works (read by the trainer, task, inputs or export).
IMPLEMENTED = frozenset(
  {
    "runtime.distribution_strategy",
    "runtime.tpu",
    "runtime.mixed_precision_dtype",
    "runtime.loss_scale",
    "runtime.seed",
    "task.init_checkpoint",
    "task.loss.label_smoothing",
    "task.use_synthetic_data",
    "task.use_tf_record_reader",
    "task.data_format",
    "task.holdout_every",
    "trainer.train_steps",
    "trainer.validation_steps",
    "trainer.validation_interval",
    "trainer.checkpoint_interval",
    "trainer.max_to_keep",
    "trainer.checkpoint_delta_interval",
    "trainer.summary_interval",
    "trainer.steps_per_loop",
    "trainer.time_history.log_steps",
    "trainer.pipeline_sparse_and_dense_execution",
    "trainer.enable_metrics_in_training",
    "trainer.validation_summary_subdir",
    "trainer.export_saved_model",
    "trainer.best_checkpoint_export_subdir",
    "trainer.best_checkpoint_eval_metric",
    "trainer.best_checkpoint_metric_comp",
  }
  | {
    f"task.model.{f.name}"
    for f in dataclasses.fields(definitions.ModelConfig)
    if f"task.model.{f.name}" not in UNSUPPORTED
  }
  | {
    f"task.{split}.{name}"
    for split in ("train_data", "validation_data")
    for name in (
      "input_path",
      "global_batch_size",
      "dtype",
      "cycle_length",
      "sharding",
      "on_bad_record",
    )
  }
  | {
    f"task.synthetic.{f.name}"
    for f in dataclasses.fields(definitions.SyntheticDataConfig)
  }
  | {
    f"trainer.optimizer_config.{schedule}.{f.name}"
    for schedule in ("lr_config", "dense_sgd_config")
    for f in dataclasses.fields(definitions.LearningRateConfig)
  }
  | {
    "trainer.optimizer_config.embedding_optimizer",
    "trainer.optimizer_config.dense_optimizer",
    "trainer.optimizer_config.dense_learning_rate",
  }
)

#: ``runtime.mixed_precision_dtype`` values.
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
#: ``task.*_data.dtype`` values (the dense features' dtype).
DATA_DTYPES = ("float32", "bfloat16", "float16")


def leaves(config: Any, prefix: str = "") -> dict[str, Any]:
  """``{dotted key: value}`` of every non-dataclass field of ``config``.

  Example:
    >>> from model_garden.ranking.configs import definitions, support
    >>> support.leaves(definitions.Loss())
    {'label_smoothing': 0.0}
  """
  values: dict[str, Any] = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    key = prefix + field.name
    if dataclasses.is_dataclass(value):
      values.update(leaves(value, key + "."))
    else:
      values[key] = value
  return values


def validate(
  config: definitions.ExperimentConfig,
) -> definitions.ExperimentConfig:
  """``definitions.validate`` and ``check_supported``; returns ``config``.

  Raises:
    ValueError: naming the field and what to change.
  """
  check_supported(definitions.validate(config))
  return config


def check_supported(config: definitions.ExperimentConfig) -> None:
  """Rejects keys set to values that would have no effect here, and
  combinations that do not fit together.

  Raises:
    ValueError: naming the key, its value and why.
  """
  defaults = leaves(definitions.ExperimentConfig())
  for key, value in leaves(config).items():
    if key in UNSUPPORTED and value != defaults[key]:
      raise ValueError(
        f"{key}={value!r} is not supported here: {UNSUPPORTED[key]}. "
        f"Remove it (only the default, {defaults[key]!r}, is accepted)."
      )
  runtime, trainer = config.runtime, config.trainer
  if runtime.mixed_precision_dtype not in PRECISIONS:
    raise ValueError(
      f"runtime.mixed_precision_dtype must be one of {PRECISIONS}, got "
      f"{runtime.mixed_precision_dtype!r}."
    )
  if (
    runtime.loss_scale is not None
    and runtime.mixed_precision_dtype != "mixed_float16"
  ):
    raise ValueError(
      f"runtime.loss_scale={runtime.loss_scale!r} applies to "
      f"mixed_precision_dtype mixed_float16 only (this run: "
      f"{runtime.mixed_precision_dtype})."
    )
  if isinstance(runtime.loss_scale, str) and runtime.loss_scale != "dynamic":
    raise ValueError(
      f'runtime.loss_scale must be "dynamic" or a positive number, got '
      f"{runtime.loss_scale!r}."
    )
  if isinstance(runtime.loss_scale, float) and runtime.loss_scale <= 0:
    raise ValueError(
      f"runtime.loss_scale must be positive, got {runtime.loss_scale}."
    )
  if runtime.tpu and runtime.distribution_strategy != "tpu":
    raise ValueError(
      f"runtime.tpu={runtime.tpu!r} applies to the tpu strategy, not "
      f"{runtime.distribution_strategy}."
    )
  _check_disk(config)
  for split in ("train_data", "validation_data"):
    dtype = getattr(config.task, split).dtype
    if dtype not in DATA_DTYPES:
      raise ValueError(
        f"task.{split}.dtype must be one of {DATA_DTYPES}, got {dtype!r}."
      )
  if trainer.steps_per_loop <= 0:
    raise ValueError(
      f"trainer.steps_per_loop must be positive, got {trainer.steps_per_loop}."
    )
  if trainer.best_checkpoint_export_subdir:
    if trainer.best_checkpoint_eval_metric not in METRIC_NAMES:
      raise ValueError(
        f"trainer.best_checkpoint_export_subdir is set, so "
        f"trainer.best_checkpoint_eval_metric must name a validation "
        f"metric, one of {METRIC_NAMES}; got "
        f"{trainer.best_checkpoint_eval_metric!r}."
      )
    if trainer.best_checkpoint_metric_comp not in ("higher", "lower"):
      raise ValueError(
        f'trainer.best_checkpoint_metric_comp must be "higher" or "lower", '
        f"got {trainer.best_checkpoint_metric_comp!r}."
      )
  elif trainer.best_checkpoint_eval_metric:
    raise ValueError(
      "trainer.best_checkpoint_eval_metric is set but "
      "trainer.best_checkpoint_export_subdir is empty: set the directory "
      "to keep the best checkpoint in."
    )


#: The strategies that train tables kept on disk (one device, or
#: row-sharded over the replicas of one process or of a cluster's workers,
#: each worker in its own subdirectory: ``embedding.disk_directory``).
DISK_STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored")


def _check_disk(config: definitions.ExperimentConfig) -> None:
  """Refuses what tables kept on disk do not run with: other strategies
  than ``DISK_STRATEGIES``, dynamic vocabularies.

  Example:
    >>> from model_garden.ranking import configs
    >>> from model_garden.ranking.configs import support
    >>> config = configs.override(configs.get_config("dlrm_criteo"), {
    ...   "task.model.disk_directory": "/ssd/tables",
    ...   "runtime.distribution_strategy": "parameter_server"})
    >>> try:
    ...   support.check_supported(config)
    ... except ValueError as e:
    ...   print(str(e)[:61])
    task.model.disk_directory keeps 6 table(s) on disk (more rows
  """
  model = config.task.model
  count = len(model.disk_tables())
  if not count:
    return
  kept = (
    f"task.model.disk_directory keeps {count} table(s) on disk (more rows "
    f"than disk_size_threshold={model.disk_size_threshold})"
  )
  strategy = config.runtime.distribution_strategy
  if strategy not in DISK_STRATEGIES:
    raise ValueError(
      f"{kept}, which train on one device or row-sharded over mirrored "
      "replicas (--strategy default, one_device, mirrored or "
      f"multi_worker_mirrored), not {strategy}: use one of those, or remove "
      "task.model.disk_directory."
    )
  if model.vocabulary != "fixed":
    raise ValueError(
      f"{kept}, and task.model.vocabulary={model.vocabulary!r}: tables "
      "with a dynamic vocabulary are not kept on disk; use "
      "vocabulary=fixed, or remove task.model.disk_directory."
    )
