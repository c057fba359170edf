"""Every script under tools/ and examples/ runs, on tiny sizes.

Each is started as a user starts it (``python3 tools/<name>.py ...``, in
a subprocess, importing the installed packages) with flags that make it
finish in seconds, and its output is checked: the figures it prints, the
``--json`` it writes, the SavedModel it exports. Every flag of every tool
has help text. ``tools/criteo_to_tfrecord.py`` is run by
``tests/model_garden/test_data_options.py``.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from model_garden import cli
from model_garden.ranking import saved_model
from model_garden.ranking.configs import params_file
from model_garden.ranking.task import RankingTask
from tests import processes
from tests.scripts import ROOT
from tests.scripts import run_script
from tests.scripts import run_tool

TOOLS = sorted(os.path.basename(p) for p in glob.glob(f"{ROOT}/tools/*.py"))
EXAMPLES = sorted(
  os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/examples/*.py")
)
#: Tools whose flags are argparse's (``build_parser()``); the others absl's.
ARGPARSE_TOOLS = (
  "benchmark.py",
  "delta_benchmark.py",  # run by tests/checkpointing/test_delta_checkpoints.py
  "dynamic_benchmark.py",
  "export.py",
  "fdo_report.py",  # run by tests/fdo/test_fdo.py
  "gpu_check.py",
  "pipelining_benchmark.py",
  # its AUC by tests/export/test_quantized_export.py
  "quantized_export_report.py",
  "sharding_report.py",
  "memory_report.py",  # run by tests/test_memory.py
  "mutation_check.py",  # run by tests/test_mutation_check.py
)
ABSL_TOOLS = ("criteo_to_tfrecord.py", "input_benchmark.py")
#: A tiny ranking experiment for the tools that take the train flags.
TINY = ",".join(
  [
    f"task.model.vocab_sizes={[40] * 26}",
    "task.train_data.global_batch_size=32",
    "task.validation_data.global_batch_size=32",
    "task.synthetic.num_train_examples=512",
    "task.synthetic.num_eval_examples=64",
  ]
)


def _load(name: str):
  """Imports ``tools/<name>`` (its ``main`` does not run)."""
  sys.path.insert(0, os.path.join(ROOT, "tools"))  # for tools/_timing.py
  try:
    spec = importlib.util.spec_from_file_location(
      name[:-3], os.path.join(ROOT, "tools", name)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(os.path.join(ROOT, "tools"))
  return module


def run_in_process(capsys, name: str, *args: str, returncode: int = 0):
  """``tools/<name> args`` in this process, called as its ``__main__``
  block calls it (``main(argv)``, under ``cli.run`` where that block adds
  it); its exit code is checked as ``run_tool`` checks it. Returns a
  ``CompletedProcess`` with the captured stdout and stderr.

  For the runs that need no process of their own: each tool keeps at
  least one ``run_tool`` run here (a subprocess) where its command-line
  contract (exit code, one-line error, no traceback) is checked.
  """
  module = _load(name)
  argv = list(args)
  try:
    if name in _MAIN_UNDER_CLI_RUN:
      code = cli.run(lambda: module.main(argv))
    else:
      code = module.main(argv)
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  code = int(code or 0)
  assert code == returncode, (name, argv, code, out.out[-3000:], out.err)
  return subprocess.CompletedProcess([name, *argv], code, out.out, out.err)


#: Tools whose ``__main__`` block is ``cli.run(main)`` (the others call
#: ``main()``, which runs ``cli.run`` itself).
_MAIN_UNDER_CLI_RUN = ("benchmark.py", "pipelining_benchmark.py")


def test_every_tool_and_example_is_covered():
  helpers = (
    {"_timing.py", "_floor.py", "_plots.py", "_disk.py"}
    | {"proc_memory.py"}
    | {
      f"memory_{part}.py"
      for part in ("cluster", "config", "jobs", "runs", "workload")
    }
  )  # memory_report.py's parts
  assert set(TOOLS) == set(ARGPARSE_TOOLS) | set(ABSL_TOOLS) | helpers
  assert EXAMPLES == ["examples/quickstart.py"]


@pytest.mark.parametrize("name", ARGPARSE_TOOLS)
def test_argparse_flags_have_help_and_defaults(name):
  parser = _load(name).build_parser()
  assert parser.formatter_class.__name__ == "ArgumentDefaultsHelpFormatter"
  for action in parser._actions:
    if action.dest != "help":
      assert action.help and len(action.help) > 3, (name, action.dest)
  text = parser.format_help()
  assert text.count("(default:") >= len(parser._actions) - 2, text
  # Every tool writes its figures with --json and explains an error with
  # --debug.
  assert {"json", "debug"} <= {a.dest for a in parser._actions}, name


@pytest.mark.parametrize("name", ABSL_TOOLS)
def test_absl_flags_have_help(name):
  out = run_tool(name, "--help", returncode=1).stdout  # absl exits 1
  flags = re.findall(r"^  --(\w+): (.*)$", out, flags=re.MULTILINE)
  assert len(flags) >= 4, out
  assert "json" in dict(flags), name
  for flag, text in flags:
    assert len(text.strip()) > 3, (name, flag)


def _json(path) -> dict:
  with open(path) as f:
    return json.load(f)


def _check_measurements(result: dict, names: list[str], repeats: int):
  assert sorted(result["measurements"]) == sorted(names)
  for name, m in result["measurements"].items():
    assert len(m["values"]) == repeats, name
    assert m["min"] <= m["median"] <= m["max"], name
    assert m["spread"] == pytest.approx((m["max"] - m["min"]) / m["median"])


def test_benchmark_prints_repeats_and_spread_and_writes_json(tmp_path):
  out = run_tool(
    "benchmark.py",
    "--tables=2", "--rows=500", "--dim=4", "--batch_size=64", "--steps=2",
    "--warmup=1", "--repeats=2", "--replicas=1,2",
    f"--json={tmp_path / 'b.json'}",
  ).stdout  # fmt: skip
  assert re.search(
    r"tpu_embedding: [\d,]+ examples/s \(median of 2; "
    r"[\d,]+-[\d,]+, spread [\d.]+%\)",
    out,
  ), out
  assert re.search(r"tpu_embedding / keras [\d.]+x", out), out
  assert re.search(r"peak resident [\d,]+ MiB = [\d.]+x", out), out
  assert re.search(
    r"2 replicas .*\n    step vs one device, per repeat: [\d.]+ x "
    r"\(median of 2",
    out,
  ), out
  result = _json(tmp_path / "b.json")
  assert result["settings"]["repeats"] == 2
  _check_measurements(
    result,
    [
      "tpu_embedding",
      "keras",
      "one_device",
      "sharded_2_replicas",
      "step_ratio_2_replicas",
    ],
    2,
  )


def test_benchmark_times_16_bit_tables_against_float32_in_turn(tmp_path):
  out = run_tool(
    "benchmark.py",
    "--table_dtype=bfloat16", "--tables=2", "--rows=500", "--dim=8",
    "--batch_size=64", "--steps=2", "--warmup=1", "--repeats=2",
    f"--json={tmp_path / 'b.json'}",
  ).stdout  # fmt: skip
  # Tables and slots in half the bytes: 2 tables x 500 x 8 x (2 + 2).
  assert re.search(r"bfloat16 \(stochastic\) +tables and slots 0 MiB", out)
  assert re.search(
    r"bfloat16 / float32: [\d.]+ x \(median of 2; .*\(per repeat\)", out
  ), out
  assert re.search(r"peak resident growth bfloat16 / float32: [\d.]+", out)
  result = _json(tmp_path / "b.json")
  _check_measurements(
    result,
    [
      "tpu_embedding[bfloat16 (stochastic)]",
      "tpu_embedding[float32]",
      "bfloat16/float32",
    ],
    2,
  )


def test_benchmark_disk_storage_against_memory_and_the_io_floor(tmp_path):
  out = run_tool(
    "benchmark.py",
    "--storage=disk", "--tables=2", "--rows=3000", "--dim=4",
    "--batch_size=64", "--steps=3", "--warmup=1", "--repeats=2",
    "--disk_warmup=5", "--batches_ahead=1",
    "--dist=zipf", "--zipf=1.05", "--cache_fraction=0.1",
    "--disk_probe_mib=8", f"--disk_dir={tmp_path}", "--skip_keras",
    f"--json={tmp_path / 'd.json'}",
  ).stdout  # fmt: skip
  assert re.search(r"[\d,]+ random 4 KiB reads/s \(64 in flight\)", out), out
  assert re.search(r"cache 10% of each table \(300 rows", out), out
  assert re.search(r"in memory : [\d,]+ examples/s", out), out
  assert re.search(r"on disk   : [\d,]+ examples/s", out), out
  assert re.search(
    r"hit rate [\d.]+%; per step [\d,]+ misses \(an ideal cache: [\d,]+\)",
    out,
  ), out
  # The timed steps' batches go through data.prefetch_rows: their missed
  # rows are read ahead (the first batch's cannot be: no step before it).
  ahead = re.search(r"[\d,]+ row reads \((\d+)% read ahead\)", out)
  assert ahead and int(ahead[1]) > 0, out
  assert re.search(r"IO floor [\d,]+ examples/s .* on disk at \d+% of it", out)
  _check_measurements(_json(tmp_path / "d.json"), ["in memory", "on disk"], 2)


def _membench_json(tmp_path, dim, huge_pages=False):
  """Made-up membench rates: on its 1 GiB table 10M gathers and 2M Adagrad
  updates a second, on a 1 MiB one 40M gathers and 20M scatter-adds; with
  ``huge_pages``, also the same on huge pages at 1.5x those."""
  big, small = (1 << 30) // (4 * dim), (1 << 20) // (4 * dim)
  pages = {"4k": 1.0, "thp": 1.5} if huge_pages else {"4k": 1.0}
  rates = [
    {"impl": "c", "pages": kind, "threads": 2, "dim": dim, "dist": dist,
     "rows": rows, "bench": bench, "mrows": mrows * factor, **extra}
    for kind, factor in pages.items()
    for dist in ("uniform", "zipf")
    for rows, bench, mrows, extra in (
      (big, "gather", 10.0, {}), (big, "opt", 2.0, {"op": "adagrad"}),
      (small, "gather", 40.0, {}), (small, "scatter", 20.0, {}))
  ]  # fmt: skip
  membench = tmp_path / "m.json"
  membench.write_text(json.dumps({"results": rates}))
  return membench


def test_benchmark_sweeps_floor_and_plot(tmp_path):
  membench = _membench_json(tmp_path, 4)
  out = run_tool(
    "benchmark.py",
    "--tables=2", "--rows=300", "--dim=4", "--batch_size=32", "--steps=1",
    "--warmup=1", "--repeats=1", "--sweep=all", "--sweep_rows=100,400",
    "--sweep_tables=2", f"--membench={membench}",
    f"--plot={tmp_path / 'b.png'}", f"--json={tmp_path / 'b.json'}",
  ).stdout  # fmt: skip
  # uniform: 32 draws over 300 rows, 2 tables: U = 2 * 30.4 distinct rows;
  # N = 64 ids.
  unique = 2 * 300 * -np.expm1(32 * np.log1p(-1 / 300))
  floor = 32 / (unique / 10e6 + unique / 2e6 + 64 / 40e6 + 64 / 20e6)
  assert f"uniform                  memory floor {floor:,.0f} examples/s" in out
  assert "step time of tpu_embedding vs 100 rows" in out
  assert re.search(r"\s+400 rows: [\d.]+x   keras [\d.]+x", out), out
  assert (tmp_path / "b.png").stat().st_size > 10_000
  figures = _json(tmp_path / "b.json")["settings"]["figures"]
  assert [r["label"] for r in figures["rows"]] == ["100 rows", "400 rows"]
  assert [round(r["floor"]) for r in figures["dists"]][0] == round(floor)
  assert all(r["ours"] > 0 and r["keras"] > 0 for r in figures["dists"])


def test_the_floor_takes_huge_page_rates_where_membench_measured_them(
  tmp_path,
):
  floor = _load("benchmark.py")._floor
  huge = _membench_json(tmp_path, 4, huge_pages=True)
  both = floor.rates(str(huge), 4, "zipf")
  assert both == floor.Rates(15e6, 3e6, 60e6, 30e6, pages="thp")
  small = floor.rates(str(_membench_json(tmp_path, 4)), 4, "zipf")
  assert small == floor.Rates(10e6, 2e6, 40e6, 20e6, pages="4k")


def test_benchmark_multi_hot_mlperf_floor(tmp_path):
  # Sparse bags (made from the ragged ones), sharded over 2 replicas too.
  membench = _membench_json(tmp_path, 4)
  out = run_tool(
    "benchmark.py",
    "--multi_hot=mlperf", "--input=sparse", "--rows=300", "--dim=4",
    "--batch_size=16", "--steps=1", "--warmup=1", "--repeats=1",
    "--dist=uniform", "--replicas=1,2", f"--membench={membench}",
    f"--json={tmp_path / 'b.json'}",
  ).stdout  # fmt: skip
  assert "mlperf multi-hot (214 ids per example, sparse, sum)" in out, out
  assert re.search(r"2 replicas +: [\d,]+ examples/s", out), out
  hot = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100,
         27, 10, 3, 1, 1]  # fmt: skip
  unique = sum(300 * -np.expm1(16 * h * np.log1p(-1 / 300)) for h in hot)
  ids = 16 * 214
  floor = 16 / (unique / 10e6 + unique / 2e6 + ids / 40e6 + ids / 20e6)
  assert f"memory floor {floor:,.0f} examples/s" in out, out
  (base,) = _json(tmp_path / "b.json")["settings"]["figures"]["base"]
  assert base["floor"] == pytest.approx(floor)
  assert base["ours"] > 0 and base["keras"] > 0


@pytest.mark.parametrize(
  "content",
  ["[1, 2, 3]", '{"foo": 1}', "not json", '{"results": [1]}'],
  ids=["list", "no_results", "not_json", "results_not_measurements"],
)
def test_benchmark_names_a_membench_file_of_another_kind(
  content, tmp_path, capsys
):
  membench = tmp_path / "m.json"
  membench.write_text(content)
  failed = run_in_process(
    capsys, "benchmark.py", "--tables=1", "--rows=50", "--dim=4",
    f"--membench={membench}", returncode=1,
  )  # fmt: skip
  (line,) = failed.stderr.strip().splitlines()
  assert line.startswith(f"--membench: {membench} "), line
  assert line.endswith("expected the file membench.py --json writes."), line


@pytest.mark.parametrize(
  "tool, flag",
  [
    ("benchmark.py", "--replicas=1,x"),
    ("benchmark.py", "--replicas=0"),
    ("benchmark.py", "--sweep_rows=100,1e3"),
    ("benchmark.py", "--warmup=-1"),
    ("sharding_report.py", "--replicas=2,0"),
    ("quantized_export_report.py", "--batch_sizes=1,x"),
  ],
)
def test_tools_refuse_a_bad_number_before_any_work(tool, flag, capsys):
  name = flag.split("=")[0]
  bad = run_in_process(capsys, tool, flag, returncode=2)
  (line,) = bad.stderr.strip().splitlines()
  assert f"argument {name}: " in line and flag.split("=")[1] in line, line


def test_a_bad_replica_list_is_one_line_and_exit_2():
  # The command-line contract, in a process of its own.
  bad = run_tool("benchmark.py", "--replicas=1,x", returncode=2)
  assert "Traceback" not in bad.stderr
  assert (
    bad.stderr.strip()
    .splitlines()[-1]
    .startswith(
      "benchmark.py: argument --replicas: expected comma-separated "
      "integers >= 1 (e.g. 1,2,4), got '1,x'"
    )
  ), bad.stderr


def test_benchmark_floor_needs_the_cached_rates(tmp_path, capsys):
  membench = tmp_path / "m.json"
  membench.write_text(json.dumps({"results": [
    {"impl": "c", "pages": "4k", "threads": 2, "dim": 4, "dist": "uniform",
     "rows": 1 << 28, "bench": "gather", "mrows": 10.0}]}))  # fmt: skip
  # Refused before any timing (in this process: no device is configured).
  failed = run_in_process(
    capsys, "benchmark.py", "--tables=1", "--rows=50", "--dim=4",
    f"--membench={membench}", returncode=1,
  )  # fmt: skip
  (line,) = failed.stderr.strip().splitlines()
  assert "no cache-resident table at dim 4" in line
  assert "--extra 4:0.001" in line


@pytest.mark.parametrize("dense, control", [("xla", False), ("ops", True)])
def test_pipelining_benchmark(dense, control, tmp_path):
  out = run_tool(
    "pipelining_benchmark.py",
    f"--dense={dense}",
    "--tables=2", "--rows=500", "--dim=4", "--batch_size=32", "--hidden=8",
    "--layers=1", "--steps=4", "--steps_per_call=2", "--warmup=1",
    "--repeats=2", f"--json={tmp_path / 'p.json'}",
    *(["--control"] if control else []),
  ).stdout  # fmt: skip
  assert re.search(
    r"pipelined step +: [\d.]+ ms/step \(median of 2.*; cores busy [\d.]+$",
    out,
    re.MULTILINE,
  ), out
  # Timed in turn: the ratio is taken within each repeat.
  assert re.search(
    r"ratio \(unpipelined / pipelined\), per repeat: [\d.]+ x \(median of 2",
    out,
  ), out
  assert ("A/A control (unpipelined / unpipelined again)" in out) == control
  written = _json(tmp_path / "p.json")
  steps = ["unpipelined", "pipelined"] + ["unpipelined_again"] * control
  _check_measurements(
    written,
    ["embedding_part", "dense_part", "step_ratio_unpipelined_vs_pipelined"]
    + ["step_ratio_unpipelined_vs_again"] * control
    + [f"{step}_step" for step in steps]
    + [f"{step}_cores_busy" for step in steps],
    2,
  )
  measured = written["measurements"]
  for step in steps:
    # Processor time over wall time: above 0, at most every core (and a
    # little for the clocks' granularity).
    for busy in measured[f"{step}_cores_busy"]["values"]:
      assert 0 < busy <= os.cpu_count() + 0.5, (step, busy)
  for other, ratio in [
    ("pipelined", "step_ratio_unpipelined_vs_pipelined"),
    ("unpipelined_again", "step_ratio_unpipelined_vs_again"),
  ][: 1 + control]:
    pairs = zip(
      measured["unpipelined_step"]["values"],
      measured[f"{other}_step"]["values"],
      strict=True,
    )
    assert measured[ratio]["values"] == [u / p for u, p in pairs]


@pytest.mark.parametrize(
  "steps, per_call, where", [("4", "3", "subprocess"), ("4", "0", "process")]
)
def test_pipelining_benchmark_refuses_steps_it_cannot_time(
  steps, per_call, where, capsys
):
  flags = (f"--steps={steps}", f"--steps_per_call={per_call}")
  if where == "subprocess":  # the command-line contract: exit 2, the line
    bad = run_tool("pipelining_benchmark.py", *flags, returncode=2)
  else:
    bad = run_in_process(
      capsys, "pipelining_benchmark.py", *flags, returncode=2
    )
  assert "must be a multiple of --steps_per_call" in bad.stderr


def test_dynamic_benchmark(tmp_path):
  """Times both tables, then streams 128x each dynamic table's capacity in
  distinct keys (every key new, every step evicting): the process's
  resident memory once the tables are full bounds its peak over the rest
  of the stream within 5 % (some 30 MiB: memory kept per streamed key
  shows from about 15 bytes a key)."""
  rows, batch, steps = 8192, 8192, 128  # 2 tables: 2,097,152 keys
  out = run_tool(
    "dynamic_benchmark.py",
    "--tables=2", f"--rows={rows}", "--dim=4", f"--batch_size={batch}",
    "--key_space=5000", "--steps=2", "--warmup=1", "--repeats=2",
    f"--stream_keys={2 * batch * steps}", "--log_every=64",
    f"--json={tmp_path / 'd.json'}",
  ).stdout  # fmt: skip
  assert steps * batch >= 50 * rows
  assert re.search(r"step time, dynamic / fixed : [\d.]+ x \(median of 2", out)
  assert re.search(r"stream step 128/128: 2,097,152 distinct keys", out), out
  assert re.search(r"until 2,097,152 distinct keys: [\d,]+ MiB", out), out
  measurements = _json(tmp_path / "d.json")["measurements"]
  assert sorted(measurements) == [
    "dynamic_tables",
    "fixed_tables",
    "peak_resident_to_end",
    "resident_after_fill",
    "step_ratio_dynamic_vs_fixed",
  ]
  assert len(measurements["step_ratio_dynamic_vs_fixed"]["values"]) == 2
  filled = measurements["resident_after_fill"]["median"]
  end = measurements["peak_resident_to_end"]["median"]
  assert 0 < end <= 1.05 * filled, (end / filled, out)


def test_input_benchmark(tmp_path):
  out = run_tool(
    "input_benchmark.py",
    f"--params_override={TINY}", "--steps=2", "--warmup=1", "--repeats=2",
    f"--json={tmp_path / 'i.json'}",
  ).stdout  # fmt: skip
  assert "synthetic data, global batch 32" in out
  assert re.search(r"ratio input / training step \(medians\): [\d.]+x", out)
  result = _json(tmp_path / "i.json")
  assert result["settings"]["global_batch_size"] == 32
  _check_measurements(
    result, ["input_pipeline", "training_step", "training_on_pipeline"], 2
  )


def test_sharding_report_of_a_named_experiment(tmp_path, capsys):
  # Plans only (no TensorFlow devices): in this process; the last run, an
  # error, in a subprocess.
  out = run_in_process(
    capsys, "sharding_report.py", "--experiment=dlrm_criteo",
    "--replicas=1,8", "--table_stacking=none",
  ).stdout  # fmt: skip
  assert "experiment dlrm_criteo: 26 tables (187,767,399 rows), SGD" in out
  # Model Garden's threshold (50,000 rows) on 8 replicas: the biggest
  # table split in 8, the 3-row one replicated.
  assert re.search(
    r"embedding_table_00\s+row_sharded .* -\s+4,985,551 \(r0-r5\), "
    r"4,985,550 \(r6-r7\)\n",
    out,
  )
  assert re.search(r"embedding_table_05\s+replicated .* 3 \(r0-r7\)\n", out)
  assert "more than 50,000 rows are row-sharded" in out
  stacked = run_in_process(
    capsys, "sharding_report.py", "--tables=4", "--rows=100000",
    "--replicas=2",
    "--table_stacking=t0+t1+t2,t3", f"--json={tmp_path / 's.json'}",
  ).stdout  # fmt: skip
  assert "1 stack(s) hold 3 of the 4 tables" in stacked
  # The stack's 300,000 rows split in two: t0 on replica 0, t1 halved,
  # t2 on replica 1; each table's rows on each replica, as they are.
  assert re.search(
    r"t0\s+row_sharded\s+48\.83\s+stack_t0_t1_t2\s+100,000 \| 0\n", stacked
  ), stacked
  assert re.search(r"t1\s+row_sharded .* 50,000 \| 50,000\n", stacked)
  assert re.search(r"t2\s+row_sharded .* 0 \| 100,000\n", stacked)
  # --json: the same rows of each table on each replica.
  (plan,) = _json(tmp_path / "s.json")["plans"]
  rows = {t["table"]: t["rows_per_replica"] for t in plan["tables"]}
  assert {t: rows[t] for t in ("t0", "t1", "t2")} == {
    "t0": [100_000, 0],
    "t1": [50_000, 50_000],
    "t2": [0, 100_000],
  }
  bad = run_tool("sharding_report.py", "--experiment=dlrm", returncode=2)
  assert "Traceback" not in bad.stderr
  assert (
    bad.stderr.strip()
    .splitlines()[-1]
    .startswith("--experiment 'dlrm': not an experiment; one of dcn_criteo")
  )


def test_sharding_report_builds_and_measures():
  out = run_tool(
    "sharding_report.py", "--tables=3", "--rows=30000", "--dim=4",
    "--replicas=2", "--build",
  ).stdout  # fmt: skip
  assert "measured bytes per device: [" in out


def test_sharding_report_of_dynamic_tables():
  out = run_tool(
    "sharding_report.py", "--tables=2", "--rows=300", "--dim=4",
    "--replicas=2", "--dynamic", "--build", "--steps=6", "--batch_size=100",
  ).stdout  # fmt: skip
  # 300 rows: 3 * 300 int64 per table + the step and evictions.
  assert "2 dynamic table(s), capacity 600 rows (+1 default row each)" in out
  assert "vocabulary state at most 0.01 MiB per replica" in out
  assert "(0 sharded with their rows, 2 replicated)" in out
  found = re.findall(
    r"t\d: capacity 300, rows in use ([\d,]+) \([\d.]+%\), evictions (\d+)",
    out,
  )
  assert len(found) == 2, out
  for in_use, evictions in found:
    # 600 keys from 900 into 300 rows: full, and keys were evicted.
    assert int(in_use) == 300 and int(evictions) > 0


def test_sharding_report_of_sharded_vocabularies(capsys):
  """A row-sharded dynamic table's state is sharded with its rows: 30,000
  rows in 469 buckets of 64, 2 replicas: shards of 234 and 235 buckets
  (14,968 and 15,032 rows, 3 int64 each + step and evictions). Plans
  only: in this process."""
  args = ["--tables=2", "--rows=30000", "--dim=4", "--replicas=2", "--dynamic"]
  report = functools.partial(run_in_process, capsys, "sharding_report.py")
  sharded = report(*args, "--row_threshold=0").stdout
  whole = 8 * (3 * 30_000 + 2) * 2 / 2**20
  half = 8 * (3 * 15_032 + 2) * 2 / 2**20
  assert f"state at most {half:.2f} MiB per replica" in sharded
  assert "(2 sharded with their rows, 0 replicated)" in sharded
  replicated = report(*args, "--row_threshold=10000000")
  assert f"state at most {whole:.2f} MiB per replica" in replicated.stdout
  assert "(0 sharded with their rows, 2 replicated)" in replicated.stdout


@pytest.fixture(scope="module")
def ranking_run(tmp_path_factory):
  """A tiny ``model_garden.ranking.train`` run (its model_dir)."""
  model_dir = tmp_path_factory.mktemp("run")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  processes.run(
    [
      sys.executable, "-m", "model_garden.ranking.train",
      "--experiment=dcn_criteo_cpu_small", f"--model_dir={model_dir}",
      "--mode=train", "--seed=1",
      f"--params_override={TINY},trainer.train_steps=3,"
      "trainer.export_saved_model=false",
    ],
    check=True, capture_output=True, env=env, cwd=str(model_dir),
    timeout=300,
  )  # fmt: skip
  return model_dir


def test_export_a_ranking_run_from_its_model_dir_alone(ranking_run, tmp_path):
  export_dir = tmp_path / "serving" / "1"
  out = run_tool(
    "export.py", f"--model_dir={ranking_run}", f"--export_dir={export_dir}",
    f"--json={tmp_path / 'e.json'}",
  ).stdout  # fmt: skip
  assert f"SavedModel: {export_dir}" in out
  assert "input sparse_25: int64 [None]" in out
  written = _json(tmp_path / "e.json")
  assert written["export_dir"] == str(export_dir)
  assert written["inputs"]["sparse_25"] == {"dtype": "int64", "shape": [None]}
  # TensorFlow alone serves it; the trained model predicts the same.
  config = params_file.read_params(str(ranking_run))
  assert config.task.model.interaction == "cross"
  serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
  request = saved_model.example_request(config, batch_size=4)
  served = serve(**request)["predictions"].numpy()
  task = RankingTask(config, tf.distribute.get_strategy())
  task.checkpoint.restore(
    tf.train.latest_checkpoint(str(ranking_run))
  ).assert_existing_objects_matched()
  activations = task.embedding(
    {str(i): request[f"sparse_{i}"] for i in range(26)}
  )
  logits = task.model(
    {
      "dense_features": request["dense_features"],
      "embeddings": [activations[str(i)] for i in range(26)],
    }
  )
  np.testing.assert_allclose(served, tf.sigmoid(logits).numpy(), atol=1e-5)
  show = processes.run(
    [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli",
     "show", "--dir", str(export_dir), "--tag_set", "serve",
     "--signature_def", "serving_default"],
    capture_output=True, text=True, check=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
  ).stdout  # fmt: skip
  assert "inputs['dense_features']" in show
  assert "outputs['predictions']" in show


def test_export_errors_are_one_line(ranking_run, tmp_path, capsys):
  # A usage error (2) and a runtime one (1) as the user meets them, in a
  # subprocess (no traceback); the other refusals in this process.
  both = run_in_process(
    capsys, "export.py", f"--model_dir={ranking_run}", "--spec=x.py:build",
    f"--export_dir={tmp_path / 'a'}", returncode=2,
  )  # fmt: skip
  assert "either --model_dir" in _last_line(both)
  subset = run_in_process(
    capsys, "export.py", f"--model_dir={ranking_run}",
    "--tables=embedding_table_00", f"--export_dir={tmp_path / 'b'}",
    returncode=2,
  )  # fmt: skip
  assert "reads all of its tables" in _last_line(subset)
  missing = run_tool(
    "export.py", f"--model_dir={tmp_path}", f"--export_dir={tmp_path / 'c'}",
    returncode=1,
  )  # fmt: skip
  assert "params.yaml not found" in _last_line(missing)
  unknown = run_tool("export.py", "--export_dir=x", "--bogus", returncode=2)
  assert _last_line(unknown) == (
    "export.py: unrecognized arguments: --bogus; see --help"
  )
  (tmp_path / "file").write_text("x")
  into_a_file = run_in_process(
    capsys, "export.py", f"--model_dir={ranking_run}",
    f"--export_dir={tmp_path / 'file'}", returncode=1,
  )  # fmt: skip
  assert _last_line(into_a_file).startswith(
    f"--export_dir {tmp_path / 'file'} is a file, not a directory"
  )


def _last_line(process: subprocess.CompletedProcess) -> str:
  """stderr's last line; there is no traceback."""
  assert "Traceback" not in process.stderr, process.stderr
  return process.stderr.strip().splitlines()[-1]


def test_quickstart_example(tmp_path):
  out = run_script(
    "examples/quickstart.py", "--steps=40", "--log_every=20",
    f"--logdir={tmp_path}",
  ).stdout  # fmt: skip
  assert re.search(r"step +40/40  loss [\d.]+  train AUC", out), out
  assert 0.0 < float(re.search(r"held-out AUC: ([\d.]+)", out).group(1)) < 1
  assert "--log_every" in run_script("examples/quickstart.py", "--help").stdout
  assert glob.glob(
    str(tmp_path / "**" / "events.out.tfevents*"), recursive=True
  )


@pytest.mark.skipif(
  bool(tf.config.list_physical_devices("GPU")),
  reason="a GPU is visible: gpu_check.py runs its checks (minutes)",
)
def test_gpu_check_without_a_gpu_says_so_and_succeeds():
  process = run_tool("gpu_check.py")
  assert process.stdout.strip().splitlines() == ["no GPU visible to TensorFlow"]


def test_gpu_check_small_oracle_is_the_update_rule():
  """The oracle gpu_check.py falls back on (an installed copy without
  tests/oracle.py): one Adagrad step by hand."""
  module = _load("gpu_check.py")
  init = np.zeros((module.V, module.D))
  small = module.SmallOracle(init, "adagrad", 0.5)
  grads = np.zeros((2, module.D))
  grads[0, 0], grads[1, 0] = 3.0, 1.0
  small.step([[4, 4], [4]], grads)  # row 4: g = 3 + 3 + 1 = 7
  assert small.slots["accumulators"][4, 0] == 0.1 + 49.0
  np.testing.assert_allclose(small.params[4, 0], -0.5 * 7.0 / np.sqrt(49.1))
  assert not small.params[[0, 1, 2, 3, 5]].any()


def test_gpu_check_runs_its_checks_on_cpu_devices():
  """Its oracle cases and sharded check, on logical CPUs (no GPU here):
  the numbers agree, the sharded table is row-sharded and exact."""
  module = _load("gpu_check.py")
  oracle = module.oracle_cases(steps=2, device="/cpu:0")
  assert oracle["oracle"] == "tests/oracle.py"
  assert sorted(oracle["cases"]) == sorted(module.CASES)
  assert oracle["ok"], oracle
  sharded = module.sharded_check(steps=2, kind="CPU")
  assert sharded["ok"], sharded
  assert sharded["SGD"]["layout"] == "row_sharded"
  assert sharded["SGD"]["exact"] and sharded["Adagrad"]["exact"], sharded


def test_memory_report_fails_only_for_a_promised_phase_and_names_it():
  report = _load("memory_report.py")

  def row(phase, growth, checked=True):
    return report.Row(
      "default", "MWMS 2 workers", "worker1", phase, growth, 1.0,
      full_bytes=100, checked=checked,
    )  # fmt: skip

  # export promises nothing; nor does a 1-process job.
  shown_only = [
    row("train", 50), row("export", 90), row("save", 99, checked=False),
  ]  # fmt: skip
  assert report.over_promise(shown_only, 0.6) is None
  assert "OVER" not in report.format_table(shown_only, 0.6)
  line = report.over_promise([row("restore", 71), *shown_only], 0.6)
  assert line == (
    "memory_report: phase over the 0.6x promise: restore 0.71x "
    "(MWMS 2 workers worker1)"
  )
  # Restoring a 1-worker job's checkpoint into N workers is promised too.
  line = report.over_promise([row("restore 1->2", 62), *shown_only], 0.6)
  assert line == (
    "memory_report: phase over the 0.6x promise: restore 1->2 0.62x "
    "(MWMS 2 workers worker1)"
  )
