r"""Command line: train a MovieLens 100K model, checkpoint it, export it.

Usage::

  python -m model_garden.movielens --task ranking --model_dir /tmp/ml_rank
  python -m model_garden.movielens --task retrieval --model_dir /tmp/ml_ret \
      --epochs 5 --batch_size 512

Trains on the real MovieLens 100K ratings (the installed recbole copy, or
``--data_dir``), split 80/20 at random, with a Keras progress bar (on a
terminal; ``--progress_bar``); the features keep TensorFlow Datasets'
``movielens/100k-ratings`` names (``user_id``, ``movie_id``,
``user_rating``; ``data.from_tfds`` maps TFDS's own examples). Writes to
``--model_dir``:

* ``ckpt-<epoch>``: a checkpoint after every epoch (tables and their
  optimizer slots, Keras weights, the Keras optimizer). A run started
  again with the same ``--model_dir`` resumes after the last saved epoch
  (``--epochs`` is the total), seeing the batches an uninterrupted run sees;
* ``train/``, ``validation/``: TensorBoard scalars per epoch (loss, RMSE
  or recall@k);
* ``saved_model/``: the serving SavedModel, loadable with TensorFlow alone
  (ranking: ``user_id``, ``movie_id`` → ``predictions``, the rating in
  ``[0, 1]``; retrieval: the query tower, ``user_id`` → ``predictions``,
  unit query vectors, with the user table only). Check it with
  ``saved_model_cli show --all --dir <model_dir>/saved_model``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app
from absl import flags

from model_garden import cli

#: ``--task`` values.
TASKS = ("ranking", "retrieval")

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the command line's flags (once)."""
  if "task" in FLAGS:
    return
  flags.DEFINE_enum(
    "task",
    "ranking",
    list(TASKS),
    "ranking: rating prediction (test RMSE); retrieval: a two-tower model "
    "(recall@k against popularity).",
  )
  flags.DEFINE_string(
    "model_dir",
    None,
    "Checkpoints (a run resumes from the latest), TensorBoard summaries "
    "and the SavedModel go here.",
  )
  flags.DEFINE_integer(
    "epochs",
    None,
    "Total epochs (default: the task's, 5).",
    lower_bound=1,
  )
  flags.DEFINE_integer(
    "batch_size",
    None,
    "Training batch (default: the task's: ranking 256, retrieval 512).",
    lower_bound=2,
  )
  flags.DEFINE_integer(
    "seed", None, "Seeds initializers and shuffling (default 0).", lower_bound=0
  )
  flags.DEFINE_string(
    "data_dir",
    None,
    "Directory of ml-100k.inter/.user/.item (default: the copy the "
    "installed recbole==1.2.1 ships).",
  )
  flags.DEFINE_bool(
    "export", True, "Write the serving SavedModel to <model_dir>/saved_model."
  )
  flags.DEFINE_enum(
    "table_dtype",
    "float32",
    ["float32", "bfloat16", "float16"],
    "ranking: the type the tables store their rows in (tpe.RowStorage; "
    "lookups and updates compute in float32).",
  )
  flags.DEFINE_enum(
    "rounding",
    "stochastic",
    ["stochastic", "nearest"],
    "ranking: how 16-bit tables round each update (seeded by --seed).",
  )
  flags.DEFINE_enum(
    "progress_bar",
    "auto",
    ["auto", "on", "off"],
    "Keras' progress bar during each epoch (auto: on a terminal; off: a "
    "line per epoch).",
  )


def _verbose() -> int:
  """``model.fit``'s verbosity: 1 shows the progress bar, 2 a line."""
  if FLAGS.progress_bar == "auto":
    return 1 if sys.stdout.isatty() else 2
  return 1 if FLAGS.progress_bar == "on" else 2


def main(argv: list[str]) -> None:
  if len(argv) > 2 or (len(argv) == 2 and argv[1] not in TASKS):
    raise app.UsageError(
      f"Unexpected arguments {argv[1:]}; the task is --task "
      f"({' or '.join(TASKS)})."
    )
  task = argv[1] if len(argv) == 2 else FLAGS.task  # `... ranking` works too
  if not FLAGS.model_dir:
    raise app.UsageError("--model_dir is required.")
  from absl import logging  # noqa: PLC0415

  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # our progress goes to stdout
  import tensorflow as tf  # noqa: PLC0415

  tf.get_logger().setLevel("ERROR")
  from model_garden.movielens import data  # noqa: PLC0415
  from model_garden.movielens import ranking  # noqa: PLC0415
  from model_garden.movielens import retrieval  # noqa: PLC0415

  module = ranking if task == "ranking" else retrieval
  config = (
    ranking.RankingConfig()
    if task == "ranking"
    else retrieval.RetrievalConfig()
  )
  overrides = {
    k: v
    for k, v in (
      ("epochs", FLAGS.epochs),
      ("batch_size", FLAGS.batch_size),
      ("seed", FLAGS.seed),
    )
    if v is not None
  }
  if task == "ranking":
    import tpu_embedding as tpe  # noqa: PLC0415

    overrides["storage"] = tpe.RowStorage(
      FLAGS.table_dtype, rounding=FLAGS.rounding, seed=FLAGS.seed or 0
    )
  elif FLAGS["table_dtype"].present or FLAGS["rounding"].present:
    raise app.UsageError(
      "--table_dtype and --rounding apply to --task ranking only."
    )
  config = dataclasses.replace(config, **overrides)
  try:
    splits = data.load_splits(
      FLAGS.data_dir, config.test_fraction, config.split_seed
    )
  except (FileNotFoundError, ValueError) as e:
    raise cli.FixableError(str(e)) from e
  from model_garden.ranking import preflight  # noqa: PLC0415

  preflight.check_model_dir(FLAGS.model_dir)
  print(
    f"MovieLens 100K {task}: {len(splits.train['user_id']):,} training and "
    f"{len(splits.test['user_id']):,} test ratings, batch "
    f"{config.batch_size}, {config.epochs} epochs; model_dir "
    f"{FLAGS.model_dir}",
    flush=True,
  )
  result = module.train_and_evaluate(
    config, splits, verbose=_verbose(), model_dir=FLAGS.model_dir
  )
  if task == "ranking":
    print(
      f"test RMSE {result.test_rmse:.4f} ({4 * result.test_rmse:.3f} "
      f"stars; mean-rating baseline {result.baseline_rmse:.4f}) after "
      f"{result.epochs} epochs, {result.train_seconds:.1f} s of training"
    )
  else:
    for k in config.ks:
      print(
        f"recall@{k}: two-tower {result.recall[k]:.4f}, popularity "
        f"{result.popularity_recall[k]:.4f}"
      )
    print(f"{result.epochs} epochs, {result.train_seconds:.1f} s of training")
  if FLAGS.export:
    export_dir = os.path.join(FLAGS.model_dir, "saved_model")
    if tf.io.gfile.exists(export_dir):
      tf.io.gfile.rmtree(export_dir)
    if task == "ranking":
      exported = ranking.export(result.model, export_dir)
    else:
      exported = retrieval.export_user_tower(result.model, export_dir)
    print(
      f"SavedModel: {exported.export_dir} (tables: "
      f"{', '.join(exported.tables)})"
    )


def run() -> None:
  """The console entry point: a mistake is one line (``model_garden.cli``)."""
  cli.quiet_tensorflow()  # before TensorFlow is imported
  define_flags()
  if "debug" not in FLAGS:
    flags.DEFINE_boolean(
      "debug", False, "Show the traceback of an error (also: TPE_DEBUG=1)."
    )
  app.run(cli.absl_main(main), flags_parser=cli.absl_flags_parser)


if __name__ == "__main__":
  run()
