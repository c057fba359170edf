"""Input pipelines of a ranking experiment: synthetic, Criteo TSV, PaddleRec.

``RankingInputs(task_config, strategy)`` builds the training and
validation datasets of ``Task`` and distributes them with
``strategy.distribute_datasets_from_function`` (ids kept on the host,
``tpu_embedding.data.input_options()``). Batches are

.. code-block:: text

  ({"dense_features": float32 (b, 13),
    "sparse_features": {"0": int32 (b,) or SparseTensor (b, k_0), ...}},
   labels: float32 (b,))

per replica (``b = global_batch_size / replicas``); multi-hot ids become
``SparseTensor``\\ s so that the tables' ``mean`` combiner applies.

Sources (``Task``):

* ``use_synthetic_data``: ``data.synthetic.SyntheticCriteo`` over the
  model's vocabularies; examples ``0 .. num_train_examples - 1`` train
  (cycled), the next ``num_eval_examples`` validate. Generated once per
  process and held in memory; a batch is a slice (no per-example work).
* files: ``input_path`` globs (comma-separated) of raw Criteo TSV
  (``data_format="tsv"``) or PaddleRec lines (``"paddlerec"``), read by
  ``data.criteo.CriteoReader``; with ``"paddlerec"`` and no path, the
  installed 80-record sample (lines 1-64 train, 65-80 validate).
* TFRecord files (``use_tf_record_reader``): ``input_path`` globs of
  Model Garden's ``tf.train.Example`` records, read by
  ``data.criteo_tfrecord.CriteoTFRecordReader``.
* a split held out of the training files (``Task.holdout_every = N``,
  the default when only training files are given): both splits read
  ``train_data.input_path``, validation records ``N, 2N, ...`` of each
  file and training the others (``data.text_files.Holdout``), TSV and
  TFRecord alike; ``split_note`` says so in the log.

Malformed records follow each split's ``on_bad_record`` (``"raise"``,
``"count"``, ``"skip"``); ``bad_record_scalars`` and ``bad_record_note``
report the counts of ``"count"``.

Training data is deterministic and starts at a given step
(``start_step``): a run resumed from step ``k`` sees exactly the batches an
uninterrupted run sees from step ``k`` on (files are re-read up to there).

Example:
  >>> from model_garden.ranking import inputs
  >>> from model_garden.ranking.configs import definitions as d
  >>> task = d.Task(
  ...   model=d.ModelConfig(vocab_sizes=(50,) * 26, embedding_dim=4),
  ...   use_synthetic_data=True,
  ...   train_data=d.DataConfig(global_batch_size=8),
  ...   synthetic=d.SyntheticDataConfig(num_train_examples=64,
  ...                                   num_eval_examples=16))
  >>> ds = inputs.RankingInputs(task).train_dataset_fn()(None)
  >>> features, labels = next(iter(ds))
  >>> features["dense_features"].shape.as_list(), labels.shape.as_list()
  ([8, 13], [8])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from model_garden.ranking.configs import definitions
from model_garden.ranking.data import bad_records
from model_garden.ranking.data import criteo
from model_garden.ranking.data import criteo_tfrecord
from model_garden.ranking.data import paddlerec
from model_garden.ranking.data import synthetic
from model_garden.ranking.data import text_files
from tpu_embedding import data

DatasetFn = Callable[[tf.distribute.InputContext | None], tf.data.Dataset]
#: The task's data splits (``Task`` fields).
SPLITS = ("train_data", "validation_data")


@functools.lru_cache(maxsize=4)
def _synthetic_split(
  generator: synthetic.SyntheticCriteo,
  start: int,
  count: int,
  multi_hot_sizes: tuple[int, ...] | None,
) -> tuple[Any, tf.Tensor]:
  """Examples ``start .. start + count - 1`` as in-memory tensors.

  Eager tensors (made outside any graph), so that every dataset function
  that uses the cached split can capture them, whatever graph built first.
  """
  with tf.init_scope():
    parsed = generator.parsed(start, count)
    config = criteo.CriteoConfig(
      vocab_sizes=generator.vocab_sizes,
      missing_id=generator.missing_id,
      multi_hot_sizes=multi_hot_sizes,
    )
    row_keys = tf.range(start, start + count, dtype=tf.int64)
    return criteo.to_features(parsed, config, row_keys)


def _to_model_inputs(features: dict[str, Any], labels: tf.Tensor) -> Any:
  """Multi-hot ``(b, k)`` ids as SparseTensors (``mean`` combiner)."""
  sparse = {
    key: data.multi_hot_to_sparse(ids) if ids.shape.rank == 2 else ids
    for key, ids in features["sparse_features"].items()
  }
  return {
    "dense_features": features["dense_features"],
    "sparse_features": sparse,
  }, labels


def _pipelines(context: tf.distribute.InputContext | None) -> tuple[int, int]:
  """``(number of input pipelines, this one's id)``."""
  if context is None:
    return 1, 0
  return context.num_input_pipelines, context.input_pipeline_id


def _batches_per_step(context: tf.distribute.InputContext | None) -> int:
  """Per-replica batches one pipeline yields per global step."""
  if context is None:
    return 1
  return max(
    1, context.num_replicas_in_sync // max(1, context.num_input_pipelines)
  )


def criteo_config(task: definitions.Task) -> criteo.CriteoConfig:
  """How the task's text files become model inputs (the serving export's
  raw signature preprocesses alike).

  Example:
    >>> from model_garden.ranking import inputs
    >>> from model_garden.ranking.configs import definitions as d
    >>> task = d.Task(model=d.ModelConfig(vocab_sizes=(9,) * 26))
    >>> config = inputs.criteo_config(task)
    >>> config.dense_transform, config.missing_id, config.multi_hot_sizes
    ('log', 0, None)
  """
  model = task.model
  return criteo.CriteoConfig(
    vocab_sizes=model.vocab_sizes,
    file_format=task.data_format,
    multi_hot_sizes=tuple(model.multi_hot_sizes)
    if model.use_multi_hot
    else None,
    multi_hot_mode="mlperf",
  )


class RankingInputs:
  """The training and validation pipelines of a ``Task``.

  Args:
    task: the task config (model vocabularies, data configs, source).
    strategy: distributes the datasets (default: the current strategy).

  Example:
    >>> from model_garden.ranking import inputs
    >>> from model_garden.ranking.configs import definitions as d
    >>> task = d.Task(model=d.ModelConfig(vocab_sizes=(9,) * 26),
    ...               use_synthetic_data=True)
    >>> inputs.RankingInputs(task).source
    'synthetic'
  """

  def __init__(
    self,
    task: definitions.Task,
    strategy: tf.distribute.Strategy | None = None,
  ):
    self.task = task
    self.strategy = strategy or tf.distribute.get_strategy()
    model = task.model
    self._multi_hot = (
      tuple(model.multi_hot_sizes) if model.use_multi_hot else None
    )
    self._generator = None
    self._readers: dict[str, Any] = {}
    # Under MultiWorkerMirroredStrategy tf.data's autotuning makes deleting
    # an iterator (after training, at exit) wait for seconds, up to the
    # other workers' exit: fixed parallelism there.
    self._autotune = not isinstance(
      self.strategy, tf.distribute.MultiWorkerMirroredStrategy
    )
    if task.use_synthetic_data:
      self._generator = synthetic.SyntheticCriteo(
        vocab_sizes=model.vocab_sizes,
        seed=task.synthetic.seed,
        zipf_exponent=task.synthetic.zipf_exponent,
      )
    else:
      # Readers hold the bad-record counters: made once, here.
      self._readers = {split: self._reader(split) for split in SPLITS}

  @property
  def source(self) -> str:
    """``"synthetic"``, ``"tfrecord"``, ``"tsv"`` or ``"paddlerec"``."""
    if self._generator:
      return "synthetic"
    return (
      "tfrecord" if self.task.use_tf_record_reader else self.task.data_format
    )

  def _reader(self, split: str) -> Any:
    policy = getattr(self.task, split).on_bad_record
    if self.task.use_tf_record_reader:
      return criteo_tfrecord.CriteoTFRecordReader(
        self.task.model.vocab_sizes, self._multi_hot, on_bad_record=policy
      )
    return criteo.CriteoReader(criteo_config(self.task), on_bad_record=policy)

  # --- bad records ---------------------------------------------------------

  def bad_record_counts(self, split: str) -> dict[str, int] | None:
    """Records of ``split`` dropped so far, by kind; None unless counted.

    Counts are of what the input pipelines parsed: including batches
    prefetched ahead of training and files re-read to resume.
    """
    reader = self._readers.get(split)
    if reader is None or reader.policy is not bad_records.BadRecordPolicy.COUNT:
      return None
    return reader.bad_records.counts()

  def split_note(self) -> str | None:
    """The log line saying where validation's records come from when
    they are held out of the training files (else None).

    Example:
      >>> from model_garden.ranking import inputs
      >>> from model_garden.ranking.configs import definitions as d
      >>> task = d.Task(model=d.ModelConfig(vocab_sizes=(9,) * 26),
      ...   holdout_every=10,
      ...   train_data=d.DataConfig(input_path="/data/day_*.tsv"))
      >>> inputs.RankingInputs(task).split_note()[:49]
      'Validation split: records 10, 20, 30, ... of each'
    """
    if not definitions.holds_out(self.task):
      return None
    n = self.task.holdout_every
    return (
      f"Validation split: records {n}, {2 * n}, {3 * n}, ... of each file "
      f"of {self.task.train_data.input_path}, held out of training "
      f"(task.holdout_every={n})."
    )

  def policy_notes(self) -> list[str]:
    """What happens to bad records of each split, unless they raise."""
    notes = []
    for split, reader in self._readers.items():
      if reader.policy is bad_records.BadRecordPolicy.COUNT:
        notes.append(f"{split}: bad records are dropped and counted.")
      elif reader.policy is bad_records.BadRecordPolicy.SKIP:
        notes.append(f"{split}: bad records are dropped, uncounted.")
    return notes

  def bad_record_scalars(self, split: str) -> dict[str, float]:
    """``{"bad_records/<kind>": n, "bad_records/total": n}`` (TensorBoard),
    empty unless ``split`` counts bad records."""
    counts = self.bad_record_counts(split)
    if counts is None:
      return {}
    scalars = {f"bad_records/{k}": float(v) for k, v in counts.items()}
    scalars["bad_records/total"] = float(sum(counts.values()))
    return scalars

  def bad_record_note(self, split: str) -> str | None:
    """A log line of ``split``'s dropped records, or None (none counted).

    Example:
      >>> from model_garden.ranking import inputs
      >>> from model_garden.ranking.configs import definitions as d
      >>> task = d.Task(model=d.ModelConfig(vocab_sizes=(9,) * 26),
      ...               data_format="paddlerec",
      ...               train_data=d.DataConfig(on_bad_record="count"))
      >>> inputs.RankingInputs(task).bad_record_note("train_data")
      'bad records dropped from train_data so far: 0'
    """
    counts = self.bad_record_counts(split)
    if counts is None:
      return None
    total = sum(counts.values())
    detail = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
    return f"bad records dropped from {split} so far: {total}" + (
      f" ({detail})" if detail else ""
    )

  # --- dataset functions ---------------------------------------------------

  def train_dataset_fn(self, start_step: int = 0) -> DatasetFn:
    """``dataset_fn(input_context)`` of the (endless) training batches.

    Args:
      start_step: global steps already trained; their batches are skipped.
    """
    return self._dataset_fn("train_data", start_step)

  def eval_dataset_fn(self) -> DatasetFn:
    """``dataset_fn(input_context)`` of the validation batches (one pass)."""
    return self._dataset_fn("validation_data", 0)

  def distribute(self, dataset_fn: DatasetFn) -> Any:
    """``dataset_fn``'s batches distributed over the strategy's replicas."""
    return self.strategy.distribute_datasets_from_function(
      dataset_fn, data.input_options()
    )

  def _dataset_fn(self, split: str, start_step: int) -> DatasetFn:
    config = getattr(self.task, split)
    training = split == "train_data"

    def dataset_fn(
      context: tf.distribute.InputContext | None,
    ) -> tf.data.Dataset:
      batch_size = data.per_replica_batch_size(
        config.global_batch_size, context
      )
      skip = start_step * _batches_per_step(context)
      if self._generator is not None:
        ds = self._synthetic(batch_size, training, skip, context)
      else:
        ds = self._files(split, batch_size, skip, context)
      ds = ds.map(_to_model_inputs, num_parallel_calls=tf.data.AUTOTUNE)
      return data.prefetch(data.with_options(ds, autotune=self._autotune))

    return dataset_fn

  # --- sources -------------------------------------------------------------

  def _synthetic(
    self,
    batch_size: int,
    training: bool,
    skip: int,
    context: tf.distribute.InputContext | None,
  ) -> tf.data.Dataset:
    """Batches sliced from in-memory examples, in a fixed order.

    Per-replica batch ``g`` (counted over all pipelines) holds examples
    ``[g * b, (g + 1) * b)`` of the split (cycling for training); pipeline
    ``p`` of ``P`` yields ``g = p, p + P, ...``.
    """
    cfg = self.task.synthetic
    if training:
      start, count = 0, cfg.num_train_examples
    else:
      start, count = cfg.num_train_examples, cfg.num_eval_examples
    features, labels = _synthetic_split(
      self._generator, start, count, self._multi_hot
    )
    num_batches = count // batch_size
    if num_batches == 0:
      raise ValueError(
        f"The synthetic {'training' if training else 'validation'} set has "
        f"{count} examples, fewer than one per-replica batch ({batch_size})."
      )
    pipelines, pipeline = _pipelines(context)
    first = pipeline + skip * pipelines
    if training:
      indices = tf.data.Dataset.range(first, 2**62, pipelines)
    else:
      # Every pipeline yields the same number of whole global steps (or
      # the replicas of a short last step would wait for each other).
      per_step = _batches_per_step(context)
      steps = num_batches // (pipelines * per_step)
      indices = tf.data.Dataset.range(
        first, steps * per_step * pipelines, pipelines
      )

    def take(index: tf.Tensor) -> Any:
      begin = (index % num_batches) * batch_size
      return tf.nest.map_structure(
        lambda t: t[begin : begin + batch_size], (features, labels)
      )

    return indices.map(take, num_parallel_calls=tf.data.AUTOTUNE)

  def _files(
    self,
    split: str,
    batch_size: int,
    skip: int,
    context: tf.distribute.InputContext | None,
  ) -> tf.data.Dataset:
    config = getattr(self.task, split)
    training = split == "train_data"
    input_path = definitions.split_input_path(self.task, split)
    paths = [p.strip() for p in input_path.split(",") if p.strip()]
    options: dict[str, Any] = {}
    if definitions.holds_out(self.task):
      options["holdout"] = text_files.Holdout(
        self.task.holdout_every, validation=not training
      )
    lines = definitions.paddlerec_sample_lines(self.task, split)
    if lines is not None:
      paths, options["lines"] = [paddlerec.find_sample_file()], lines
    if not paths:
      raise ValueError(
        f"No input files: set task.{split}.input_path (or --data), or use "
        "synthetic data (task.use_synthetic_data=true)."
      )
    ds = self._readers[split].dataset(
      paths,
      batch_size,
      input_context=context if config.sharding else None,
      repeat=training,
      cycle_length=config.cycle_length,
      deterministic=True,
      **options,
    )
    if not training:
      # Whole global steps only (the last per-replica batches of a pass may
      # not fill one). With several workers, also set validation_steps:
      # their files may hold different numbers of steps.
      per_step = _batches_per_step(context)
      if per_step > 1:
        ds = ds.batch(per_step, drop_remainder=True).unbatch()
    return ds.skip(skip) if skip else ds
