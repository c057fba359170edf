"""Plants known defects in a copy of the installed package; the tests must fail.

Each mutant is one exact edit (a file of the installed ``tpu_embedding`` or
``model_garden``, an original snippet that must occur there exactly once,
its replacement) and the test ids that must catch it: a realistic defect
in the numeric core (optimizer rules, the sparse update, the sharding
exchange, XLA's padding), checkpoints (delta rows, restores by rows) or
exports (quantization, versions from a delta). The installed packages are
copied to a temporary directory, put first on ``PYTHONPATH`` (the tests
import the installed package, ``conftest.py``, so they import the copy;
the kernel libraries come along); the unmutated copy must pass every
named test first, then each mutant is applied to the copy alone, its
tests run (``pytest -x``, one process, no workers), and the edit undone.
The source tree and the real install are never written.

A mutant whose tests pass *survived*: the suite no longer pins that
behaviour, exit 1 listing it. A snippet missing from the installed file
(or from this checkout's copy of it: a refactor moved the code) is an
error naming the mutant and the file, exit 1, before anything runs; so is
an unmutated copy that fails its tests. Mutants of the Python optimizer
rules that the C++ fused kernels also implement (SGD, Adagrad) run with
``TPU_EMBEDDING_KERNELS=0``, the TensorFlow path.

Run (from the checkout's root, after installing it; about 3 minutes on
2 cores):
  python3 tools/mutation_check.py
  python3 tools/mutation_check.py --only adam_velocity,step_record_order
  python3 tools/mutation_check.py --list
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

from model_garden import cli

#: The checkout this tool belongs to: the tests run from its root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The packages a mutant may edit (copied from where they are installed).
PACKAGES = ("tpu_embedding", "model_garden")
#: The TensorFlow path: the fused kernels do not run the Python rules.
NO_KERNELS = {"TPU_EMBEDDING_KERNELS": "0"}


class Mutant(NamedTuple):
  """One planted defect and the tests that must catch it.

  Attributes:
    name: how ``--only`` and the report call it.
    path: the file, relative to the installed packages' directory
      (``tpu_embedding/...`` or ``model_garden/...``).
    original: a snippet occurring exactly once in that file.
    replacement: what the defect puts in its place.
    tests: pytest ids (relative to the checkout's root) that must fail.
    env: extra environment of the test run (e.g. ``NO_KERNELS``).
    defect: what the edit breaks, in words.
  """

  name: str
  path: str
  original: str
  replacement: str
  tests: tuple[str, ...]
  env: tuple[tuple[str, str], ...] = ()
  defect: str = ""

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> Mutant:
    """A mutant from a ``--mutants`` file's entry (``env`` a dict)."""
    known = set(cls._fields)
    unknown = sorted(set(data) - known)
    if unknown:
      raise cli.UsageError(
        f"--mutants: unknown field {unknown[0]!r} in mutant "
        f"{data.get('name', '?')!r} (fields: {', '.join(sorted(known))})."
      )
    missing = [
      f
      for f in ("name", "path", "original", "replacement", "tests")
      if f not in data
    ]
    if missing:
      raise cli.UsageError(
        f"--mutants: mutant {data.get('name', '?')!r} has no {missing[0]!r}."
      )
    return cls(
      name=str(data["name"]),
      path=str(data["path"]),
      original=str(data["original"]),
      replacement=str(data["replacement"]),
      tests=tuple(data["tests"]),
      env=tuple(sorted(dict(data.get("env", {})).items())),
      defect=str(data.get("defect", "")),
    )


def _mutant(
  name: str,
  path: str,
  original: str,
  replacement: str,
  tests: Sequence[str],
  defect: str,
  env: dict[str, str] | None = None,
) -> Mutant:
  return Mutant(
    name,
    path,
    original,
    replacement,
    tuple(tests),
    tuple(sorted((env or {}).items())),
    defect,
  )


_ORACLE = (
  "tests/optimizers/test_optimizer_oracle.py::test_training_matches_oracle"
)
_DELTAS = "tests/checkpointing/test_delta_checkpoints.py"

#: The planted defects (a dozen and more), each with the tests that pin it.
MUTANTS: tuple[Mutant, ...] = (
  # --- the numeric core ---------------------------------------------------
  _mutant(
    "adagrad_accumulator",
    "tpu_embedding/optimizers/adagrad.py",
    "accumulators = slots.accumulators + tf.square(grads)",
    "accumulators = slots.accumulators + tf.abs(grads)",
    [f"{_ORACLE}[adagrad-dense-sum-nw]"],
    "Adagrad accumulates |g| instead of g^2 (the TensorFlow path)",
    NO_KERNELS,
  ),
  _mutant(
    "adam_velocity",
    "tpu_embedding/optimizers/adam.py",
    "1.0 - self.beta_2\n    ) * tf.square(grads)",
    "1.0 - self.beta_2\n    ) * grads",
    [f"{_ORACLE}[adam-dense-sum-nw]"],
    "Adam's second moment takes g instead of g^2",
  ),
  _mutant(
    "sparse_update_slots",
    "tpu_embedding/tables/updates.py",
    "_scatter(block[key], ids, value)",
    "_scatter(\n        block[key],\n        ids,\n"
    "        value if key == 'parameters' else tf.gather(block[key], ids),\n"
    "      )",
    [f"{_ORACLE}[adam-dense-sum-nw]"],
    "the sparse update writes the parameters but not the new slots",
  ),
  _mutant(
    "rounding_count_stuck",
    "tpu_embedding/tables/rounding.py",
    "return self._count.assign_add(1, read_value=False)",
    "return None",
    [
      "tests/tables/test_row_storage_training.py::"
      "test_each_step_is_the_float32_step_then_the_rounding[adagrad-bfloat16]"
    ],
    "a 16-bit block never counts its updates: every step draws the same "
    "stochastic rounding",
  ),
  _mutant(
    "fused_clip_assumed_symmetric",
    "tpu_embedding/kernels/fused_update.py",
    "clip_gradient_max=_bound(optimizer.clip_gradient_max, math.inf)",
    "clip_gradient_max=_bound(\n      optimizer.clip_gradient_max,\n"
    "      -_bound(optimizer.clip_gradient_min, -math.inf),\n    )",
    [
      "tests/kernels/test_kernels.py::test_one_bound_gradient_clipping_equals_the_"
      "tensorflow_path"
    ],
    "the fused kernels clip (c, None) to [c, -c], as if symmetric",
  ),
  _mutant(
    "exchange_replies_swapped",
    "tpu_embedding/backends/exchanges.py",
    "request.store.gather_block_lists(local, received, ops)",
    "request.store.gather_block_lists(local, received[::-1], ops)",
    [
      "tests/backends/test_sharded.py::test_sharded_training_equals_one_device[sgd-4]"
    ],
    "the all-to-all exchange answers each sender with another's rows",
  ),
  _mutant(
    "xla_truncated_padding",
    "tpu_embedding/inputs.py",
    "tf.where(keep, ids, tf.constant(PADDING_ID, tf.int64))",
    "tf.where(keep, ids, tf.constant(-1, tf.int64))",
    [
      "tests/kernels/test_xla.py::test_truncated_sequence_on_a_later_stack_member_"
      "moves_no_other_row"
    ],
    "XLA pads truncated sequence ids with -1: a stack member after the "
    "first writes the row before its own",
  ),
  _mutant(
    "step_record_order",
    "tpu_embedding/tables/step_record.py",
    "updates=tf.maximum(last, step_id)[None]",
    "updates=step_id[None]",
    [
      "tests/backends/test_parameter_server.py::test_out_of_order_steps_in_one_slot_"
      "each_land_once"
    ],
    "a late older step overwrites its slot: the newer step's re-run lands "
    "twice",
  ),
  _mutant(
    "vocabulary_lru_order",
    "tpu_embedding/vocabularies/transition.py",
    '[last_key, count_key]\n    if vocabulary.eviction == "lru"',
    '[-last_key, count_key]\n    if vocabulary.eviction == "lru"',
    [
      "tests/vocabularies/test_vocabulary.py::test_sharded_state_steps_match_the_oracle"
      "[tf_ops-1-lru-None-2]"
    ],
    "LRU evicts the most recently used row (sharded state, min_count 1)",
  ),
  # --- checkpoints ---------------------------------------------------------
  _mutant(
    "delta_dense_adam_rows",
    "tpu_embedding/tables/base.py",
    "return [*writes, changes.mark_all()]",
    "return [*writes, changes.mark(rows, ops)]",
    [
      f"{_DELTAS}::test_deltas_of_an_optimizer_updating_every_row_restore_"
      "every_row[one_device-1]"
    ],
    "deltas of Adam(lazy_adam=False) hold the looked-up rows only",
  ),
  _mutant(
    "delta_single_row",
    "tpu_embedding/checkpointing/deltas.py",
    "if rows is not None and rows[0].size:",
    "if rows is not None and rows[0].size > 1:",
    [f"{_DELTAS}::test_a_delta_of_exactly_one_row_restores_it"],
    "a restore skips a table whose delta holds exactly one row",
  ),
  _mutant(
    "bad_record_policy_per_split",
    "model_garden/ranking/inputs.py",
    "policy = getattr(self.task, split).on_bad_record",
    "policy = self.task.train_data.on_bad_record",
    [
      "tests/model_garden/test_bad_records.py::test_each_split_follows_its_"
      "own_policy"
    ],
    "the trainer applies train_data's on_bad_record to validation_data too",
  ),
  _mutant(
    "saved_rows_byte_offset",
    "tpu_embedding/checkpointing/rows.py",
    "offset = piece.entry.offset + (first - piece.first) * width",
    "offset = piece.entry.offset + first * width",
    [
      "tests/checkpointing/test_saved_rows.py::test_every_part_read_holds_the_saved_rows"
    ],
    "a restore by rows' bytes forgets where the saved piece starts",
  ),
  # --- exports -------------------------------------------------------------
  _mutant(
    "int8_offset",
    "tpu_embedding/export/quantize.py",
    "values = tf.cast(steps - 128.0, tf.int8)",
    "values = tf.cast(steps - 127.0, tf.int8)",
    [
      "tests/export/test_apply_delta.py::test_a_delta_of_exactly_one_changed_row[int8]"
    ],
    "int8 values stored one step off their offset",
  ),
  _mutant(
    "quantize_non_finite",
    "tpu_embedding/export/quantize.py",
    "if not np.isfinite(largest):",
    "if dtype == 'float16' and not np.isfinite(largest):",
    [
      "tests/export/test_quantized_export.py::test_tables_holding_nan_or_inf_are_"
      "refused_by_name"
    ],
    "int8 and bfloat16 exports of a table holding nan or inf go through",
  ),
  _mutant(
    "apply_delta_single_row",
    "tpu_embedding/export/from_delta.py",
    "if found is None or not found[0].size:",
    "if found is None or found[0].size < 2:",
    [
      "tests/export/test_apply_delta.py::test_a_delta_of_exactly_one_changed_row"
      "[float32]"
    ],
    "a version from a delta keeps the old row of a table that changed in "
    "exactly one row",
  ),
  _mutant(
    "apply_delta_rows_past_the_end",
    "tpu_embedding/export/from_delta.py",
    "if ids.min() < 0 or ids.max() >= rows:",
    "if ids.min() < 0 or ids.max() > rows:",
    [
      "tests/export/test_apply_delta.py::test_a_delta_of_another_model_is_refused_"
      "and_nothing_written"
    ],
    "a delta writing row N of an N-row table is applied",
  ),
)


def _installed(package: str) -> str:
  """The directory of the installed ``package`` (not this checkout's)."""
  saved = list(sys.path)
  sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
  try:
    spec = importlib.util.find_spec(package)
  finally:
    sys.path[:] = saved
  if spec is None or not spec.submodule_search_locations:
    raise cli.FixableError(
      f"{package} is not installed: install the checkout first "
      "(python3 -m pip install .)."
    )
  return os.path.dirname(list(spec.submodule_search_locations)[0])


def _count(path: str, snippet: str) -> int | None:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read().count(snippet)
  except FileNotFoundError:
    return None


def check_snippets(mutants: Sequence[Mutant], site: str) -> None:
  """Each original snippet occurs exactly once in the installed file and
  in this checkout's copy of it (where the checkout has it).

  Raises:
    FixableError: naming the first mutant and file that fails.
  """
  for mutant in mutants:
    for where, base in (("installed", site), ("checkout", ROOT)):
      path = os.path.join(base, mutant.path)
      found = _count(path, mutant.original)
      if found is None and where == "checkout":
        continue  # installed from elsewhere: the installed file decides
      if found != 1:
        what = (
          "does not exist"
          if found is None
          else f"holds its snippet {found} times, not once"
        )
        raise cli.FixableError(
          f"Mutant {mutant.name!r}: {where} file {path} {what} (snippet "
          f"{mutant.original.splitlines()[0]!r}); update the mutant in "
          "tools/mutation_check.py to the code as it is now."
        )


def installed_site() -> str:
  """The directory the packages are installed in (one for both)."""
  sites = {_installed(p) for p in PACKAGES}
  if len(sites) != 1:
    raise cli.FixableError(
      f"{' and '.join(PACKAGES)} are installed in different places "
      f"({', '.join(sorted(sites))}); install this checkout."
    )
  return sites.pop()


def _copy_packages(target: str) -> str:
  """Copies the installed packages into ``target``; returns their site."""
  site = installed_site()
  for package in PACKAGES:
    shutil.copytree(
      os.path.join(site, package),
      os.path.join(target, package),
      ignore=shutil.ignore_patterns("__pycache__"),
    )
  return site


class Outcome(NamedTuple):
  """How one run of tests ended."""

  name: str
  status: str  # "killed", "survived", "passed" (baseline), "error"
  seconds: float
  detail: str = ""


def run_tests(
  copy: str, tests: Sequence[str], env: dict[str, str], timeout: float
) -> tuple[int, str]:
  """``(pytest's exit code, its output)`` for ``tests`` on the packages in
  ``copy``."""
  path = os.environ.get("PYTHONPATH", "")
  command = [
    sys.executable,
    "-m",
    "pytest",
    "-x",
    "-q",
    "-n",
    "0",
    "-p",
    "no:cacheprovider",
    "--durations=0",
    "--no-header",
    *tests,
  ]
  try:
    process = subprocess.run(
      command,
      cwd=ROOT,
      env={
        # (not an outer pytest's worker settings)
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        "PYTHONPATH": os.pathsep.join(filter(None, [copy, path])),
        "PYTHONDONTWRITEBYTECODE": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        **env,
      },
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return -1, f"timed out after {timeout:g} s"
  # All of it: under CI=true the suite's own lines may follow pytest's
  # summary (the FAILED lines _failed_tests reads).
  return process.returncode, (process.stdout + process.stderr).strip()


def _failed_tests(output: str) -> str:
  lines = [
    line.split(" ", 2)[1]
    for line in output.splitlines()
    if line.startswith(("FAILED ", "ERROR "))
  ]
  return ", ".join(lines)


def _baseline(
  copy: str, mutants: Sequence[Mutant], timeout: float, say: Callable
) -> None:
  """The unmutated copy passes every named test (one run per env)."""
  by_env: dict[tuple[tuple[str, str], ...], list[str]] = {}
  for mutant in mutants:
    tests = by_env.setdefault(mutant.env, [])
    tests += [t for t in mutant.tests if t not in tests]
  for env, tests in by_env.items():
    start = time.perf_counter()
    code, output = run_tests(copy, tests, dict(env), timeout)
    seconds = time.perf_counter() - start
    label = " ".join(f"{k}={v}" for k, v in env) or "default env"
    if code != 0:
      raise cli.FixableError(
        f"The unmutated package fails its mutants' tests ({label}; pytest "
        f"exit {code}: {_failed_tests(output) or output.splitlines()[-1]}): "
        "fix the suite before checking mutants."
      )
    say(f"baseline  {len(tests)} tests pass ({label}), {seconds:.0f} s")


def apply(copy: str, mutant: Mutant) -> str:
  """Plants ``mutant`` in ``copy``; returns the file's original text."""
  path = os.path.join(copy, mutant.path)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  with open(path, "w", encoding="utf-8") as f:
    f.write(text.replace(mutant.original, mutant.replacement, 1))
  return text


def check_mutant(copy: str, mutant: Mutant, timeout: float) -> Outcome:
  """Runs ``mutant``'s tests with the defect planted in ``copy``."""
  original = apply(copy, mutant)
  start = time.perf_counter()
  try:
    code, output = run_tests(copy, mutant.tests, dict(mutant.env), timeout)
  finally:
    with open(os.path.join(copy, mutant.path), "w", encoding="utf-8") as f:
      f.write(original)
  seconds = time.perf_counter() - start
  if code == 0:
    return Outcome(mutant.name, "survived", seconds)
  if code == 1:
    return Outcome(mutant.name, "killed", seconds, _failed_tests(output))
  last = output.splitlines()[-1] if output else ""
  return Outcome(
    mutant.name, "error", seconds, f"pytest exit {code}: {last}".strip()
  )


def load_mutants(path: str) -> tuple[Mutant, ...]:
  """The mutants of a JSON file (a list of ``Mutant`` fields)."""
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as error:
      raise cli.UsageError(f"--mutants {path}: not JSON ({error}).") from None
  if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
    raise cli.UsageError(f"--mutants {path}: expected a list of objects.")
  return tuple(Mutant.from_dict(d) for d in data)


def select(mutants: Sequence[Mutant], only: str | None) -> list[Mutant]:
  """The mutants named by ``--only`` (comma-separated), or all."""
  if not only:
    return list(mutants)
  by_name = {m.name: m for m in mutants}
  names = [n.strip() for n in only.split(",") if n.strip()]
  unknown = [n for n in names if n not in by_name]
  if unknown:
    raise cli.UsageError(
      f"--only: no mutant {unknown[0]!r} (known: {', '.join(by_name)})."
    )
  return [by_name[n] for n in names]


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--only",
    default=None,
    help="comma-separated mutant names to check (default: all; --list "
    "names them)",
  )
  parser.add_argument(
    "--list",
    action="store_true",
    help="check that every snippet is still in the installed files, list "
    "the mutants and exit",
  )
  parser.add_argument(
    "--mutants",
    default=None,
    help="a JSON file of mutants (a list of objects with name, path, "
    "original, replacement, tests, and optionally env and defect) to "
    "check instead of the built-in ones",
  )
  parser.add_argument(
    "--timeout",
    type=cli.positive_int,
    default=600,
    help="seconds one pytest run may take",
  )
  parser.add_argument(
    "--json", default=None, help="also write the report to this file"
  )
  return parser


def check(args: argparse.Namespace) -> int:
  mutants = load_mutants(args.mutants) if args.mutants else MUTANTS
  names = [m.name for m in mutants]
  if len(set(names)) != len(names):
    raise cli.UsageError("mutant names must be unique.")
  chosen = select(mutants, args.only)
  if args.list:  # (the snippets checked: a stale mutant fails here too)
    check_snippets(chosen, installed_site())
    for m in chosen:
      print(f"{m.name}: {m.path}: {m.defect}")
    return 0
  start = time.perf_counter()
  outcomes: list[Outcome] = []
  with tempfile.TemporaryDirectory(prefix="mutation_check_") as copy:
    site = _copy_packages(copy)
    check_snippets(chosen, site)
    print(f"mutation check: {len(chosen)} mutants of {site}", flush=True)
    _baseline(copy, chosen, args.timeout, lambda s: print(s, flush=True))
    for mutant in chosen:
      outcome = check_mutant(copy, mutant, args.timeout)
      outcomes.append(outcome)
      detail = f": {outcome.detail}" if outcome.detail else ""
      print(
        f"{outcome.status:9} {mutant.name} ({outcome.seconds:.0f} s){detail}",
        flush=True,
      )
  seconds = time.perf_counter() - start
  bad = [o for o in outcomes if o.status != "killed"]
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(
        {
          "seconds": round(seconds, 1),
          "mutants": [o._asdict() for o in outcomes],
          "killed": sum(o.status == "killed" for o in outcomes),
          "survived": [o.name for o in outcomes if o.status == "survived"],
          "errors": [o.name for o in outcomes if o.status == "error"],
        },
        f,
        indent=1,
      )
  killed = len(outcomes) - len(bad)
  print(f"{killed} of {len(outcomes)} mutants killed in {seconds:.0f} s")
  if bad:
    listed = "; ".join(
      f"{o.name} {o.status}" + (f" ({o.detail})" if o.status == "error" else "")
      for o in bad
    )
    raise cli.FixableError(
      f"Mutants not caught by their tests: {listed}. Pin those behaviours "
      "with a test (or fix the mutant's test ids)."
    )
  return 0


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  return int(cli.run(lambda: check(args)))


if __name__ == "__main__":
  cli.quiet_tensorflow()
  sys.exit(main())
