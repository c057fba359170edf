"""The fused update kernel: identical numbers to the TensorFlow path.

``tpu_embedding/kernels`` compiles ``TpeFusedSparseApply`` against the
installed TensorFlow. Each case applies the same update twice, once with
the kernel and once with the TensorFlow ops (``TPU_EMBEDDING_KERNELS=0``'s
path: ``unsorted_segment_sum`` then the optimizer's rule), and requires
bit-identical parameters and slots; bad inputs must fail and change
nothing; the build works from an empty cache and falls back cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import oracle
from tests import processes
from tests.conftest import op_types
from tpu_embedding import kernels
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.kernels import build as builder
from tpu_embedding.kernels import library
from tpu_embedding.kernels.ops import KernelOps
from tpu_embedding.kernels.ops import cores
from tpu_embedding.kernels.ops import select_ops
from tpu_embedding.resolved import resolve
from tpu_embedding.tables import updates

pytestmark = pytest.mark.skipif(
  kernels.load() is None, reason="the kernels did not build here"
)

ROWS, DIM = 1000, 8

#: The kernel ops, spreading rows over the threads.
KERNEL_OPS = KernelOps(kernels.load())
fused_apply = KERNEL_OPS.fused_apply

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.3),
  "adagrad": lambda: tpe.Adagrad(0.3, initial_accumulator_value=0.2),
  "sgd_clip_decay": lambda: tpe.SGD(
    0.3,
    clipvalue=(-0.5, 0.25),
    weight_decay_factor=0.1,
    clip_weight_min=-0.6,
    clip_weight_max=0.7,
  ),
  "adagrad_all": lambda: tpe.Adagrad(
    0.3,
    clipvalue=0.4,
    weight_decay_factor=0.05,
    multiply_weight_decay_factor_by_learning_rate=True,
    clip_weight_min=-0.8,
    clip_weight_max=0.9,
  ),
  "adagrad_dynamic_lr": lambda: tpe.Adagrad(lambda: tf.constant(0.05) * 3.0),
}


def _table(optimizer, dim=DIM):
  return resolve(
    tpe.FeatureConfig(tpe.TableConfig(ROWS, dim, name="t")), optimizer
  ).tables[0]


def _block(table, rng):
  shape = (ROWS, table.dim)
  block = {"parameters": tf.Variable(rng.normal(size=shape).astype(np.float32))}
  for slot in table.optimizer.SLOT_NAMES:
    block[slot] = tf.Variable(rng.uniform(0.1, 1.0, shape).astype(np.float32))
  return block


def _update(rng, occurrences=60, unique=17, idle=0, dim=DIM):
  """Ids, index and gradients of one update; ``idle`` more ids that no
  gradient row names (the segment sum gives them zeros)."""
  ids = rng.choice(ROWS, unique + idle, replace=False).astype(np.int64)
  index = np.concatenate(
    [np.arange(unique), rng.integers(0, unique, occurrences - unique)]
  )
  rng.shuffle(index)
  grads = rng.normal(size=(occurrences, dim)).astype(np.float32)
  grads[0, :3] = [0.0, -0.0, 1e-30]  # signed zeros and tiny values
  return ids, index.astype(np.int32), grads


def _values(block):
  return {k: v.numpy() for k, v in block.items()}


def _tensorflow_path(table, block, ids, grads, index):
  summed = tf.math.unsorted_segment_sum(grads, index, tf.size(ids))
  return updates.apply_rows(table, block, ids, PickedRows.dense(summed), ROWS)


#: (occurrences, distinct ids, width) of an update: a few, and enough
#: gradient rows for the kernel to split the rows over the threads
#: (shards); a width the kernel reads at run time, and one it has compiled
#: in (64).
SIZES = {
  "small": (60, 17, DIM),
  "sharded": (40_000, 300, DIM),
  "width64": (300, 90, 64),
}


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("spread", [True, False], ids=["spread", "inline"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_update_equals_the_tensorflow_path(name, traced, spread, size):
  rng = np.random.default_rng(3)
  occurrences, unique, dim = SIZES[size]
  table = _table(OPTIMIZERS[name](), dim)
  fused, reference = _block(table, rng), None
  reference = {k: tf.Variable(v) for k, v in fused.items()}
  steps = [_update(rng, occurrences, unique, 2, dim) for _ in range(3)]

  def fused_step(ids, grads, index):
    # Rows on the worker threads, or all on this one (a step with a
    # replica per core): the same numbers.
    ops = KernelOps(kernels.load(), spread=spread)
    grads = PickedRows.dense(grads)
    assert ops.fused_apply(table, fused, ids, grads, index) is not None

  def tf_step(ids, grads, index):
    _tensorflow_path(table, reference, ids, grads, index)

  if traced:
    fused_step, tf_step = tf.function(fused_step), tf.function(tf_step)
  for ids, index, grads in steps:
    fused_step(tf.constant(ids), tf.constant(grads), tf.constant(index))
    tf_step(tf.constant(ids), tf.constant(grads), tf.constant(index))
  want, got = _values(reference), _values(fused)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  # Rows never updated are untouched.
  touched = np.unique(np.concatenate([s[0] for s in steps]))
  untouched = np.setdiff1d(np.arange(ROWS), touched)
  assert not np.array_equal(got["parameters"][touched], 0)
  assert untouched.size


#: One gradient bound only (``clipvalue=(None, c)`` or ``(c, None)``):
#: the other side must stay unclipped.
ONE_BOUND = {"upper": (None, 0.25), "lower": (-0.5, None)}


@pytest.mark.parametrize("bound", sorted(ONE_BOUND))
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_one_bound_gradient_clipping_equals_the_tensorflow_path(name, bound):
  """The kernel and the TensorFlow path bit for bit, and both the numpy
  oracle's per-row rule (``tests/oracle.py``, float64): summed gradients
  beyond the bound are clipped to it, those beyond the other side are
  not."""
  clip = ONE_BOUND[bound]
  kwargs = {"initial_accumulator_value": 0.2} if name == "adagrad" else {}
  optimizer = {"sgd": tpe.SGD, "adagrad": tpe.Adagrad}[name]
  table = _table(optimizer(0.3, clipvalue=clip, **kwargs))
  rng = np.random.default_rng(11)
  fused = _block(table, rng)
  reference = {k: tf.Variable(v) for k, v in fused.items()}
  start = _values(fused)
  ids, index, grads = _update(rng, occurrences=80, unique=20)
  summed = np.zeros((ids.size, DIM))
  np.add.at(summed, index, grads.astype(np.float64))
  low, high = (-np.inf if c is None else c for c in clip)
  assert (summed > high).any() or (summed < low).any()  # the bound binds
  other = summed < -1.0 if clip[0] is None else summed > 1.0
  assert other.any()  # the side without a bound is reached, unclipped
  assert (
    fused_apply(
      table,
      fused,
      tf.constant(ids),
      PickedRows.dense(tf.constant(grads)),
      index,
    )
    is not None
  )
  _tensorflow_path(
    table, reference, tf.constant(ids), tf.constant(grads), index
  )
  want, got = _values(reference), _values(fused)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  params = start["parameters"].astype(np.float64)
  slots = {s: start[s].astype(np.float64) for s in table.optimizer.SLOT_NAMES}
  oracle.Optimizer.create(
    name, learning_rate=0.3, clipvalue=clip, **kwargs
  ).apply(params, slots, dict(zip(ids.tolist(), summed, strict=True)))
  np.testing.assert_allclose(got["parameters"], params, rtol=1e-5, atol=1e-6)
  for slot, value in slots.items():
    np.testing.assert_allclose(got[slot], value, rtol=1e-5, err_msg=slot)


def test_pieces_are_read_as_their_concatenation():
  rng = np.random.default_rng(4)
  table = _table(tpe.Adagrad(0.2))
  one, split = _block(table, rng), None
  split = {k: tf.Variable(v) for k, v in one.items()}
  ids, index, grads = _update(rng)
  dense = PickedRows.dense(tf.constant(grads))
  fused_apply(table, one, tf.constant(ids), dense, index)
  pieces = [tf.constant(p) for p in np.split(grads, [7, 7, 30])]
  fused_apply(
    table, split, tf.constant(ids), PickedRows.of_pieces(pieces), index
  )
  for key in one:
    np.testing.assert_array_equal(one[key].numpy(), split[key].numpy())


@pytest.mark.parametrize("positions", [True, False], ids=["picked", "in_order"])
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_scaled_rows_equal_the_tensorflow_path_on_the_scaled_rows(
  name, positions
):
  """``PickedRows`` with scales (a multi-id feature's gradients: each id's
  output row times its combiner weight) are summed as the TensorFlow path
  sums the gathered rows times the scales: bit for bit."""
  rng = np.random.default_rng(8)
  table = _table(OPTIMIZERS[name]())
  fused = _block(table, rng)
  reference = {k: tf.Variable(v) for k, v in fused.items()}
  ids, index, _ = _update(rng)
  outputs = rng.normal(size=(23, DIM)).astype(np.float32)
  pieces = [tf.constant(p) for p in np.split(outputs, [5, 11])]
  at = rng.integers(0, 23, index.size) if positions else np.arange(23)[:0]
  if not positions:  # Row i is output row i: as many rows as ids.
    pieces = [tf.constant(rng.normal(size=(index.size, DIM)), tf.float32)]
  scales = rng.uniform(-2.0, 2.0, index.size).astype(np.float32)
  scales[:2] = [0.0, 1.0 / 3.0]
  grads = PickedRows.at(
    pieces,
    tf.constant(at, tf.int32) if positions else None,
    tf.constant(scales),
  )
  assert fused_apply(table, fused, tf.constant(ids), grads, index) is not None
  rows = tf.concat(pieces, 0)
  if positions:
    rows = tf.gather(rows, at)
  _tensorflow_path(
    table, reference, tf.constant(ids), rows * scales[:, None], index
  )
  want, got = _values(reference), _values(fused)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_grouped_positions_equal_the_tensorflow_path(scaled):
  """An owner's rows out of each sender's pieces (one positions tensor, and
  scales, per group of pieces) are the groups' picks in order."""
  rng = np.random.default_rng(10)
  table = _table(tpe.Adagrad(0.2))
  fused = _block(table, rng)
  reference = {k: tf.Variable(v) for k, v in fused.items()}
  ids, index, _ = _update(rng)  # 60 occurrences
  sizes = [[4, 9], [0, 12]]  # two senders, two pieces each
  pieces = [
    tf.constant(rng.normal(size=(n, DIM)).astype(np.float32))
    for group in sizes
    for n in group
  ]
  at = [rng.integers(0, 13, 25), rng.integers(0, 12, 35)]
  scales = [rng.uniform(-2, 2, 25), rng.uniform(-2, 2, 35)]
  grads = PickedRows.grouped(
    pieces,
    [tf.constant(a, tf.int32) for a in at],
    [tf.constant(s, tf.float32) for s in scales] if scaled else (),
  )
  assert fused_apply(table, fused, tf.constant(ids), grads, index) is not None
  rows = []
  for k in range(len(sizes)):
    whole = tf.concat(pieces[2 * k : 2 * k + 2], 0)
    picked = tf.gather(whole, at[k])
    if scaled:
      picked = picked * tf.constant(scales[k], tf.float32)[:, None]
    rows.append(picked)
  want_rows = tf.concat(rows, 0)
  np.testing.assert_array_equal(concat_pieces(grads), want_rows)
  _tensorflow_path(table, reference, tf.constant(ids), want_rows, index)
  want, got = _values(reference), _values(fused)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize(
  "counts, scales, match",
  [
    ([20, 20, 20], None, "positions split 4 pieces into 3 groups"),
    ([30, 29], None, "positions have 59 entries for 60 index entries"),
    ([30, 30], [30, 3], r"scales\[1\] has 3 entries for 30 positions"),
    ([30, 30], [30], "scales come in 1 parts for 2 positions tensors"),
    (
      [30, 30],
      "widths",
      r"grads piece must be \[rows, 8\], group 1 has width 7",
    ),
    (None, [3], r"scales must have index's shape \[60\], got 3"),
  ],
)
def test_bad_picked_rows_fail_and_change_nothing(counts, scales, match):
  rng = np.random.default_rng(11)
  table = _table(tpe.Adagrad(0.2))
  block = _block(table, rng)
  before = _values(block)
  ids, index, grads = _update(rng)
  if counts is None:  # Rows in order, scales of the wrong length.
    picked = PickedRows.at([tf.constant(grads)], None, tf.ones(scales))
  else:  # Groups of pieces, one positions (and scales) tensor each.
    pieces = [tf.constant(rng.normal(size=(5, DIM)), tf.float32)] * 4
    if scales == "widths":  # The second sender's rows are narrower.
      pieces[2:] = [tf.ones([5, DIM - 1])] * 2
      scales = None
    positions = [tf.constant(rng.integers(0, 5, c), tf.int32) for c in counts]
    factors = () if scales is None else [tf.ones([n]) for n in scales]
    picked = PickedRows.grouped(pieces, positions, factors)
  with pytest.raises(tf.errors.InvalidArgumentError, match=match):
    fused_apply(table, block, tf.constant(ids), picked, index)
  for key, value in _values(block).items():
    np.testing.assert_array_equal(value, before[key])


def test_empty_update_changes_nothing():
  rng = np.random.default_rng(5)
  table = _table(tpe.Adagrad(0.2))
  block = _block(table, rng)
  before = _values(block)
  fused_apply(
    table,
    block,
    tf.zeros([0], tf.int64),
    PickedRows.dense(tf.zeros([0, DIM])),
    tf.zeros([0], tf.int32),
  )
  for key, value in _values(block).items():
    np.testing.assert_array_equal(value, before[key])


@pytest.mark.parametrize(
  "ids, index, rows, match",
  [
    ([3, ROWS], [0, 1], 2, rf"rows\[1\] = {ROWS} is not in \[0, {ROWS}\)"),
    ([3, -1], [0, 1], 2, r"rows\[1\] = -1 is not in"),
    ([3, 4], [0, 2], 2, r"index\[1\] = 2 is not in \[0, 2\)"),
    ([3, 4], [0, 1], 3, "grads have 3 rows for 2 index entries"),
  ],
)
def test_bad_inputs_fail_and_change_nothing(ids, index, rows, match):
  rng = np.random.default_rng(6)
  table = _table(tpe.Adagrad(0.2))
  block = _block(table, rng)
  before = _values(block)
  with pytest.raises(tf.errors.InvalidArgumentError, match=match):
    fused_apply(
      table,
      block,
      tf.constant(ids, tf.int64),
      PickedRows.dense(
        tf.constant(rng.normal(size=(rows, DIM)).astype(np.float32))
      ),
      tf.constant(index, tf.int32),
    )
  for key, value in _values(block).items():
    np.testing.assert_array_equal(value, before[key])


def test_a_held_dense_read_is_not_mutated():
  rng = np.random.default_rng(7)
  table = _table(tpe.SGD(1.0))
  block = _block(table, rng)
  held = block["parameters"].read_value()  # shares the buffer until a write
  before = held.numpy().copy()
  ids, index, grads = _update(rng)
  dense = PickedRows.dense(tf.constant(grads))
  fused_apply(table, block, tf.constant(ids), dense, index)
  np.testing.assert_array_equal(held.numpy(), before)
  assert not np.array_equal(block["parameters"].numpy(), before)


def test_spread_unless_the_step_chains_fill_the_cores():
  cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
  assert select_ops([cpu], concurrent=1).spread == (cores() > 1)
  assert not select_ops([cpu], concurrent=cores()).spread


def test_optimizers_without_a_kernel_take_the_tensorflow_path():
  table = _table(tpe.Adam(0.1))
  assert fused_apply(table, {}, None, None, None) is None


class _ScaledSGD(tpe.SGD):
  """A user's SGD with another update: the kernel must not run it."""

  def _rule(self, params, slots, grads, lr):
    return super()._rule(params, slots, 2.0 * grads, lr)


class _NamedSGD(tpe.SGD):
  """A user's SGD that keeps the update and says so."""

  FUSED_RULE = "sgd"


def test_a_subclass_gets_the_kernel_only_when_it_names_the_rule():
  assert tpe.SGD(0.1).fused_rule == "sgd"
  assert tpe.Adagrad(0.1).fused_rule == "adagrad"
  assert tpe.Adam(0.1).fused_rule is None
  # As ``type(optimizer) in RULES`` did: a subclass is not the kernel's.
  assert _ScaledSGD(0.1).fused_rule is None
  rng = np.random.default_rng(12)
  ids, index, grads = _update(rng)
  grads = PickedRows.dense(tf.constant(grads))
  table = _table(_ScaledSGD(0.1))
  assert fused_apply(table, _block(table, rng), ids, grads, index) is None
  assert _NamedSGD(0.1).fused_rule == "sgd"
  table = _table(_NamedSGD(0.1))
  block = _block(table, rng)
  assert fused_apply(table, block, ids, grads, index) is not None


def _run(code: str, env: dict, *args: str) -> subprocess.CompletedProcess:
  """``python -c code`` (or ``python *args``) with ``env`` added."""
  return processes.run(
    [sys.executable, *(args or ("-c", code))],
    cwd="/",  # Not the checkout: the installed package is imported.
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


def test_build_command_from_an_empty_cache(tmp_path):
  """``kernels build`` writes a tuned library that then loads, and
  ``status`` names it. The compiler stands in (a real compile of every
  target takes minutes here; the install's real build is what CI tests):
  it copies the library this process loaded to the output path."""
  loaded = library.choose().path
  if loaded is None:
    pytest.skip("no kernel library to stand in for the compiler's")
  compiler = tmp_path / "cxx"
  compiler.write_text(
    f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp "{loaded}" "$2"\n'
  )
  compiler.chmod(0o755)
  cache = tmp_path / "cache"
  env = {"TPU_EMBEDDING_KERNEL_DIR": str(cache), "CXX": str(compiler)}
  result = _run("", env, "-m", "tpu_embedding.kernels", "build")
  assert result.returncode == 0, result.stderr
  assert str(cache) in result.stdout
  built = [f for _, _, files in os.walk(cache) for f in files]
  assert "libtpu_embedding_kernels.so" in built
  status = _run("", env, "-m", "tpu_embedding.kernels", "status")
  assert status.returncode == 0, status.stderr
  assert f"{cache}" in status.stdout and "(tuned)" in status.stdout


def test_tuned_library_path_follows_tensorflow_sources_and_cpu(monkeypatch):
  path = builder.tuned_library_path()
  assert f"tf{tf.__version__}-" in path
  assert path.startswith(builder.cache_dir())
  # Code built for this CPU is never loaded on another one.
  monkeypatch.setattr(builder, "_cpu_features", lambda: "flags : sse2")
  assert builder.tuned_library_path() != path


def test_a_compiler_without_native_code_builds_the_widest_level(tmp_path):
  """Where ``-march=native`` is refused (as GCC 12 refuses TensorFlow's
  Eigen headers on CPUs with AVX-512 FP16), the tuned build takes the
  widest portable level this CPU runs, never silently generic code."""
  calls = tmp_path / "calls"
  compiler = tmp_path / "cxx"
  compiler.write_text(
    "#!/bin/sh\n"
    f'echo "$*" >> {calls}\n'
    'case "$*" in *-march=native*) echo "no native" >&2; exit 1;; esac\n'
    # Stands in for the generic build: writes the output file.
    'while [ "$1" != "-o" ]; do shift; done; echo built > "$2"\n'
  )
  compiler.chmod(0o755)
  code = "from tpu_embedding.kernels import build; print(build.build_tuned())"
  built = _run(
    code,
    {"TPU_EMBEDDING_KERNEL_DIR": str(tmp_path / "k"), "CXX": str(compiler)},
  )
  assert built.returncode == 0, built.stderr
  library = built.stdout.strip().splitlines()[-1]
  assert open(library).read() == "built\n"
  lines = calls.read_text().splitlines()
  assert all("-march=native" in line for line in lines[:-1])
  assert "-march=native" not in lines[-1]
  runnable = builder.runnable_levels(
    builder.machine_levels(), builder.cpu_flags()
  )
  if runnable and runnable[-1].flags:
    assert " ".join(runnable[-1].flags) in lines[-1]


def test_kernels_serve_training_steps_and_never_lookups_for_serving():
  emb = tpe.TPUEmbedding(
    tpe.FeatureConfig(tpe.TableConfig(30, 4, name="t")), tpe.Adagrad(0.1)
  )
  ids = tf.ragged.constant([[1, 2], [2]], tf.int64)

  @tf.function
  def train(ids):
    emb.enqueue(ids, training=True)
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, emb.dequeue()))

  types = op_types(train, ids)
  assert {
    "TpeUnique",
    "TpeGatherRows",
    "TpeSegmentSum",
    "TpeFusedSparseApply",
  } <= types
  # The combiner reads each id's row where its distinct row is: no
  # per-id rows are gathered for a feature with several ids per row.
  assert not {"Unique", "ResourceGather", "TpeGatherPieces"} & types
  # One id per output row: each id's row is read straight from the table
  # into the activations (no distinct rows picked again).
  one_id = tf.constant([1, 2], tf.int64)
  one_id_types = op_types(train, one_id)
  assert {"TpeUnique", "TpeGatherRows", "TpeFusedSparseApply"} <= one_id_types
  assert not {"ResourceGather", "TpeGatherPieces"} & one_id_types

  @tf.function
  def serve(ids):  # What a SavedModel for TF Serving holds.
    return emb.embedding_lookup(ids)

  assert not {t for t in op_types(serve, ids) if t.startswith("Tpe")}


def _crafted_values(rng, dtype: str) -> np.ndarray:
  """Values across a 16-bit type's range, both signs: subnormals (float16),
  zeros, ties, values already held, values next to powers of two."""
  top = 6e4 if dtype == "float16" else 1e30
  magnitudes = np.concatenate(
    [
      np.exp(rng.uniform(np.log(1e-8), np.log(top), 200)),
      [0.0, 2.0**-24, 3 * 2.0**-25, 2.0**-14, 2.0**-14 * 0.999, 65504.0],
      [1.0 + 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9, 0.999999, 1.5],
    ]
  )
  signs = rng.choice([-1.0, 1.0], magnitudes.size)
  values = (magnitudes * signs).astype(np.float32)
  values = values[: values.size // 16 * 16]
  return values.reshape(-1, 16)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_rows_round_as_the_oracle_in_the_kernel_and_tensorflow(
  dtype, rounding, rng
):
  """SGD(1) from zero rows with gradients -x writes round(x): the fused
  kernel and the TensorFlow path give the numpy oracle's bits
  (tests/low_precision_oracle.py), rows numbered from the block's first
  row (here 1000) and drawn at its update count (here 3)."""
  from tests import low_precision_oracle as low  # noqa: PLC0415
  from tpu_embedding.tables.rounding import BlockRounding  # noqa: PLC0415

  values = _crafted_values(rng, dtype)
  rows, dim = values.shape
  storage = tpe.RowStorage(dtype, rounding=rounding, seed=11)
  table = resolve(
    tpe.FeatureConfig(tpe.TableConfig(rows, dim, name="t", storage=storage)),
    tpe.SGD(1.0),
  ).tables[0]
  ids = tf.constant(rng.permutation(rows), tf.int64)
  grads = PickedRows.dense(tf.constant(-values[ids.numpy()]))
  index = tf.range(rows, dtype=tf.int32)
  rows_at = np.arange(rows, dtype=np.int64) + 1000
  if rounding == "nearest":
    want = low.nearest_round(values, dtype)
  else:
    bits = low.random_bits(11, 0, 3, rows_at, dim)
    want = low.stochastic_round(values, bits, dtype)
  for ops in (KERNEL_OPS, updates.TENSORFLOW_OPS):
    block = {"parameters": tf.Variable(tf.zeros([rows, dim], dtype))}
    rounding_of_block = BlockRounding(table, 1000, None)
    for _ in range(3):  # update count 3 at the update below
      rounding_of_block.advance()
    updates.apply_rows(
      table, block, ids, grads, rows, index, ops, rounding_of_block
    )
    got = tf.cast(block["parameters"], tf.float64).numpy()
    np.testing.assert_array_equal(got, want, err_msg=repr(ops))
    assert int(rounding_of_block.step()) == 4
