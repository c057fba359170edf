"""``train.main``'s flags, configs and clusters: checked before anything is
built, each problem one absl ``UsageError`` line.

In-process (``train.main`` with parsed flags; every case stops before a
table or strategy exists), plus one subprocess to see what a user sees.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import tensorflow as tf
from absl import app
from absl import flags
from absl.testing import flagsaver

from model_garden import cli
from model_garden.ranking import configs
from model_garden.ranking import preflight
from model_garden.ranking import train
from model_garden.ranking.configs import definitions
from model_garden.ranking.configs import support
from tests import processes

train.define_flags()
FLAGS = flags.FLAGS


@pytest.fixture
def run_main(monkeypatch, tmp_path):
  """``run_main(*flags, tf_config=None)``: parses the flags, runs main."""

  def run(*args, tf_config=None):
    if tf_config is None:
      monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
      monkeypatch.setenv("TF_CONFIG", tf_config)
    argv = ["train", f"--model_dir={tmp_path / 'run'}", *args]
    with flagsaver.flagsaver():
      FLAGS(argv)
      return train.main([])

  return run


def usage_error(run_main, *args, tf_config=None):
  with pytest.raises(app.UsageError) as raised:
    run_main(*args, tf_config=tf_config)
  message = str(raised.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize(
  "args, expected",
  [
    (
      ["--experiment=dlrm_tiny"],
      "Unknown --experiment 'dlrm_tiny' (did you mean dlrm_criteo?); known:",
    ),
    (
      ["--params_override=task.model.embeding_dim=8"],
      "Unknown config key 'task.model.embeding_dim'. Valid keys under "
      "task.model:",
    ),
    (["--config_file=/nonexistent/c.yaml"], "'/nonexistent/c.yaml' does not"),
    (["--params_override=trainer.train_steps"], "must be key=value entries"),
    (["--params_override={trainer: [1,"], "Not valid YAML (while parsing"),
    (
      ["--params_override=runtime.num_gpus=4"],
      "runtime.num_gpus=4 is not supported here: MirroredStrategy uses",
    ),
    (
      ["--params_override=trainer.use_orbit=false"],
      "trainer.use_orbit=False is not supported here",
    ),
    (
      ["--params_override=runtime.mixed_precision_dtype=float16"],
      "runtime.mixed_precision_dtype must be one of ('float32', "
      "'mixed_bfloat16', 'mixed_float16'), got 'float16'",
    ),
    (
      ["--params_override=runtime.loss_scale=128"],
      "runtime.loss_scale=128.0 applies to mixed_precision_dtype "
      "mixed_float16 only",
    ),
    (
      ["--params_override=trainer.best_checkpoint_export_subdir=best"],
      "trainer.best_checkpoint_eval_metric must name a validation metric",
    ),
    (
      ["--params_override=task.model.vocab_sizes=[5, 5]"],
      "task.model.vocab_sizes needs 26 sizes, got 2 (one per Criteo",
    ),
    (["--num_replicas=2"], "--num_replicas=2 applies to --strategy mirrored"),
    (
      ["--strategy=multi_worker_mirrored", "--num_ps=1"],
      "--num_ps applies to --strategy parameter_server only",
    ),
    (
      ["--strategy=parameter_server", "--num_workers=2"],
      "needs both --num_workers and --num_ps (got 2 and 0)",
    ),
    (["--strategy=mirrored", "--num_workers=2"], "not mirrored"),
    (["--tpu=grpc://x"], "runtime.tpu='grpc://x' applies to the tpu strategy"),
    (["--eval_timeout=5"], "--eval_timeout applies to --mode continuous_eval"),
    (
      ["--strategy=mirrored", "--cluster_timeout=5"],
      "--cluster_timeout applies to --strategy multi_worker_mirrored, not",
    ),
    (
      ["--strategy=multi_worker_mirrored", "--cluster_timeout=-1"],
      "--cluster_timeout must not be negative (0: wait forever), got -1",
    ),
    (["--mode=eval", "--kill_at_step=3"], "--kill_at_step applies to"),
    (["--ps_local_cluster=2,1"], "applies to --strategy parameter_server"),
    (
      ["--strategy=parameter_server", "--ps_local_cluster=2"],
      '--ps_local_cluster must be "W,P"',
    ),
    (
      ["--strategy=parameter_server"],
      "--strategy parameter_server needs a cluster: set TF_CONFIG",
    ),
    (["--mode=eval"], "--mode eval: no checkpoint in"),
    (
      [
        "--strategy=parameter_server",
        "--ps_local_cluster=1,1",
        "--data=/data/day_*.tsv",
      ],
      "Under --strategy parameter_server, set trainer.validation_steps",
    ),
  ],
)
def test_usage_errors_are_one_line_before_anything_is_built(
  run_main, args, expected
):
  assert expected in usage_error(run_main, *args)


@pytest.mark.parametrize(
  "content, expected",
  [
    (
      "task:\n  model: [unclosed\n",
      ": not valid YAML (while parsing a flow sequence in the file, line 2, "
      "column 10",
    ),
    ("- 1\n- 2\n", ": expected a mapping of config fields, got [1, 2]."),
  ],
  ids=["unparsable", "not_a_mapping"],
)
def test_a_bad_config_file_is_named(run_main, tmp_path, content, expected):
  path = tmp_path / "bad.yaml"
  path.write_text(content)
  line = usage_error(run_main, f"--config_file={path}")
  assert line.startswith(f"{path}{expected}"), line
  assert "<unicode string>" not in line, line


@pytest.mark.parametrize(
  "strategy, tf_config, expected",
  [
    ("parameter_server", "{not json", "TF_CONFIG is not valid JSON"),
    ("parameter_server", '{"task": {}}', 'TF_CONFIG has no "cluster"'),
    (
      "parameter_server",
      json.dumps(
        {
          "cluster": {"chief": ["h:1"], "worker": ["h:2"]},
          "task": {"type": "chief", "index": 0},
        }
      ),
      "TF_CONFIG's cluster has no ['ps'] tasks",
    ),
    (
      "multi_worker_mirrored",
      json.dumps(
        {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}}
      ),
      "TF_CONFIG's task index 1 is out of range: the cluster has 1 worker",
    ),
    (
      "default",
      json.dumps(
        {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}
      ),
      "TF_CONFIG is set but --strategy default runs in one process",
    ),
  ],
)
def test_clusters_are_checked_before_anything_is_built(
  run_main, strategy, tf_config, expected
):
  message = usage_error(run_main, f"--strategy={strategy}", tf_config=tf_config)
  assert expected in message


def test_tables_that_cannot_fit_are_refused_up_front(run_main, monkeypatch):
  monkeypatch.setattr(preflight, "available_memory", lambda: 16 * 2**30)
  with pytest.raises(cli.FixableError) as raised:  # runtime: exit 1
    run_main("--experiment=dlrm_criteo", "--data=synthetic")
  message = str(raised.value)
  assert "\n" not in message
  assert message.startswith("dlrm_criteo: the 26 embedding tables need about")
  rows = sum(configs.get_config("dlrm_criteo").task.model.vocab_sizes)
  assert f"tables {rows * 64 * 4 / 2**30:.1f} GiB" in message
  assert "optimizer slots 0.0 GiB" in message  # SGD
  assert "but this machine has 16.0 GiB available" in message
  assert "--experiment dlrm_criteo_cpu_small" in message
  # Spread over 4 PS machines, each holds a quarter of the big tables.
  estimate = preflight.table_bytes(configs.get_config("dlrm_criteo"))
  assert estimate.per_host(4) < estimate.total / 3
  preflight.check_memory(
    configs.get_config("dlrm_criteo"),
    "dlrm_criteo",
    hosts=4,
    available=estimate.per_host(4) + estimate.largest,
  )


def test_eval_refuses_an_experiment_that_does_not_match_the_checkpoint(
  run_main, tmp_path
):
  model_dir = tmp_path / "run"
  trained = train.build_config(
    "dlrm_criteo_cpu_small",
    params_override="task.model.embedding_dim=8,task.model.bottom_mlp=[8]",
  )
  train.write_params(trained, str(model_dir))
  tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(model_dir / "ckpt"))
  message = usage_error(run_main, "--mode=eval")
  assert "--mode eval: the experiment does not match" in message
  assert "task.model.bottom_mlp: [64, 32, 16] here, [8] there" in message
  assert "task.model.embedding_dim: 16 here, 8 there" in message
  assert f"--config_file={model_dir / 'params.yaml'}" in message
  # With the saved config the checks pass (and nothing was overwritten).
  with flagsaver.flagsaver():
    FLAGS(
      [
        "train",
        f"--model_dir={model_dir}",
        "--mode=eval",
        f"--config_file={model_dir / 'params.yaml'}",
      ]
    )
    plan = train.prepare()
  assert plan.config.task.model.embedding_dim == 8
  assert preflight.saved_params(str(model_dir))["task"]["model"][
    "bottom_mlp"
  ] == [8]


def test_parameter_server_validation_steps_default_for_synthetic_data():
  with flagsaver.flagsaver():
    FLAGS(
      [
        "train",
        "--model_dir=/tmp/unused",
        "--strategy=parameter_server",
        "--ps_local_cluster=2,1",
        "--params_override=task.synthetic.num_eval_examples=8192",
      ]
    )
    plan = train.prepare()
  assert plan.config.trainer.validation_steps == 8192 // 4096
  assert plan.local_cluster == (2, 1)
  assert "trainer.validation_steps set to 2" in plan.notes[0]


def test_params_override_takes_yaml_files_and_flow_style(tmp_path):
  path = tmp_path / "override.yaml"
  path.write_text(
    "trainer:\n  train_steps: 7\ntask:\n  model: {dcn_num_layers: 2}\n"
  )
  for text in (
    str(path),
    "{trainer: {train_steps: 7}, task: {model: {dcn_num_layers: 2}}}",
    "trainer: {train_steps: 7}",
    "trainer.train_steps: 7",
  ):
    config = train.build_config("dcn_criteo_cpu_small", params_override=text)
    assert config.trainer.train_steps == 7, text
  assert config.task.model.dcn_num_layers == 3  # only the first two set it
  config = train.build_config("dcn_criteo_cpu_small", params_override=str(path))
  assert config.task.model.dcn_num_layers == 2


def test_params_yaml_goes_through_tensorflow_filesystems():
  config = configs.get_config("dlrm_criteo_cpu_small")
  path = train.write_params(config, "ram://params_test/run")
  assert path == "ram://params_test/run/params.yaml"
  assert tf.io.gfile.exists(path)
  assert not os.path.exists("ram:")
  assert train.build_config("dlrm_criteo_cpu_small", [path]) == config


def test_every_config_key_works_or_is_rejected():
  keys = set(support.leaves(definitions.ExperimentConfig()))
  unsupported = set(support.UNSUPPORTED)
  assert not unsupported & support.IMPLEMENTED
  assert keys == unsupported | support.IMPLEMENTED, (
    "classify in configs/support.py: "
    f"{sorted(keys ^ (unsupported | support.IMPLEMENTED))}"
  )
  # Defaults (and so Model Garden's YAML files and params.yaml) pass.
  for name in configs.experiments():
    support.check_supported(configs.get_config(name))


def test_the_command_line_shows_one_line_and_no_traceback(tmp_path):
  result = processes.run(
    [
      sys.executable,
      "-m",
      "model_garden.ranking.train",
      f"--model_dir={tmp_path}",
      "--params_override=runtime.num_gpus=2",
    ],
    capture_output=True,
    text=True,
    cwd=str(tmp_path),
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    timeout=120,
  )
  assert result.returncode == 2  # usage
  assert "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("runtime.num_gpus=2 is not supported here"), last
  assert last.endswith("; see --help"), last
  assert not list(tmp_path.iterdir())  # nothing written
