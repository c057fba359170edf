"""What a run with delta checkpoints ships and evaluates: its last state.

Two runs of ``dlrm_criteo_cpu_small`` (same seed, same data, one device:
bit-identical training), started together:

* ``deltas``: a full checkpoint at step 2, then deltas at steps 4 and 6
  (``trainer.checkpoint_delta_interval=2``);
* ``full``: full checkpoints at steps 2, 4 and 6 (the oracle).

Everything made from ``deltas``'s directory must serve the predictions of
the same thing made from ``full``'s, bit for bit: the trainer's SavedModel,
``tools/export.py --model_dir`` and ``--checkpoint delta-4`` (float32 and
int8), the versions ``--apply_delta`` makes from the trainer's own deltas
(served predictions, both signatures, against a fresh export), and the
continuous evaluator (which must evaluate ``delta-6``, not wait on
``ckpt-2``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking import configs
from model_garden.ranking import saved_model
from model_garden.ranking.data import synthetic
from tests.model_garden.test_train import command
from tests.model_garden.test_train import finish
from tests.model_garden.test_train import start as _start
from tests.scripts import run_tool

STEPS = 6
PARAMS = (
  "task.train_data.global_batch_size=256,"
  "task.validation_data.global_batch_size=256,"
  "task.synthetic.num_train_examples=4096,"
  "task.synthetic.num_eval_examples=1024,"
  f"trainer.train_steps={STEPS},"
  "trainer.checkpoint_interval=2,"
  f"trainer.validation_interval={STEPS},"
  "trainer.optimizer_config.lr_config.learning_rate=20,"
  "trainer.optimizer_config.lr_config.warmup_steps=2"
)
SOURCE = os.path.join("assets.extra", "tpu_embedding_source.json")


def _command(model_dir, params, *flags):
  return command(model_dir, *flags, params=params)


def _run(processes_by_name, timeout=300):
  results = {}
  for name, process in processes_by_name.items():
    code, stdout, stderr = finish(process, timeout)
    assert code == 0, f"{name}:\n{stdout[-2000:]}\n{stderr[-3000:]}"
    results[name] = stdout
  return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("delta_runs")
  dirs = {"deltas": root / "deltas", "full": root / "full"}
  stdout = _run(
    {
      "deltas": _start(
        _command(
          dirs["deltas"],
          PARAMS + ",trainer.checkpoint_delta_interval=2",
          "--mode=train_and_eval",
        ),
        root,
      ),
      "full": _start(
        _command(dirs["full"], PARAMS, "--mode=train_and_eval"), root
      ),
    }
  )
  return {"root": root, "dirs": dirs, "stdout": stdout}


_REQUEST = None


def _predictions(export_dir) -> np.ndarray:
  global _REQUEST
  if _REQUEST is None:
    config = configs.get_config("dlrm_criteo_cpu_small")
    _REQUEST = saved_model.example_request(config, batch_size=64, seed=5)
  serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
  return serve(**_REQUEST)["predictions"].numpy()


def _raw_predictions(export_dir) -> np.ndarray:
  """``serving_raw``'s predictions on raw TSV lines' fields."""
  config = configs.get_config("dlrm_criteo_cpu_small")
  rows = [
    line.split("\t")
    for line in synthetic.SyntheticCriteo(
      config.task.model.vocab_sizes
    ).tsv_lines(0, 64)
  ]
  serve = tf.saved_model.load(str(export_dir)).signatures["serving_raw"]
  return serve(
    counts=tf.constant([r[1:14] for r in rows]),
    categorical=tf.constant([r[14:] for r in rows]),
  )["predictions"].numpy()


#: The exports made so far, by their arguments: a test asking for an
#: export another test made (the latest save's, float32 or int8) reads it.
_EXPORTS: dict[tuple[str, ...], str] = {}


def _export(runs, name, *args) -> str:
  if args not in _EXPORTS:
    export_dir = str(runs["root"] / "exports" / name)
    run_tool("export.py", "--export_dir", export_dir, *args)
    _EXPORTS[args] = export_dir
  return _EXPORTS[args]


def test_the_files_are_a_full_checkpoint_and_two_deltas(runs):
  names = sorted(os.listdir(runs["dirs"]["deltas"]))
  assert "ckpt-2.index" in names
  assert "delta-4.index" in names and "delta-6.index" in names
  assert not any(n.startswith(("ckpt-4", "ckpt-6")) for n in names), names


def test_the_trainer_ships_and_reports_its_last_state(runs):
  stdout = runs["stdout"]["deltas"]
  deltas = runs["dirs"]["deltas"]
  assert f"Checkpoint: {deltas / 'delta-6'}" in stdout
  assert f"SavedModel: {deltas / 'saved_model' / '6'}" in stdout
  shipped = _predictions(deltas / "saved_model" / "6")
  np.testing.assert_array_equal(
    shipped, _predictions(runs["dirs"]["full"] / "saved_model" / "6")
  )
  # Not the full checkpoint's model under the last step's label.
  step_2 = _export(
    runs,
    "step_2",
    "--model_dir",
    str(deltas),
    "--checkpoint",
    str(deltas / "ckpt-2"),
  )
  assert np.abs(shipped - _predictions(step_2)).max() > 1e-3
  record = json.loads((deltas / "saved_model" / "6" / SOURCE).read_text())
  assert record["source_name"] == "delta-6"
  assert record["unmapped_model_variables"] == 0
  assert len(record["model"]) == 12  # the ranking model's Dense layers


@pytest.mark.parametrize("table_dtype", ["float32", "int8"])
def test_the_export_tool_exports_the_latest_save(runs, table_dtype):
  dtype = ["--table_dtype", table_dtype]
  got = _export(
    runs,
    f"latest_{table_dtype}",
    "--model_dir",
    str(runs["dirs"]["deltas"]),
    *dtype,
  )
  want = _export(
    runs,
    f"full_{table_dtype}",
    "--model_dir",
    str(runs["dirs"]["full"]),
    *dtype,
  )
  np.testing.assert_array_equal(_predictions(got), _predictions(want))
  assert json.loads((Path(got) / SOURCE).read_text())["source_name"] == (
    "delta-6"
  )


def test_a_delta_checkpoint_exports_the_state_it_saved(runs):
  got = _export(
    runs,
    "delta_4",
    "--model_dir",
    str(runs["dirs"]["deltas"]),
    "--checkpoint",
    str(runs["dirs"]["deltas"] / "delta-4"),
  )
  want = _export(
    runs,
    "ckpt_4",
    "--model_dir",
    str(runs["dirs"]["full"]),
    "--checkpoint",
    str(runs["dirs"]["full"] / "ckpt-4"),
  )
  np.testing.assert_array_equal(_predictions(got), _predictions(want))


@pytest.mark.parametrize("table_dtype", ["float32", "int8"])
def test_versions_from_the_trainers_deltas_serve_a_fresh_exports_predictions(
  runs, table_dtype
):
  deltas = runs["dirs"]["deltas"]
  dtype = ["--table_dtype", table_dtype]
  version = _export(
    runs,
    f"{table_dtype}/2",
    "--model_dir",
    str(deltas),
    "--checkpoint",
    str(deltas / "ckpt-2"),
    *dtype,
  )
  for step in (4, 6):
    base, version = (
      version,
      str(runs["root"] / "exports" / table_dtype / str(step)),
    )
    done = run_tool(
      "export.py",
      "--apply_delta",
      str(deltas / f"delta-{step}"),
      "--base_export",
      base,
      "--export_dir",
      version,
    )
    assert "model variables from the delta: 12" in done.stdout
  fresh = _export(
    runs, f"fresh_{table_dtype}", "--model_dir", str(deltas), *dtype
  )
  got, want = _predictions(version), _predictions(fresh)
  np.testing.assert_array_equal(got, want)
  # The raw-fields signature, kept by the copy, serves the new variables.
  np.testing.assert_array_equal(
    _raw_predictions(version), _raw_predictions(fresh)
  )
  assert (
    np.abs(
      got - _predictions(runs["root"] / "exports" / table_dtype / "2")
    ).max()
    > 1e-3
  )


def test_float32_and_int8_exports_key_the_model_variables_alike(runs):
  deltas = runs["dirs"]["deltas"]
  records = {}
  for table_dtype in ("float32", "int8"):
    export_dir = _export(
      runs,
      f"keys_{table_dtype}",
      "--model_dir",
      str(deltas),
      "--table_dtype",
      table_dtype,
    )
    records[table_dtype] = json.loads(
      open(os.path.join(export_dir, SOURCE)).read()
    )["model"]
  assert records["float32"] == records["int8"]
  assert len(records["float32"]) == 12


def test_the_continuous_evaluator_evaluates_the_last_delta(runs):
  done = _run(
    {
      "sidecar": _start(
        _command(
          runs["dirs"]["deltas"],
          PARAMS + ",trainer.checkpoint_delta_interval=2",
          "--mode=continuous_eval",
          "--eval_timeout=20",
        ),
        runs["root"],
      )
    }
  )["sidecar"]
  evaluated = re.findall(r"Evaluating (\S+) \(step (\d+)\)", done)
  assert evaluated == [(str(runs["dirs"]["deltas"] / "delta-6"), "6")], done
  # The same metrics as the oracle run's evaluation of its step 6.
  auc = re.search(r"Validation AUC ([0-9.]+)", done).group(1)
  want = re.search(r"Validation AUC ([0-9.]+)", runs["stdout"]["full"]).group(1)
  assert auc == want
