"""The training loop: steps, checkpoints, resumption, evaluation, summaries.

``Trainer(task, inputs, model_dir)`` runs ``train`` / ``evaluate`` /
``train_and_evaluate`` for a ``RankingTask``:

* checkpoints: ``tf.train.CheckpointManager`` over ``task.checkpoint``
  (embedding tables and slots, dense model, dense optimizer, global step)
  in ``model_dir``, every ``trainer.checkpoint_interval`` steps and at the
  end. A run restarts from the latest checkpoint (after a crash or a
  kill) and continues with the very batches an uninterrupted run would
  have seen, so it ends with the same tables.
* logs: a progress bar and a log line every ``time_history.log_steps``
  steps (loss, training AUC, accuracy, examples/s); TensorBoard scalars
  under ``model_dir/train`` and ``model_dir/validation``.
* evaluation: AUC, accuracy, prediction and label means, loss on the
  validation set, every ``validation_interval`` steps and at the end.

Under ``ParameterServerStrategy`` the steps are scheduled on the workers by
a ``ClusterCoordinator``; under ``MultiWorkerMirroredStrategy`` every
worker runs the loop and only the chief keeps what it writes.

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> from model_garden.ranking import configs, inputs, task, trainer
  >>> config = configs.override(configs.get_config("dlrm_criteo_cpu_small"), {
  ...   "task.model.vocab_sizes": [50] * 26,
  ...   "task.train_data.global_batch_size": 64,
  ...   "task.validation_data.global_batch_size": 64,
  ...   "task.synthetic": {"num_train_examples": 256,
  ...                      "num_eval_examples": 128},
  ...   "trainer": {"train_steps": 3, "checkpoint_interval": 2}})
  >>> strategy = tf.distribute.get_strategy()
  >>> loop = trainer.Trainer(task.RankingTask(config, strategy),
  ...                        inputs.RankingInputs(config.task, strategy),
  ...                        tempfile.mkdtemp(), progress_bar=False,
  ...                        log_stream=open("/dev/null", "w"))
  >>> result = loop.train_and_evaluate()
  >>> int(loop.task.step), sorted(result)[:2]
  (3, ['accuracy', 'auc'])
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from typing import Any
from typing import TextIO

import tensorflow as tf

from model_garden.ranking import strategies
from model_garden.ranking.inputs import RankingInputs
from model_garden.ranking.progress import Progress
from model_garden.ranking.progress import format_metrics
from model_garden.ranking.task import RankingTask


def _write_scalars(
  writer: Any, values: dict[str, float], step: int, prefix: str = ""
) -> None:
  if writer is None:
    return
  with writer.as_default(step=step):
    for name, value in values.items():
      tf.summary.scalar(prefix + name, value)
  writer.flush()


class Trainer:
  """Trains and evaluates a ``RankingTask``, checkpointing to ``model_dir``.

  Args:
    task: the built task (under its strategy).
    inputs: the task's input pipelines.
    model_dir: checkpoints, summaries and exports go here.
    kill_at_step: testing fault tolerance: kill this process (SIGKILL)
      right after this global step, as a crash or preemption would.
    progress_bar: show a progress bar (None: on a terminal only).
    log_stream: where log lines go (default stdout).

  The latest checkpoint of ``model_dir`` (else ``task.init_checkpoint``)
  is restored on construction.

  Attributes:
    task: the task.
    model_dir: the output directory.
    restored: the checkpoint restored on construction, or None.
    manager: the ``tf.train.CheckpointManager``.
    train_examples_per_second: the training throughput of the last
      ``train`` call (after its first step), or None.
  """

  def __init__(
    self,
    task: RankingTask,
    inputs: RankingInputs,
    model_dir: str,
    *,
    kill_at_step: int | None = None,
    progress_bar: bool | None = None,
    log_stream: TextIO | None = None,
  ):
    self.task = task
    self.inputs = inputs
    self.model_dir = model_dir
    self.config = task.config
    self.strategy = task.strategy
    self.kill_at_step = kill_at_step
    self.progress_bar = progress_bar
    self.log_stream = log_stream or sys.stdout
    self.train_examples_per_second: float | None = None
    self._chief = strategies.is_chief(self.strategy)
    self._is_ps = isinstance(
      self.strategy, tf.distribute.experimental.ParameterServerStrategy
    )
    self._coordinator = None
    if self._is_ps:
      self._coordinator = (
        tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)
      )
    trainer = self.config.trainer
    self._writers: dict[str, Any] = {}
    self.restored = self.restore()
    self._saved_step = self.step if self.restored else None
    self._write_dir = model_dir if self._chief else self._worker_dir()
    self.manager = tf.train.CheckpointManager(
      task.checkpoint,
      directory=self._write_dir,
      max_to_keep=trainer.max_to_keep,
    )

  # --- helpers -------------------------------------------------------------

  def _worker_dir(self) -> str:
    resolver = self.strategy.cluster_resolver
    return os.path.join(
      self.model_dir, f".worker_{resolver.task_type}_{resolver.task_id}"
    )

  def _writer(self, name: str) -> Any:
    if not self._chief:
      return None
    if name not in self._writers:
      self._writers[name] = tf.summary.create_file_writer(
        os.path.join(self.model_dir, name)
      )
    return self._writers[name]

  def log(self, message: str) -> None:
    """Writes a line to the log stream."""
    self.log_stream.write(message + "\n")
    self.log_stream.flush()

  @property
  def step(self) -> int:
    """The global step."""
    return int(self.task.step.numpy())

  def restore(self) -> str | None:
    """Restores the latest checkpoint of ``model_dir`` (else
    ``task.init_checkpoint``); returns its path, or None (fresh start)."""
    latest = tf.train.latest_checkpoint(self.model_dir)
    if latest:
      self.task.checkpoint.restore(latest).assert_existing_objects_matched()
      self.log(f"Restored {latest} (step {self.step}).")
      return latest
    init = self.config.task.init_checkpoint
    if init:
      path = tf.train.latest_checkpoint(init) or init
      self.task.checkpoint.restore(path).expect_partial()
      self.log(f"Initialized from {path} (step {self.step}).")
      return path
    return None

  def save(self, force: bool = False) -> str | None:
    """Writes a checkpoint if one is due (or ``force``); returns its path.

    One is due every ``trainer.checkpoint_interval`` global steps.
    """
    step = self.step
    if not force and step % self.config.trainer.checkpoint_interval:
      return None
    if step == self._saved_step:
      return None
    self.task.flush_pipeline()
    path = self.manager.save(checkpoint_number=step, check_interval=False)
    self._saved_step = step
    if path and not self._chief:
      shutil.rmtree(self._write_dir, ignore_errors=True)
    return path

  # --- training ------------------------------------------------------------

  def train(self, until_step: int | None = None) -> float | None:
    """Trains from the current step to ``until_step`` (default: all).

    Returns:
      The last step's loss, or None if there was nothing to train.
    """
    trainer = self.config.trainer
    target = trainer.train_steps if until_step is None else until_step
    start = self.step
    if start >= target:
      return None
    batch_size = self.config.task.train_data.global_batch_size
    dataset_fn = self.inputs.train_dataset_fn(start_step=start)
    if self._is_ps:
      step_fn, iterator = self._ps_train_step(dataset_fn)
    else:
      iterator = iter(self.inputs.distribute(dataset_fn))
      step_fn = self.task.train_step
    progress = Progress(
      target,
      initial=start,
      batch_size=batch_size,
      log_steps=trainer.time_history.log_steps or trainer.summary_interval,
      stream=self.log_stream,
      bar=self.progress_bar,
    )
    writer = self._writer("train")
    metrics = self.task.train_metrics
    metrics.reset()
    loss = None
    for step in range(start + 1, target + 1):
      if self._is_ps:
        # One step at a time (see _ps_evaluate for why).
        loss = self._coordinator.schedule(step_fn, args=(iterator,))
        self._coordinator.join()
        loss = loss.fetch()
      else:
        loss = step_fn(*next(iterator))
      loss = float(loss)
      due = step % progress.log_steps == 0 or step == target
      results = metrics.result() if due else None
      progress.update(step, loss, results)
      if writer is not None and (
        step % trainer.summary_interval == 0 or step == target
      ):
        values = {"loss": loss, **(results or metrics.result())}
        rate = progress.throughput.interval_examples_per_second()
        if rate:
          values["examples_per_second"] = rate
        values.update(self.inputs.bad_record_scalars("train_data"))
        _write_scalars(writer, values, step)
      if due:
        metrics.reset()
        note = self.inputs.bad_record_note("train_data")
        if note:
          self.log(note)
      self.save(force=step == target)
      if self.kill_at_step is not None and step == self.kill_at_step:
        self.log(f"Killing this process after step {step} (--kill_at_step).")
        os.kill(os.getpid(), signal.SIGKILL)
    self.train_examples_per_second = progress.throughput.examples_per_second()
    return loss

  def _ps_train_step(self, dataset_fn: Any) -> tuple[Any, Any]:
    """The scheduled step and per-worker iterator under parameter servers."""

    @tf.function
    def per_worker_dataset_fn():
      return self.strategy.distribute_datasets_from_function(dataset_fn)

    dataset = self._coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    return tf.function(self.task.train_step_ps), iter(dataset)

  # --- evaluation ----------------------------------------------------------

  def evaluate(self) -> dict[str, float]:
    """Evaluates on the validation set; writes and returns the metrics.

    Raises:
      ValueError: if the validation set has no full global batch.
    """
    trainer = self.config.trainer
    self.task.flush_pipeline()
    metrics = self.task.eval_metrics
    metrics.reset()
    start = time.perf_counter()
    steps = 0
    limit = trainer.validation_steps
    if self._is_ps:
      steps = self._ps_evaluate(limit)
    else:
      for features, labels in self.inputs.distribute(
        self.inputs.eval_dataset_fn()
      ):
        if 0 <= limit <= steps:
          break
        self.task.eval_step(features, labels)
        steps += 1
    if steps == 0:
      raise ValueError(
        "The validation data has no full global batch of "
        f"{self.config.task.validation_data.global_batch_size} examples; "
        "lower task.validation_data.global_batch_size."
      )
    results = metrics.result()
    seconds = time.perf_counter() - start
    step = self.step
    _write_scalars(
      self._writer(trainer.validation_summary_subdir),
      {**results, **self.inputs.bad_record_scalars("validation_data")},
      step,
    )
    examples = steps * self.config.task.validation_data.global_batch_size
    self.log(
      f"validation at step {step}: {format_metrics(results)}  "
      f"({examples:,} examples, {seconds:.1f}s)"
    )
    note = self.inputs.bad_record_note("validation_data")
    if note:
      self.log(note)
    return results

  def _ps_evaluate(self, limit: int) -> int:
    if limit < 0:
      raise ValueError(
        "Under parameter_server, set trainer.validation_steps (> 0): "
        "workers read the validation data as an endless stream."
      )

    def dataset_fn(context):
      return self.inputs.eval_dataset_fn()(context).repeat()

    @tf.function
    def per_worker_dataset_fn():
      return self.strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(
      self._coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    )
    step_fn = tf.function(self.task.eval_step_ps)
    for _ in range(limit):
      # One step at a time: Keras 3 metrics add by read-modify-write
      # (`assign(self + value)`), so steps running concurrently on several
      # workers would lose counts and report wrong AUC and means.
      self._coordinator.schedule(step_fn, args=(iterator,))
      self._coordinator.join()
    return limit

  # --- modes ---------------------------------------------------------------

  def train_and_evaluate(self) -> dict[str, float]:
    """Trains to ``train_steps``, evaluating every ``validation_interval``
    steps and at the end; returns the last evaluation."""
    trainer = self.config.trainer
    interval = max(1, trainer.validation_interval)
    results: dict[str, float] = {}
    while self.step < trainer.train_steps:
      next_eval = min(
        (self.step // interval + 1) * interval, trainer.train_steps
      )
      self.train(until_step=next_eval)
      results = self.evaluate()
    if not results:
      results = self.evaluate()
    return results
