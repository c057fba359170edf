"""The kernels as the install delivers them.

``pip install .`` compiles one library per x86-64 level into the package
(``kernels/build.py``, called by ``setup.py``); ``kernels/library.py``
loads the widest this CPU runs. These tests run training in fresh
processes of the installed package and require:

* every level this CPU runs, and the TensorFlow ops path, give the same
  numbers bit for bit (one-hot and multi-hot features, Adagrad and SGD,
  one device and 2 replicas of row-sharded tables);
* without a usable library (none built at install, built for another
  TensorFlow, one that does not load) training still runs, on the
  TensorFlow path, and says so once, in one line, with the remedy;
* an install without a compiler succeeds.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest

from tests import processes
from tpu_embedding.kernels import build as builder
from tpu_embedding.kernels import library

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Trains 3 steps on one device and 3 on 2 replicas (row-sharded
#: tables) with the library ``choose`` is forced to give
#: (``TPU_EMBEDDING_TEST_FORCE``: keyword arguments of ``library.choose``,
#: as JSON) and saves every table and slot.
_TRAIN = """
import json, os, sys
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tpu_embedding.kernels import library
force = json.loads(os.environ.get("TPU_EMBEDDING_TEST_FORCE", "null"))
if force is not None:
  original = library.choose
  library.choose = lambda: original(**{
      k: frozenset(v) if k == "cpu_flags" else v for k, v in force.items()})
import tpu_embedding as tpe
from tpu_embedding import kernels

BATCH = 32

def batches():
  rng = np.random.default_rng(7)
  for _ in range(3):
    lengths = rng.integers(1, 6, BATCH)
    yield {
        "user": tf.constant(rng.zipf(1.3, BATCH) % 64, tf.int64),
        "history": tf.RaggedTensor.from_row_lengths(
            tf.constant(rng.integers(0, 96, lengths.sum()), tf.int64),
            lengths),
    }

def initial(rows, dim):
  values = np.random.default_rng(rows).normal(size=(rows, dim))
  return tf.constant_initializer(values.astype(np.float32))

def train(strategy):
  with strategy.scope():
    users = tpe.TableConfig(64, 8, name="users", initializer=initial(64, 8),
                            optimizer=tpe.Adagrad(0.3, clipvalue=0.5))
    items = tpe.TableConfig(96, 16, name="items", initializer=initial(96, 16),
                            optimizer=tpe.SGD(0.2), combiner="sum")
    emb = tpe.TPUEmbedding(
        {"user": tpe.FeatureConfig(users),
         "history": tpe.FeatureConfig(items)},
        tpe.Adagrad(0.1), row_sharding_threshold=10)
  replicas = strategy.num_replicas_in_sync
  per = BATCH // replicas

  @tf.function
  def step(features):
    emb.enqueue(strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.nest.map_structure(
            lambda t: t[ctx.replica_id_in_sync_group * per:
                        (ctx.replica_id_in_sync_group + 1) * per],
            features)), training=True)
    def replica_fn():
      acts = emb.dequeue()
      emb.apply_gradients({k: tf.sin(v) + 0.1 for k, v in acts.items()})
    strategy.run(replica_fn)

  for features in batches():
    step(features)
  return {f"{strategy.num_replicas_in_sync}/{t}/{slot}":
              np.asarray(tf.convert_to_tensor(v))
          for t, slots in emb.variables.items() for slot, v in slots.items()}

arrays = train(tf.distribute.OneDeviceStrategy("/cpu:0"))
arrays.update(train(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])))
np.savez(sys.argv[1], **arrays)
print("ORIGIN", library.choose().origin, kernels.load() is not None)
"""


def _train(tmp_path, name: str, force=None, env=None):
  """Runs ``_TRAIN``; returns (its arrays, stdout, stderr)."""
  out = tmp_path / f"{name}.npz"
  environment = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TPU_EMBEDDING_KERNELS", "TPU_EMBEDDING_TEST_FORCE")
  }
  environment.update(TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
  if force is not None:
    environment["TPU_EMBEDDING_TEST_FORCE"] = json.dumps(force)
  done = processes.run(
    [sys.executable, "-c", _TRAIN, str(out)],
    cwd=tmp_path,  # Not the checkout: the installed package is imported.
    env=environment,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  with np.load(out) as arrays:
    return dict(arrays), done.stdout, done.stderr


def _installed_build_info() -> dict:
  info = builder.read_build_info(builder.package_dir())
  if info is None and os.environ.get("CI") != "true":
    pytest.skip("an editable or source install: the install built no kernels")
  assert info is not None, f"no {builder.BUILD_INFO} in {builder.package_dir()}"
  return info


def _tensorflow_path_lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if "kernels not loaded" in line]


@pytest.fixture(scope="module")
def tensorflow_path(tmp_path_factory):
  """The numbers of the TensorFlow ops path (``TPU_EMBEDDING_KERNELS=0``)."""
  arrays, stdout, stderr = _train(
    tmp_path_factory.mktemp("tf"), "tf", env={"TPU_EMBEDDING_KERNELS": "0"}
  )
  assert "ORIGIN none False" in stdout
  assert not _tensorflow_path_lines(stderr)  # Asked for: nothing to say.
  return arrays


def test_the_install_built_every_level_for_this_tensorflow():
  info = _installed_build_info()
  assert info["tensorflow"] == builder.tensorflow_identity()
  levels = [level.name for level in builder.machine_levels()]
  assert sorted(info["libraries"]) == sorted(levels)
  for name in info["libraries"].values():
    assert (pathlib.Path(builder.package_dir()) / name).stat().st_size > 0
  # The widest level this CPU runs is the one chosen.
  runnable = builder.runnable_levels(
    builder.machine_levels(), builder.cpu_flags()
  )
  choice = library.choose(tuned="/nonexistent.so")
  assert choice.origin == f"package:{runnable[-1].name}"


@pytest.mark.parametrize("level", [level.name for level in builder.LEVELS])
def test_every_level_gives_the_tensorflow_path_numbers(
  level, tensorflow_path, tmp_path
):
  info = _installed_build_info()
  wanted = {lvl.name: lvl for lvl in builder.machine_levels()}.get(level)
  if wanted is None or not wanted.cpu_flags <= builder.cpu_flags():
    pytest.skip(f"this machine does not run the {level} library")
  force = {"tuned": "/nonexistent.so", "cpu_flags": sorted(wanted.cpu_flags)}
  arrays, stdout, stderr = _train(tmp_path, level, force=force)
  assert f"ORIGIN package:{level} True" in stdout, stderr[-2000:]
  assert level in info["libraries"]
  assert sorted(arrays) == sorted(tensorflow_path)
  for key, value in arrays.items():
    np.testing.assert_array_equal(value, tensorflow_path[key], err_msg=key)


def _package_copy(tmp_path, edit) -> str:
  """A copy of the installed libraries and record, changed by ``edit``."""
  info = _installed_build_info()
  directory = tmp_path / "kernels"
  directory.mkdir()
  for name in [*info["libraries"].values(), builder.BUILD_INFO]:
    shutil.copy(pathlib.Path(builder.package_dir()) / name, directory)
  edit(directory, info)
  return str(directory)


def _no_library(directory, info):
  builder.remove_portable(str(directory))


def _other_tensorflow(directory, info):
  info = {**info, "tensorflow": {"version": "2.20.0", "git_version": "v2.20"}}
  (directory / builder.BUILD_INFO).write_text(json.dumps(info))


def _broken_library(directory, info):
  for name in info["libraries"].values():
    (directory / name).write_bytes(b"not a shared library")


@pytest.mark.parametrize(
  "edit, reason",
  [
    (_no_library, "the install built no kernel library"),
    (_other_tensorflow, "built for TensorFlow 2.20.0"),
    (_broken_library, "does not load"),
  ],
)
def test_without_a_usable_library_training_says_so_once_and_runs(
  edit, reason, tensorflow_path, tmp_path
):
  directory = _package_copy(tmp_path, edit)
  arrays, stdout, stderr = _train(
    tmp_path, "fallback", force={"directory": directory, "tuned": "/none.so"}
  )
  assert "ORIGIN" in stdout and stdout.strip().endswith("False")
  lines = _tensorflow_path_lines(stderr)
  assert len(lines) == 1, stderr[-3000:]
  assert reason in lines[0]
  assert "apt-get install g++" in lines[0]
  assert "python3 -m tpu_embedding.kernels build" in lines[0]
  assert "Traceback" not in stderr
  for key, value in arrays.items():
    np.testing.assert_array_equal(value, tensorflow_path[key], err_msg=key)


def test_a_checkout_run_from_its_root_loads_the_installed_kernels():
  """``python3 -m model_garden.ranking.train`` from the checkout's root (the
  README's first command) imports the checkout's files, which hold no
  build: the installed copy's libraries serve, built from the same
  sources."""
  info = _installed_build_info()
  code = (
    "import tpu_embedding, sys; from tpu_embedding import kernels; "
    "from tpu_embedding.kernels import library; "
    "print(tpu_embedding.__file__); c = library.choose(); "
    "print(c.origin, c.path, kernels.load() is not None)"
  )
  done = processes.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    env={
      **{k: v for k, v in os.environ.items() if k != "TPU_EMBEDDING_KERNELS"},
      "TF_CPP_MIN_LOG_LEVEL": "3",
    },
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  imported, choice = done.stdout.strip().splitlines()[-2:]
  if not imported.startswith(str(ROOT / "tpu_embedding")):
    pytest.skip("the checkout's package is the installed one (editable)")
  origin, path, loaded = choice.split()
  assert origin.startswith("package:") and loaded == "True", done.stderr
  assert path.startswith(builder.package_dir())
  assert info["sources"] == builder.sources_digest()


def test_choice_reasons_name_what_is_wrong(tmp_path):
  assert library.choose(directory=str(tmp_path), tuned="/x.so").reason == (
    "the install built no kernel library (was a C++ compiler missing?)"
  )
  (tmp_path / builder.BUILD_INFO).write_text(
    json.dumps(
      {
        "tensorflow": builder.tensorflow_identity(),
        "libraries": {"avx512": "lib.avx512.so"},
      }
    )
  )
  below = library.choose(
    directory=str(tmp_path), tuned="/x.so", cpu_flags=frozenset({"avx"})
  )
  if builder.machine_levels() == builder.LEVELS:
    assert below.path is None
    assert "this CPU runs none of the built kernel libraries" in below.reason
  tuned = tmp_path / "tuned.so"
  tuned.write_bytes(b"")
  assert library.choose(directory=str(tmp_path), tuned=str(tuned)).origin == (
    "tuned"
  )


def test_an_install_without_a_compiler_succeeds(tmp_path):
  """setup.py's build step with no compiler: the package, no libraries."""
  build_lib = tmp_path / "lib"
  done = processes.run(
    [
      sys.executable,
      "setup.py",
      "-q",
      "build_py",
      "--build-lib",
      str(build_lib),
    ],
    cwd=ROOT,
    env={**os.environ, "CXX": "false"},
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "tpu_embedding: kernels not built" in done.stderr
  kernels_dir = build_lib / "tpu_embedding" / "kernels"
  assert (kernels_dir / "fused_update.py").exists()
  assert not (kernels_dir / builder.BUILD_INFO).exists()
  assert not list(kernels_dir.glob("*.so"))
  assert not list(kernels_dir.glob("tmp*"))  # No partial build left.


def test_a_rebuild_of_an_unchanged_tree_reuses_its_libraries(
  tmp_path, monkeypatch
):
  """(``pip install`` again from the same checkout.) Any change (sources,
  TensorFlow, a missing library) compiles anew."""
  monkeypatch.setenv("CXX", "false")  # Compiling would fail.
  names = {lvl.name: builder.LIBRARY.format(lvl.name) for lvl in builder.LEVELS}
  info = {
    "tensorflow": builder.tensorflow_identity(),
    "libraries": {
      lvl.name: names[lvl.name] for lvl in builder.machine_levels()
    },
    "sources": builder.sources_digest(),
  }
  for name in info["libraries"].values():
    (tmp_path / name).write_bytes(b"built")
  (tmp_path / builder.BUILD_INFO).write_text(json.dumps(info))
  assert builder.build_portable(str(tmp_path)) == info
  (tmp_path / builder.BUILD_INFO).write_text(
    json.dumps({**info, "sources": "edited"})
  )
  with pytest.raises(builder.BuildError):
    builder.build_portable(str(tmp_path))
