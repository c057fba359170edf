"""Exports a SavedModel for TF Serving from a checkpoint of an embedding.

A ranking run of this repository (``python -m model_garden.ranking.train
--model_dir DIR``) needs nothing else: ``--model_dir DIR`` reads the
run's saved config (``DIR/params.yaml``), rebuilds its model and exports
its latest save (or ``--checkpoint``) with the ranking signature
(``model_garden.ranking.saved_model``: ``dense_features``, ``sparse_<i>``
→ ``predictions``)::

  python3 tools/export.py --model_dir /tmp/tpe_dlrm \
      --export_dir /tmp/serving/dlrm/1

Any other model: the checkpoint is a
``tf.train.Checkpoint(embedding=emb, model=model)`` written while training
(on any layout: one device, ``MirroredStrategy``, parameter servers,
``TPUStrategy``, or TensorFlow's own TPU embedding: the table keys are the
same). A small *spec* function, which you write next to
your training code, rebuilds what the checkpoint does not hold:

    # my_project/serving_spec.py
    import keras
    import tensorflow as tf
    import tpu_embedding as tpe
    from tpu_embedding.export import ExportSpec, FeatureSpec

    def build():
      users = tpe.TableConfig(1_000_000, 32, name="users")
      items = tpe.TableConfig(5_000_000, 32, name="items")
      features = {"user": tpe.FeatureConfig(users),
                  "clicks": tpe.FeatureConfig(items),
                  "item": tpe.FeatureConfig(items)}
      model = make_query_tower()  # built, same structure as in training
      return ExportSpec(
          feature_config=features,  # exactly the training feature config
          input_signature={"user": FeatureSpec([None]),
                           "clicks": FeatureSpec([None, 50]),
                           "age": tf.TensorSpec([None, 1], tf.float32)},
          model=model)  # model_key="model", embedding_key="embedding"

The tool creates a ``TPUEmbeddingForServing`` holding only the tables
selected with ``--tables`` (all by default; the spec's ``tables`` if set),
restores them and the model's variables from the checkpoint (optimizer
slots and the other tables are never loaded), checks that everything was
found, and writes the SavedModel with ``export_for_serving``.

Run:
  python3 tools/export.py --model_dir /tmp/tpe_dlrm --export_dir /tmp/dlrm/1
  python3 tools/export.py --spec my_project/serving_spec.py:build \\
      --checkpoint /tmp/train --export_dir /tmp/serving/ranker/1
  python3 tools/export.py --spec my_project.serving_spec:build \\
      --checkpoint /tmp/train/ckpt-20 --export_dir /tmp/query/1 \\
      --tables users,items
  python3 tools/export.py --model_dir /tmp/tpe_dlrm --export_dir /tmp/q/1 \
      --table_dtype int8
  saved_model_cli show --all --dir /tmp/serving/ranker/1

``--table_dtype float16|bfloat16|int8`` stores the tables in that type
(int8: row-wise, with a float32 scale and offset per row); the SavedModel
dequantizes the rows each request looks up, with TensorFlow ops only
(error bounds: ``tpu_embedding.export.quantize``).

Fresh versions from delta checkpoints: every export records the digest of
the checkpoint it was made from. ``--apply_delta DELTA --base_export V``
writes the next version from version ``V`` and a delta of that checkpoint
(``tpu_embedding.checkpoints.write_delta``; ``delta-<n>`` of a
``CheckpointManager(delta_interval=K)`` run), with TensorFlow alone: no
spec, no config, no training job. It equals an export of the full
checkpoint at the delta's step (tables in the base version's type) and is
renamed into place once whole; a delta of another run, or one after a
skipped delta, is refused in one line naming both digests. One writer
per model: the versions' directory (``/tmp/serving/dlrm`` below) is
locked while a version is written (``tpu_embedding.run_lock``), and a
second ``--apply_delta`` into it is refused in one line naming the
holder's pid, exit 1, writing nothing::

  python3 tools/export.py --apply_delta /tmp/tpe_dlrm/delta-2 \
      --base_export /tmp/serving/dlrm/1 --export_dir /tmp/serving/dlrm/2
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from tpu_embedding import checkpoints  # noqa: E402
from tpu_embedding import run_lock  # noqa: E402
from tpu_embedding.export import TABLE_DTYPES  # noqa: E402
from tpu_embedding.export import DeltaExport  # noqa: E402
from tpu_embedding.export import ExportResult  # noqa: E402
from tpu_embedding.export import ExportSource  # noqa: E402
from tpu_embedding.export import ExportSpec  # noqa: E402
from tpu_embedding.export import apply_delta  # noqa: E402
from tpu_embedding.export import export_for_serving  # noqa: E402
from tpu_embedding.export import restore_for_export  # noqa: E402
from tpu_embedding.export import serving_embedding_for  # noqa: E402
from tpu_embedding.export import validate_signature  # noqa: E402


def progress(message: str, *args: object) -> None:
  """A progress line on stderr (``message % args``)."""
  print(message % args if args else message, file=sys.stderr, flush=True)


class ExportError(cli.FixableError):
  """A problem with the tool's inputs, reported without a traceback
  (one line, exit 1)."""


def load_spec(reference: str) -> ExportSpec:
  """Calls the spec function ``module:function`` or ``file.py:function``.

  Raises:
    ExportError: if it cannot be imported, found, or returns no
      ``ExportSpec``.
  """
  module_ref, _, function_name = reference.rpartition(":")
  if not module_ref or not function_name:
    raise cli.UsageError(
      f"--spec {reference!r}: expected 'package.module:function' or "
      "'path/to/file.py:function'."
    )
  if module_ref.endswith(".py") or os.sep in module_ref:
    if not os.path.exists(module_ref):
      raise ExportError(f"--spec: no such file {module_ref!r}.")
    name = os.path.splitext(os.path.basename(module_ref))[0]
    module_spec = importlib.util.spec_from_file_location(name, module_ref)
    module = importlib.util.module_from_spec(module_spec)
    try:
      module_spec.loader.exec_module(module)
    except SyntaxError as e:
      raise ExportError(
        f"--spec: {module_ref}:{e.lineno}: {e.msg} (a syntax error)."
      ) from None
  else:
    sys.path.insert(0, os.getcwd())
    try:
      module = importlib.import_module(module_ref)
    except ModuleNotFoundError as e:
      if e.name is None or not module_ref.startswith(e.name):
        raise  # the spec's own import: its traceback helps
      raise ExportError(
        f"--spec {reference!r}: no module {e.name!r} (run from the "
        "directory that holds it, or pass 'path/to/file.py:function')."
      ) from None
  function = getattr(module, function_name, None)
  if not callable(function):
    raise ExportError(
      f"--spec: {module_ref!r} has no function {function_name!r}."
    )
  spec = function()
  if not isinstance(spec, ExportSpec):
    raise ExportError(
      f"--spec: {reference} returned a {type(spec).__name__}; it must "
      "return a tpu_embedding.export.ExportSpec."
    )
  return spec


def checkpoint_path(path: str, flag: str = "--checkpoint") -> str:
  """The save ``path`` names: itself, or a directory's latest save (its
  last delta, if deltas follow its last full checkpoint)."""
  try:
    base, deltas = checkpoints.saved_chain(path)
  except ValueError as e:
    raise ExportError(f"{flag}: {e}") from None
  return checkpoints.chain_end(base, deltas)


def restore(spec: ExportSpec, path: str, tables):
  """The serving embedding of the selected tables, restored with the model.

  Returns:
    ``(serving embedding, table names, the checkpoint object restored)``.

  Raises:
    ExportError: if a table or a model variable is not in the checkpoint.
  """
  embedding, names = serving_embedding_for(spec.feature_config, tables)
  objects = {spec.embedding_key: embedding}
  if spec.model is not None and spec.model_key:
    if not getattr(spec.model, "variables", True):
      raise ExportError(
        "The spec's model has no variables yet, so nothing would be "
        "restored into it: build it in the spec (a functional Keras model, "
        "or call it once on example inputs)."
      )
    objects[spec.model_key] = spec.model
  checkpoint = tf.train.Checkpoint(**objects)
  try:
    restore_for_export(checkpoint, path, embedding)
  except AssertionError as e:
    keys = sorted({k.split("/")[0] for k, _ in tf.train.list_variables(path)})
    raise ExportError(
      f"The checkpoint {path} lacks values for the selected tables or the "
      f"model (check ExportSpec.embedding_key / model_key; its top-level "
      f"keys are {keys}): {e}"
    ) from e
  return embedding, names, checkpoint


def export_source(
  spec: ExportSpec, path: str, checkpoint
) -> ExportSource | None:
  """What the export records as its source, or None (with a note) when
  the model holds weights of its own (``model_key=None``): a version
  whose values do not all come from the checkpoint cannot follow its
  deltas (``--apply_delta`` refuses it)."""
  if spec.model is not None and not spec.model_key and spec.model.variables:
    progress(
      "The spec's model holds its own weights (model_key=None), not the "
      "checkpoint's: this version records no source checkpoint, so "
      "--apply_delta cannot make the next one from it."
    )
    return None
  return ExportSource(path, checkpoint)


def export_ranking_run(args: argparse.Namespace) -> ExportResult:
  """Exports a ``model_garden.ranking.train`` run of ``--model_dir``."""
  from model_garden.ranking import saved_model  # noqa: PLC0415
  from model_garden.ranking.configs import params_file  # noqa: PLC0415

  if args.tables:
    raise cli.UsageError(
      "--tables: a ranking model reads all of its tables; export a subset "
      "with --spec."
    )
  try:
    config = params_file.read_params(args.model_dir)
  except (FileNotFoundError, ValueError) as e:
    raise ExportError(f"--model_dir: {e}") from e
  path = checkpoint_path(
    args.checkpoint or args.model_dir,
    "--checkpoint" if args.checkpoint else "--model_dir",
  )
  prepare_export_dir(args)  # after the inputs' checks
  progress("Restoring %s (the run's config: %s)", path, args.model_dir)
  try:
    return saved_model.export_from_checkpoint(
      config, path, args.export_dir, table_dtype=table_dtype(args)
    )
  except (ValueError, AssertionError) as e:
    raise ExportError(
      f"{path} does not match {args.model_dir}'s config: {e}"
    ) from e


def prepare_export_dir(args: argparse.Namespace) -> None:
  """Checks (or, with ``--overwrite``, empties) ``--export_dir``."""
  from model_garden.ranking import preflight  # noqa: PLC0415

  preflight.check_model_dir(args.export_dir, flag="--export_dir")
  if tf.io.gfile.exists(args.export_dir) and tf.io.gfile.listdir(
    args.export_dir
  ):
    if not args.overwrite:
      raise ExportError(
        f"--export_dir {args.export_dir} is not empty; pass --overwrite "
        "or choose a new version directory."
      )
    tf.io.gfile.rmtree(args.export_dir)


def table_dtype(args: argparse.Namespace) -> str:
  """``--table_dtype``, float32 when not given."""
  return getattr(args, "table_dtype", None) or "float32"


def run_apply_delta(args: argparse.Namespace):
  """``--apply_delta``: the next version from ``--base_export``."""
  if not (args.apply_delta and args.base_export):
    raise cli.UsageError(
      "--apply_delta DELTA and --base_export DIR (the version the delta "
      "follows) go together."
    )
  given = [
    flag
    for flag, value in (
      ("--spec", args.spec),
      ("--model_dir", args.model_dir),
      ("--checkpoint", args.checkpoint),
      ("--tables", args.tables),
      ("--table_dtype", getattr(args, "table_dtype", None)),
    )
    if value
  ]
  if given:
    raise cli.UsageError(
      f"--apply_delta takes no {given[0]}: the tables, their type and the "
      "model are the --base_export version's."
    )
  from model_garden.ranking import preflight  # noqa: PLC0415

  # One version writer per model: its export directory (the versions'
  # parent) is locked while the version is written.
  model = os.path.dirname(os.path.abspath(args.export_dir.rstrip("/")))
  what = "write the version when it is done"
  try:
    run_lock.check_free(model, what)
  except run_lock.DirectoryInUseError as e:
    raise ExportError(str(e)) from None
  preflight.check_model_dir(args.export_dir, flag="--export_dir")
  progress("Applying %s to %s", args.apply_delta, args.base_export)
  try:
    with run_lock.RunLock(model, what):
      result = apply_delta(
        args.base_export,
        args.apply_delta,
        args.export_dir,
        overwrite=args.overwrite,
      )
  except run_lock.DirectoryInUseError as e:
    raise ExportError(str(e)) from None
  except ValueError as e:  # DeltaMismatchError included
    raise ExportError(str(e)) from None
  except (tf.errors.OpError, OSError) as e:  # a write that failed
    reason = " ".join(str(getattr(e, "message", e)).split())
    raise ExportError(
      f"Writing {args.export_dir} failed ({type(e).__name__}: {reason}); "
      "the previous versions are as they were."
    ) from None
  progress("Done in %.2fs", result.seconds)
  return result


def run(args: argparse.Namespace):
  """Loads the spec (or the run's config), restores the checkpoint and
  writes the SavedModel (or, with ``--apply_delta``, the next version)."""
  start = time.time()
  if args.apply_delta or args.base_export:
    return run_apply_delta(args)
  if bool(args.spec) == bool(args.model_dir):
    raise cli.UsageError(
      "Pass either --model_dir (a model_garden.ranking.train directory) or "
      "--spec with --checkpoint."
    )
  if args.model_dir:
    result = export_ranking_run(args)
    progress("Done in %.2fs", time.time() - start)
    return result
  if not args.checkpoint:
    raise cli.UsageError("--spec needs --checkpoint.")
  progress("Loading the spec %s", args.spec)
  spec = load_spec(args.spec)
  tables = spec.tables
  if args.tables:
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
  path = checkpoint_path(args.checkpoint)
  prepare_export_dir(args)  # after the inputs' checks
  try:
    validate_signature(spec.feature_config, spec.input_signature, tables)
    progress("Restoring %s (tables: %s)", path, tables or "all")
    embedding, names, checkpoint = restore(spec, path, tables)
    progress("Restored tables %s in %.1fs", list(names), time.time() - start)
    result = export_for_serving(
      args.export_dir,
      embedding,
      spec.model,
      spec.input_signature,
      tables=list(names),
      feature_config=spec.feature_config,
      signature_name=args.signature_name,
      table_dtype=table_dtype(args),
      source=export_source(spec, path, checkpoint),
    )
  except (ValueError, TypeError) as e:
    raise ExportError(str(e)) from e
  progress("Done in %.2fs", time.time() - start)
  return result


def describe(result) -> str:
  """A summary of the written signature (or of the delta applied)."""
  if isinstance(result, DeltaExport):
    rows = ", ".join(f"{t} {n}" for t, n in result.rows.items())
    return "\n".join(
      [
        f"SavedModel: {result.export_dir}",
        f"from: {result.base_export} (source {result.parent})",
        f"delta: {result.delta} (source {result.source})",
        f"rows rewritten: {rows or 'none'}",
        f"model variables from the delta: {result.model_variables}",
        f"seconds: {result.seconds:.2f}",
      ]
    )
  lines = [
    f"SavedModel: {result.export_dir}",
    f"tables: {', '.join(result.tables)} ({result.table_dtype})",
    f"signature {result.signature_name!r}:",
  ]
  for kind, specs in (("input", result.inputs), ("output", result.outputs)):
    for name, spec in specs.items():
      lines.append(f"  {kind} {name}: {spec.dtype.name} {spec.shape.as_list()}")
  for signature, specs in result.extra_signatures.items():
    lines.append(f"signature {signature!r}: the same outputs, from")
    for name, spec in specs.items():
      lines.append(f"  input {name}: {spec.dtype.name} {spec.shape.as_list()}")
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog="See the module docstring (tools/export.py) for the spec format.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--model_dir",
    default=None,
    help="a model_garden.ranking.train directory: its params.yaml and "
    "latest save, the deltas after its last full checkpoint included (no "
    "spec needed)",
  )
  parser.add_argument(
    "--spec",
    default=None,
    help="'package.module:function' or 'file.py:function' returning a "
    "tpu_embedding.export.ExportSpec (any other model)",
  )
  parser.add_argument(
    "--checkpoint",
    default=None,
    help="a checkpoint prefix (full or delta), or a directory (its latest "
    "save, deltas included); needed with --spec, default the latest of "
    "--model_dir",
  )
  parser.add_argument(
    "--export_dir",
    required=True,
    help="the SavedModel directory (for TF Serving: <model>/<version>)",
  )
  parser.add_argument(
    "--tables",
    default="",
    help="comma-separated table names to export (default: the spec's, "
    "else all)",
  )
  parser.add_argument(
    "--table_dtype",
    default=argparse.SUPPRESS,  # absent unless given (--apply_delta)
    choices=TABLE_DTYPES,
    help="the type the SavedModel stores the tables in (int8: row-wise, "
    "a float32 scale and offset per row); default float32",
  )
  parser.add_argument(
    "--apply_delta",
    default=None,
    metavar="DELTA",
    help="a delta checkpoint: write --export_dir as --base_export plus "
    "this delta (TensorFlow alone: no spec, config or checkpoint)",
  )
  parser.add_argument(
    "--base_export",
    default=None,
    metavar="DIR",
    help="with --apply_delta: the SavedModel version the delta follows "
    "(exported from the delta's parent checkpoint, or made by "
    "--apply_delta from it)",
  )
  parser.add_argument(
    "--signature_name",
    default="serving_default",
    help="the signature's name (--spec)",
  )
  parser.add_argument(
    "--overwrite", action="store_true", help="replace a non-empty export_dir"
  )
  parser.add_argument(
    "--json",
    default="",
    help="also write the result (directory, tables, signature) here",
  )
  return parser


def figures(result) -> dict:
  """``--json``: what ``describe`` prints."""
  if isinstance(result, DeltaExport):
    return dataclasses.asdict(result)

  def specs(named) -> dict:
    return {
      name: {"dtype": spec.dtype.name, "shape": spec.shape.as_list()}
      for name, spec in named.items()
    }

  return {
    "export_dir": result.export_dir,
    "tables": list(result.tables),
    "table_dtype": result.table_dtype,
    "signature_name": result.signature_name,
    "inputs": specs(result.inputs),
    "outputs": specs(result.outputs),
    "extra_signatures": {
      name: specs(inputs) for name, inputs in result.extra_signatures.items()
    },
  }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  """Exports; a user's error is one line (exit 2 usage, 1 runtime)."""
  args = parse_args(argv)
  # Our progress lines only (``progress``): TensorFlow's and the library's
  # INFO logs stay out.
  logging.use_absl_handler()
  logging.set_verbosity(logging.WARNING)
  tf.get_logger().setLevel("ERROR")
  try:
    result = cli.run(lambda: run(args))
  except SystemExit as e:  # the one line is printed: its code, in-process
    return int(e.code or 0)
  print(describe(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(figures(result), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
