"""docs/your_own_data.md runs as pasted; so does ``--help``'s TFRecord line.

Every ```bash block of the page runs, in order, in one directory holding
``criteo/day_0.tsv`` and ``criteo/day_1.tsv`` (2,000 synthetic lines
each, ``synthetic.SyntheticCriteo.tsv_lines``) and ``tools`` (a link to
the checkout's: the page runs from the checkout's root): TSV training with
the held-out split, the TFRecord conversion and training, the export, and
``saved_model_cli`` on both signatures, whose ``serving_raw`` answer for
a file's first two lines is checked against the SavedModel loaded here.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking.data import synthetic
from model_garden.ranking.train import build_config
from tests import processes

ROOT = pathlib.Path(__file__).parents[2]
PAGE = ROOT / "docs" / "your_own_data.md"
BASH_BLOCKS = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.M | re.S)


def _env():
  bin_dir = os.path.dirname(sys.executable)  # python3, saved_model_cli
  return dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL="3",
    PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
  )


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
  cwd = tmp_path_factory.mktemp("own_data")
  generator = synthetic.SyntheticCriteo(
    synthetic.capped_vocab_sizes(100_000), seed=1
  )
  (cwd / "criteo").mkdir()
  for day in range(2):
    lines = generator.tsv_lines(day * 2000, 2000)
    (cwd / "criteo" / f"day_{day}.tsv").write_text(
      "".join(line + "\n" for line in lines)
    )
  (cwd / "tools").symlink_to(ROOT / "tools")
  outputs = []
  for block in BASH_BLOCKS:
    done = processes.run(
      ["bash", "-e", "-o", "pipefail", "-c", block],
      cwd=str(cwd),
      env=_env(),
      capture_output=True,
      text=True,
      timeout=400,
      check=False,
    )
    assert done.returncode == 0, (
      f"{block}\nexited {done.returncode}:\n{done.stdout[-3000:]}\n"
      f"{done.stderr[-3000:]}"
    )
    outputs.append(done.stdout)
  return cwd, outputs


def _output(ran, start: str) -> str:
  _, outputs = ran
  (out,) = [
    o for b, o in zip(BASH_BLOCKS, outputs, strict=True) if b.startswith(start)
  ]
  return out


def _probabilities(out: str) -> list[float]:
  tail = out.split("Result for output key predictions:")[1]
  return [float(x) for x in re.findall(r"\d\.\d+(?:e-?\d+)?", tail)]


def test_the_page_trains_on_tsv_files_with_the_held_out_split(ran):
  assert len(BASH_BLOCKS) >= 6
  (out,) = [o for o in ran[1] if "runs/tsv/ckpt-30" in o]
  assert "records 10, 20, 30, ... of each file of criteo/*.tsv" in out
  assert "SavedModel: runs/tsv/saved_model/30" in out


def test_the_page_converts_to_tfrecords_and_trains_on_them(ran):
  cwd, outputs = ran
  assert "wrote 4,000 examples" in _output(ran, "python3 tools/criteo_to")
  (out,) = [o for o in outputs if "runs/tfrecord/ckpt-30" in o]
  assert "tfrecord data" in out and "criteo_tfrecord/*.tfrecord" in out
  assert (cwd / "exports" / "criteo" / "1" / "saved_model.pb").exists()


def test_the_page_serves_both_signatures(ran):
  cwd, _ = ran
  raw_out = _output(ran, "saved_model_cli show")
  assert "inputs['categorical']" in raw_out and "inputs['counts']" in raw_out
  got = _probabilities(raw_out)
  rows = [
    line.split("\t")
    for line in (cwd / "criteo" / "day_0.tsv").read_text().splitlines()[:2]
  ]
  serve = tf.saved_model.load(str(cwd / "runs/tsv/saved_model/30"))
  want = serve.signatures["serving_raw"](
    counts=tf.constant([r[1:14] for r in rows]),
    categorical=tf.constant([r[14:] for r in rows]),
  )["predictions"]
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-7)
  (default,) = _probabilities(_output(ran, "saved_model_cli run --dir exp"))
  assert 0 < default < 1


def test_the_help_tfrecord_example_reads_tfrecords(tmp_path):
  """``--help``'s TFRecord line, applied to a ``*_cpu_small`` experiment
  (synthetic by default), both ways it gives: files are read."""
  done = processes.run(
    [sys.executable, "-m", "model_garden.ranking.train", "--help"],
    capture_output=True,
    text=True,
    env=_env(),
    cwd=str(tmp_path),
    timeout=120,
    check=False,
  )
  text = " ".join(done.stdout.split())
  match = re.search(
    r"TFRecord files \(.*?\): ``--data '([^']+)' --params_override "
    r"(\S+)``; without ``--data``, also ``(\S+)=\.\.\.``",
    text,
  )
  assert match, text[:3000]
  glob, override, more = match.groups()
  for config in (
    build_config("dlrm_criteo_cpu_small", params_override=override, data=glob),
    build_config(
      "dlrm_criteo_cpu_small",
      params_override=f"{override},{more}={glob}",
    ),
  ):
    task = config.task
    assert task.use_tf_record_reader and not task.use_synthetic_data
    assert task.train_data.input_path == glob
