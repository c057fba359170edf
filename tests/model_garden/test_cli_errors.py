"""What a user sees for ordinary mistakes with ``model_garden.ranking.train``.

Usage errors: one line ending ``see --help``, exit 2. Runtime failures
the user can fix (files, permissions, data, memory): one line naming the
file or key, exit 1. Never a traceback (``--debug`` shows it), never
TensorFlow's start-up banner (unless ``TF_CPP_MIN_LOG_LEVEL`` is set), and
nothing written to ``--model_dir`` before the checks pass.

A few runs are real subprocesses (what the user sees); the preflight's
cases run ``train.main`` in this process (each stops before a table
exists).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from model_garden import cli
from model_garden.ranking import preflight
from model_garden.ranking import train
from tests import processes

train.define_flags()
FLAGS = flags.FLAGS
#: A tiny experiment: 26 tables of 40 rows, batches of 8.
TINY = ",".join(
  [
    f"task.model.vocab_sizes={[40] * 26}",
    "task.train_data.global_batch_size=8",
    "trainer.train_steps=2",
    "trainer.validation_interval=2",
    "trainer.checkpoint_interval=2",
    "trainer.export_saved_model=false",
  ]
)


def tsv_line(label: str = "1", dense: str = "3", cat: str = "a1") -> str:
  return "\t".join([label] + [dense] * 13 + [cat] * 26)


def write_lines(path, lines: list[str]) -> str:
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def train_command(*args: str, cwd, debug: bool = False):
  """Runs ``python -m model_garden.ranking.train`` as a user does: no
  ``TF_CPP_MIN_LOG_LEVEL`` in the environment."""
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TF_CPP_MIN_LOG_LEVEL", "TPE_QUIET_TENSORFLOW", "TPE_DEBUG")
  }
  if debug:
    env["TPE_DEBUG"] = "1"
  return processes.run(
    [sys.executable, "-m", "model_garden.ranking.train", *args],
    capture_output=True,
    text=True,
    cwd=str(cwd),
    env=env,
    timeout=300,
    check=False,
  )


def last_line(process: subprocess.CompletedProcess) -> str:
  assert "Traceback" not in process.stderr, process.stderr
  return process.stderr.strip().splitlines()[-1]


# --- subprocesses ------------------------------------------------------------


def test_usage_error_is_one_line_exit_2_without_banner_or_help(tmp_path):
  result = train_command(
    "--experiment=dlrm_tiny", f"--model_dir={tmp_path / 'run'}", cwd=tmp_path
  )
  assert result.returncode == 2
  # The whole of stderr: no flag help, no TensorFlow banner.
  assert result.stderr.strip().splitlines() == [
    "Unknown --experiment 'dlrm_tiny' (did you mean dlrm_criteo?); known: "
    "dcn_criteo, "
    "dcn_criteo_cpu_small, dlrm_criteo, dlrm_criteo_cpu_small, "
    "dlrm_dcn_v2_criteo, dlrm_dcn_v2_criteo_cpu_small; see --help"
  ], result.stderr
  flag = train_command("--mode=bogus", "--model_dir=x", cwd=tmp_path)
  assert flag.returncode == 2
  assert last_line(flag) == (
    "flag --mode=bogus: value should be one of "
    "<train|eval|train_and_eval|continuous_eval>; see --help"
  )
  assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


def test_input_glob_matching_nothing_is_one_line_exit_1(tmp_path):
  pattern = str(tmp_path / "day_*.tsv")
  result = train_command(
    f"--model_dir={tmp_path / 'run'}", f"--data={pattern}", cwd=tmp_path
  )
  assert result.returncode == 1
  assert last_line(result) == (
    f"task.train_data.input_path: no file matches {pattern!r}; check the "
    "path (--data or the input_path key)."
  )
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("run_dir", ["new", "there"])
def test_bad_record_names_file_line_and_the_policy_key(run_dir, tmp_path):
  good = [tsv_line(label=str(i % 2), dense=str(i)) for i in range(24)]
  path = write_lines(
    tmp_path / "day.tsv", good[:11] + [tsv_line(dense="x")] + good[11:]
  )
  if run_dir == "there":
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
  result = train_command(
    f"--model_dir={tmp_path / 'run'}", f"--data={path}", "--mode=train",
    f"--params_override={TINY}", cwd=tmp_path,
  )  # fmt: skip
  assert result.returncode == 1, result.stderr
  assert last_line(result) == (
    f"{path}:12: invalid dense field (the line starts with: "
    + "\\t".join(["1"] + ["x"] * 13 + ["a1"] * 5)
    + "); "
    "to drop bad records set task.train_data.on_bad_record=count (counted "
    "in the logs) or skip"
  )
  if run_dir == "new":
    # The run made its directory and failed before a checkpoint: nothing
    # of it is left behind.
    assert not (tmp_path / "run").exists()
  else:  # A directory that was there is kept, with what it held.
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_another_experiments_run_dir_is_refused_and_kept(tmp_path):
  model_dir = tmp_path / "run"
  params = train.write_params(
    train.build_config("dlrm_criteo_cpu_small"), str(model_dir)
  )
  with open(params) as f:
    before = f.read()
  result = train_command(
    "--experiment=dcn_criteo_cpu_small", f"--model_dir={model_dir}",
    cwd=tmp_path,
  )  # fmt: skip
  assert result.returncode == 2
  assert last_line(result).startswith(
    f"--model_dir {model_dir} holds another experiment's run ({params} "
    'differs: task.model.interaction: "cross" here, "dot" there)'
  )
  with open(params) as f:
    assert f.read() == before
  assert os.listdir(model_dir) == ["params.yaml"]


# --- the preflight, in this process --------------------------------------


def _contents(path):
  """A directory's names, a file's text, or None."""
  if path.is_dir():
    return sorted(os.listdir(path))
  return path.read_text() if path.exists() else None


@pytest.fixture
def run_main(monkeypatch, tmp_path):
  """``run_main(*flags)``: runs ``train.main``; returns the error it raised
  (a ``cli`` error), after checking nothing was written."""

  def run(*args, model_dir=None):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    model_dir = model_dir or tmp_path / "run"
    existed = _contents(model_dir)
    argv = ["train", f"--model_dir={model_dir}", "--progress_bar=off", *args]
    with flagsaver.flagsaver(), pytest.raises(SystemExit) as raised:
      FLAGS(argv)
      train.cli.run(lambda: train.main([]), train.translate_error)
    now = _contents(model_dir)
    assert now == existed  # nothing written
    return raised.value.code

  return run


def test_preflight_refuses_what_cannot_run(run_main, tmp_path, capsys):
  good = write_lines(tmp_path / "good.tsv", [tsv_line()] * 16)
  small = write_lines(tmp_path / "small.tsv", [tsv_line()] * 5)
  binary = tmp_path / "data.bin"
  binary.write_bytes(bytes(range(256)) * 4)
  latin = tmp_path / "latin.tsv"
  latin.write_bytes(("\n".join([tsv_line()] * 3) + "\n").encode() + b"\xe9\n")
  (tmp_path / "a_file").write_text("x")
  days = tmp_path / "days"
  days.mkdir()
  cases = [
    (
      [f"--data={days}", f"--params_override={TINY}"],
      1,
      f"task.train_data.input_path: {str(days)!r} is a directory; name its "
      f"files with a glob (e.g. {str(days / '*')!r}).",
    ),
    (
      ["--strategy=mirrored", "--num_replicas=3", f"--params_override={TINY}"],
      2,
      "task.train_data.global_batch_size=8 does not split over 3 replicas: "
      "use a multiple of 3; see --help",
    ),
    (
      [f"--data={small}", f"--params_override={TINY}"],
      1,
      f"task.train_data.input_path: {small} hold(s) 5 record(s), fewer than "
      "one global batch (task.train_data.global_batch_size=8): lower the "
      "batch or add data.",
    ),
    (
      [f"--data={binary}", f"--params_override={TINY}"],
      1,
      f"{binary}: not a text file (task.train_data.input_path expects "
      "Criteo TSV lines; TFRecord files need task.use_tf_record_reader=true,"
      " compressed files must be decompressed).",
    ),
    (
      [f"--data={latin}", f"--params_override={TINY}"],
      1,
      f"{latin}:4: not UTF-8 text (task.train_data.input_path expects "
      "Criteo TSV lines).",
    ),
    (
      [f"--params_override={TINY},task.train_data.input_path={good}"],
      2,
      f"task.train_data.input_path={good!r} is ignored while "
      "task.use_synthetic_data is true: set task.use_synthetic_data=false "
      "(or --data=<glob>) to read the files, or remove the input path; "
      "see --help",
    ),
    (
      [f"--params_override={TINY},task.use_synthetic_data=false"],
      2,
      "task.train_data.input_path is empty and task.use_synthetic_data is "
      "false: set task.train_data.input_path (or --data=<glob>), or use "
      "--data=synthetic; see --help",
    ),
    (
      [
        f"--params_override={TINY},task.synthetic.num_train_examples=4",
      ],
      1,
      "task.synthetic.num_train_examples=4 is less than one global batch "
      "(task.train_data.global_batch_size=8): raise it or lower the batch.",
    ),
  ]
  for args, code, line in cases:
    assert run_main(*args) == code, args
    assert capsys.readouterr().err.strip().splitlines()[-1] == line


@pytest.mark.parametrize(
  "where, reason",
  [
    ("a_file/run", "a_file is a file, not a directory."),
    ("a_file", "is a file, not a directory: choose a directory"),
    ("/proc/self", "cannot be created or written"),
    ("/proc/tpe_test/run", "cannot be created or written"),
  ],
)
def test_unwritable_model_dir_is_one_line_exit_1(
  run_main, tmp_path, capsys, where, reason
):
  (tmp_path / "a_file").write_text("x")
  model_dir = tmp_path / where
  assert run_main(f"--params_override={TINY}", model_dir=model_dir) == 1
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert line.startswith(f"--model_dir {model_dir}") and reason in line, line


def test_validation_batch_follows_the_training_batch():
  config = train.build_config(
    "dlrm_criteo_cpu_small",
    params_override="task.train_data.global_batch_size=8",
  )
  assert config.task.validation_data.global_batch_size == 8


def test_model_dir_check_leaves_no_trace(tmp_path):
  preflight.check_model_dir(str(tmp_path / "a" / "b"))
  assert os.listdir(tmp_path) == []
  (tmp_path / "run").mkdir()
  preflight.check_model_dir(str(tmp_path / "run"))
  assert os.listdir(tmp_path / "run") == []


def test_the_same_experiment_resumes(tmp_path):
  config = train.build_config("dlrm_criteo_cpu_small")
  train.write_params(config, str(tmp_path))
  more_steps = train.build_config(
    "dlrm_criteo_cpu_small", params_override="trainer.train_steps=900"
  )
  preflight.check_run_dir(more_steps, str(tmp_path), "train")
  other = train.build_config("dlrm_criteo_cpu_small", seed=None)
  other = train.configs.override(other, {"task.model.embedding_dim": 8})
  with pytest.raises(ValueError, match="task.model.embedding_dim: 8 here"):
    preflight.check_run_dir(other, str(tmp_path), "train_and_eval")
  preflight.check_run_dir(other, str(tmp_path), "eval")  # checked elsewhere


def test_one_line_keeps_tracebacks_for_bugs():
  assert cli.one_line(KeyError("x")) is None
  assert cli.one_line(cli.UsageError("--x is wrong.")) == (
    2,
    "--x is wrong; see --help",
  )
  assert json.dumps(cli.one_line(MemoryError()))  # a line, exit 1


def test_debug_shows_the_traceback(monkeypatch, capsys):
  def missing():
    raise FileNotFoundError(2, "No such file", "/data/x.tsv")

  with pytest.raises(SystemExit) as raised:
    cli.run(missing)
  assert raised.value.code == 1
  assert capsys.readouterr().err == "/data/x.tsv: No such file\n"
  monkeypatch.setenv(cli.DEBUG_ENV, "1")
  with pytest.raises(SystemExit) as raised:
    cli.run(missing)
  assert raised.value.code == 1
  err = capsys.readouterr().err
  assert "Traceback" in err and err.endswith("/data/x.tsv: No such file\n")


def test_a_checkpoint_of_another_experiment_leaves_its_directory_alone(
  run_main, tmp_path, capsys
):
  # A run directory without its params.yaml (copied, or written by hand).
  model_dir = tmp_path / "run"
  tiny = train.build_config(
    "dlrm_criteo_cpu_small",
    params_override=TINY + ",trainer.train_steps=1,task.synthetic."
    "num_train_examples=64,task.synthetic.num_eval_examples=64",
  )
  train.run(tiny, str(model_dir), mode="train", progress_bar=False)
  os.remove(model_dir / "params.yaml")
  capsys.readouterr()
  code = run_main(
    "--experiment=dcn_criteo_cpu_small",
    "--mode=train",
    f"--params_override={TINY}",
    model_dir=model_dir,
  )
  assert code == 1
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert line.startswith(
    f"The checkpoint in {model_dir} was written by another experiment "
    "(Received incompatible tensor"
  ), line
