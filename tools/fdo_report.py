"""Prints the SparseCore limits (FDO) a dataset needs, without a TPU.

For a ranking experiment (``--experiment``, its feature config, embedding
optimizer and training batches) or the keras-rs MovieLens tutorial
(``--keras_rs_tutorial``: its keras-rs configs and MovieLens 100K batches),
it reads ``--num_batches`` global batches and prints, per stacked table as
TensorFlow's ``TPUEmbeddingV2`` stacks them on ``--topology``, the most ids
and unique ids one SparseCore partition receives in a step (the maximum and
the ``--percentile`` of the per-step maxima), the ids buffer per chip, and
the ``SparseCoreEmbeddingConfig`` to paste (see ``tpu_embedding.fdo``).
``--stacking none`` (``--no_stacking``) measures each table alone
(TensorFlow's ``disable_table_stacking=True``, keras-rs'
``table_stacking=None``); ``--stacking jax`` stacks keras-rs configs as
keras-rs does on JAX (jax-tpu-embedding's rule; ``pip install
"tpu_embedding[fdo-jax]"``).
``--save`` writes the file ``TPUEmbedding(...,
sparse_core_embedding_config=PATH)`` reads on TPU; ``--plot`` draws each
table's per-step maxima against the chosen limit; ``--train_steps_ratio``
times training steps on the same batches and prints what FDO costs next to
them.

Run:
  python3 tools/fdo_report.py --experiment dlrm_dcn_v2_criteo \
      --params_override task.train_data.global_batch_size=4096 \
      --num_batches 300 --topology v5p-8 --save /tmp/fdo.json
  python3 tools/fdo_report.py --keras_rs_tutorial --topology v6e-8
  python3 tools/fdo_report.py --keras_rs_tutorial --stacking jax
"""

from __future__ import annotations

import argparse
import json
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tpu_embedding import fdo  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--experiment",
    default="dlrm_dcn_v2_criteo",
    help="A ranking experiment (model_garden.ranking): its feature config, "
    "embedding optimizer and training data.",
  )
  parser.add_argument(
    "--params_override",
    default="",
    help='Experiment overrides, e.g. "task.train_data.global_batch_size=4096".',
  )
  parser.add_argument(
    "--data",
    default="synthetic",
    help='The experiment\'s data: "synthetic", "paddlerec" or a glob of '
    "Criteo TSV files.",
  )
  parser.add_argument(
    "--keras_rs_tutorial",
    action="store_true",
    help="Use the keras-rs MovieLens tutorial's configs and data instead "
    "of --experiment (256 examples per chip, 5 epochs).",
  )
  parser.add_argument(
    "--topology",
    default="v5p-8",
    help="The TPU: v5p-N, v6e-N, v7x-N (N TensorCores) or CHIPSxSPARSECORES "
    "(e.g. 4x4).",
  )
  parser.add_argument(
    "--stacking",
    choices=list(fdo.STACKINGS),
    default="tensorflow",
    help="How tables stack: 'tensorflow' (TPUEmbeddingV2, keras-rs on "
    "TensorFlow), 'jax' (keras-rs on JAX: jax-tpu-embedding's rule; "
    '--keras_rs_tutorial only; pip install "tpu_embedding[fdo-jax]") or '
    "'none' (each table alone: disable_table_stacking=True, keras-rs "
    "table_stacking=None).",
  )
  parser.add_argument(
    "--no_stacking",
    action="store_const",
    const="none",
    dest="stacking",
    help="Same as --stacking none.",
  )
  parser.add_argument(
    "--num_batches",
    type=cli.positive_int,
    default=300,
    help="Global batches to read.",
  )
  parser.add_argument(
    "--percentile",
    type=float,
    default=99.0,
    help="Reported next to the maximum (of the per-step maxima).",
  )
  parser.add_argument(
    "--use",
    choices=["max", "percentile"],
    default="max",
    help="Which limits the config to paste, --save and --plot use "
    "(TensorFlow fails a step over its limits).",
  )
  parser.add_argument(
    "--limits",
    default="",
    help="Count the ids these limits drop: an FDO file, 'default' "
    "(TensorFlow's 256) or MAX_IDS,MAX_UNIQUE for every table.",
  )
  parser.add_argument(
    "--save", default="", help="Write the FDO file the TPU engine reads here."
  )
  parser.add_argument(
    "--plot", default="", help="Draw the per-step maxima to this PNG file."
  )
  parser.add_argument(
    "--train_steps_ratio",
    type=int,
    default=0,
    help="Also time this many training steps (CPU, one replica) on the same "
    "batches and print the FDO cost per batch relative to a step.",
  )
  parser.add_argument(
    "--json", default="", help="Write the statistics here (JSON)."
  )
  return parser


def parse_topology(text: str) -> fdo.Topology:
  if "x" in text and text.replace("x", "").isdigit():
    chips, cores = text.split("x")
    return fdo.Topology(int(chips), int(cores))
  return fdo.topology(text)


def parse_limits(text: str):
  if not text:
    return None
  if text == "default":
    return (fdo.TF_DEFAULT_LIMIT, fdo.TF_DEFAULT_LIMIT)
  if "," in text:
    try:
      max_ids, max_unique = (int(v) for v in text.split(","))
    except ValueError:
      raise cli.UsageError(
        f"--limits {text!r}: expected MAX_IDS,MAX_UNIQUE, 'default' or a file."
      ) from None
    return (max_ids, max_unique)
  try:
    return fdo.load_sparse_core_config(text)
  except (OSError, ValueError, KeyError) as error:
    raise cli.UsageError(f"--limits: {error}") from None


def experiment_inputs(args, num_chips: int):
  """(feature config, optimizer, global batches of features, task config)."""
  from model_garden.ranking import embedding  # noqa: PLC0415
  from model_garden.ranking import inputs  # noqa: PLC0415
  from model_garden.ranking import optimizers  # noqa: PLC0415
  from model_garden.ranking import train  # noqa: PLC0415
  from model_garden.ranking.configs import registry  # noqa: PLC0415

  if args.experiment not in registry.experiments():
    raise cli.UsageError(
      f"--experiment {args.experiment!r}: not an experiment; one of "
      f"{', '.join(registry.experiments())}."
    )
  config = train.build_config(
    args.experiment, params_override=args.params_override, data=args.data
  )
  model = config.task.model
  optimizer = optimizers.embedding_optimizer(
    config.trainer.optimizer_config,
    config.task.train_data.global_batch_size,
    tf.Variable(0, dtype=tf.int64),
  )
  feature_config = embedding.feature_config(model)
  dataset = inputs.RankingInputs(config.task).train_dataset_fn()(None)
  batches = dataset.map(lambda f, labels: f["sparse_features"])
  return feature_config, optimizer, batches, config


def tutorial_inputs(num_chips: int):
  from model_garden.movielens import data  # noqa: PLC0415
  from model_garden.movielens import keras_rs_tutorial  # noqa: PLC0415

  config = keras_rs_tutorial.TutorialConfig()
  splits = data.load_splits()
  batch = keras_rs_tutorial.global_batch_size(config, num_chips)
  feature_config = keras_rs_tutorial.feature_configs(
    splits.num_users, splits.num_movies, batch, config
  )
  batches = (
    keras_rs_tutorial.rating_dataset(splits.train, batch, drop_remainder=True)
    .repeat(config.epochs)
    .map(lambda f, rating: f)
  )
  return feature_config, None, batches


def train_step_ratio(config, batches, steps: int, fdo_seconds: float) -> dict:
  """Times ``steps`` training steps of the experiment on the default
  strategy, on the first batches."""
  from model_garden.ranking import inputs  # noqa: PLC0415
  from model_garden.ranking.task import RankingTask  # noqa: PLC0415

  strategy = tf.distribute.get_strategy()
  task = RankingTask(config, strategy)
  step = task.train_step
  dataset = inputs.RankingInputs(config.task).train_dataset_fn()(None)
  it = iter(dataset)
  step(*next(it))  # trace
  elements = [next(it) for _ in range(steps)]
  start = time.perf_counter()
  for element in elements:
    result = step(*element)
  tf.nest.map_structure(lambda t: t.numpy(), result)
  step_seconds = (time.perf_counter() - start) / steps
  return {
    "train_step_seconds": step_seconds,
    "fdo_seconds_per_batch": fdo_seconds,
    "fdo_over_train_step": fdo_seconds / step_seconds,
  }


PLOT_INSTALL = 'pip install "tpu_embedding[plot]"'


def require_matplotlib() -> None:
  """One line saying how to get matplotlib where it is missing."""
  try:
    import matplotlib  # noqa: F401, PLC0415
  except ImportError:
    raise cli.UsageError(
      f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL} "
      "(or pip install matplotlib)."
    ) from None


def plot(path: str, stats: fdo.FdoStats, use: str) -> None:
  require_matplotlib()
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  tables = sorted(stats.tables)
  cols = min(4, len(tables))
  rows = -(-len(tables) // cols)
  fig, axes = plt.subplots(
    rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False
  )
  for ax, name in zip(axes.flat, tables, strict=False):
    t = stats.tables[name]
    limit_ids, limit_unique = t.limit(use)
    bins = max(10, min(50, len(t.ids_per_step) // 4))
    ax.hist(t.ids_per_step, bins=bins, alpha=0.6, label="max ids")
    ax.hist(t.unique_ids_per_step, bins=bins, alpha=0.6, label="max unique")
    ax.axvline(limit_ids, color="tab:blue", ls="--", label=f"limit {use}")
    ax.axvline(limit_unique, color="tab:orange", ls="--")
    ax.axvline(fdo.TF_DEFAULT_LIMIT, color="gray", ls=":", label="default")
    ax.set_title(fdo.short_name(name, t.tables), fontsize=8)
    ax.set_xlabel("per partition, per step")
  for ax in list(axes.flat)[len(tables) :]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  fig.suptitle(
    f"per-step maxima over {stats.steps} steps, {stats.topology.describe()}"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def report(args: argparse.Namespace) -> None:
  topo = parse_topology(args.topology)
  limits = parse_limits(args.limits)
  if args.stacking == "jax" and not args.keras_rs_tutorial:
    raise cli.UsageError(
      "--stacking jax measures keras-rs on JAX, so it takes keras-rs "
      "configs: use it with --keras_rs_tutorial (an experiment's tables "
      "stack as TensorFlow's TPUEmbeddingV2 stacks them)."
    )
  if args.plot:
    require_matplotlib()  # before reading any batch
  config = None
  if args.keras_rs_tutorial:
    feature_config, optimizer, batches = tutorial_inputs(topo.num_chips)
    source = "the keras-rs MovieLens tutorial"
  else:
    feature_config, optimizer, batches, config = experiment_inputs(
      args, topo.num_chips
    )
    source = f"--experiment {args.experiment}"
  collector = fdo.FdoCollector(
    feature_config, topo, optimizer=optimizer,
    percentile=args.percentile, limits=limits, stacking=args.stacking,
  )  # fmt: skip
  seconds = 0.0
  for i, features in enumerate(batches):
    if i >= args.num_batches:
      break
    start = time.perf_counter()
    collector.update(features)
    seconds += time.perf_counter() - start
  stats = collector.result()
  per_batch = seconds / stats.steps
  print(f"{source}: {stats.steps} batches, {per_batch * 1e3:.1f} ms each")
  print(stats.summary(args.use))
  print(f"keras-rs TableConfig limits, for {stats.keras_rs_backend}:")
  print(stats.keras_rs_source(args.use))
  figures = {"source": source, **stats.to_json()}
  if args.train_steps_ratio and config is not None:
    cost = train_step_ratio(config, batches, args.train_steps_ratio, per_batch)
    print(
      f"cost: FDO {cost['fdo_seconds_per_batch'] * 1e3:.1f} ms per batch, "
      f"training step {cost['train_step_seconds'] * 1e3:.1f} ms: "
      f"{cost['fdo_over_train_step']:.2f}x"
    )
    figures["cost"] = cost
  if args.save:
    print(f"FDO file: {stats.save(args.save)}")
  if args.plot:
    plot(args.plot, stats, args.use)
    print(f"plot: {args.plot}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"settings": vars(args), **figures}, f, indent=1)


def _translate(error: BaseException) -> BaseException | None:
  if isinstance(error, ValueError):
    return cli.UsageError(str(error))
  return None


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  cli.run(lambda: report(args), _translate)


if __name__ == "__main__":
  np.set_printoptions(linewidth=120)
  main()
