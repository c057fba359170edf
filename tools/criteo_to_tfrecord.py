r"""Converts Criteo TSV (or PaddleRec) files into TFRecord files.

Writes Model Garden's TFRecord format (one ``tf.train.Example`` per
record: ``label``, ``dense-feature-1..13``, ``sparse-feature-14..39``;
see ``model_garden.ranking.data.criteo_tfrecord``), parsed, transformed and
reduced to an experiment's vocabularies exactly as the TSV reader does, so
training on the TFRecord files (``task.use_tf_record_reader=true``) sees
the same batches without parsing text.

Run:
  python3 tools/criteo_to_tfrecord.py --input '/data/criteo/day_*' \
      --output_dir /data/criteo_tfrecord --experiment dlrm_criteo \
      --num_shards 64
  python3 -m model_garden.ranking.train --experiment dlrm_criteo \
      --params_override "task.use_tf_record_reader=true,\
task.train_data.input_path=/data/criteo_tfrecord/*.tfrecord,..."
  # The installed PaddleRec sample (80 records):
  python3 tools/criteo_to_tfrecord.py --input paddlerec \
      --output_dir /tmp/criteo_tfrecord --experiment dlrm_criteo_cpu_small
"""

from __future__ import annotations

import json
import os
import sys
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "input",
  None,
  'Glob pattern(s) (comma-separated) of Criteo files, or "paddlerec" for '
  "the 80-record sample of paddle-rec==0.1.0.",
)
flags.DEFINE_string("output_dir", None, "Where to write the TFRecord files.")
flags.DEFINE_string(
  "experiment",
  "dlrm_criteo",
  "The experiment whose vocabularies and multi-hot sizes the ids are "
  "reduced to and expanded for.",
)
flags.DEFINE_enum(
  "format",
  None,
  ["tsv", "paddlerec"],
  'The input format (default: "paddlerec" for --input paddlerec, else "tsv").',
)
flags.DEFINE_integer("num_shards", 1, "Output files.", lower_bound=1)
flags.DEFINE_enum(
  "on_bad_record",
  "raise",
  ["raise", "count", "skip"],
  "A malformed line: stop naming it, drop and count it, or drop it.",
)
flags.DEFINE_integer(
  "batch_size", 4096, "Lines parsed and written at a time.", lower_bound=1
)
flags.DEFINE_string(
  "json", None, "Also write the result (files, examples, counts) here."
)
flags.mark_flags_as_required(["input", "output_dir"])


def _remove_new_files(directory: str, existed: bool, before: set) -> None:
  """A failed conversion leaves ``directory`` as it was."""
  import tensorflow as tf  # noqa: PLC0415

  if not tf.io.gfile.exists(directory):
    return
  if not existed:
    tf.io.gfile.rmtree(directory)
    return
  for name in set(tf.io.gfile.listdir(directory)) - before:
    tf.io.gfile.remove(os.path.join(directory, name))


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}.")
  import tensorflow as tf  # noqa: PLC0415

  from model_garden.ranking import configs  # noqa: PLC0415
  from model_garden.ranking.data import criteo  # noqa: PLC0415
  from model_garden.ranking.data import criteo_tfrecord  # noqa: PLC0415
  from model_garden.ranking.data import paddlerec  # noqa: PLC0415

  tf.get_logger().setLevel("ERROR")
  if FLAGS.experiment not in configs.experiments():
    raise app.UsageError(
      f"--experiment {FLAGS.experiment!r}: one of "
      f"{', '.join(configs.experiments())}."
    )
  model = configs.get_config(FLAGS.experiment).task.model
  sample = FLAGS.input == "paddlerec"
  file_format = FLAGS.format or ("paddlerec" if sample else "tsv")
  pattern = (
    paddlerec.find_sample_file()
    if sample
    else [p.strip() for p in FLAGS.input.split(",") if p.strip()]
  )
  config = criteo.CriteoConfig(
    vocab_sizes=model.vocab_sizes,
    file_format=file_format,
    multi_hot_sizes=model.multi_hot_sizes if model.use_multi_hot else None,
  )
  start = time.perf_counter()

  def progress(examples: int) -> None:
    rate = examples / max(time.perf_counter() - start, 1e-9)
    print(f"\r{examples:,} examples ({rate:,.0f}/s)", end="", flush=True)

  existed = tf.io.gfile.exists(FLAGS.output_dir)
  before = set(tf.io.gfile.listdir(FLAGS.output_dir)) if existed else set()
  try:
    result = criteo_tfrecord.convert(
      pattern,
      FLAGS.output_dir,
      config,
      num_shards=FLAGS.num_shards,
      on_bad_record=FLAGS.on_bad_record,
      batch_size=FLAGS.batch_size,
      progress=progress,
    )
  except (FileNotFoundError, ValueError, tf.errors.InvalidArgumentError) as e:
    from model_garden.ranking.data import bad_records  # noqa: PLC0415

    print(file=sys.stderr)  # ends the progress line
    _remove_new_files(FLAGS.output_dir, existed, before)
    message = bad_records.describe_bad_record(e, "--on_bad_record")
    if message is None:
      message = str(getattr(e, "message", e)).strip().splitlines()[0]
    raise cli.FixableError(f"conversion failed: {message}") from e
  seconds = time.perf_counter() - start
  print(
    f"\nwrote {result.examples:,} examples to {len(result.files)} file(s) "
    f"in {FLAGS.output_dir} ({seconds:.1f}s)"
  )
  if result.bad_records:
    print(f"bad records dropped: {result.bad_records}")
  if FLAGS.json:
    with tf.io.gfile.GFile(FLAGS.json, "w") as f:
      json.dump(
        {
          "files": list(result.files),
          "examples": result.examples,
          "bad_records": result.bad_records,
          "seconds": seconds,
        },
        f,
        indent=2,
      )
  return 0


if __name__ == "__main__":
  app.run(cli.absl_main(main), flags_parser=cli.absl_flags_parser)
