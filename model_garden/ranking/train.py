r"""Trains and evaluates a ranking model (DLRM, DCN v2, DLRM-DCNv2).

Model Garden's ``official/recommendation/ranking/train.py`` on
``tpu_embedding``: the same experiments, config files and overrides, on
any ``tf.distribute`` strategy, with the tables sharded across replicas.

Run (trains on synthetic Criteo data, no download; about a minute on
2 CPU cores):

  python3 -m model_garden.ranking.train --experiment dlrm_criteo_cpu_small \
      --strategy mirrored --num_replicas 2 --model_dir /tmp/tpe_dlrm

Flags:

* ``--experiment``: ``dlrm_criteo``, ``dcn_criteo``, ``dlrm_dcn_v2_criteo``
  (Model Garden's Criteo 1TB settings) or their ``*_cpu_small`` variants.
* ``--config_file`` (repeatable) YAML files and ``--params_override``
  (``"task.train_data.global_batch_size=512,trainer.train_steps=100"`` or
  YAML) change the config, in that order.
* ``--mode``: ``train``, ``eval`` (the latest checkpoint),
  ``train_and_eval`` or ``continuous_eval`` (evaluate each new checkpoint
  another process writes to ``--model_dir``, until the last step's or
  ``--eval_timeout`` seconds without one).
* ``--strategy``: ``default``, ``one_device``, ``mirrored``,
  ``multi_worker_mirrored``, ``parameter_server`` or ``tpu``;
  ``--num_replicas``: logical CPU devices for ``mirrored`` without GPUs.
* ``--num_workers N`` (and ``--num_ps M`` for ``parameter_server``): run
  the same command as a local cluster of processes (``launcher``), logs
  prefixed by task, restarted from the last checkpoint when a process
  dies (``--max_restarts``). On real machines set ``TF_CONFIG`` instead.
* ``--cluster_timeout`` (default 600 s; 0: forever): a
  ``multi_worker_mirrored`` task waits that long for the other tasks of
  its cluster to start, saying which (and their addresses) after 3 s and
  every 30 s, then gives up in one line, exit code 1.
* ``--data``: ``synthetic``, ``paddlerec`` (the 80-record Criteo sample of
  ``paddle-rec==0.1.0``: lines 1-64 train, 65-80 validate, batches of 16
  unless set) or a glob of raw Criteo TSV files. TFRecord files
  (``tools/criteo_to_tfrecord.py`` converts TSV): ``--data
  '/data/tfrecords/*.tfrecord' --params_override
  task.use_tf_record_reader=true``; without ``--data``, also
  ``task.use_synthetic_data=false,task.train_data.input_path=...`` (the
  ``*_cpu_small`` experiments default to synthetic data).
  docs/your_own_data.md: from files to a served model.
* Training files alone (``--data GLOB``, or ``task.train_data.input_path``
  without ``validation_data``'s): validation reads a split held out of
  them, records 10, 20, 30, ... of each file (``task.holdout_every=10``;
  training never reads those), and the log says so. Set
  ``task.validation_data.input_path`` to validate on other files; a
  validation set that shares files with training is warned about.
* Malformed records: ``task.train_data.on_bad_record`` (and
  ``validation_data``'s): ``raise`` (default), ``count`` (drop; counts in
  the logs and TensorBoard) or ``skip`` (drop uncounted).

Wrong flags, configs or clusters stop the program with one line ending
``see --help`` and exit code 2 (``model_garden.cli``), before anything is
built or written: unknown experiments, keys or flag values, missing
config files, contradicting flags or data keys, a cluster without the
tasks the strategy needs, an evaluation without a checkpoint or with a
config that does not match the checkpoint's ``params.yaml``, training into
a ``--model_dir`` that holds another experiment's run. Problems with
files, memory or data are one line naming the file or key, exit code 1:
an input glob that matches nothing, a binary or non-UTF-8 file, data
smaller than one global batch, a ``--model_dir`` that cannot be written,
tables that cannot fit in memory, a bad record (``file:line``, and the
``on_bad_record`` key that drops it). ``--debug`` (or ``TPE_DEBUG=1``)
also prints the traceback.

Writes to ``--model_dir`` (any TensorFlow filesystem, e.g. ``gs://``):
``params.yaml`` (the effective config; training modes only), checkpoints
(a killed run resumes from the latest), TensorBoard summaries (``train/``,
``validation/``), the best checkpoint (``trainer.
best_checkpoint_export_subdir``) and the serving SavedModel
(``saved_model/<step>``).
"""

from __future__ import annotations

import json
import os
import sys

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

from model_garden.ranking import configs  # noqa: E402
from model_garden.ranking.configs import definitions  # noqa: E402

#: ``--mode`` values.
MODES = ("train", "eval", "train_and_eval", "continuous_eval")
#: Modes that train (and write ``params.yaml``).
TRAINING_MODES = ("train", "train_and_eval")
#: Flags the launcher handles itself (not passed to the tasks).
LAUNCHER_FLAGS = ("num_workers", "num_ps", "max_restarts", "kill_at_step")

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines this program's flags (once; ``tools/`` reuse them)."""
  if "experiment" in FLAGS:
    return
  flags.DEFINE_string(
    "experiment",
    "dlrm_criteo_cpu_small",
    f"The experiment: one of {configs.experiments()}.",
  )
  flags.DEFINE_multi_string(
    "config_file", [], "YAML files overriding the experiment, in order."
  )
  flags.DEFINE_string(
    "params_override",
    "",
    'Overrides after the config files: "a.b=1,c.d=[1, 2]" or YAML.',
  )
  flags.DEFINE_enum("mode", "train_and_eval", list(MODES), "What to do.")
  flags.DEFINE_string("model_dir", None, "Checkpoints, summaries, SavedModel.")
  flags.DEFINE_enum(
    "strategy",
    None,
    list(definitions.STRATEGIES),
    "The distribution strategy (default: runtime.distribution_strategy).",
  )
  flags.DEFINE_integer(
    "num_replicas",
    0,
    "mirrored without GPUs: split the CPU into this many logical devices.",
  )
  flags.DEFINE_string("tpu", None, "The TPU address (--strategy tpu).")
  flags.DEFINE_string(
    "data",
    None,
    '"synthetic", "paddlerec" (the installed 80-record Criteo sample: 64 '
    "records train, 16 validate, batches of 16 unless set), or a glob of "
    "Criteo TSV files (default: the experiment's). Files without "
    "task.validation_data.input_path: every 10th record of each file "
    "(records 10, 20, ...) is held out of training and validates "
    "(task.holdout_every=10).",
  )
  flags.DEFINE_integer(
    "seed", None, "Seeds every initializer (runtime.seed): reproducible runs."
  )
  flags.DEFINE_string(
    "ps_local_cluster",
    None,
    'parameter_server: "W,P" starts W workers and P parameter servers in '
    "this process (instead of TF_CONFIG).",
  )
  flags.DEFINE_integer(
    "num_workers",
    0,
    "multi_worker_mirrored / parameter_server: start this many local "
    "worker processes (with TF_CONFIG on 127.0.0.1) and supervise them.",
  )
  flags.DEFINE_integer(
    "num_ps",
    0,
    "parameter_server with --num_workers: local parameter-server processes.",
  )
  flags.DEFINE_integer(
    "max_restarts",
    3,
    "With --num_workers: restarts from the last checkpoint after a process "
    "dies, before giving up.",
  )
  flags.DEFINE_float(
    "cluster_timeout",
    600.0,
    "multi_worker_mirrored: seconds a task waits for the other tasks of "
    "TF_CONFIG's cluster to start (saying which, every 30 s) before giving "
    "up with exit code 1; 0: wait forever.",
  )
  flags.DEFINE_float(
    "eval_timeout",
    None,
    "--mode continuous_eval: stop after this many seconds without a new "
    "checkpoint (default: wait until the last step's checkpoint).",
  )
  flags.DEFINE_integer(
    "kill_at_step",
    None,
    "Testing fault tolerance: SIGKILL this process after that step (with "
    "--num_workers: the last worker, or the parameter_server chief, in the "
    "first attempt only).",
  )
  flags.DEFINE_enum(
    "progress_bar", "auto", ["auto", "on", "off"], "Show a progress bar."
  )
  flags.DEFINE_string(
    "fdo_stats_dir",
    None,
    "Keep SparseCore statistics (FDO: the ids per partition that TPU "
    "limits must hold, tpu_embedding.fdo) of the training batches and write "
    "them to DIR/fdo_stats.json every --fdo_every_n_steps steps.",
  )
  flags.DEFINE_string(
    "fdo_topology",
    "v5p-8",
    "With --fdo_stats_dir: the TPU the limits are for (v5p-N, v6e-N, v7x-N).",
  )
  flags.DEFINE_integer(
    "fdo_every_n_steps", 100, "With --fdo_stats_dir: write every N steps."
  )
  if "debug" not in FLAGS:
    flags.DEFINE_boolean(
      "debug",
      False,
      "Show the traceback of an error (also: TPE_DEBUG=1).",
    )


def build_config(
  experiment: str,
  config_files: list[str] = (),
  params_override: str = "",
  *,
  strategy: str | None = None,
  data: str | None = None,
  seed: int | None = None,
  tpu: str | None = None,
) -> definitions.ExperimentConfig:
  """The experiment's config with files, overrides and flags applied.

  Example:
    >>> from model_garden.ranking.train import build_config
    >>> config = build_config("dcn_criteo_cpu_small",
    ...                       params_override="trainer.train_steps=7",
    ...                       data="paddlerec", strategy="mirrored")
    >>> (config.trainer.train_steps, config.task.data_format,
    ...  config.runtime.distribution_strategy)
    (7, 'paddlerec', 'mirrored')
  """
  config = configs.get_config(experiment)
  for path in config_files:
    config = configs.override(config, configs.load_yaml(path))
  if params_override:
    config = configs.override(
      config, configs.parse_params_override(params_override)
    )
  changes: dict[str, Any] = {}
  if data == "synthetic":
    changes["task.use_synthetic_data"] = True
  elif data == "paddlerec":
    changes.update(
      {
        "task.use_synthetic_data": False,
        "task.use_tf_record_reader": False,
        "task.data_format": "paddlerec",
        "task.train_data.input_path": "",
        "task.validation_data.input_path": "",
      }
    )
    # The sample's splits hold 64 and 16 records: batches the experiment
    # sized for big data become 16 (a size set by the user is checked).
    default = configs.get_config(experiment).task
    for split in ("train_data", "validation_data"):
      batch = getattr(config.task, split).global_batch_size
      if batch == getattr(default, split).global_batch_size:
        changes[f"task.{split}.global_batch_size"] = min(batch, 16)
  elif data:
    changes.update(
      {
        "task.use_synthetic_data": False,
        "task.data_format": "tsv",
        "task.train_data.input_path": data,
      }
    )
  # The validation batch follows a training batch set by the user, unless
  # set too.
  default = configs.get_config(experiment).task
  train_batch = config.task.train_data.global_batch_size
  if (
    train_batch != default.train_data.global_batch_size
    and config.task.validation_data.global_batch_size
    == default.validation_data.global_batch_size
    and "task.validation_data.global_batch_size" not in changes
  ):
    changes["task.validation_data.global_batch_size"] = train_batch
  if strategy:
    changes["runtime.distribution_strategy"] = strategy
  if seed is not None:
    changes["runtime.seed"] = seed
  if tpu:
    changes["runtime.tpu"] = tpu
  if changes:
    config = configs.override(config, changes)
  task = config.task
  if (
    task.train_data.input_path
    and not task.validation_data.input_path
    and not task.use_synthetic_data
    and not task.holdout_every
  ):
    # Training files alone: validation is held out of them, never the
    # training records themselves.
    config = configs.override(
      config, {"task.holdout_every": definitions.DEFAULT_HOLDOUT_EVERY}
    )
  return configs.validate(config)


def write_params(config: definitions.ExperimentConfig, model_dir: str) -> str:
  """Writes the effective config to ``model_dir/params.yaml`` (as JSON,
  which is YAML: ``--config_file`` reads it back); any TensorFlow
  filesystem."""
  import tensorflow as tf  # noqa: PLC0415

  tf.io.gfile.makedirs(model_dir)
  path = os.path.join(model_dir, "params.yaml")
  with tf.io.gfile.GFile(path, "w") as f:
    f.write(json.dumps(dataclasses.asdict(config), indent=2))
  return path


@dataclasses.dataclass
class Plan:
  """What ``main`` runs, decided before anything is built."""

  config: definitions.ExperimentConfig
  strategy: str
  launch: bool = False
  local_cluster: tuple[int, int] | None = None
  cluster: dict[str, Any] | None = None
  notes: list[str] = dataclasses.field(default_factory=list)


def prepare(tf_config: str = "") -> Plan:
  """Checks the flags, the config and the cluster (``preflight``).

  Args:
    tf_config: the ``TF_CONFIG`` environment variable ("" if unset).

  Raises:
    ValueError: with the one line to show the user.
  """
  from model_garden.ranking import preflight  # noqa: PLC0415

  if not FLAGS.model_dir:
    raise ValueError("--model_dir is required.")
  if FLAGS.experiment not in configs.experiments():
    import difflib  # noqa: PLC0415

    close = difflib.get_close_matches(FLAGS.experiment, configs.experiments())
    raise ValueError(
      f"Unknown --experiment {FLAGS.experiment!r}"
      + (f" (did you mean {close[0]}?)" if close else "")
      + f"; known: {', '.join(configs.experiments())}."
    )
  config = build_config(
    FLAGS.experiment,
    FLAGS.config_file,
    FLAGS.params_override,
    strategy=FLAGS.strategy,
    data=FLAGS.data,
    seed=FLAGS.seed,
    tpu=FLAGS.tpu,
  )
  strategy = config.runtime.distribution_strategy
  preflight.check_flags(
    strategy=strategy,
    mode=FLAGS.mode,
    num_replicas=FLAGS.num_replicas,
    num_workers=FLAGS.num_workers,
    num_ps=FLAGS.num_ps,
    ps_local_cluster=FLAGS.ps_local_cluster,
    tpu=FLAGS.tpu,
    kill_at_step=FLAGS.kill_at_step,
    eval_timeout=FLAGS.eval_timeout,
    cluster_timeout=(
      FLAGS.cluster_timeout if FLAGS["cluster_timeout"].present else None
    ),
    tf_config=tf_config,
  )
  plan = Plan(config, strategy, launch=FLAGS.num_workers > 0)
  if FLAGS.ps_local_cluster:
    plan.local_cluster = _parse_local_cluster(FLAGS.ps_local_cluster)
  elif not plan.launch and strategy in preflight.CLUSTER_STRATEGIES:
    plan.cluster = preflight.check_cluster(strategy, tf_config)
  preflight.check_data(config)
  preflight.check_data_keys(config, FLAGS.mode)
  if strategy == "mirrored":
    preflight.check_batches(config, FLAGS.num_replicas, FLAGS.mode)
  preflight.check_checkpoint(config, FLAGS.model_dir, FLAGS.mode)
  preflight.check_run_dir(config, FLAGS.model_dir, FLAGS.mode)
  steps = preflight.validation_steps(config, FLAGS.mode)
  if steps is not None:
    plan.config = configs.override(config, {"trainer.validation_steps": steps})
    plan.notes.append(
      f"trainer.validation_steps set to {steps} (the synthetic validation "
      "set's global batches): parameter-server workers read it as a stream."
    )
  return plan


def check_resources(plan: Plan) -> None:
  """The checks of memory, input files and ``--model_dir`` (runtime
  failures: ``cli.FixableError``), after ``prepare`` and before anything is
  written; ``--model_dir`` is left as it was.

  A training run's chief first checks that no other run holds
  ``--model_dir`` (``tpu_embedding.run_lock``), writing nothing there.
  """
  from model_garden.ranking import preflight  # noqa: PLC0415
  from tpu_embedding import run_lock  # noqa: PLC0415

  if writes_run_dir(FLAGS.mode):
    try:
      run_lock.check_free(FLAGS.model_dir, USE_ANOTHER_DIR)
    except run_lock.DirectoryInUseError as e:
      raise cli.FixableError(str(e)) from None
  preflight.check_memory(
    plan.config,
    FLAGS.experiment,
    hosts=preflight.cluster_hosts(plan.strategy, plan.cluster),
    replicas=max(1, FLAGS.num_replicas) if plan.strategy == "mirrored" else 1,
  )
  preflight.check_disk_directory(
    plan.config, FLAGS.num_workers if plan.launch else 0
  )
  preflight.check_inputs(plan.config, FLAGS.mode)
  warning = preflight.shared_files_warning(plan.config, FLAGS.mode)
  if warning:
    plan.notes.append(warning)
  preflight.check_model_dir(FLAGS.model_dir)


#: The way out a refused run's message offers (``run_lock``).
USE_ANOTHER_DIR = "use another --model_dir"


def writes_run_dir(mode: str) -> bool:
  """Whether this process is the chief of a training run, by
  ``TF_CONFIG``: the one that holds ``--model_dir``'s lock (``run_lock``;
  a parameter-server cluster's coordinator is its chief).

  Example:
    >>> from model_garden.ranking import train
    >>> train.writes_run_dir("train"), train.writes_run_dir("continuous_eval")
    (True, False)
  """
  from tpu_embedding import run_lock  # noqa: PLC0415

  return mode in TRAINING_MODES and run_lock.is_chief_task()


def _parse_local_cluster(text: str) -> tuple[int, int]:
  try:
    workers, ps = (int(x) for x in text.split(","))
  except ValueError:
    raise ValueError(
      f'--ps_local_cluster must be "W,P" (workers, parameter servers), got '
      f"{text!r}."
    ) from None
  if workers < 1 or ps < 1:
    raise ValueError(
      f"--ps_local_cluster needs at least 1 worker and 1 PS, got {text!r}."
    )
  return workers, ps


def task_command() -> list[str]:
  """This command for the launcher's tasks: the flags given, minus the
  launcher's own."""
  args = [sys.executable, "-m", "model_garden.ranking.train"]
  for name in list(FLAGS):
    flag = FLAGS[name]
    if name in LAUNCHER_FLAGS or not flag.present or name != flag.name:
      continue
    args.extend(line for line in flag.serialize().split("\n") if line)
  return args


def main(argv: list[str]) -> None:
  """Runs the flags' experiment (see the module docstring).

  Raises:
    app.UsageError: for anything wrong with the flags, the config or the
      cluster, before anything is built.
  """
  del argv
  if not FLAGS["verbosity"].present:
    # Our progress goes to stdout; keep library INFO logs out of it.
    logging.set_verbosity(logging.WARNING)
    import tensorflow as tf  # noqa: PLC0415

    tf.get_logger().setLevel("ERROR")
  tf_config = os.environ.get("TF_CONFIG", "")
  try:
    plan = prepare(tf_config)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  check_resources(plan)
  _RUNNING.append(plan.config)
  for note in plan.notes:
    print(note, flush=True)
  if plan.launch:
    from model_garden.ranking import launcher  # noqa: PLC0415
    from tpu_embedding import run_lock  # noqa: PLC0415

    kill = (
      [f"--kill_at_step={FLAGS.kill_at_step}"]
      if (FLAGS.kill_at_step is not None)
      else []
    )
    # The launcher holds the run's directory for the tasks it starts and
    # restarts (its children share the lock).
    training = FLAGS.mode in TRAINING_MODES
    fresh = training and not _exists(FLAGS.model_dir)
    lock = (
      run_lock.RunLock(FLAGS.model_dir, USE_ANOTHER_DIR)
      if training
      else contextlib.nullcontext()
    )
    with lock:
      code = launcher.launch(
        task_command(),
        plan.strategy,
        FLAGS.num_workers,
        FLAGS.num_ps,
        max_restarts=FLAGS.max_restarts,
        first_attempt_only=kill,
      )
      if code and fresh:
        _remove_unfinished(FLAGS.model_dir)
    if code:
      sys.exit(code)
    return
  # Before TensorFlow initializes its devices:
  from model_garden.ranking import strategies  # noqa: PLC0415

  if plan.strategy == "mirrored" and FLAGS.num_replicas > 1:
    strategies.use_logical_cpus(FLAGS.num_replicas)
  cluster = None
  if plan.local_cluster is not None:
    cluster = strategies.local_cluster(*plan.local_cluster)
  elif plan.strategy == "parameter_server":
    strategies.run_server_if_not_coordinator()
  run(
    plan.config,
    FLAGS.model_dir,
    mode=FLAGS.mode,
    experiment=FLAGS.experiment,
    num_replicas=FLAGS.num_replicas,
    cluster=cluster,
    kill_at_step=FLAGS.kill_at_step,
    progress_bar={"on": True, "off": False}.get(FLAGS.progress_bar),
    eval_timeout=FLAGS.eval_timeout,
    cluster_timeout=FLAGS.cluster_timeout,
    fdo_stats_dir=FLAGS.fdo_stats_dir,
    fdo_topology=FLAGS.fdo_topology,
    fdo_every_n_steps=FLAGS.fdo_every_n_steps,
  )


def run(
  config: definitions.ExperimentConfig,
  model_dir: str,
  *,
  mode: str = "train_and_eval",
  experiment: str = "",
  num_replicas: int = 0,
  cluster: Any = None,
  kill_at_step: int | None = None,
  progress_bar: bool | None = None,
  eval_timeout: float | None = None,
  cluster_timeout: float | None = 600.0,
  fdo_stats_dir: str | None = None,
  fdo_topology: str = "v5p-8",
  fdo_every_n_steps: int = 100,
) -> dict[str, Any]:
  """Runs an experiment; returns a summary (metrics, paths, timings).

  Args:
    config: the experiment (``build_config``).
    model_dir: checkpoints, summaries and the SavedModel go here.
    mode: ``"train"``, ``"eval"``, ``"train_and_eval"`` or
      ``"continuous_eval"``.
    experiment: the experiment's name, for the log.
    num_replicas: ``mirrored`` on CPUs: logical devices to use (made by
      ``strategies.use_logical_cpus``).
    cluster: ``parameter_server``: an in-process cluster.
    kill_at_step: see ``trainer.Trainer``.
    progress_bar: see ``progress.Progress``.
    eval_timeout: see ``trainer.Trainer.continuous_evaluate``.
    cluster_timeout: ``multi_worker_mirrored``: seconds to wait for the
      cluster's other tasks (``strategies.wait_for_cluster``; None or 0:
      forever).
    fdo_stats_dir: keep SparseCore statistics of the training batches
      (``tpu_embedding.fdo``) for ``fdo_topology`` and write them here every
      ``fdo_every_n_steps`` steps and at the end of training.

  Returns:
    ``{"validation": metrics, "examples_per_second", "skipped_steps",
    "checkpoint", "saved_model", "seconds", "model_dir"}`` (what
    applies).

  A training run that creates ``model_dir`` and fails before its first
  checkpoint removes it again. A training run's chief holds
  ``model_dir``'s lock (``tpu_embedding.run_lock``) for the run's life;
  evaluations take none.

  Raises:
    ValueError: for an unknown mode, or ``"eval"`` without a checkpoint.
    tpu_embedding.run_lock.DirectoryInUseError: another run holds ``model_dir``
      (nothing was written).
  """
  import keras  # noqa: PLC0415

  from model_garden.ranking import embedding as ranking_embedding  # noqa: PLC0415
  from model_garden.ranking import saved_model  # noqa: PLC0415
  from model_garden.ranking import strategies  # noqa: PLC0415
  from model_garden.ranking.inputs import RankingInputs  # noqa: PLC0415
  from model_garden.ranking.task import RankingTask  # noqa: PLC0415
  from model_garden.ranking.trainer import Trainer  # noqa: PLC0415
  from tpu_embedding import run_lock  # noqa: PLC0415

  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  start = time.perf_counter()
  # The strategy first: MultiWorkerMirroredStrategy must configure
  # collectives before TensorFlow's context starts.
  strategy = strategies.create_strategy(
    config.runtime.distribution_strategy,
    num_replicas=num_replicas,
    tpu=config.runtime.tpu,
    cluster=cluster,
    cluster_timeout=cluster_timeout,
  )
  seed = config.runtime.seed
  if seed is not None:
    keras.utils.set_random_seed(seed)
  chief = strategies.is_chief(strategy)
  writer = chief and mode in TRAINING_MODES
  # Whether the directory is there is known before the lock makes it; a
  # run refused the lock never gets to remove anything.
  fresh = writer and not _exists(model_dir)
  lock = (
    run_lock.RunLock(model_dir, USE_ANOTHER_DIR)
    if writer
    else contextlib.nullcontext()
  )
  made_here = (
    _made_by_this_run(model_dir, fresh) if writer else contextlib.nullcontext()
  )
  with lock, made_here:
    task = RankingTask(config, strategy, seed=seed)
    inputs = RankingInputs(config.task, strategy)
    tracker = None
    if fdo_stats_dir:
      from tpu_embedding import fdo  # noqa: PLC0415

      tracker = fdo.FdoTracker(
        fdo.FdoCollector(
          ranking_embedding.feature_config(config.task.model),
          fdo_topology,
          optimizer=task.embedding_optimizer,
        ),
        fdo_stats_dir,
        fdo_every_n_steps,
      )
    loop = Trainer(
      task,
      inputs,
      model_dir,
      kill_at_step=kill_at_step,
      progress_bar=progress_bar,
      fdo=tracker,
    )
    if chief and mode in TRAINING_MODES:
      # After the restore: a checkpoint of another experiment stops the run
      # before its directory gets this experiment's params.yaml.
      write_params(config, model_dir)
    _describe(loop, experiment or "experiment")
    summary: dict[str, Any] = {"model_dir": model_dir}
    if mode == "eval":
      if loop.restored is None:
        raise ValueError(f"--mode eval: no checkpoint in {model_dir}.")
      summary["validation"] = loop.evaluate()
    elif mode == "continuous_eval":
      summary["validation"] = loop.continuous_evaluate(timeout=eval_timeout)
    elif mode == "train":
      loop.train()
    else:
      summary["validation"] = loop.train_and_evaluate()
    if mode in TRAINING_MODES:
      summary["examples_per_second"] = loop.train_examples_per_second
      summary["skipped_steps"] = loop.skipped_steps
      # The last save, full or delta: the state the run ends in.
      summary["checkpoint"] = loop.manager.latest_save
      if config.trainer.export_saved_model and chief:
        export_dir = os.path.join(model_dir, "saved_model", str(loop.step))
        result = saved_model.export_from_checkpoint(
          config, loop.manager.latest_save, export_dir
        )
        summary["saved_model"] = result.export_dir
    summary["seconds"] = time.perf_counter() - start
    _report(loop, summary)
    return summary


@contextlib.contextmanager
def _made_by_this_run(model_dir: str, fresh: bool) -> Iterator[None]:
  """Removes ``model_dir`` if this training run made it (``fresh``: it was
  not there before the run took its lock) and fails before its first
  checkpoint (a bad record in the first batches, a wrong key...): a
  failed run leaves no half-made run directory behind. A directory that
  was there, or holds a checkpoint, is kept, and so is one of a run
  stopped by the user (KeyboardInterrupt).
  """
  try:
    yield
  except Exception:
    if fresh:
      _remove_unfinished(model_dir)
    raise


def _remove_unfinished(model_dir: str) -> None:
  """Removes a run's directory that holds no checkpoint (logged)."""
  import tensorflow as tf  # noqa: PLC0415

  if not _exists(model_dir) or _has_checkpoint(model_dir):
    return
  try:
    tf.io.gfile.rmtree(model_dir)
    logging.warning(
      "Removed %s: the run failed before a checkpoint.", model_dir
    )
  except (OSError, tf.errors.OpError) as error:
    logging.warning("Could not remove %s: %s", model_dir, error)


def _exists(path: str) -> bool:
  import tensorflow as tf  # noqa: PLC0415

  return bool(tf.io.gfile.exists(path))


def _has_checkpoint(model_dir: str) -> bool:
  import tensorflow as tf  # noqa: PLC0415

  return tf.train.latest_checkpoint(model_dir) is not None


def _describe(loop: Any, experiment: str) -> None:
  config, strategy = loop.config, loop.strategy
  model = config.task.model
  plan = loop.task.embedding.sharding_plan
  sharded = (
    sum(p.sharded for p in plan.placements.values()) if plan is not None else 0
  )
  on_disk = ""
  if model.disk_tables():  # (this process's stores, in its directory)
    stores = loop.task.embedding.table_stores.values()
    tiered = sum(store.layout.startswith("tiered") for store in stores)
    from model_garden.ranking import embedding  # noqa: PLC0415

    directory = embedding.disk_directory(
      model, config.runtime.distribution_strategy
    )
    on_disk = f", {tiered} on disk in {directory}"
  loop.log(
    f"{experiment}: {model.interaction} interaction, "
    f"{len(model.vocab_sizes)} tables ({sum(model.vocab_sizes):,} rows; "
    f"{sharded} row-sharded{on_disk}), {type(strategy).__name__} with "
    f"{strategy.num_replicas_in_sync} replica(s), global batch "
    f"{config.task.train_data.global_batch_size}, {loop.inputs.source} "
    f"data, {config.trainer.train_steps} steps"
    + (
      f", {config.runtime.mixed_precision_dtype}"
      if config.runtime.mixed_precision_dtype != "float32"
      else ""
    )
    + (f" (restored at step {loop.step})" if loop.restored else "")
  )
  split = loop.inputs.split_note()
  if split:
    loop.log(split)
  for note in loop.inputs.policy_notes():
    loop.log(note)


def _report(loop: Any, summary: dict[str, Any]) -> None:
  validation = summary.get("validation")
  if validation:
    loop.log(
      f"Validation AUC {validation['auc']:.4f} (accuracy "
      f"{validation['accuracy']:.4f}, loss {validation['loss']:.4f})"
    )
  rate = summary.get("examples_per_second")
  if rate:
    loop.log(f"Training throughput: {rate:,.0f} examples/s")
  if summary.get("skipped_steps"):
    loop.log(
      f"Skipped {summary['skipped_steps']} step(s) whose gradients were not "
      "finite."
    )
  if summary.get("checkpoint"):
    loop.log(f"Checkpoint: {summary['checkpoint']}")
  if summary.get("saved_model"):
    loop.log(f"SavedModel: {summary['saved_model']}")
  loop.log(f"Done in {summary['seconds']:.0f}s.")
  sys.stdout.flush()


def translate_error(error: BaseException) -> BaseException | None:
  """A run's failure the user can fix, as one ``cli`` line (or None)."""
  from model_garden.ranking.data import bad_records  # noqa: PLC0415
  from tpu_embedding import run_lock  # noqa: PLC0415

  if isinstance(error, app.UsageError):
    return cli.UsageError(str(error))
  if isinstance(error, run_lock.DirectoryInUseError):
    return cli.FixableError(str(error))
  from model_garden.ranking import strategies  # noqa: PLC0415

  if isinstance(error, strategies.ClusterTimeoutError):
    return cli.FixableError(str(error))
  from tpu_embedding.tables import tiered  # noqa: PLC0415

  failure = tiered.own_error(error)  # (inside a step: TensorFlow's error)
  if failure is not None:
    knob = "task.model.disk_cache_bytes"
    return cli.FixableError(str(failure).replace("DiskTier.cache_bytes", knob))
  message = bad_records.describe_bad_record(error, _bad_record_key(error))
  if message is not None:
    return cli.FixableError(message)
  if isinstance(error, ValueError) and "no full global batch" in str(error):
    return cli.FixableError(str(error))
  if "Received incompatible tensor" in str(error) or (
    "Shapes" in str(error) and "are incompatible" in str(error)
  ):
    model_dir = FLAGS.model_dir if "model_dir" in FLAGS else "--model_dir"
    return cli.FixableError(
      f"The checkpoint in {model_dir} was written by another experiment "
      f"({_first_line(error)}): use a new --model_dir, or run with that "
      "experiment's config."
    )
  if isinstance(error, ValueError) and "is not divisible by" in str(error):
    # (replicas known only once the strategy exists: GPUs, workers)
    return cli.FixableError(
      f"{str(error).strip()}: set task.train_data.global_batch_size (and "
      "validation_data's) to a multiple of the replicas."
    )
  return None


def _first_line(error: BaseException) -> str:
  text = str(getattr(error, "message", error)).strip()
  return text.splitlines()[0][:160] if text else type(error).__name__


#: The config ``main`` runs (for the error messages).
_RUNNING: list[definitions.ExperimentConfig] = []


def _bad_record_key(error: BaseException) -> str:
  """``task.<split>.on_bad_record`` of the split whose file ``error``
  names."""
  import fnmatch  # noqa: PLC0415

  from model_garden.ranking.data import text_files  # noqa: PLC0415

  text = str(getattr(error, "message", error))
  splits = ("train_data", "validation_data")
  if _RUNNING:
    task = _RUNNING[-1].task
    at = text.find("Bad record at ") + len("Bad record at ")
    where = text[at:].split(":")
    if definitions.holds_out(task) and len(where) > 1:
      # Both splits read the files: the record's number says whose it is.
      number = "".join(c for c in where[1][:20] if c.isdigit())
      if number:
        held = text_files.Holdout(task.holdout_every, True).holds(int(number))
        return f"task.{splits[held]}.on_bad_record"
    for split in splits:
      paths = definitions.split_input_path(task, split).split(",")
      for pattern in (p.strip() for p in paths if p.strip()):
        if fnmatch.fnmatch(where[0], pattern):
          return f"task.{split}.on_bad_record"
  return "task.train_data.on_bad_record (or validation_data's)"


def _main(argv: list[str]) -> None:
  cli.run(lambda: main(argv), translate_error)


if __name__ == "__main__":
  define_flags()
  app.run(_main, flags_parser=cli.absl_flags_parser)
