"""The training loop: steps, checkpoints, resumption, evaluation, summaries.

``Trainer(task, inputs, model_dir)`` runs ``train`` / ``evaluate`` /
``train_and_evaluate`` / ``continuous_evaluate`` for a ``RankingTask``:

* checkpoints: ``tpe.checkpoints.CheckpointManager`` over ``task.checkpoint``
  (embedding tables and slots, dense model, dense optimizer, global step)
  in ``model_dir``, every ``trainer.checkpoint_interval`` steps and at the
  end. A run restarts from the latest checkpoint (after a crash or a
  kill) and continues with the very batches an uninterrupted run would
  have seen, so it ends with the same tables.
* loops: steps run back to back and the host reads their results every
  ``trainer.steps_per_loop`` steps (and at every log, summary, checkpoint
  and evaluation step). Under ``ParameterServerStrategy`` a
  ``ClusterCoordinator`` schedules them on all workers at once (many in
  flight) and joins once per loop.
* metrics: steps return additive statistics (``metrics``), added up on the
  host: exact however many steps run at once.
* logs: a progress bar and a log line every ``time_history.log_steps``
  steps (loss, training AUC, accuracy, examples/s); TensorBoard scalars
  under ``model_dir/train`` (loss, metrics, learning rates, steps/s,
  examples/s, skipped steps) and ``model_dir/validation``.
* skipped steps: a step whose gradients are not finite changes nothing
  (``finite_steps``); the trainer counts them and says so.
* evaluation: AUC, accuracy, prediction and label means, loss on the
  validation set, every ``validation_interval`` steps and at the end; with
  ``trainer.best_checkpoint_export_subdir``, the best checkpoint is kept
  (``best_checkpoint``). ``continuous_evaluate`` evaluates each new
  checkpoint another process writes (Model Garden's sidecar evaluator).

Under ``MultiWorkerMirroredStrategy`` every worker runs the loop and only
the chief keeps what it writes. All file operations go through
``tf.io.gfile`` (``model_dir`` may be ``gs://...``).

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
  >>> int(loop.task.step), sorted(result)[:2], loop.skipped_steps
  (3, ['accuracy', 'auc'], 0)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any
from typing import TextIO

import numpy as np
import tensorflow as tf

import tpu_embedding as tpe
from model_garden.ranking import strategies
from model_garden.ranking.best_checkpoint import BestCheckpointExporter
from model_garden.ranking.inputs import RankingInputs
from model_garden.ranking.metrics import RankingMetrics
from model_garden.ranking.progress import Progress
from model_garden.ranking.progress import format_metrics
from model_garden.ranking.task import RankingTask
from tpu_embedding import data
from tpu_embedding.tables.row_cache import CacheCounts


def _write_scalars(
  writer: Any, values: dict[str, float], step: int, prefix: str = ""
) -> None:
  if writer is None:
    return
  with writer.as_default(step=step):
    for name, value in values.items():
      tf.summary.scalar(prefix + name, value)
  writer.flush()


def _counts_since(
  counts: dict[str, Any], before: dict[str, Any]
) -> dict[str, Any]:
  """Each disk table's ``CacheCounts`` since ``before`` (its counts then)."""
  return {name: total - before[name] for name, total in counts.items()}


def _fetch(result: Any) -> Any:
  """A step's result as numpy values (waits for a RemoteValue)."""
  if isinstance(result, _Packed):
    return result.unpack()
  return tf.nest.map_structure(np.asarray, result)


class _Packed:
  """A scheduled step's result: one RemoteValue holding a flat vector.

  Fetching a RemoteValue copies each of its tensors from the worker in a
  call of its own; a step's loss, verdict and metric statistics travel as
  one float32 vector instead, and are unpacked on the coordinator.
  """

  def __init__(self, remote: Any, layout: list[Any]):
    self.remote = remote
    self.layout = layout

  def unpack(self) -> Any:
    structure, shapes = self.layout
    flat = np.asarray(self.remote.fetch(), np.float64)
    values, start = [], 0
    for shape in shapes:
      size = int(np.prod(shape))
      values.append(flat[start : start + size].reshape(shape))
      start += size
    return tf.nest.pack_sequence_as(structure, values)


def _packing(step: Any) -> tuple[Any, list[Any]]:
  """``step`` returning one flat float32 vector, and (once traced) the
  ``(structure, shapes)`` to unpack it."""
  layout: list[Any] = []

  def packed(*args: Any) -> tf.Tensor:
    result = step(*args)
    flat = tf.nest.flatten(result)
    layout[:] = [result, [tuple(t.shape.as_list()) for t in flat]]
    return tf.concat(
      [tf.reshape(tf.cast(t, tf.float32), [-1]) for t in flat], axis=0
    )

  return tf.function(packed), layout


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
    fdo: a ``tpu_embedding.fdo.FdoTracker``: SparseCore statistics of the
      training batches, written every N steps (not under parameter
      servers, whose batches the workers read).

  The latest checkpoint of ``model_dir`` (else ``task.init_checkpoint``)
  is restored on construction.

  Attributes:
    task: the task.
    model_dir: the output directory.
    restored: the checkpoint restored on construction, or None.
    manager: the ``tpe.checkpoints.CheckpointManager`` (every worker).
    train_examples_per_second: the training throughput of the last
      ``train`` call (after its first loop), or None.
    skipped_steps: steps with non-finite gradients skipped by this
      trainer's ``train`` calls.
    best_exporter: the ``BestCheckpointExporter``, or None.
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
    fdo: Any = None,
  ):
    self.task = task
    self.fdo = fdo
    self.inputs = inputs
    self.model_dir = model_dir
    self.config = task.config
    self.strategy = task.strategy
    self.kill_at_step = kill_at_step
    self.progress_bar = progress_bar
    self.log_stream = log_stream or sys.stdout
    self.train_examples_per_second: float | None = None
    self.skipped_steps = 0
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
    self._next_batches: tuple[int, Any, Any] | None = None
    # When the disk tables' counts were last read, and what they were.
    self._disk_mark = (
      time.perf_counter(),
      self.task.embedding.disk_tier_counts(),
    )
    self.restored = self.restore()
    self._saved_step = self.step if self.restored else None
    # Every worker saves into model_dir: under MultiWorkerMirroredStrategy
    # each writes its own rows of the sharded tables and the chief merges
    # them (tpe.checkpoints); elsewhere it is TensorFlow's manager.
    self.manager = tpe.checkpoints.CheckpointManager(
      task.checkpoint,
      directory=model_dir,
      max_to_keep=trainer.max_to_keep,
      delta_interval=trainer.checkpoint_delta_interval,
    )
    # A restored chain goes on: the next save is its next delta if due.
    self.manager.deltas = list(getattr(self, "_restored_deltas", []))
    self.best_exporter = None
    if trainer.best_checkpoint_export_subdir and self._chief:
      self.best_exporter = BestCheckpointExporter(
        os.path.join(model_dir, trainer.best_checkpoint_export_subdir),
        trainer.best_checkpoint_eval_metric,
        trainer.best_checkpoint_metric_comp,
      )

  # --- helpers -------------------------------------------------------------

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
    latest, deltas = tpe.checkpoints.latest_with_deltas(self.model_dir)
    if latest:  # (each worker reads only its rows of sharded tables)
      tpe.checkpoints.restore(
        self.task.checkpoint, latest, deltas=deltas
      ).assert_existing_objects_matched()
      self._restored_deltas = deltas
      if deltas:
        latest = deltas[-1]
      self.log(f"Restored {latest} (step {self.step}).")
      return latest
    init = self.config.task.init_checkpoint
    if init:
      # A run's directory or a save in it: its last full checkpoint and
      # the deltas after it (the state it names, never an older one).
      base, deltas = tpe.checkpoints.saved_chain(init)
      tpe.checkpoints.restore(self.task.checkpoint, base).expect_partial()
      tpe.checkpoints.apply_deltas(
        self.task.checkpoint, base, deltas, partial=True
      )
      path = tpe.checkpoints.chain_end(base, deltas)
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
    return path

  # --- training ------------------------------------------------------------

  def _is_boundary(self, step: int, target: int) -> bool:
    """Whether the host reads results (and may log or save) after ``step``."""
    trainer = self.config.trainer
    intervals = (
      trainer.steps_per_loop,
      trainer.summary_interval,
      trainer.checkpoint_interval,
      trainer.time_history.log_steps or trainer.summary_interval,
    )
    return (
      step == target
      or step == self.kill_at_step
      or any(n > 0 and step % n == 0 for n in intervals)
    )

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
    step_fn, iterator = self._train_data(start)
    progress = Progress(
      target,
      initial=start,
      total=trainer.train_steps,
      batch_size=batch_size,
      log_steps=trainer.time_history.log_steps or trainer.summary_interval,
      stream=self.log_stream,
      bar=self.progress_bar,
    )
    writer = self._writer("train")
    metrics = RankingMetrics()
    loss = None
    pending: list[Any] = []
    loop_start = time.perf_counter()
    disk_before = self.task.embedding.disk_tier_counts()
    for step in range(start + 1, target + 1):
      if self._is_ps:
        pending.append(self._schedule(step_fn, iterator))
      elif self.fdo is not None:
        element = next(iterator)
        self._observe_fdo(element[0]["sparse_features"])
        pending.append(step_fn(*element))
      else:
        pending.append(step_fn(*next(iterator)))
      if not self._is_boundary(step, target):
        continue
      if self._is_ps:
        self._coordinator.join()
      loss = self._read_results(pending, metrics, step)
      pending = []
      due = step % progress.log_steps == 0 or step == target
      results = metrics.result() if due and metrics.examples else None
      progress.update(step, loss, results)
      if writer is not None and (
        step % trainer.summary_interval == 0 or step == target
      ):
        self._write_train_summaries(
          writer, step, loss, results or metrics.result(), progress
        )
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
    self._log_disk_tiers(disk_before, time.perf_counter() - loop_start)
    if self.fdo is not None and not self._is_ps:
      self._finish_fdo(time.perf_counter() - loop_start)
    self._next_batches = (target, step_fn, iterator)
    return loss

  def _observe_fdo(self, sparse_features: Any) -> None:
    from tpu_embedding import fdo  # noqa: PLC0415

    self.fdo.observe(fdo.local_batch(self.strategy, sparse_features))

  def _finish_fdo(self, elapsed: float) -> None:
    """Writes the statistics with their cost next to the training's (the
    loop's time without the statistics' own; the first step's trace
    included, so the ratio errs low only on very short runs)."""
    self.fdo.train_seconds = max(elapsed - self.fdo.seconds, 1e-9)
    path = self.fdo.save()
    if path:
      cost = self.fdo.cost()
      ratio = cost["fdo_over_train_step"]
      self.log(
        f"FDO statistics: {path} ({self.fdo.collector.steps} batches, "
        f"{cost['fdo_seconds_per_batch'] * 1e3:.1f} ms each"
        + (f", {ratio:.2f}x a training step)" if ratio else ")")
      )

  def _train_data(self, start: int) -> tuple[Any, Any]:
    """The training step and an iterator at ``start``'s batches.

    The last ``train`` call's iterator continues where it stopped, so it is
    kept (a new one would skip to the same batches): creating and deleting
    iterators between evaluations costs time, and deleting one under
    ``MultiWorkerMirroredStrategy`` waits on the other workers for seconds.
    """
    if self._next_batches is not None and self._next_batches[0] == start:
      return self._next_batches[1:]
    dataset_fn = self.inputs.train_dataset_fn(start_step=start)
    if self._is_ps:
      return self._ps_step(dataset_fn, self.task.train_step_ps)
    embedding = self.task.embedding

    def reading_rows_ahead(context: Any) -> tf.data.Dataset:
      """The batches, their disk tables' missed rows read ahead while the
      step before runs (``data.prefetch_rows``; as they are otherwise)."""
      return data.prefetch_rows(
        dataset_fn(context),
        embedding,
        features=lambda element: element[0]["sparse_features"],
      )

    batches = self.inputs.distribute(reading_rows_ahead)
    return self.task.train_step, iter(batches)

  def _read_results(
    self, pending: list[Any], metrics: RankingMetrics, step: int
  ) -> float:
    """Adds finished steps' statistics; counts and reports skipped steps;
    returns the last step's loss."""
    skipped = 0
    loss = float("nan")
    for result in pending:
      result = _fetch(result)
      loss = float(result["loss"])
      if result["skipped"] > 0:
        skipped += 1
      elif "statistics" in result:
        metrics.add(result["statistics"])
    if skipped:
      self.skipped_steps += skipped
      self.log(
        f"step {step}: skipped {skipped} step(s) whose gradients were not "
        f"finite (no table, slot or dense weight changed); "
        f"{self.skipped_steps} skipped so far."
      )
    return loss

  def _write_train_summaries(
    self,
    writer: Any,
    step: int,
    loss: float,
    results: dict[str, float],
    progress: Progress,
  ) -> None:
    values = {"loss": loss, **results, **self.task.learning_rates()}
    rate = progress.throughput.interval_examples_per_second()
    if rate:
      values["examples_per_second"] = rate
      values["steps_per_second"] = (
        rate / self.config.task.train_data.global_batch_size
      )
    values["skipped_steps"] = float(self.skipped_steps)
    values.update(self._disk_tier_scalars())
    values.update(self.inputs.bad_record_scalars("train_data"))
    if self.task.loss_scale is not None:
      values["loss_scale"] = float(
        tf.convert_to_tensor(self.task.loss_scale.scale)
      )
    _write_scalars(writer, values, step)

  def _disk_tier_scalars(self) -> dict[str, float]:
    """Each disk table's hit rate, rows read and written per second and
    the share of those read ahead, since the last call
    (``disk/<table>/...``; none without disk tables)."""
    then, before = self._disk_mark
    now, counts = time.perf_counter(), self.task.embedding.disk_tier_counts()
    self._disk_mark = (now, counts)
    seconds = max(now - then, 1e-9)
    values = {}
    for name, interval in _counts_since(counts, before).items():
      values[f"disk/{name}/hit_rate"] = interval.hit_rate
      values[f"disk/{name}/rows_read_per_second"] = interval.rows_read / seconds
      values[f"disk/{name}/read_ahead_rate"] = interval.read_ahead_rate
      values[f"disk/{name}/rows_written_per_second"] = (
        interval.rows_written / seconds
      )
    return values

  def _log_disk_tiers(self, before: dict[str, Any], seconds: float) -> None:
    """One line: the disk tables' hit rates and rows read and written per
    second over a ``train`` call (nothing without disk tables)."""
    run = _counts_since(self.task.embedding.disk_tier_counts(), before)
    if not run:
      return
    total = sum(run.values(), CacheCounts())
    reads = total.rows_read / max(seconds, 1e-9)
    writes = total.rows_written / max(seconds, 1e-9)
    rates = ", ".join(f"{n} {c.hit_rate:.1%}" for n, c in sorted(run.items()))
    self.log(
      f"Disk tables: hit rate {rates}; {reads:,.0f} rows read/s "
      f"({total.read_ahead_rate:.0%} read ahead), {writes:,.0f} written/s."
    )

  def _ps_step(self, dataset_fn: Any, step: Any) -> tuple[Any, Any]:
    """A scheduled step and its per-worker iterator (parameter servers)."""

    @tf.function
    def per_worker_dataset_fn():
      return self.strategy.distribute_datasets_from_function(dataset_fn)

    dataset = self._coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    return _packing(step), iter(dataset)

  def _schedule(self, step: tuple[Any, list[Any]], iterator: Any) -> _Packed:
    """Schedules a packed step (``_ps_step``) on any free worker."""
    function, layout = step
    remote = self._coordinator.schedule(function, args=(iterator,))
    return _Packed(remote, layout)  # the layout is known once traced

  # --- evaluation ----------------------------------------------------------

  def evaluate(self, checkpoint: str | None = None) -> dict[str, float]:
    """Evaluates on the validation set; writes and returns the metrics.

    Args:
      checkpoint: the checkpoint the task holds (for the best-checkpoint
        export; default: the latest one written or restored).

    Raises:
      ValueError: if the validation set has no full global batch.
    """
    trainer = self.config.trainer
    self.task.flush_pipeline()
    metrics = RankingMetrics()
    start = time.perf_counter()
    limit = trainer.validation_steps
    if self._is_ps:
      steps = self._ps_evaluate(limit, metrics)
    else:
      steps = 0
      pending = []
      for features, labels in self.inputs.distribute(
        self.inputs.eval_dataset_fn()
      ):
        if 0 <= limit <= steps:
          break
        pending.append(self.task.eval_step(features, labels))
        steps += 1
      for statistics in pending:
        metrics.add(_fetch(statistics))
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
    self.log(
      f"validation at step {step}: {format_metrics(results)}  "
      f"({metrics.examples:,} examples, {seconds:.1f}s)"
    )
    note = self.inputs.bad_record_note("validation_data")
    if note:
      self.log(note)
    self._export_if_best(results, checkpoint, step)
    return results

  def _export_if_best(
    self, results: dict[str, float], checkpoint: str | None, step: int
  ) -> None:
    if self.best_exporter is None:
      return
    checkpoint = checkpoint or self.manager.latest_save or self.restored
    if not checkpoint or not checkpoint.endswith(f"-{step}"):
      self.log(
        f"No checkpoint of step {step} to keep as the best "
        f"({self.config.trainer.best_checkpoint_export_subdir}/)."
      )
      return
    if self.best_exporter.maybe_export(results, checkpoint, step):
      metric = self.best_exporter.metric
      self.log(
        f"Best {metric} so far ({results[metric]:.4f}): kept {checkpoint} as "
        f"{self.best_exporter.checkpoint_path}."
      )

  def _ps_evaluate(self, limit: int, metrics: RankingMetrics) -> int:
    if limit <= 0:
      raise ValueError(
        "Under parameter_server, set trainer.validation_steps (> 0): "
        "workers read the validation data as an endless stream."
      )

    def dataset_fn(context):
      return self.inputs.eval_dataset_fn()(context).repeat()

    step_fn, iterator = self._ps_step(dataset_fn, self.task.eval_step_ps)
    # All at once on all workers; statistics add up on the host.
    pending = [self._schedule(step_fn, iterator) for _ in range(limit)]
    self._coordinator.join()
    for statistics in pending:
      metrics.add(_fetch(statistics))
    return limit

  def continuous_evaluate(
    self, timeout: float | None = None, poll_seconds: float = 1.0
  ) -> dict[str, float]:
    """Evaluates each new save of ``model_dir`` once, as it appears (a
    full checkpoint, or a delta: restored after the saves it follows).

    Model Garden's sidecar evaluator: another process trains and writes
    checkpoints; this one waits for them. It stops after evaluating the
    checkpoint of step ``trainer.train_steps`` (or later), or when no new
    checkpoint appears for ``timeout`` seconds.

    Returns:
      The last evaluation's metrics (empty if none ran).
    """
    results: dict[str, float] = {}
    final = self.config.trainer.train_steps
    self.log(
      f"Waiting for checkpoints in {self.model_dir} (until step {final}"
      + (f", or {timeout:.0f}s without a new one)." if timeout else ").")
    )
    for base, deltas in self._new_saves(timeout, poll_seconds):
      path = tpe.checkpoints.chain_end(base, deltas)
      try:
        tpe.checkpoints.restore(
          self.task.checkpoint, base, deltas=deltas
        ).assert_existing_objects_matched()
      except (
        tf.errors.NotFoundError,
        tf.errors.DataLossError,
        tpe.checkpoints.DeltaMismatchError,
      ) as e:
        self.log(f"Could not read {path} (replaced meanwhile?): {e}")
        continue
      self.log(f"Evaluating {path} (step {self.step}).")
      results = self.evaluate(checkpoint=path)
      if self.step >= final:
        break
    else:
      self.log(f"No new checkpoint for {timeout:.0f}s: stopping.")
    return results

  def _new_saves(
    self, timeout: float | None, poll_seconds: float
  ) -> Iterator[tuple[str, list[str]]]:
    """``(full checkpoint, deltas)`` of each new save of ``model_dir``
    (full or delta), as it appears; ends after ``timeout`` seconds
    without one."""
    last = None
    waited_since = time.monotonic()
    while True:
      base, deltas = tpe.checkpoints.latest_with_deltas(self.model_dir)
      latest = tpe.checkpoints.chain_end(base, deltas)
      if latest is not None and latest != last:
        last = latest
        yield base, deltas
        waited_since = time.monotonic()
        continue
      if timeout is not None and time.monotonic() - waited_since > timeout:
        return
      time.sleep(poll_seconds)

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
