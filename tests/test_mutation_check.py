"""``tools/mutation_check.py``: planted defects must be caught by the suite.

The built-in mutants' snippets must all be in the installed files (a
refactor that moves the code fails here, in a normal suite run, not only
when the check runs). Two mutants are checked for real (the unmutated
copy first, then each mutant's tests, killed); a harmless "mutant" (a
comment added: the behaviour unchanged) given beside a real one by a
``--mutants`` file is reported as surviving, exit 1, naming it; a snippet
that is not there is one line naming the mutant and the file, before any
test runs; an unknown ``--only`` name is a usage line.
"""

from __future__ import annotations

import importlib.util
import json
import os

from tests.scripts import ROOT
from tests.scripts import run_tool


def _tool():
  spec = importlib.util.spec_from_file_location(
    "mutation_check_tool", os.path.join(ROOT, "tools", "mutation_check.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


#: A real defect and its test: a late older step id overwrites the ring.
STEP_RECORD = {
  "name": "step_record_order",
  "path": "tpu_embedding/tables/step_record.py",
  "original": "updates=tf.maximum(last, step_id)[None]",
  "replacement": "updates=step_id[None]",
  "tests": [
    "tests/backends/test_parameter_server.py::test_out_of_order_steps_in_one_slot_"
    "each_land_once[whole]"
  ],
}
#: The same file with a comment added: nothing changes, it must survive.
HARMLESS = {
  "name": "harmless_comment",
  "path": "tpu_embedding/tables/step_record.py",
  "original": "SLOTS = 8192\n",
  "replacement": "SLOTS = 8192  # (a comment: the same program)\n",
  "tests": STEP_RECORD["tests"],
  "defect": "none: a comment",
}


def test_every_built_in_mutant_names_code_that_is_there():
  tool = _tool()
  assert len(tool.MUTANTS) >= 12
  assert len({m.name for m in tool.MUTANTS}) == len(tool.MUTANTS)
  areas = {m.path.split("/")[1] for m in tool.MUTANTS}
  assert {"optimizers", "tables", "backends", "export"} <= areas
  assert {m.path for m in tool.MUTANTS} >= {
    "tpu_embedding/checkpointing/deltas.py",
    "tpu_embedding/checkpointing/rows.py",
    "tpu_embedding/export/quantize.py",
    "tpu_embedding/export/from_delta.py",
  }
  for mutant in tool.MUTANTS:
    assert mutant.original != mutant.replacement, mutant.name
    assert mutant.tests and all(t.startswith("tests/") for t in mutant.tests)
  out = run_tool("mutation_check.py", "--list").stdout
  assert [line.split(":")[0] for line in out.splitlines()] == [
    m.name for m in tool.MUTANTS
  ]


def test_two_mutants_are_killed(tmp_path):
  report = tmp_path / "report.json"
  process = run_tool(
    "mutation_check.py",
    "--only",
    "step_record_order,quantize_non_finite",
    "--json",
    str(report),
    timeout=600,
  )
  assert "baseline  2 tests pass" in process.stdout, process.stdout
  assert "2 of 2 mutants killed" in process.stdout
  data = json.loads(report.read_text())
  assert [m["name"] for m in data["mutants"]] == [
    "step_record_order",
    "quantize_non_finite",
  ]
  assert {m["status"] for m in data["mutants"]} == {"killed"}
  assert "test_out_of_order_steps" in data["mutants"][0]["detail"]
  assert data["survived"] == [] and data["errors"] == []


def test_a_harmless_mutant_survives_and_fails_the_check(tmp_path):
  mutants = tmp_path / "mutants.json"
  mutants.write_text(json.dumps([STEP_RECORD, HARMLESS]))
  report = tmp_path / "report.json"
  process = run_tool(
    "mutation_check.py",
    "--mutants",
    str(mutants),
    "--json",
    str(report),
    returncode=1,
    timeout=600,
  )
  assert "killed    step_record_order" in process.stdout, process.stdout
  assert "survived  harmless_comment" in process.stdout
  assert "1 of 2 mutants killed" in process.stdout
  last = process.stderr.strip().splitlines()[-1]
  assert "harmless_comment survived" in last
  assert "step_record_order" not in last
  assert "Traceback" not in process.stderr
  assert json.loads(report.read_text())["survived"] == ["harmless_comment"]


def test_a_missing_snippet_names_the_mutant_and_file(tmp_path):
  mutants = tmp_path / "mutants.json"
  gone = dict(STEP_RECORD, name="moved_code", original="no_such_code(")
  mutants.write_text(json.dumps([gone]))
  process = run_tool(
    "mutation_check.py", "--mutants", str(mutants), returncode=1
  )
  lines = process.stderr.strip().splitlines()
  assert len(lines) == 1, process.stderr
  assert "'moved_code'" in lines[0]
  assert "tpu_embedding/tables/step_record.py" in lines[0]
  assert "baseline" not in process.stdout  # nothing ran


def test_an_unknown_mutant_is_a_usage_error():
  process = run_tool(
    "mutation_check.py", "--only", "no_such_mutant", returncode=2
  )
  lines = process.stderr.strip().splitlines()
  assert len(lines) == 1 and "'no_such_mutant'" in lines[0]
  assert lines[0].endswith("see --help")
