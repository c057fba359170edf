r"""Input pipeline vs. training step: is the input the bottleneck?

For one ranking experiment (the flags of ``model_garden.ranking.train``),
in one process, on the same strategy and global batch:

1. the input pipeline alone: the distributed training dataset iterated
   as the training loop does, nothing else (examples/s);
2. the training step alone: ``RankingTask.train_step`` on a few batches
   held in memory (examples/s, no input cost);
3. both together: the training loop's step on the live pipeline.

It prints the three rates and the ratio input / training step: above 1
the pipeline outpaces the step (it must, with a margin: they share the
CPU), below 1 training waits for data.

Run:
  python3 tools/input_benchmark.py --experiment dlrm_criteo_cpu_small \
      --strategy mirrored --num_replicas 2
  # The Criteo TSV reader on generated click logs (no download):
  python3 tools/input_benchmark.py --write_tsv_examples 200000
  # Your files:
  python3 tools/input_benchmark.py --data '/data/criteo/day_*'

Each rate is measured ``--repeats`` times: the median is printed with the
range and the spread (range / median); ``--json`` writes them all.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import _timing  # noqa: E402  (tools/_timing.py, next to this script)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from model_garden.ranking import train  # noqa: E402

FLAGS = flags.FLAGS
train.define_flags()
flags.DEFINE_integer("steps", 50, "Timed steps of each repeat.")
flags.DEFINE_integer("warmup", 5, "Untimed steps first (tracing, buffers).")
flags.DEFINE_integer(
  "repeats", 3, "Timings of each measurement (median and spread reported)."
)
flags.DEFINE_string("json", None, "Also write every timing to this file.")
flags.DEFINE_integer(
  "write_tsv_examples",
  0,
  "Write this many synthetic examples as raw Criteo TSV files to a "
  "temporary directory and read those (the TSV reader's cost).",
)


def examples_per_second(run_step, steps: int, warmup: int, batch: int) -> float:
  """Times ``steps`` calls of ``run_step`` after ``warmup`` untimed ones."""
  for _ in range(warmup):
    run_step()
  start = time.perf_counter()
  for _ in range(steps):
    run_step()
  return steps * batch / (time.perf_counter() - start)


def write_tsv(config, num_examples: int) -> str:
  """Synthetic examples of ``config``'s vocabularies as TSV shards."""
  from model_garden.ranking.data import synthetic  # noqa: PLC0415

  directory = tempfile.mkdtemp(prefix="criteo_tsv_")
  generator = synthetic.SyntheticCriteo(config.task.model.vocab_sizes)
  generator.write_tsv(directory, num_examples, num_shards=4)
  return os.path.join(directory, "*.tsv")


def main(argv: list[str]) -> None:
  del argv
  config = train.build_config(
    FLAGS.experiment,
    FLAGS.config_file,
    FLAGS.params_override,
    strategy=FLAGS.strategy,
    data=FLAGS.data,
    seed=FLAGS.seed if FLAGS.seed is not None else 0,
  )
  from model_garden.ranking import strategies  # noqa: PLC0415

  if config.runtime.distribution_strategy == "mirrored" and (
    FLAGS.num_replicas > 1
  ):
    strategies.use_logical_cpus(FLAGS.num_replicas)
  if FLAGS.write_tsv_examples:
    pattern = write_tsv(config, FLAGS.write_tsv_examples)
    atexit.register(shutil.rmtree, os.path.dirname(pattern), True)
    config = train.build_config(
      FLAGS.experiment,
      FLAGS.config_file,
      FLAGS.params_override,
      strategy=FLAGS.strategy,
      data=pattern,
      seed=config.runtime.seed,
    )
  import tensorflow as tf  # noqa: PLC0415

  tf.get_logger().setLevel("ERROR")
  from model_garden.ranking.inputs import RankingInputs  # noqa: PLC0415
  from model_garden.ranking.task import RankingTask  # noqa: PLC0415

  strategy = strategies.create_strategy(
    config.runtime.distribution_strategy,
    num_replicas=FLAGS.num_replicas,
    tpu=config.runtime.tpu,
  )
  batch = config.task.train_data.global_batch_size
  inputs = RankingInputs(config.task, strategy)
  print(
    f"{FLAGS.experiment}: {inputs.source} data, global batch {batch}, "
    f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} "
    f"replica(s); {FLAGS.steps} timed steps after {FLAGS.warmup}, "
    f"{FLAGS.repeats} repeats",
    flush=True,
  )

  def measure(name: str, run_step) -> _timing.Measurement:
    return _timing.repeat(
      name,
      "examples/s",
      lambda: examples_per_second(run_step, FLAGS.steps, FLAGS.warmup, batch),
      FLAGS.repeats,
    )

  # 1. The input pipeline alone.
  iterator = iter(inputs.distribute(inputs.train_dataset_fn()))
  input_rate = measure("input_pipeline", lambda: next(iterator))
  print(f"input pipeline alone     : {input_rate.describe()}", flush=True)

  # 2. The training step alone, on batches held in memory.
  task = RankingTask(config, strategy, seed=config.runtime.seed)
  held = [next(iterator) for _ in range(4)]
  count = [0]

  def cached_step():
    features, labels = held[count[0] % len(held)]
    count[0] += 1
    return float(task.train_step(features, labels)["loss"])

  step_rate = measure("training_step", cached_step)
  print(f"training step alone      : {step_rate.describe()}", flush=True)

  # 3. Both, as in training.
  def live_step():
    return float(task.train_step(*next(iterator))["loss"])

  live_rate = measure("training_on_pipeline", live_step)
  print(f"training on the pipeline : {live_rate.describe()}", flush=True)
  ratio = input_rate.median / step_rate.median
  verdict = (
    "the input pipeline is not the bottleneck"
    if ratio > 1
    else "training waits for the input pipeline"
  )
  print(f"ratio input / training step (medians): {ratio:.1f}x ({verdict})")
  print(
    f"training on the pipeline / training step alone: "
    f"{live_rate.median / step_rate.median:.2f}"
  )
  if FLAGS.json:
    settings = {
      name: FLAGS[name].value
      for name in ("experiment", "strategy", "num_replicas", "data", "steps",
                   "warmup", "repeats", "write_tsv_examples",
                   "params_override")
    }  # fmt: skip
    settings["global_batch_size"] = batch
    _timing.write_json(FLAGS.json, settings, [input_rate, step_rate, live_rate])
    print(f"wrote {FLAGS.json}")


if __name__ == "__main__":
  app.run(cli.absl_main(main), flags_parser=cli.absl_flags_parser)
