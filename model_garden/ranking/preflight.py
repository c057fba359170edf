"""Checks a ranking run can start, before anything is built.

``train.main`` runs these after parsing its flags and building the config,
and turns each ``ValueError`` into one usage line (exit 2); the checks
of files, memory and permissions raise ``cli.FixableError`` (exit 1). Nothing
is written before they all pass:

* ``check_flags``: flags that contradict each other (``--num_replicas``
  without ``mirrored``, ``--num_ps`` without ``parameter_server``, ...).
* ``check_cluster``: the cluster a multi-worker strategy needs
  (``TF_CONFIG``, ``--num_workers``, ``--ps_local_cluster``), read and
  checked (instead of TensorFlow's "Cluster spec must be non-empty").
* ``check_checkpoint``: ``--mode eval`` needs a checkpoint, and an
  experiment that matches the ``params.yaml`` of the run that wrote it.
* ``check_memory``: the tables and their slots must fit in the memory
  available (``table_bytes`` estimates them from the config alone; a
  table kept on disk counts a cache per replica and 4 bytes a row).
* ``check_disk_directory``: ``task.model.disk_directory`` can be created
  and written, and no other process keeps its tables there.
* ``check_data_keys``: data keys that contradict each other or would be
  ignored (an ``input_path`` with synthetic data, ...).
* ``check_run_dir``: training into a ``model_dir`` whose ``params.yaml``
  is another experiment's is refused, naming the keys that differ.
* ``check_inputs``: every input glob matches readable (text) files that
  hold at least one global batch.
* ``check_model_dir``: ``model_dir`` can be created and written (checked
  last, leaving it as it was).
* ``check_data``: the model's features must be Criteo's (26 tables).
* ``validation_steps``: under ``parameter_server``, evaluation needs
  ``trainer.validation_steps`` (defaulted for synthetic data).

Example:
  >>> from model_garden.ranking import configs, preflight
  >>> estimate = preflight.table_bytes(configs.get_config("dlrm_criteo"))
  >>> round(estimate.total / 2**30, 1)  # 26 tables, 64 wide, SGD: no slots
  44.8
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from model_garden.ranking import optimizers
from model_garden.ranking.configs import definitions
from tpu_embedding import memory
from tpu_embedding import run_lock
from tpu_embedding.sharding import DiskTier

#: Strategies that run over a cluster of processes.
CLUSTER_STRATEGIES = ("multi_worker_mirrored", "parameter_server")
#: Bytes per table element (float32).
ELEMENT_BYTES = 4
#: The saved effective config in ``model_dir``.
PARAMS_FILE = "params.yaml"
#: Sections of the config a checkpoint's variables depend on.
CHECKPOINT_SHAPING = (
  "task.model",
  "trainer.optimizer_config.embedding_optimizer",
  "trainer.optimizer_config.dense_optimizer",
  "runtime.mixed_precision_dtype",
)
#: Keys under those that leave the checkpoint alone (where tables live:
#: a checkpoint restores into memory or onto disk).
NOT_CHECKPOINT_SHAPING = (
  "task.model.disk_directory",
  "task.model.disk_size_threshold",
  "task.model.disk_cache_bytes",
)
#: The way out a memory refusal offers: tables kept on a local disk.
DISK_WAY_OUT = (
  "keep the largest tables on a local disk behind a RAM cache "
  "(task.model.disk_directory, disk_size_threshold, disk_cache_bytes; one "
  "device, mirrored or multi_worker_mirrored)"
)


def check_flags(
  *,
  strategy: str,
  mode: str,
  num_replicas: int = 0,
  num_workers: int = 0,
  num_ps: int = 0,
  ps_local_cluster: str | None = None,
  tpu: str | None = None,
  kill_at_step: int | None = None,
  eval_timeout: float | None = None,
  cluster_timeout: float | None = None,
  tf_config: str = "",
) -> None:
  """Rejects flags that contradict each other or the strategy.

  Raises:
    ValueError: naming the flags and what to change.

  Example:
    >>> from model_garden.ranking import preflight
    >>> try:
    ...   preflight.check_flags(strategy="default", mode="train",
    ...                         num_replicas=2)
    ... except ValueError as e:
    ...   print(str(e)[:44])
    --num_replicas=2 applies to --strategy mirro
  """
  if num_replicas and strategy != "mirrored":
    raise ValueError(
      f"--num_replicas={num_replicas} applies to --strategy mirrored "
      f"(logical CPU devices), not {strategy}; remove it or use mirrored."
    )
  if num_replicas < 0 or num_workers < 0 or num_ps < 0:
    raise ValueError(
      "--num_replicas, --num_workers and --num_ps must not be negative."
    )
  if ps_local_cluster and strategy != "parameter_server":
    raise ValueError(
      f"--ps_local_cluster applies to --strategy parameter_server, not "
      f"{strategy}."
    )
  if (num_workers or num_ps) and strategy not in CLUSTER_STRATEGIES:
    raise ValueError(
      f"--num_workers / --num_ps start a local cluster for --strategy "
      f"multi_worker_mirrored or parameter_server, not {strategy}."
    )
  if num_ps and strategy != "parameter_server":
    raise ValueError(
      "--num_ps applies to --strategy parameter_server only "
      "(multi_worker_mirrored has no parameter servers)."
    )
  if strategy == "parameter_server" and (num_workers or num_ps):
    if not (num_workers and num_ps):
      raise ValueError(
        "--strategy parameter_server with a local cluster needs both "
        f"--num_workers and --num_ps (got {num_workers} and {num_ps})."
      )
  if (num_workers or num_ps) and ps_local_cluster:
    raise ValueError(
      "Use either --num_workers/--num_ps (separate processes) or "
      "--ps_local_cluster (servers in this process), not both."
    )
  if (num_workers or num_ps or ps_local_cluster) and tf_config:
    raise ValueError(
      "TF_CONFIG is set (this process is a task of a cluster), so "
      "--num_workers, --num_ps and --ps_local_cluster, which start a local "
      "cluster, do not apply: unset TF_CONFIG or drop those flags."
    )
  if cluster_timeout is not None and strategy != "multi_worker_mirrored":
    raise ValueError(
      f"--cluster_timeout applies to --strategy multi_worker_mirrored, not "
      f"{strategy}."
    )
  if cluster_timeout is not None and cluster_timeout < 0:
    raise ValueError(
      f"--cluster_timeout must not be negative (0: wait forever), got "
      f"{cluster_timeout:g}."
    )
  if tpu and strategy != "tpu":
    raise ValueError(f"--tpu applies to --strategy tpu, not {strategy}.")
  if kill_at_step is not None and mode not in ("train", "train_and_eval"):
    raise ValueError(f"--kill_at_step applies to training, not --mode {mode}.")
  if eval_timeout is not None and mode != "continuous_eval":
    raise ValueError(
      f"--eval_timeout applies to --mode continuous_eval, not --mode {mode}."
    )
  if tf_config and strategy not in CLUSTER_STRATEGIES + ("tpu",):
    raise ValueError(
      f"TF_CONFIG is set but --strategy {strategy} runs in one process and "
      "would ignore it: use multi_worker_mirrored or parameter_server, or "
      "unset TF_CONFIG."
    )


def check_cluster(strategy: str, tf_config: str) -> dict[str, Any] | None:
  """Reads and checks ``TF_CONFIG`` for a cluster strategy.

  Args:
    strategy: ``runtime.distribution_strategy``.
    tf_config: the ``TF_CONFIG`` environment variable ("" if unset), for a
      run without ``--num_workers`` / ``--ps_local_cluster``.

  Returns:
    The parsed ``TF_CONFIG`` (None if unset).

  Raises:
    ValueError: for a ``parameter_server`` run without a cluster, invalid
      JSON, or a cluster without the tasks the strategy needs.

  Example:
    >>> from model_garden.ranking import preflight
    >>> try:
    ...   preflight.check_cluster("parameter_server", "")
    ... except ValueError as e:
    ...   print(str(e)[:48])
    --strategy parameter_server needs a cluster: set
  """
  if not tf_config:
    if strategy == "parameter_server":
      raise ValueError(
        "--strategy parameter_server needs a cluster: set TF_CONFIG (see "
        "README, 'Multi-worker training'), or start a local one with "
        "--num_workers N --num_ps M (processes) or --ps_local_cluster W,P "
        "(in this process)."
      )
    return None
  try:
    parsed = json.loads(tf_config)
  except json.JSONDecodeError as e:
    raise ValueError(
      f"TF_CONFIG is not valid JSON ({e}): {tf_config!r}."
    ) from None
  cluster = parsed.get("cluster") if isinstance(parsed, dict) else None
  if not isinstance(cluster, dict) or not cluster:
    raise ValueError(
      'TF_CONFIG has no "cluster": expected {"cluster": {"worker": '
      '["host:port", ...], ...}, "task": {"type": "worker", "index": 0}}.'
    )
  task = parsed.get("task") or {}
  kind, index = task.get("type"), task.get("index", 0)
  if kind not in cluster:
    raise ValueError(
      f"TF_CONFIG's task type {kind!r} is not one of its cluster's jobs "
      f"{sorted(cluster)}."
    )
  if not isinstance(index, int) or not 0 <= index < len(cluster[kind]):
    raise ValueError(
      f"TF_CONFIG's task index {index!r} is out of range: the cluster has "
      f"{len(cluster[kind])} {kind} task(s)."
    )
  needed = {
    "parameter_server": ("chief", "worker", "ps"),
    "multi_worker_mirrored": ("worker",),
  }.get(strategy, ())
  missing = [job for job in needed if not cluster.get(job)]
  if "chief" in cluster and strategy == "multi_worker_mirrored":
    missing = []
  if missing:
    raise ValueError(
      f"--strategy {strategy}: TF_CONFIG's cluster has no {missing} tasks "
      f"(it has {sorted(cluster)}); {strategy} needs "
      f"{', '.join(needed)}."
    )
  return parsed


def check_data(config: definitions.ExperimentConfig) -> None:
  """Every data source here is Criteo's: 26 categorical features.

  Raises:
    ValueError: naming ``task.model.vocab_sizes``.
  """
  from model_garden.ranking.data import criteo_schema  # noqa: PLC0415

  try:
    criteo_schema.check_vocab_sizes(tuple(config.task.model.vocab_sizes))
  except ValueError as e:
    raise ValueError(
      f"task.model.{str(e).rstrip('.')} (one per Criteo categorical feature)."
    ) from None


@dataclasses.dataclass(frozen=True)
class TableBytes:
  """Estimated memory of an experiment's tables and optimizer slots.

  ``tables``, ``slots``, ``sharded`` and ``largest`` count the tables held
  in memory; ``disk`` the memory of the tables kept on disk: each one's
  caches (one a replica) and its map of cached rows
  (``DiskTier.memory_bytes`` of each replica's block).
  """

  tables: int
  slots: int
  sharded: int
  largest: int
  disk: int = 0

  @property
  def total(self) -> int:
    return self.tables + self.slots + self.disk

  def per_host(self, hosts: int) -> int:
    """Bytes on each of ``hosts`` machines: row-sharded tables split, the
    others whole (an upper bound)."""
    return self.total - self.sharded + -(-self.sharded // max(1, hosts))


def table_bytes(
  config: definitions.ExperimentConfig, replicas: int = 1
) -> TableBytes:
  """Table and slot bytes of ``config``'s model (float32), from its config.

  A table kept on disk (``task.model.disk_directory``) counts as
  ``tpu_embedding``'s ``build()`` counts it: a cache of
  ``disk_cache_bytes`` for each of the ``replicas`` blocks it is
  row-sharded into (one on one device) plus 4 bytes a row; with fewer
  rows than replicas it stays in memory.

  Example:
    >>> from model_garden.ranking import configs, preflight
    >>> config = configs.override(configs.get_config("dlrm_criteo"), {
    ...   "task.model.vocab_sizes": [1000, 10],
    ...   "task.model.embedding_dim": 64,
    ...   "trainer.optimizer_config.embedding_optimizer": "Adagrad"})
    >>> b = preflight.table_bytes(config)
    >>> b.tables, b.slots, b.largest
    (258560, 258560, 512000)
    >>> b = preflight.table_bytes(configs.override(config, {
    ...   "task.model.disk_directory": "/ssd",
    ...   "task.model.disk_size_threshold": 100,
    ...   "task.model.disk_cache_bytes": 2**16}))
    >>> b.tables, b.disk  # table 0 on disk: 64 KiB of cache + 4 B a row
    (2560, 69536)
    >>> preflight.table_bytes(configs.override(config, {
    ...   "task.model.disk_directory": "/ssd",
    ...   "task.model.disk_size_threshold": 100,
    ...   "task.model.disk_cache_bytes": 2**16}), replicas=2).disk
    135072
  """
  model = config.task.model
  slots = len(
    optimizers.embedding_optimizer_class(
      config.trainer.optimizer_config.embedding_optimizer
    ).SLOT_NAMES
  )
  threshold = model.row_sharding_threshold()
  on_disk = set(model.disk_tables())
  tier = DiskTier(model.disk_directory, model.disk_cache_bytes)
  tables = sharded = largest = disk = 0
  for i, (rows, dim) in enumerate(
    zip(model.vocab_sizes, model.embedding_dims(), strict=True)
  ):
    if i in on_disk and rows >= replicas:
      disk += tier.memory_bytes(rows) + (replicas - 1) * tier.cache_bytes
      continue
    size = rows * dim * ELEMENT_BYTES
    tables += size
    largest = max(largest, size * (1 + slots))
    if rows > threshold:
      sharded += size * (1 + slots)
  return TableBytes(tables, tables * slots, sharded, largest, disk)


def available_memory() -> int | None:
  """Bytes this process can still get (None if unknown): the library's
  measure (``tpu_embedding.memory.available_memory``: the least of the
  cgroup's limit, ``MemAvailable`` and ``RLIMIT_AS``)."""
  found = memory.available_memory()
  return None if found is None else found.bytes


def _gib(size: int) -> str:
  return f"{size / 2**30:.1f} GiB"


def check_memory(
  config: definitions.ExperimentConfig,
  experiment: str,
  *,
  hosts: int = 1,
  replicas: int = 1,
  available: int | None = None,
) -> TableBytes:
  """Rejects an experiment whose tables cannot fit in memory.

  Args:
    config: the experiment.
    experiment: its name, for the message.
    hosts: machines the row-sharded tables are spread over (the workers
      of a real ``multi_worker_mirrored`` cluster, the PS tasks of a
      ``parameter_server`` one; 1 when every process runs here).
    replicas: the replicas of this process whose caches are in its memory
      (``mirrored``'s ``--num_replicas`` logical CPUs): each holds a
      cache of every table kept on disk (``table_bytes``).
    available: bytes available on each machine (default: this one's
      ``available_memory()``; unknown: no check).

  Returns:
    The estimate.

  Raises:
    cli.FixableError: saying how much is needed and what to do (a runtime
      failure: exit 1).
  """
  estimate = table_bytes(config, replicas)
  available = available_memory() if available is None else available
  # Initializing a table briefly holds its initial value and the variable.
  needed = estimate.per_host(hosts) + estimate.largest
  if available is None or needed <= available:
    return estimate
  where = "this machine" if hosts == 1 else f"each of {hosts} machines"
  from model_garden import cli  # noqa: PLC0415

  on_disk = len(config.task.model.disk_tables())
  disk = (
    f", the caches of the {on_disk} table(s) on disk {_gib(estimate.disk)}"
    if on_disk
    else ""
  )
  raise cli.FixableError(
    f"{experiment}: the {len(config.task.model.vocab_sizes)} embedding "
    f"tables need about {_gib(needed)} per machine (tables "
    f"{_gib(estimate.tables)}, optimizer slots {_gib(estimate.slots)}"
    f"{disk}, largest table while initializing {_gib(estimate.largest)}) "
    f"but {where} has {_gib(available)} available. Use a smaller variant "
    f"(e.g. --experiment {experiment.removesuffix('_cpu_small')}_cpu_small),"
    " smaller task.model.vocab_sizes, spread the tables over more "
    "machines (multi_worker_mirrored workers or parameter_server PS tasks "
    f"with TF_CONFIG), or {DISK_WAY_OUT}."
  )


def check_disk_directory(
  config: definitions.ExperimentConfig, workers: int = 0
) -> None:
  """``task.model.disk_directory`` (when it keeps tables) can be created
  and written, and no other process keeps its tables there (their
  locks); leaves it as it was. The directory is this process's
  (``embedding.disk_directory``: under ``multi_worker_mirrored`` its
  task's subdirectory), or, for a launcher of ``workers`` local workers,
  each worker's.

  Raises:
    cli.FixableError: naming the directory and what to do.
  """
  from model_garden import cli  # noqa: PLC0415
  from model_garden.ranking import embedding  # noqa: PLC0415

  model = config.task.model
  if not model.disk_tables():
    return
  flag = "task.model.disk_directory"
  strategy = config.runtime.distribution_strategy
  tasks = [("worker", i) for i in range(workers)] or [None]
  for task in tasks:
    directory = embedding.disk_directory(model, strategy, task)
    check_model_dir(directory, flag)
    for name in embedding.disk_table_names(model):
      try:
        run_lock.check_free(
          os.path.join(directory, name), f"use another {flag}"
        )
      except run_lock.DirectoryInUseError as e:
        raise cli.FixableError(str(e)) from None


def cluster_hosts(strategy: str, tf_config: Mapping[str, Any] | None) -> int:
  """Machines a real cluster spreads the row-sharded tables over."""
  if not tf_config:
    return 1
  cluster = tf_config["cluster"]
  if strategy == "parameter_server":
    return len(cluster.get("ps", ())) or 1
  return len(cluster.get("worker", ())) + len(cluster.get("chief", ())) or 1


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
  if isinstance(value, Mapping):
    flat: dict[str, Any] = {}
    for key, item in value.items():
      flat.update(_flatten(item, f"{prefix}.{key}" if prefix else key))
    return flat
  if isinstance(value, tuple):
    return {prefix: list(value)}
  return {prefix: value}


def saved_params(model_dir: str) -> dict[str, Any] | None:
  """``model_dir/params.yaml`` as a dict (None if absent)."""
  from model_garden.ranking.configs import overrides  # noqa: PLC0415

  path = os.path.join(model_dir, PARAMS_FILE)
  if not tf.io.gfile.exists(path):
    return None
  return overrides.load_yaml(path)


def check_checkpoint(
  config: definitions.ExperimentConfig, model_dir: str, mode: str
) -> None:
  """``--mode eval``: a checkpoint exists and matches the experiment.

  The experiment's model, optimizers and precision (what the checkpoint's
  variables depend on) must equal those of ``model_dir/params.yaml``, the
  config of the run that wrote the checkpoints.

  Raises:
    ValueError: without a checkpoint, or naming the differing fields.
  """
  if mode not in ("eval", "continuous_eval"):
    return
  if mode == "eval" and not (
    tf.train.latest_checkpoint(model_dir) or config.task.init_checkpoint
  ):
    raise ValueError(
      f"--mode eval: no checkpoint in {model_dir} (and no "
      "task.init_checkpoint); train first (--mode train) or point "
      "--model_dir at a training run's directory."
    )
  saved = saved_params(model_dir)
  if saved is None:
    return
  mine = _flatten(dataclasses.asdict(config), "")
  theirs = _flatten(saved, "")
  differences = [
    key
    for key in sorted(mine)
    if shapes_checkpoint(key) and key in theirs and mine[key] != theirs[key]
  ]
  if differences:
    shown = "; ".join(
      f"{key}: {_short(mine[key])} here, {_short(theirs[key])} there"
      for key in differences[:3]
    )
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    raise ValueError(
      f"--mode {mode}: the experiment does not match "
      f"{os.path.join(model_dir, PARAMS_FILE)}, the config of the run that "
      f"wrote the checkpoints: {shown}{more}. Evaluate with that config: "
      f"--config_file={os.path.join(model_dir, PARAMS_FILE)}."
    )


def _short(value: Any) -> str:
  text = json.dumps(value)
  return text if len(text) <= 60 else text[:57] + "..."


def validation_steps(
  config: definitions.ExperimentConfig, mode: str
) -> int | None:
  """``trainer.validation_steps`` a parameter-server evaluation needs.

  Returns:
    None if the config's value is fine; else the default to use (the
    synthetic validation set's whole global batches).

  Raises:
    ValueError: under ``parameter_server`` with files and no
      ``validation_steps``.
  """
  if (
    config.runtime.distribution_strategy != "parameter_server"
    or mode == "train"
    or config.trainer.validation_steps > 0
  ):
    return None
  batch = config.task.validation_data.global_batch_size
  if config.task.use_synthetic_data:
    steps = config.task.synthetic.num_eval_examples // batch
    if steps > 0:
      return steps
  raise ValueError(
    "Under --strategy parameter_server, set trainer.validation_steps (> 0): "
    "workers read the validation data as an endless stream (e.g. "
    "--params_override=trainer.validation_steps=100)."
  )


# --- before anything is written ---------------------------------------------


def needed_splits(mode: str) -> tuple[str, ...]:
  """The data splits ``mode`` reads."""
  if mode == "train":
    return ("train_data",)
  if mode in ("eval", "continuous_eval"):
    return ("validation_data",)
  return ("train_data", "validation_data")


def check_batches(
  config: definitions.ExperimentConfig, replicas: int, mode: str
) -> None:
  """Each global batch ``mode`` reads splits evenly over ``replicas``.

  Raises:
    ValueError: naming the batch key.
  """
  for split in needed_splits(mode):
    batch = getattr(config.task, split).global_batch_size
    if replicas > 1 and batch % replicas:
      raise ValueError(
        f"task.{split}.global_batch_size={batch} does not split over "
        f"{replicas} replicas: use a multiple of {replicas}."
      )


def check_data_keys(config: definitions.ExperimentConfig, mode: str) -> None:
  """Rejects data keys that contradict each other (or would be ignored).

  Raises:
    ValueError: naming the keys and what to change.

  Example:
    >>> from model_garden.ranking import configs, preflight
    >>> config = configs.override(configs.get_config("dlrm_criteo_cpu_small"),
    ...   {"task.train_data.input_path": "/data/day_*.tsv"})
    >>> try:
    ...   preflight.check_data_keys(config, "train")
    ... except ValueError as e:
    ...   print(str(e)[:60])
    task.train_data.input_path='/data/day_*.tsv' is ignored whil
  """
  task = config.task
  paths = {
    split: getattr(task, split).input_path
    for split in ("train_data", "validation_data")
  }
  for split, path in paths.items():
    if path and task.use_synthetic_data:
      raise ValueError(
        f"task.{split}.input_path={path!r} is ignored while "
        "task.use_synthetic_data is true: set task.use_synthetic_data=false "
        "(or --data=<glob>) to read the files, or remove the input path."
      )
    if path and task.data_format == "paddlerec" and not task.use_synthetic_data:
      raise ValueError(
        f"task.{split}.input_path={path!r} is ignored with "
        "task.data_format='paddlerec' (the installed sample): remove one "
        "of them."
      )
  if task.use_synthetic_data:
    return
  if task.use_tf_record_reader and task.data_format == "paddlerec":
    raise ValueError(
      "task.use_tf_record_reader=true reads TFRecord files from "
      "input_path, but task.data_format='paddlerec' reads the installed "
      "text sample: set one of them."
    )
  if task.data_format == "paddlerec":
    return
  for split in needed_splits(mode):
    if not paths[split] and not (
      split == "validation_data" and definitions.holds_out(task)
    ):
      raise ValueError(
        f"task.{split}.input_path is empty and task.use_synthetic_data is "
        f"false: set task.{split}.input_path (or --data=<glob>), or use "
        "--data=synthetic."
      )


def _probe_name() -> str:
  return f".preflight-{os.getpid()}"


def check_model_dir(model_dir: str, flag: str = "--model_dir") -> None:
  """``model_dir`` can be created and written; leaves it as it was.

  Creates the missing directories and a probe file, then removes them.

  Args:
    model_dir: the directory.
    flag: its flag, for the message.

  Raises:
    cli.FixableError: naming ``model_dir`` and why it cannot be written.
  """
  from model_garden import cli  # noqa: PLC0415

  if tf.io.gfile.exists(model_dir) and not tf.io.gfile.isdir(model_dir):
    raise cli.FixableError(
      f"{flag} {model_dir} is a file, not a directory: choose a "
      "directory (it is created if missing)."
    )
  missing = []
  parent = model_dir.rstrip("/") or model_dir
  try:
    while parent and not tf.io.gfile.exists(parent):
      missing.append(parent)
      up = os.path.dirname(parent)
      if up == parent:
        break
      parent = up
    if parent and tf.io.gfile.exists(parent) and not tf.io.gfile.isdir(parent):
      raise cli.FixableError(
        f"{flag} {model_dir}: {parent} is a file, not a directory."
      )
    _write_probe(model_dir)
  except (OSError, tf.errors.OpError) as e:
    reason = getattr(e, "strerror", None) or getattr(e, "message", str(e))
    reason = str(reason).strip().splitlines()[0] if str(reason) else ""
    raise cli.FixableError(
      f"{flag} {model_dir} cannot be created or written ({reason}): "
      "choose a writable directory."
    ) from None
  finally:
    for path in missing:  # deepest first
      try:
        if tf.io.gfile.isdir(path) and not tf.io.gfile.listdir(path):
          _rmdir(path)
      except (OSError, tf.errors.OpError):
        pass


def _write_probe(model_dir: str, attempts: int = 3) -> None:
  """Creates ``model_dir`` and writes and removes a file in it.

  Retried: the tasks of a cluster check the same directory at once, and
  one may remove the directory it created while another writes its probe.
  """
  for attempt in range(attempts):
    try:
      tf.io.gfile.makedirs(model_dir)
      probe = os.path.join(model_dir, _probe_name())
      with tf.io.gfile.GFile(probe, "w") as f:
        f.write("probe")
      tf.io.gfile.remove(probe)
      return
    except (FileNotFoundError, tf.errors.NotFoundError):
      if attempt == attempts - 1 or not _parent_exists(model_dir):
        raise


def _parent_exists(path: str) -> bool:
  parent = os.path.dirname(path.rstrip("/"))
  return not parent or tf.io.gfile.isdir(parent)


def _rmdir(path: str) -> None:
  if "://" in path:
    tf.io.gfile.rmtree(path)
  else:
    os.rmdir(path)


def shapes_checkpoint(key: str) -> bool:
  """Whether config ``key`` (dotted) shapes the checkpoint's variables.

  Example:
    >>> from model_garden.ranking import preflight
    >>> (preflight.shapes_checkpoint("task.model.vocab_sizes"),
    ...  preflight.shapes_checkpoint("task.model.disk_directory"))
    (True, False)
  """
  return (
    key.startswith(CHECKPOINT_SHAPING) and key not in NOT_CHECKPOINT_SHAPING
  )


def differing_keys(
  config: definitions.ExperimentConfig, saved: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
  """``(key, here, there)`` for the checkpoint-shaping keys that differ."""
  mine = _flatten(dataclasses.asdict(config), "")
  theirs = _flatten(saved, "")
  return [
    (key, mine[key], theirs[key])
    for key in sorted(mine)
    if shapes_checkpoint(key) and key in theirs and mine[key] != theirs[key]
  ]


def _describe_differences(differences: list[tuple[str, Any, Any]]) -> str:
  shown = "; ".join(
    f"{key}: {_short(here)} here, {_short(there)} there"
    for key, here, there in differences[:3]
  )
  more = len(differences) - 3
  return shown + (f" (and {more} more)" if more > 0 else "")


def check_run_dir(
  config: definitions.ExperimentConfig, model_dir: str, mode: str
) -> None:
  """Training into ``model_dir``: it holds no other experiment's run.

  A ``params.yaml`` whose model, optimizers or precision differ is
  another experiment's (its checkpoints would not restore, and the file
  would be overwritten); the same experiment resumes.

  Raises:
    ValueError: naming the keys that differ.
  """
  if mode not in ("train", "train_and_eval"):
    return
  try:
    saved = saved_params(model_dir)
  except (ValueError, OSError, tf.errors.OpError):
    saved = {}
  if not saved:
    return
  differences = differing_keys(config, saved)
  if differences:
    raise ValueError(
      f"--model_dir {model_dir} holds another experiment's run "
      f"({os.path.join(model_dir, PARAMS_FILE)} differs: "
      f"{_describe_differences(differences)}): use a new --model_dir, or "
      f"resume that run with --config_file="
      f"{os.path.join(model_dir, PARAMS_FILE)}."
    )


#: Bytes read from the start of each file to check it is text.
_SNIFF_BYTES = 1 << 16


def _split_files(config: definitions.ExperimentConfig, split: str) -> list[str]:
  from model_garden import cli  # noqa: PLC0415

  patterns = [
    p.strip()
    for p in definitions.split_input_path(config.task, split).split(",")
    if p.strip()
  ]
  files: set[str] = set()
  for pattern in patterns:
    try:
      matches = tf.io.gfile.glob(pattern)
    except tf.errors.OpError as e:
      raise cli.FixableError(
        f"task.{split}.input_path: {pattern} cannot be listed "
        f"({e.message.strip().splitlines()[0]})."
      ) from None
    files_only = [m for m in matches if not tf.io.gfile.isdir(m)]
    if matches and not files_only:
      raise cli.FixableError(
        f"task.{split}.input_path: {pattern!r} is a directory; name its "
        f"files with a glob (e.g. {os.path.join(pattern, '*')!r})."
      )
    matches = files_only
    if not matches:
      raise cli.FixableError(
        f"task.{split}.input_path: no file matches {pattern!r}; check the "
        "path (--data or the input_path key)."
      )
    files.update(matches)
  return sorted(files)


def _count_text_records(path: str, split: str, limit: int) -> int:
  """Lines of ``path`` up to ``limit``; the first bytes must be text."""
  from model_garden import cli  # noqa: PLC0415

  count = 0
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      head = f.read(_SNIFF_BYTES)
      if b"\0" in head or head[:2] == b"\x1f\x8b":
        raise cli.FixableError(
          f"{path}: not a text file (task.{split}.input_path expects Criteo "
          "TSV lines; TFRecord files need task.use_tf_record_reader=true, "
          "compressed files must be decompressed)."
        )
      try:
        head.decode("utf-8")
      except UnicodeDecodeError as e:
        if len(head) < _SNIFF_BYTES or e.start < len(head) - 4:
          # (not a character that the read cut in two)
          line = head[: e.start].count(b"\n") + 1
          raise cli.FixableError(
            f"{path}:{line}: not UTF-8 text (task.{split}.input_path expects "
            "Criteo TSV lines)."
          ) from None
      count, last = head.count(b"\n"), head[-1:]
      while count < limit:
        chunk = f.read(_SNIFF_BYTES)
        if not chunk:
          count += 1 if last not in (b"", b"\n") else 0  # no final newline
          break
        count, last = count + chunk.count(b"\n"), chunk[-1:]
  except (OSError, tf.errors.OpError) as e:
    reason = getattr(e, "strerror", None) or getattr(e, "message", str(e))
    raise cli.FixableError(
      f"{path}: cannot be read ({str(reason).strip().splitlines()[0]})."
    ) from None
  return count


def _count_tfrecords(path: str, limit: int) -> int:
  """Records of ``path`` up to ``limit``, read without starting TensorFlow's
  runtime (a ``tf.data`` pipeline would: the logical CPU devices of
  ``--num_replicas`` and ``multi_worker_mirrored``'s collectives must be
  set up after these checks, before any op runs)."""
  from model_garden import cli  # noqa: PLC0415

  count = 0
  logger = tf.get_logger()
  level = logger.level
  logger.setLevel("ERROR")  # (its deprecation notice: tf.data, which we avoid)
  try:
    records = tf.compat.v1.io.tf_record_iterator(path)
    logger.setLevel(level)
    while count < limit:
      next(records)
      count += 1
  except StopIteration:
    pass
  except (OSError, tf.errors.OpError) as e:
    reason = getattr(e, "message", None) or getattr(e, "strerror", None)
    raise cli.FixableError(
      f"{path}: not a readable TFRecord file "
      f"({str(reason or e).strip().splitlines()[0]})."
    ) from None
  finally:
    logger.setLevel(level)
  return count


def check_inputs(config: definitions.ExperimentConfig, mode: str) -> None:
  """The splits ``mode`` reads exist, are readable and hold a batch.

  Every glob of ``input_path`` must match files that can be read (text
  for TSV), and a split must hold at least one global batch of records
  (counting stops there: big data sets are not read).

  Raises:
    cli.FixableError: naming the key, the file and what was expected.
  """
  from model_garden import cli  # noqa: PLC0415

  task = config.task
  for split in needed_splits(mode):
    batch = getattr(task, split).global_batch_size
    key = f"task.{split}.global_batch_size"
    if task.use_synthetic_data:
      synthetic = task.synthetic
      count = (
        synthetic.num_train_examples
        if split == "train_data"
        else synthetic.num_eval_examples
      )
      which = (
        "num_train_examples" if split == "train_data" else "num_eval_examples"
      )
      if count < batch:
        raise cli.FixableError(
          f"task.synthetic.{which}={count} is less than one global batch "
          f"({key}={batch}): raise it or lower the batch."
        )
      continue
    if definitions.paddlerec_sample_lines(task, split) is not None:
      from model_garden.ranking.data import paddlerec  # noqa: PLC0415

      try:
        paddlerec.find_sample_file()
      except FileNotFoundError as e:
        raise cli.FixableError(str(e).strip().splitlines()[0]) from None
      continue  # its batches are checked by definitions.validate
    files = _split_files(config, split)
    # Under holdout_every=N a file's records are split N-1 to 1: count
    # up to N times the records still needed.
    every = task.holdout_every if definitions.holds_out(task) else 1
    count = 0
    for path in files:
      limit = (batch - count) * every
      if task.use_tf_record_reader:
        records = _count_tfrecords(path, limit)
      else:
        records = _count_text_records(path, split, limit)
      if every == 1:
        count += records
      else:
        held = records // every
        count += held if split == "validation_data" else records - held
      if count >= batch:
        break
    if count < batch:
      shown = files[0] if len(files) == 1 else f"{len(files)} files"
      if every > 1 and split == "validation_data":
        raise cli.FixableError(
          f"task.validation_data: the records held out of {shown} "
          f"(task.holdout_every={every}) number {count}, fewer than one "
          f"global batch ({key}={batch}): lower the batch or "
          "task.holdout_every, or add data."
        )
      raise cli.FixableError(
        f"task.{split}.input_path: {shown} hold(s) {count} record(s), "
        f"fewer than one global batch ({key}={batch}): lower the batch "
        "or add data."
      )


def shared_files_warning(
  config: definitions.ExperimentConfig, mode: str
) -> str | None:
  """A one-line warning when validation reads files that training reads
  (its metrics would then measure records the model trained on), or None.

  Splits held out of the training files (``task.holdout_every``) share
  files but no record: no warning. Globs that match nothing are left to
  ``check_inputs``.

  Example:
    >>> from model_garden.ranking import configs, preflight
    >>> config = configs.get_config("dlrm_criteo_cpu_small")
    >>> preflight.shared_files_warning(config, "train_and_eval") is None
    True
  """
  from model_garden import cli  # noqa: PLC0415

  task = config.task
  if (
    task.use_synthetic_data
    or definitions.holds_out(task)
    or "validation_data" not in needed_splits(mode)
    or not task.train_data.input_path
    or not task.validation_data.input_path
  ):
    return None
  try:
    training = set(_split_files(config, "train_data"))
    validation = set(_split_files(config, "validation_data"))
  except cli.FixableError:
    return None
  shared = sorted(training & validation)
  if not shared:
    return None
  which = (
    "the training files"
    if validation == training
    else f"{len(shared)} of the training files (e.g. {shared[0]})"
  )
  return (
    f"Warning: task.validation_data.input_path reads {which}: validation "
    "metrics would measure records the model trained on; remove it to "
    "validate on records held out of the training files "
    "(task.holdout_every), or name other files."
  )
