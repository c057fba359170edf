"""The ranking experiment's configuration: Model Garden's fields, frozen.

``ExperimentConfig`` mirrors Model Garden's ranking ``Config``
(``official/recommendation/ranking/configs/config.py``): ``runtime``,
``task`` (model, train and validation data, loss) and ``trainer``
(steps, intervals, optimizers), with the same field names and defaults, so
that Model Garden's YAML files and ``--params_override`` strings apply
as they are. A few fields are this package's own (marked "Ours" below),
and a few are Model Garden's but not supported here: they accept only their
default value (``support.check_supported`` rejects any other).

Configs are frozen dataclasses: ``overrides.override`` returns a new one.

Example:
  >>> from model_garden.ranking.configs import definitions
  >>> model = definitions.ModelConfig(vocab_sizes=(10, 20), embedding_dim=4)
  >>> model.interaction, model.embedding_dims()
  ('dot', (4, 4))
"""

from __future__ import annotations

import dataclasses

#: The interactions a ``ModelConfig`` may name.
INTERACTIONS = ("dot", "cross", "multi_layer_dcn")
#: ``ModelConfig.table_dtype`` and ``slot_dtype`` values.
_ROW_TYPES = ("float32", "bfloat16", "float16")

#: ``ModelConfig.vocabulary`` values.
VOCABULARIES = ("fixed", "dynamic")
#: Embedding optimizers by Keras name (``optimizers.embedding_optimizer``).
EMBEDDING_OPTIMIZERS = ("SGD", "Adagrad", "Adam", "FTRL")
#: Dense optimizers by Keras name (``optimizers.dense_optimizer``).
DENSE_OPTIMIZERS = ("Adam", "SGD", "Adagrad")
#: ``DataConfig.on_bad_record`` values (``data.bad_records``).
BAD_RECORD_POLICIES = ("raise", "count", "skip")
#: The installed PaddleRec sample's lines (``data_format="paddlerec"``
#: without input paths): 1-64 train, 65-80 validate.
PADDLEREC_SAMPLE_SPLITS = {"train_data": (1, 64), "validation_data": (65, 80)}
#: ``Task.holdout_every`` when only training files are given (``--data
#: GLOB``, or ``task.train_data.input_path`` alone): every 10th record of
#: each file validates, the other 9 train.
DEFAULT_HOLDOUT_EVERY = 10
#: ``--strategy`` / ``runtime.distribution_strategy`` values.
STRATEGIES = (
  "default",
  "one_device",
  "mirrored",
  "multi_worker_mirrored",
  "parameter_server",
  "tpu",
)


def _frozen(cls):
  return dataclasses.dataclass(frozen=True)(cls)


@_frozen
class LearningRateConfig:
  """``WarmUpAndPolyDecay``: linear warm-up, constant, polynomial decay.

  The rate is ``learning_rate * global_batch_size / 2048``, reached
  linearly over ``warmup_steps``, held until ``decay_start_steps``, then
  decayed as ``(1 - t / decay_steps) ** decay_exp`` (see
  ``lr_schedule``).

  Example:
    >>> from model_garden.ranking.configs.definitions import LearningRateConfig
    >>> LearningRateConfig().decay_start_steps
    70000
  """

  learning_rate: float = 1.25
  """The rate at a global batch of 2048 examples."""

  warmup_steps: int = 8000
  """Steps of linear warm-up from 0 (0: no warm-up, no floor)."""

  decay_steps: int = 30000
  """Steps of polynomial decay (0: no decay)."""

  decay_start_steps: int = 70000
  """The step at which the decay starts."""

  decay_exp: float = 2.0
  """The exponent of the polynomial decay."""


@_frozen
class OptimizationConfig:
  """The embedding and dense optimizers.

  Example:
    >>> from model_garden.ranking.configs.definitions import OptimizationConfig
    >>> config = OptimizationConfig()
    >>> config.embedding_optimizer, config.dense_optimizer
    ('SGD', 'Adam')
  """

  lr_config: LearningRateConfig = dataclasses.field(
    default_factory=LearningRateConfig
  )
  """The embedding optimizer's learning-rate schedule."""

  dense_sgd_config: LearningRateConfig = dataclasses.field(
    default_factory=lambda: LearningRateConfig(warmup_steps=0)
  )
  """The dense optimizer's schedule when ``dense_optimizer="SGD"``."""

  embedding_optimizer: str = "SGD"
  """``"SGD"``, ``"Adagrad"``, ``"Adam"`` or ``"FTRL"`` (ours): the
  tables' sparse optimizer, ``tpu_embedding.SGD`` etc."""

  dense_optimizer: str = "Adam"
  """``"Adam"``, ``"SGD"`` or ``"Adagrad"``: a Keras optimizer."""

  dense_learning_rate: float = 0.001
  """Ours: the learning rate of a dense ``Adam``/``Adagrad`` (Model
  Garden uses Keras' default, 0.001)."""


@_frozen
class DataConfig:
  """One split's input pipeline.

  Example:
    >>> from model_garden.ranking.configs.definitions import DataConfig
    >>> DataConfig(input_path="/data/day_*", global_batch_size=512).sharding
    True
  """

  input_path: str = ""
  """Glob pattern(s) of Criteo files, comma-separated; empty with
  synthetic data."""

  global_batch_size: int = 0
  """Examples per step over all replicas."""

  is_training: bool = True
  """Not supported: train_data is the training split (repeated),
  validation_data the evaluation split (read once); only those values."""

  dtype: str = "float32"
  """Dense feature dtype: ``float32``, ``bfloat16`` or ``float16`` (the
  features are cast to it before the model)."""

  shuffle_buffer_size: int = 10000
  """Not supported: only the default is accepted (the readers keep the
  files' order)."""

  cycle_length: int = 10
  """Files read in parallel."""

  sharding: bool = True
  """Each input pipeline reads its own files (multi-worker)."""

  num_shards_per_host: int = 8
  """Not supported: only the default is accepted."""

  use_cached_data: bool = False
  """Not supported: only the default is accepted (synthetic data is
  always in memory)."""

  on_bad_record: str = "raise"
  """Ours: a malformed record in the files: ``"raise"`` (stop, naming
  file and line), ``"count"`` (drop it, counts by kind in the logs and
  TensorBoard) or ``"skip"`` (drop it uncounted)."""


@_frozen
class ModelConfig:
  """The model: embeddings, bottom MLP, interaction, top MLP.

  Example:
    >>> from model_garden.ranking.configs.definitions import ModelConfig
    >>> config = ModelConfig(vocab_sizes=(10, 20), size_threshold=-1)
    >>> config.row_sharding_threshold() > 20  # every table replicated
    True
  """

  num_dense_features: int = 13
  """Dense (integer count) features per example."""

  vocab_sizes: tuple[int, ...] = ()
  """Rows of each categorical feature's table, in input order."""

  use_multi_hot: bool = False
  """Several ids per categorical feature (DLRM-DCNv2)."""

  multi_hot_sizes: tuple[int, ...] = ()
  """Ids per categorical feature when ``use_multi_hot``."""

  embedding_dim: int | tuple[int, ...] = 8
  """The tables' width: one for all, or one per table."""

  size_threshold: int = 50_000
  """Tables with more rows than this are row-sharded over the replicas
  (Model Garden: TPU embedding); smaller ones are replicated (Model
  Garden: a Keras embedding). 0: shard every table; -1: replicate all."""

  bottom_mlp: tuple[int, ...] = ()
  """Units of the MLP on the dense features; ReLU after every layer."""

  top_mlp: tuple[int, ...] = ()
  """Units of the MLP on the interaction; the last must be 1 (the logit,
  then a sigmoid)."""

  interaction: str = "dot"
  """``"dot"`` (DLRM), ``"cross"`` (DCN v2, one full-rank cross layer)
  or ``"multi_layer_dcn"`` (low-rank cross layers, DLRM-DCNv2)."""

  concat_dense: bool = True
  """Concatenate the bottom MLP's output to the interaction's output."""

  dcn_num_layers: int = 3
  """Cross layers of ``"multi_layer_dcn"``."""

  dcn_low_rank_dim: int = 512
  """Rank of the ``"multi_layer_dcn"`` cross kernels."""

  dcn_kernel_initializer: str = "truncated_normal"
  """Keras initializer of the cross kernels."""

  dcn_bias_initializer: str = "zeros"
  """Keras initializer of the cross biases."""

  dcn_use_bias: bool = True
  """Whether cross layers have biases."""

  vocabulary: str = "fixed"
  """Ours: ``"fixed"``: ids in ``[0, vocab_sizes[i])``; ``"dynamic"``: raw
  int64 keys of any value, each table a ``tpu_embedding.DynamicVocabulary``
  of ``vocab_sizes[i]`` rows (a key gets a row after
  ``vocabulary_min_count`` sightings; when its bucket is full the least
  recently or least often seen key is evicted)."""

  vocabulary_min_count: int = 1
  """Ours: sightings before a key of a dynamic table gets a row."""

  vocabulary_eviction: str = "lru"
  """Ours: ``"lru"`` or ``"lfu"``, which key a full dynamic table evicts."""

  vocabulary_ttl_steps: int = 0
  """Ours: a dynamic table's key unseen for this many steps loses its row
  to the next new key of its bucket; 0: never expires."""

  disk_directory: str = ""
  """Ours: a local directory (an SSD) where the tables of more than
  ``disk_size_threshold`` rows are kept, with their optimizer slots,
  behind a RAM cache of ``disk_cache_bytes`` each
  (``tpu_embedding.sharding.DiskTier``; one device, or row-sharded over
  the replicas of ``mirrored`` or ``multi_worker_mirrored``, each worker
  in its own ``worker<i>`` under it); "" keeps every table in memory."""

  disk_size_threshold: int = 1_000_000
  """Ours: with ``disk_directory``, tables with more rows than this are
  kept on disk; 0: every table."""

  disk_cache_bytes: int = 256 * 2**20
  """Ours: the RAM cache of each table kept on disk (its cached rows and
  their slots), on each replica under ``mirrored`` (each replica's block
  of the table has a cache this size); it must hold twice the distinct
  ids of a step that fall in the block."""

  table_dtype: str = "float32"
  """Ours: the type every table's rows are stored in: ``"float32"``,
  ``"bfloat16"`` or ``"float16"`` (``tpu_embedding.RowStorage``: lookups
  and update math stay float32; half the bytes)."""

  slot_dtype: str = "float32"
  """Ours: the type of the tables' optimizer slots (``"bfloat16"`` for
  Adagrad; Adam and FTRL need ``"float32"``)."""

  rounding: str = "stochastic"
  """Ours: how 16-bit tables round each update: ``"stochastic"``
  (unbiased, seeded by ``task.seed`` where set) or ``"nearest"``."""

  use_partial_tpu_embedding: bool = True
  """Model Garden's partial TPU embedding: False puts every table in the
  TPU embedding, here: shards every table (``size_threshold`` ignored)."""

  max_ids_per_chip_per_sample: int | None = None
  """TPU SparseCore; not supported: only the default is accepted."""

  max_ids_per_table: int | tuple[int, ...] | None = None
  """TPU SparseCore; not supported: only the default is accepted."""

  max_unique_ids_per_table: int | tuple[int, ...] | None = None
  """TPU SparseCore; not supported: only the default is accepted."""

  allow_id_dropping: bool = False
  """TPU SparseCore; not supported: only the default is accepted."""

  initialize_tables_on_host: bool = False
  """TPU SparseCore; not supported: only the default is accepted."""

  def embedding_dims(self) -> tuple[int, ...]:
    """One embedding width per table."""
    if isinstance(self.embedding_dim, int):
      return (self.embedding_dim,) * len(self.vocab_sizes)
    return tuple(self.embedding_dim)

  def disk_tables(self) -> tuple[int, ...]:
    """The indices of the tables kept on disk (``disk_directory``).

    Example:
      >>> from model_garden.ranking.configs.definitions import ModelConfig
      >>> ModelConfig(vocab_sizes=(10, 2000), disk_directory="/ssd",
      ...             disk_size_threshold=1000).disk_tables()
      (1,)
    """
    if not self.disk_directory:
      return ()
    return tuple(
      i
      for i, rows in enumerate(self.vocab_sizes)
      if rows > self.disk_size_threshold
    )

  def row_sharding_threshold(self) -> int:
    """``TPUEmbedding(row_sharding_threshold=...)`` for this model."""
    if not self.use_partial_tpu_embedding or self.size_threshold == 0:
      return 0
    if self.size_threshold < 0:
      return 2**62  # Replicate every table.
    return self.size_threshold


@_frozen
class Loss:
  """The binary cross-entropy loss."""

  label_smoothing: float = 0.0
  """Labels become ``y * (1 - s) + s / 2``."""


@_frozen
class SyntheticDataConfig:
  """Ours: the generated Criteo-like data (``data.synthetic``).

  Example:
    >>> from model_garden.ranking.configs.definitions import (
    ...   SyntheticDataConfig)
    >>> SyntheticDataConfig(num_train_examples=1024).num_eval_examples
    65536
  """

  seed: int = 0
  """The generator's seed (the hidden click model and every example)."""

  num_train_examples: int = 262_144
  """Examples ``0 .. n - 1`` are the training set (repeated)."""

  num_eval_examples: int = 65_536
  """The next examples are the validation set."""

  zipf_exponent: float = 1.05
  """Skew of the categorical ids."""


@_frozen
class Task:
  """What to train: the model, its data and its loss.

  Example:
    >>> from model_garden.ranking.configs.definitions import Task
    >>> task = Task(use_synthetic_data=True)
    >>> task.train_data.is_training, task.validation_data.is_training
    (True, False)
  """

  init_checkpoint: str = ""
  """A checkpoint to start from (when ``model_dir`` has none)."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  train_data: DataConfig = dataclasses.field(
    default_factory=lambda: DataConfig(is_training=True)
  )
  validation_data: DataConfig = dataclasses.field(
    default_factory=lambda: DataConfig(is_training=False)
  )
  loss: Loss = dataclasses.field(default_factory=Loss)

  use_synthetic_data: bool = False
  """Train and evaluate on ``synthetic`` data instead of files."""

  use_tf_record_reader: bool = False
  """Read ``input_path`` as TFRecord files of ``tf.train.Example``\\ s
  (``data.criteo_tfrecord``; ``tools/criteo_to_tfrecord.py`` converts
  TSV); ``data_format`` is then ignored."""

  data_format: str = "tsv"
  """Ours: ``"tsv"`` (raw Criteo click logs) or ``"paddlerec"`` (empty
  input paths: the installed 80-record sample, lines 1-64 to train,
  65-80 to validate)."""

  synthetic: SyntheticDataConfig = dataclasses.field(
    default_factory=SyntheticDataConfig
  )
  """Ours: the generated data set."""

  holdout_every: int = 0
  """Ours: ``N`` > 1 holds records ``N, 2N, 3N, ...`` of each file of
  ``train_data.input_path`` (lines of TSV, records of TFRecord files,
  numbered from 1 in each file) out of training: validation reads those,
  training the others (``data.text_files.Holdout``).
  ``validation_data.input_path`` is then empty. 0 (default): validation
  reads ``validation_data.input_path``. Set to ``DEFAULT_HOLDOUT_EVERY``
  (10) when only training files are given."""


@_frozen
class TimeHistoryConfig:
  """How often to log examples/s."""

  log_steps: int | None = None
  """Steps between log lines (None: ``summary_interval``)."""


@_frozen
class CallbacksConfig:
  """Not supported: only the defaults are accepted (Model Garden's Keras
  ``fit`` callbacks)."""

  enable_checkpoint_and_export: bool = True
  enable_backup_and_restore: bool = False
  enable_tensorboard: bool = True
  enable_time_history: bool = True


@_frozen
class TrainerConfig:
  """How long to train, how often to evaluate, save and log.

  Example:
    >>> from model_garden.ranking.configs.definitions import TrainerConfig
    >>> TrainerConfig(train_steps=100).validation_steps  # the whole set
    -1
  """

  train_steps: int = 0
  """Total training steps (a resumed run trains up to this step)."""

  validation_steps: int = -1
  """Evaluation steps; -1 evaluates the whole validation set."""

  validation_interval: int = 70000
  """Training steps between evaluations (``train_and_eval``)."""

  checkpoint_interval: int = 1000
  """Training steps between checkpoints (and one at the end)."""

  max_to_keep: int = 5
  """Checkpoints kept."""

  checkpoint_delta_interval: int = 0
  """Delta checkpoints (the rows changed since the previous save) written
  between full ones; 0: every checkpoint is full."""

  summary_interval: int = 1000
  """Training steps between TensorBoard summaries and log lines."""

  steps_per_loop: int = 1000
  """Training steps between host-side progress updates."""

  time_history: TimeHistoryConfig = dataclasses.field(
    default_factory=lambda: TimeHistoryConfig(log_steps=5000)
  )
  optimizer_config: OptimizationConfig = dataclasses.field(
    default_factory=OptimizationConfig
  )

  pipeline_sparse_and_dense_execution: bool = False
  """``TPUEmbedding(pipeline_execution_with_tensor_core=...)``."""

  enable_metrics_in_training: bool = True
  """Compute AUC, accuracy etc. on the training batches too."""

  validation_summary_subdir: str = "validation"
  """TensorBoard subdirectory of the evaluation summaries."""

  export_saved_model: bool = True
  """Ours: export a serving SavedModel at the end of training."""

  callbacks: CallbacksConfig = dataclasses.field(
    default_factory=CallbacksConfig
  )
  use_orbit: bool = True
  """Not supported: only the default is accepted (always a custom loop)."""
  train_tf_function: bool = True
  """Not supported: only the default is accepted."""
  train_tf_while_loop: bool = True
  """Not supported: only the default is accepted."""
  eval_tf_function: bool = True
  """Not supported: only the default is accepted."""
  eval_tf_while_loop: bool = False
  """Not supported: only the default is accepted."""
  best_checkpoint_export_subdir: str = ""
  """Keep the best evaluated checkpoint in ``model_dir/<this>`` with its
  metrics in ``info.json`` (Model Garden's ``BestCheckpointExporter``);
  empty: don't."""
  best_checkpoint_eval_metric: str = ""
  """The validation metric that decides which checkpoint is best."""
  best_checkpoint_metric_comp: str = "higher"
  """``"higher"`` or ``"lower"``: which values of that metric are better."""


@_frozen
class RuntimeConfig:
  """Where to run.

  Example:
    >>> from model_garden.ranking.configs.definitions import RuntimeConfig
    >>> RuntimeConfig().distribution_strategy
    'default'
  """

  distribution_strategy: str = "default"
  """One of ``STRATEGIES`` (``--strategy`` sets it)."""

  tpu: str = ""
  """The TPU address (``TPUClusterResolver(tpu=...)``)."""

  num_gpus: int = 0
  """Not supported: only the default is accepted (MirroredStrategy uses
  every GPU)."""

  mixed_precision_dtype: str = "float32"
  """``float32``, ``mixed_bfloat16`` or ``mixed_float16``: the dense
  model's Keras dtype policy (the tables stay float32)."""

  loss_scale: str | float | None = None
  """``mixed_float16`` only: None or ``"dynamic"`` (Keras' dynamic loss
  scale), or a number (a fixed scale)."""

  seed: int | None = None
  """Ours: seeds every initializer (``--seed``); None: random."""


@_frozen
class ExperimentConfig:
  """A whole ranking experiment.

  Example:
    >>> from model_garden.ranking.configs.definitions import ExperimentConfig
    >>> ExperimentConfig().trainer.optimizer_config.lr_config.learning_rate
    1.25
  """

  runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
  task: Task = dataclasses.field(default_factory=Task)
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)


def validate(config: ExperimentConfig) -> ExperimentConfig:
  """Checks that the fields agree; returns ``config``.

  Raises:
    ValueError: naming the field and what to change.

  Example:
    >>> from model_garden.ranking.configs import definitions as d
    >>> bad = d.ExperimentConfig(task=d.Task(model=d.ModelConfig(
    ...   vocab_sizes=(5,), interaction="sum")))
    >>> try:
    ...   d.validate(bad)
    ... except ValueError as e:
    ...   print(str(e)[:40])
    task.model.interaction must be one of ('
  """
  model, trainer = config.task.model, config.trainer
  opt = trainer.optimizer_config
  task = config.task
  checks = [
    (
      task.holdout_every == 0 or task.holdout_every > 1,
      "task.holdout_every must be 0 (validation reads "
      "task.validation_data.input_path) or > 1 (every N-th record of the "
      f"training files validates), got {task.holdout_every}.",
    ),
    (
      not task.holdout_every or not task.validation_data.input_path,
      f"task.holdout_every={task.holdout_every} validates on records held "
      "out of task.train_data.input_path, and "
      "task.validation_data.input_path is set too: remove one of them.",
    ),
    (
      not task.holdout_every
      or (bool(task.train_data.input_path) and not task.use_synthetic_data),
      f"task.holdout_every={task.holdout_every} holds records of "
      "task.train_data.input_path out for validation, and the task reads "
      "no training files (synthetic data or the PaddleRec sample): set "
      "task.holdout_every=0.",
    ),
    (
      model.interaction in INTERACTIONS,
      f"task.model.interaction must be one of {INTERACTIONS}, got "
      f"{model.interaction!r}.",
    ),
    (bool(model.vocab_sizes), "task.model.vocab_sizes is empty."),
    (
      model.table_dtype in _ROW_TYPES
      and model.slot_dtype in _ROW_TYPES
      and model.rounding in ("stochastic", "nearest"),
      f"task.model.table_dtype and slot_dtype must be one of {_ROW_TYPES} "
      "and rounding 'stochastic' or 'nearest'; got "
      f"{model.table_dtype!r}, {model.slot_dtype!r}, {model.rounding!r}.",
    ),
    (
      model.vocabulary in VOCABULARIES,
      f"task.model.vocabulary must be one of {VOCABULARIES}, got "
      f"{model.vocabulary!r}.",
    ),
    (
      model.vocabulary_eviction in ("lru", "lfu")
      and model.vocabulary_min_count >= 1
      and model.vocabulary_ttl_steps >= 0,
      "task.model.vocabulary_eviction must be 'lru' or 'lfu', "
      "vocabulary_min_count >= 1 and vocabulary_ttl_steps >= 0; got "
      f"{model.vocabulary_eviction!r}, {model.vocabulary_min_count}, "
      f"{model.vocabulary_ttl_steps}.",
    ),
    (
      model.disk_size_threshold >= 0 and model.disk_cache_bytes > 0,
      "task.model.disk_size_threshold must be >= 0 and disk_cache_bytes "
      f"positive; got {model.disk_size_threshold}, "
      f"{model.disk_cache_bytes}.",
    ),
    (
      "://" not in model.disk_directory,
      f"task.model.disk_directory={model.disk_directory!r} is not local: "
      "tables kept on disk need a local directory (an SSD).",
    ),
    (
      min(model.vocab_sizes, default=1) >= 1,
      "task.model.vocab_sizes must all be >= 1.",
    ),
    (
      len(model.embedding_dims()) == len(model.vocab_sizes),
      f"task.model.embedding_dim has {len(model.embedding_dims())} widths "
      f"for {len(model.vocab_sizes)} tables.",
    ),
    (
      bool(model.bottom_mlp) and bool(model.top_mlp),
      "task.model.bottom_mlp and top_mlp need at least one layer each.",
    ),
    (
      not model.top_mlp or model.top_mlp[-1] == 1,
      f"task.model.top_mlp must end with 1 unit (the logit), got "
      f"{list(model.top_mlp)}.",
    ),
    (
      not model.use_multi_hot
      or len(model.multi_hot_sizes) == len(model.vocab_sizes),
      f"task.model.multi_hot_sizes needs one size per table "
      f"({len(model.vocab_sizes)}), got {len(model.multi_hot_sizes)}.",
    ),
    (
      opt.embedding_optimizer in EMBEDDING_OPTIMIZERS,
      f"trainer.optimizer_config.embedding_optimizer must be one of "
      f"{EMBEDDING_OPTIMIZERS}, got {opt.embedding_optimizer!r}.",
    ),
    (
      opt.dense_optimizer in DENSE_OPTIMIZERS,
      f"trainer.optimizer_config.dense_optimizer must be one of "
      f"{DENSE_OPTIMIZERS}, got {opt.dense_optimizer!r}.",
    ),
    (
      config.runtime.distribution_strategy in STRATEGIES,
      f"runtime.distribution_strategy must be one of {STRATEGIES}, got "
      f"{config.runtime.distribution_strategy!r}.",
    ),
    (
      config.task.data_format in ("tsv", "paddlerec"),
      f'task.data_format must be "tsv" or "paddlerec", got '
      f"{config.task.data_format!r}.",
    ),
    (
      trainer.checkpoint_interval > 0 and trainer.summary_interval > 0,
      "trainer.checkpoint_interval and summary_interval must be positive.",
    ),
    (
      trainer.checkpoint_delta_interval >= 0,
      "trainer.checkpoint_delta_interval must be >= 0 (deltas between full "
      f"checkpoints), got {trainer.checkpoint_delta_interval}.",
    ),
  ]
  dims = set(model.embedding_dims())
  if model.interaction == "dot" and model.bottom_mlp:
    checks.append(
      (
        dims == {model.bottom_mlp[-1]},
        f"The dot interaction needs every embedding width to equal the "
        f"bottom MLP's last layer: embedding_dim {sorted(dims)}, bottom_mlp "
        f"{list(model.bottom_mlp)}.",
      )
    )
  for data, name in (
    (config.task.train_data, "train_data"),
    (config.task.validation_data, "validation_data"),
  ):
    checks.append(
      (
        data.global_batch_size > 0,
        f"task.{name}.global_batch_size must be positive, got "
        f"{data.global_batch_size}.",
      )
    )
    checks.append(
      (
        data.on_bad_record in BAD_RECORD_POLICIES,
        f"task.{name}.on_bad_record must be one of {BAD_RECORD_POLICIES}, "
        f"got {data.on_bad_record!r}.",
      )
    )
  train_batch = config.task.train_data.global_batch_size
  validation_batch = config.task.validation_data.global_batch_size
  checks.append(
    (
      train_batch == validation_batch,
      f"task.validation_data.global_batch_size ({validation_batch}) must "
      f"equal task.train_data.global_batch_size ({train_batch}): the "
      "embedding's output shapes are fixed by the first batch.",
    )
  )
  checks.extend(_sample_checks(config.task))
  for ok, message in checks:
    if not ok:
      raise ValueError(message)
  return config


def holds_out(task: Task) -> bool:
  """Whether validation reads records held out of the training files
  (``Task.holdout_every``).

  Example:
    >>> from model_garden.ranking.configs import definitions as d
    >>> d.holds_out(d.Task(holdout_every=10,
    ...   train_data=d.DataConfig(input_path="/data/day_*.tsv")))
    True
  """
  return (
    task.holdout_every > 0
    and not task.use_synthetic_data
    and bool(task.train_data.input_path)
  )


def split_input_path(task: Task, split: str) -> str:
  """The ``input_path`` globs ``split`` reads its records from: the
  training files for both splits under ``holdout_every``.

  Example:
    >>> from model_garden.ranking.configs import definitions as d
    >>> d.split_input_path(d.Task(holdout_every=10, train_data=d.DataConfig(
    ...   input_path="/data/day_*.tsv")), "validation_data")
    '/data/day_*.tsv'
  """
  if holds_out(task):
    return task.train_data.input_path
  return getattr(task, split).input_path


def paddlerec_sample_lines(task: Task, split: str) -> tuple[int, int] | None:
  """The PaddleRec sample's lines that ``split`` reads, or None.

  ``split`` (``"train_data"`` or ``"validation_data"``) reads the
  installed sample when the task reads PaddleRec files and the split has
  no ``input_path``.

  Example:
    >>> from model_garden.ranking.configs import definitions as d
    >>> d.paddlerec_sample_lines(d.Task(data_format="paddlerec"),
    ...                          "validation_data")
    (65, 80)
  """
  if (
    task.use_synthetic_data
    or task.use_tf_record_reader
    or task.data_format != "paddlerec"
    or getattr(task, split).input_path
  ):
    return None
  return PADDLEREC_SAMPLE_SPLITS[split]


def _sample_checks(task: Task) -> list[tuple[bool, str]]:
  """Batches must fit the PaddleRec sample's splits (64 and 16 lines)."""
  checks = []
  for name in ("train_data", "validation_data"):
    lines = paddlerec_sample_lines(task, name)
    if lines is None:
      continue
    first, last = lines
    size = last - first + 1
    batch = getattr(task, name).global_batch_size
    checks.append(
      (
        batch <= size,
        f"task.{name}.global_batch_size={batch}: the PaddleRec sample's "
        f"{name.split('_')[0]} split has {size} records (lines "
        f"{first}-{last}); set it to at most {size} (e.g. 16).",
      )
    )
  return checks
