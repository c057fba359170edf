"""Every Python block of README.md runs as pasted; so does its serving line.

Each ```python block runs in its own subprocess (the installed package,
as a user would have it):

* on the default strategy, as pasted;
* if it is a training loop (it calls ``strategy.run``), also under a
  ``MirroredStrategy`` of 2 logical CPUs: a prefix creates the devices and
  enters that strategy's scope, so the block's own
  ``strategy = tf.distribute.get_strategy()`` (the README says so) picks
  it up. A suffix prints the replica count the block trained on.

The serving recipe (the ```bash ``saved_model_cli run`` line and the
Python block reading ``/tmp/tpe_dlrm``) runs against a SavedModel
exported by ``python3 -m model_garden.ranking.train --experiment
dlrm_criteo_cpu_small`` with 2 steps, the README's path replaced by the
test's directory (the only change made to a block). Both must give the
same probability for the same example: the line's raw fields
(``serving_raw``) and its preprocessed values (``serving_default``).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import sys

import pytest

from tests import processes

README = pathlib.Path(__file__).parents[1] / "README.md"
TEXT = README.read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, re.M | re.S)
BASH_BLOCKS = re.findall(r"^```bash\n(.*?)^```", TEXT, re.M | re.S)

#: The README's ranking run directory (its first command's --model_dir).
RANKING_DIR = "/tmp/tpe_dlrm"

MIRRORED_PREFIX = """\
import tensorflow as tf
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
  _cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
_scope = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope()
_scope.__enter__()  # (kept referenced: the scope holds the strategy)
"""
SUFFIX = """
if "strategy" in globals():
  print("REPLICAS", strategy.num_replicas_in_sync)
"""

#: A few training steps of the ranking model, exported (as the tests of
#: model_garden do, smaller).
TINY_RUN = (
  "task.train_data.global_batch_size=64,"
  "task.validation_data.global_batch_size=64,"
  "task.synthetic.num_train_examples=256,"
  "task.synthetic.num_eval_examples=128,"
  "trainer.train_steps=2,"
  "trainer.checkpoint_interval=2"
)


def _run(args, cwd, timeout=300):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  done = processes.run(
    args,
    cwd=str(cwd),
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert done.returncode == 0, done.stdout + done.stderr[-5000:]
  return done.stdout


def _run_python(code, cwd):
  path = pathlib.Path(cwd) / "snippet.py"
  path.write_text(code)
  return _run([sys.executable, str(path)], cwd)


def _kind(block: str) -> str:
  if RANKING_DIR in block:
    return "serving"
  return "training" if "strategy.run(" in block else "plain"


def test_the_readme_is_short_and_has_its_blocks():
  assert len(TEXT.splitlines()) <= 300
  kinds = [_kind(block) for block in PYTHON_BLOCKS]
  assert kinds.count("training") >= 1 and kinds.count("serving") == 1
  assert [b for b in BASH_BLOCKS if b.startswith("saved_model_cli run")]


def test_the_mirrored_line_says_how_to_make_logical_cpus(tmp_path):
  """Next to ``MirroredStrategy()``, the README gives the two lines that
  split the CPU: run as written, the strategy has 2 replicas."""
  paragraph = TEXT[TEXT.index("strategy = tf.distribute.MirroredStrategy()") :]
  paragraph = paragraph[: paragraph.index("\n\n")]
  lines = re.findall(
    r"`(cpu = [^`]+|tf\.config\.set_logical_[^`]+)`", paragraph
  )
  assert len(lines) == 2, paragraph
  stdout = _run_python(
    "import tensorflow as tf\n"
    + "\n".join(lines)
    + "\nstrategy = tf.distribute.MirroredStrategy()"
    + SUFFIX,
    tmp_path,
  )
  assert "REPLICAS 2" in stdout, stdout


CASES = [
  pytest.param(i, strategy, id=f"block{i}-{_kind(block)}-{strategy}")
  for i, block in enumerate(PYTHON_BLOCKS)
  if _kind(block) != "serving"
  for strategy in (
    ["default", "mirrored"] if _kind(block) == "training" else ["default"]
  )
]


@pytest.mark.parametrize("index, strategy", CASES)
def test_python_block_runs_as_pasted(index, strategy, tmp_path):
  block = PYTHON_BLOCKS[index]
  prefix = MIRRORED_PREFIX if strategy == "mirrored" else ""
  stdout = _run_python(prefix + block + SUFFIX, tmp_path)
  if _kind(block) == "training":
    replicas = int(re.search(r"^REPLICAS (\d+)$", stdout, re.M).group(1))
    assert replicas == (2 if strategy == "mirrored" else 1), stdout
    losses = [
      float(x) for x in re.findall(r"^(\d+\.\d+(?:e-?\d+)?)$", stdout, re.M)
    ]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses), stdout


@pytest.fixture(scope="module")
def ranking_dir(tmp_path_factory):
  """A ranking run's directory holding its exported SavedModel."""
  model_dir = tmp_path_factory.mktemp("tpe_dlrm")
  stdout = _run(
    [
      sys.executable,
      "-m",
      "model_garden.ranking.train",
      "--experiment=dlrm_criteo_cpu_small",
      f"--model_dir={model_dir}",
      f"--params_override={TINY_RUN}",
    ],
    cwd=model_dir,
    timeout=400,
  )
  assert re.search(r"SavedModel: \S+/saved_model/2", stdout), stdout
  return model_dir


def _probabilities(text: str) -> list[float]:
  return [float(x) for x in re.findall(r"\d\.\d+(?:e-?\d+)?", text)]


def test_the_serving_recipe_works(ranking_dir, tmp_path):
  (line,) = [b for b in BASH_BLOCKS if b.startswith("saved_model_cli run")]
  assert "--signature_def serving_raw" in line
  stdout = _run(
    ["bash", "-c", line.replace(RANKING_DIR, str(ranking_dir))], tmp_path
  )
  result = stdout.split("Result for output key predictions:")[1]
  (cli,) = _probabilities(result)
  (block,) = [b for b in PYTHON_BLOCKS if _kind(b) == "serving"]
  stdout = _run_python(block.replace(RANKING_DIR, str(ranking_dir)), tmp_path)
  python = _probabilities(stdout.strip().splitlines()[-1])
  assert len(python) == 2 and all(0 < p < 1 for p in python + [cli]), stdout
  # The same example (dense features 0.5, id 1 everywhere) both ways.
  assert python[0] == pytest.approx(cli, abs=1e-5)
