"""Checks on the GPUs TensorFlow sees: oracle cases, sharding, step timing.

Off TPU most people train on GPUs, where this package's C++ kernels (CPU
kernels) must never serve: a table on a GPU takes TensorFlow's ops
(``kernels/ops.select_ops``). On a machine with GPUs this tool runs, and
prints as one JSON summary:

* ``oracle``: the optimizers' updates on a table on GPU 0 against a numpy
  oracle (``tests/oracle.py`` of this checkout where it is there, else a
  small SGD/Adagrad one inside this tool), and which ops served;
* ``sharded``: a table row-sharded over 2 replicas (``MirroredStrategy``
  over 2 GPUs, or 2 logical GPUs of one) against the same training on one
  GPU, value by value;
* ``benchmark``: ``tools/benchmark.py``'s step timing, on small sizes.

Without a GPU it prints ``no GPU visible to TensorFlow`` and exits 0. The
exit code is 1 when a check fails.

Run:
  python3 tools/gpu_check.py
  python3 tools/gpu_check.py --steps 5 --benchmark_rows 100000 --json o.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

if importlib.util.find_spec("tensorflow") is None:
  sys.exit(
    f"gpu_check: TensorFlow is not installed for {sys.executable}; a GPU check "
    "needs TensorFlow's CUDA build: pip install 'tensorflow[and-cuda]' ."
  )

from model_garden import cli  # noqa: E402

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402

NO_GPU = "no GPU visible to TensorFlow"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
V, D, B = 64, 8, 16
RTOL = ATOL = 1e-5

#: The oracle cases: ``tpe`` class, TF-style keyword arguments.
CASES = {
  "sgd": ("SGD", {"learning_rate": 0.3}),
  "sgd_clip_decay": (
    "SGD",
    {
      "learning_rate": 0.3,
      "clipvalue": (-0.5, 0.25),
      "weight_decay_factor": 0.1,
      "clip_weight_min": -0.6,
      "clip_weight_max": 0.7,
    },
  ),
  "adagrad": ("Adagrad", {"learning_rate": 0.3}),
  "adagrad_momentum": (
    "AdagradMomentum",
    {"learning_rate": 0.1, "momentum": 0.9},
  ),
  "adam": ("Adam", {"learning_rate": 0.1}),
  "ftrl": ("FTRL", {"learning_rate": 0.1}),
}
_ORACLE_NAMES = {
  "SGD": "sgd",
  "Adagrad": "adagrad",
  "AdagradMomentum": "adagrad_momentum",
  "Adam": "adam",
  "FTRL": "ftrl",
}


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--steps",
    type=cli.positive_int,
    default=3,
    help="Training steps of each check.",
  )
  parser.add_argument(
    "--benchmark_rows",
    type=int,
    default=50_000,
    help="Rows of each benchmark table (0: no benchmark).",
  )
  parser.add_argument(
    "--benchmark_steps",
    type=cli.positive_int,
    default=10,
    help="Timed benchmark steps per repeat.",
  )
  parser.add_argument(
    "--json", default=None, help="Also write the summary to this file."
  )
  return parser


# --- the numpy oracle --------------------------------------------------------


def load_oracle() -> Any:
  """``tests/oracle.py`` of this checkout, or None (an installed copy)."""
  path = os.path.join(ROOT, "tests", "oracle.py")
  if not os.path.exists(path):
    return None
  name = "tpu_embedding_gpu_check_oracle"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # Its dataclasses look their module up.
  spec.loader.exec_module(module)
  return module


class SmallOracle:
  """SGD and Adagrad (no clipping or decay) with the sum combiner, in
  float64: ``w -= lr g``; ``a += g**2, w -= lr g / sqrt(a)``, ``g`` the
  row's gradient summed over its occurrences."""

  def __init__(self, init: np.ndarray, name: str, learning_rate: float):
    if name not in ("sgd", "adagrad"):
      raise ValueError(f"The small oracle has no {name!r}.")
    self.params = np.array(init, np.float64)
    self.name, self.lr = name, learning_rate
    self.slots: dict[str, np.ndarray] = {}
    if name == "adagrad":
      self.slots["accumulators"] = np.full(self.params.shape, 0.1)

  def step(self, ids: list[list[int]], output_grads: np.ndarray) -> None:
    total: dict[int, np.ndarray] = {}
    for sample, row_ids in enumerate(ids):
      for i in row_ids:
        total[i] = total.get(i, 0.0) + output_grads[sample]
    for i, g in total.items():
      if self.name == "adagrad":
        self.slots["accumulators"][i] += g * g
        g = g / np.sqrt(self.slots["accumulators"][i])
      self.params[i] -= self.lr * g


def _batches(rng: np.random.Generator, steps: int) -> list[list[list[int]]]:
  """Per step, per sample, ids with repeats (and an empty sample)."""
  hot = rng.integers(0, V, 5)
  batches = []
  for _ in range(steps):
    ids = [list(rng.choice(hot, rng.integers(0, 4))) for _ in range(B)]
    ids[0] = []
    batches.append([[int(i) for i in row] for row in ids])
  return batches


def _train(
  emb: tpe.TPUEmbedding, batches: list, grads: list[np.ndarray]
) -> None:
  """Steps with output gradients ``grads`` (loss ``sum(acts * r)``)."""

  @tf.function
  def step(features, r):
    emb.enqueue({"f": features}, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["f"] * r)
    emb.apply_gradients(tape.gradient(loss, acts))

  for ids, r in zip(batches, grads, strict=True):
    step(tf.ragged.constant(ids, tf.int64, ragged_rank=1), tf.constant(r))


def _embedding(init: np.ndarray, optimizer: Any, **kwargs) -> Any:
  table = tpe.TableConfig(
    V,
    D,
    initializer=tf.constant_initializer(init),
    combiner="sum",
    name="t",
  )
  return tpe.TPUEmbedding({"f": tpe.FeatureConfig(table)}, optimizer, **kwargs)


def _max_diff(got: Any, want: np.ndarray) -> float:
  got = np.asarray(tf.convert_to_tensor(got), np.float64)
  return float(np.max(np.abs(got - want))) if want.size else 0.0


def _kernels_wrong(kernels: bool, device: str) -> bool:
  """Whether this package's CPU kernels served a table on a GPU."""
  return kernels and "GPU" in device.upper()


def oracle_case(
  name: str, oracle: Any, steps: int, device: str = "/gpu:0"
) -> dict[str, Any]:
  """One optimizer on a table on ``device`` against the numpy oracle."""
  cls, kwargs = CASES[name]
  rng = np.random.default_rng(7)
  init = rng.uniform(-1, 1, (V, D)).astype(np.float32)
  batches = _batches(rng, steps)
  grads = [rng.normal(size=(B, D)).astype(np.float32) for _ in batches]
  with tf.device(device):
    emb = _embedding(init, getattr(tpe, cls)(**kwargs))
    emb.build()
  if oracle is not None:
    ref = oracle.Table(
      init, oracle.Optimizer.create(_ORACLE_NAMES[cls], **kwargs)
    )
    for ids, r in zip(batches, grads, strict=True):
      ref.step([{"ids": ids, "combiner": "sum"}], lambda _, r=r: [r])
    want_slots = ref.slots
  else:
    ref = SmallOracle(init, _ORACLE_NAMES[cls], kwargs["learning_rate"])
    for ids, r in zip(batches, grads, strict=True):
      ref.step(ids, r)
    want_slots = ref.slots
  _train(emb, batches, grads)
  variables = emb.variables["t"]
  diffs = {"parameters": _max_diff(variables["parameters"], ref.params)}
  for slot, want in want_slots.items():
    diffs[slot] = _max_diff(variables[slot], want)
  ops = emb.engine.step_ops
  close = all(
    np.allclose(
      np.asarray(tf.convert_to_tensor(variables[key])),
      want,
      rtol=RTOL,
      atol=ATOL,
    )
    for key, want in [("parameters", ref.params), *want_slots.items()]
  )
  placed = variables["parameters"].device
  return {
    "device": placed,
    "kernels": ops.kernels,
    "max_abs_diff": diffs,
    "ok": close and not _kernels_wrong(ops.kernels, placed),
  }


def oracle_cases(steps: int, device: str = "/gpu:0") -> dict[str, Any]:
  oracle = load_oracle()
  names = sorted(CASES) if oracle is not None else ["adagrad", "sgd"]
  cases = {name: oracle_case(name, oracle, steps, device) for name in names}
  return {
    "oracle": "tests/oracle.py" if oracle is not None else "small",
    "cases": cases,
    "ok": all(c["ok"] for c in cases.values()),
  }


# --- 2 replicas against one device -------------------------------------------


def _train_sharded(
  emb: Any, strategy: Any, batches: list, grads: list[np.ndarray]
) -> None:
  """``_train`` with each replica given its half of every global batch."""
  half = B // 2

  @tf.function
  def step(features, r):
    emb.enqueue(
      strategy.experimental_distribute_values_from_function(
        lambda ctx: {
          "f": features[
            ctx.replica_id_in_sync_group * half : (
              ctx.replica_id_in_sync_group + 1
            )
            * half
          ]
        }
      ),
      training=True,
    )

    def replica_fn():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      with tf.GradientTape() as tape:
        acts = emb.dequeue()
        tape.watch(acts)
        mine = r[replica * half : (replica + 1) * half]
        loss = tf.reduce_sum(acts["f"] * mine)
      emb.apply_gradients(tape.gradient(loss, acts))

    strategy.run(replica_fn)

  for ids, r in zip(batches, grads, strict=True):
    step(tf.ragged.constant(ids, tf.int64, ragged_rank=1), tf.constant(r))


def sharded_check(steps: int, kind: str = "GPU") -> dict[str, Any]:
  """A table row-sharded over 2 replicas (the first two logical devices
  of ``kind``) equals the same training on the first one alone."""
  gpus = tf.config.list_logical_devices(kind)
  rng = np.random.default_rng(11)
  init = rng.uniform(-1, 1, (V, D)).astype(np.float32)
  batches = _batches(rng, steps)
  grads = [rng.normal(size=(B, D)).astype(np.float32) for _ in batches]
  results: dict[str, Any] = {"devices": [d.name for d in gpus[:2]]}
  ok = True
  for name in ("SGD", "Adagrad"):
    with tf.device(gpus[0].name):
      one = _embedding(init, getattr(tpe, name)(0.2))
      one.build()
    _train(one, batches, grads)
    strategy = tf.distribute.MirroredStrategy(
      [d.name for d in gpus[:2]],
      cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    with strategy.scope():
      sharded = _embedding(
        init, getattr(tpe, name)(0.2), row_sharding_threshold=1
      )
      sharded.build()
    _train_sharded(sharded, strategy, batches, grads)
    placement = sharded.engine.sharding_plan.placements["t"]
    diffs, exact = {}, True
    for key, variable in one.variables["t"].items():
      want = np.asarray(tf.convert_to_tensor(variable))
      got = np.asarray(tf.convert_to_tensor(sharded.variables["t"][key]))
      diffs[key] = float(np.max(np.abs(got - want)))
      exact = exact and np.array_equal(got, want)
    kernels = one.engine.step_ops.kernels or sharded.engine.step_ops.kernels
    close = all(d <= ATOL for d in diffs.values())
    wrong = _kernels_wrong(kernels, gpus[0].name)
    results[name] = {
      "layout": placement.kind,
      "exact": exact,
      "max_abs_diff": diffs,
      "kernels": kernels,
      "ok": close and placement.sharded and not wrong,
    }
    ok = ok and results[name]["ok"]
  results["ok"] = ok
  return results


# --- the benchmark ------------------------------------------------------------


def benchmark(rows: int, steps: int) -> dict[str, Any]:
  """``tools/benchmark.py`` on small sizes, in its own process (before
  this one takes the GPUs' memory)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "benchmark.json")
    command = [
      sys.executable,
      os.path.join(HERE, "benchmark.py"),
      f"--rows={rows}",
      "--tables=8",
      "--batch_size=2048",
      f"--steps={steps}",
      "--warmup=2",
      "--repeats=3",
      f"--json={out}",
    ]
    process = subprocess.run(
      command, capture_output=True, text=True, check=False, cwd=tmp
    )
    if process.returncode != 0:
      return {
        "ok": False,
        "returncode": process.returncode,
        "stderr": process.stderr[-2000:],
      }
    with open(out) as f:
      written = json.load(f)
  return {"ok": True, "output": process.stdout.splitlines(), "json": written}


# --- main ---------------------------------------------------------------------


def _two_replicas(gpus: list) -> None:
  """Two GPU replicas: the first two GPUs, or one GPU split in two."""
  if len(gpus) >= 2:
    for gpu in gpus:
      tf.config.experimental.set_memory_growth(gpu, True)
    return
  tf.config.set_logical_device_configuration(
    gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=4096)] * 2
  )


def run(args: argparse.Namespace) -> dict[str, Any]:
  gpus = tf.config.list_physical_devices("GPU")
  summary: dict[str, Any] = {
    "gpus": [gpu.name for gpu in gpus],
    "tensorflow": tf.__version__,
  }
  if args.benchmark_rows > 0:
    summary["benchmark"] = benchmark(args.benchmark_rows, args.benchmark_steps)
  _two_replicas(gpus)
  checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
    ("oracle", lambda: oracle_cases(args.steps)),
    ("sharded", lambda: sharded_check(args.steps)),
  ]
  for name, check in checks:
    try:
      summary[name] = check()
    except Exception as e:  # Reported in the summary; the exit is 1.
      summary[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
  summary["ok"] = all(
    summary[k]["ok"] for k in ("oracle", "sharded", "benchmark") if k in summary
  )
  return summary


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if not tf.config.list_physical_devices("GPU"):
    print(NO_GPU)
    return 0
  summary = cli.run(lambda: run(args))
  text = json.dumps(summary, indent=2, default=str)
  print(text)
  if args.json:
    with open(args.json, "w") as f:
      f.write(text + "\n")
  return 0 if summary["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
