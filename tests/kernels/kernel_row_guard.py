"""Kernels run on tables whose memory outside the given rows is unreachable.

Run by tests/kernels/test_kernel_row_guard.py as its own process:
``python tests/kernels/kernel_row_guard.py``. The graph proof
(tests/sparse_access.py) stops at an op: a kernel given a table's handle
could still read, copy or write the whole buffer. Here every page of a
variable's buffer that holds no byte of a row the op is given is made
unreachable (``mprotect(PROT_NONE)``) while the op runs: any read or write
there, by any thread, kills the process with SIGSEGV. A whole-buffer
``memcpy``, a dense loop, or a ``ReadVariableOp`` followed by a reduction
dies; reading and writing the given rows works, and the results must equal
the same ops run unguarded on twin variables (and the untouched rows keep
their values).

Guarded, each with several row widths (the fused update has fixed-width
paths for 16 to 128 floats, and a large-table path from 8 MiB):

* ``TpeGatherRows`` (``KernelOps.gather_rows``), spread over the threads
  or not;
* ``TpeFusedSparseApply`` (``tables/updates.apply_rows`` with the kernels'
  ops) for SGD, Adagrad and Adagrad with clipping and weight decay, with
  gradients as one tensor, as pieces and as picked rows with scales;
* ``TpeVocabularyStep``: only the buckets (rows and probation entries) of
  the step's keys are reachable in the state arrays;
* TensorFlow's ops for the same (``TENSORFLOW_OPS``: every optimizer);
* whole traced training steps of ``TPUEmbedding`` (lookups and updates,
  with whichever ops this process selects): on one device, on 2
  Mirrored replicas (the table row-sharded: the all-to-all exchange),
  pipelined (the held update applied by the next step).

The kernel cases run where the kernel library loads (each prints
``guarded kernel ...``). Last, the control: a dense read of a guarded
table, which must kill the process (the guard is live and the buffer
address right). The granularity is a page (4 KiB): bytes of other rows
sharing a page with a given row stay reachable; the given rows are spread
so that every other row's bytes more than a page away are guarded.

A variable's buffer address is read after one unguarded sparse read
(which makes TensorFlow copy a buffer the variable still shares, e.g.
with the value it was created from: copy-on-write), with
``read_value_no_copy`` (which turns off TensorFlow's copy-on-read mode:
the read shares the buffer; two reads alive at once must share one
address); the reads are dropped at once, so that the variable is again
the buffer's only holder (else the first guarded sparse op would copy
the whole buffer, and die).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import resource
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding import kernels  # noqa: E402
from tpu_embedding.gradients import PickedRows  # noqa: E402
from tpu_embedding.kernels.ops import TENSORFLOW_OPS  # noqa: E402
from tpu_embedding.kernels.ops import KernelOps  # noqa: E402
from tpu_embedding.resolved import resolve  # noqa: E402
from tpu_embedding.tables.updates import apply_rows  # noqa: E402
from tpu_embedding.vocabularies.transition import ENTRY_ARRAYS  # noqa: E402
from tpu_embedding.vocabularies.transition import ROW_ARRAYS  # noqa: E402
from tpu_embedding.vocabularies.transition import VocabularyVariables  # noqa: E402
from tpu_embedding.vocabularies.transition import advance  # noqa: E402

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # <sys/mman.h>; the mmap module names only the others.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

#: Row widths: the fused update's fixed widths, and two others.
DIMS = (16, 64, 128, 100, 1024)

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.1),
  "adagrad": lambda: tpe.Adagrad(0.1),
  "adagrad_clipped_decayed": lambda: tpe.Adagrad(
    0.1, clipvalue=0.5, clip_weight_max=0.8, weight_decay_factor=0.01
  ),
  "adagrad_momentum": lambda: tpe.AdagradMomentum(0.1, momentum=0.9),
  "lazy_adam": lambda: tpe.Adam(0.1),
  "ftrl": lambda: tpe.FTRL(0.1),
}
#: The optimizers the fused kernel applies (``fused_update.RULES``).
FUSED = ("sgd", "adagrad", "adagrad_clipped_decayed")


def _mprotect(start: int, length: int, protection: int) -> None:
  if _libc.mprotect(start, length, protection) != 0:
    raise OSError(ctypes.get_errno(), "mprotect failed")


class Region:
  """A variable's buffer and the rows an op may touch in it.

  Args:
    variable: a fresh ``[rows, width]`` (or ``[rows]``) resource variable.
    rows: the row indices the op is given.
  """

  def __init__(self, variable: tf.Variable, rows):
    # A sparse read first: where the variable still shares its buffer
    # (with the value it was created from), TensorFlow copies it now,
    # unguarded (copy-on-write), and the variable holds its own.
    variable.sparse_read([0])
    first, second = variable.read_value_no_copy(), variable.read_value_no_copy()
    views = np.asarray(first), np.asarray(second)
    # Two reads alive at once share one buffer: the variable's.
    assert views[0].ctypes.data == views[1].ctypes.data, "reads copy"
    self.address, self.nbytes = views[0].ctypes.data, views[0].nbytes
    self.row_bytes = self.nbytes // views[0].shape[0]
    del first, second, views  # The variable is the only holder again.
    self.rows = sorted({int(r) for r in rows})

  def guarded_runs(self) -> list[tuple[int, int]]:
    """``(start, length)`` runs of the buffer's pages holding no byte of a
    given row."""
    first = -(-self.address // PAGE)
    end = (self.address + self.nbytes) // PAGE
    reachable = set()
    for row in self.rows:
      start = self.address + row * self.row_bytes
      reachable.update(
        range(start // PAGE, (start + self.row_bytes - 1) // PAGE + 1)
      )
    runs: list[tuple[int, int]] = []
    for page in range(first, end):
      if page in reachable:
        continue
      if runs and runs[-1][0] + runs[-1][1] == page * PAGE:
        runs[-1] = (runs[-1][0], runs[-1][1] + PAGE)
      else:
        runs.append((page * PAGE, PAGE))
    return runs


@contextlib.contextmanager
def guard(regions: list[Region]):
  """Every page of ``regions`` holding no given row unreachable."""
  runs = [run for region in regions for run in region.guarded_runs()]
  assert runs, "nothing to guard"
  for start, length in runs:
    _mprotect(start, length, PROT_NONE)
  try:
    yield
  finally:
    for start, length in runs:
      _mprotect(start, length, mmap.PROT_READ | mmap.PROT_WRITE)


def spread_rows(row_bytes: int, count: int) -> list[int]:
  """``count`` rows with guarded pages between any two of them."""
  step = 2 * PAGE // row_bytes + 2
  return [3 + step * (2 * k + 1) for k in range(count)]


def table_rows(row_bytes: int, given: list[int]) -> int:
  """Rows of a table holding ``given`` with guarded pages past the last."""
  return max(given) + 8 * PAGE // row_bytes + 8


def gather_case(ops, dim: int, rng) -> None:
  """``ops.gather_rows`` under the guard: the rows, the table unchanged."""
  rows = spread_rows(4 * dim, 5)
  values = rng.normal(size=(table_rows(4 * dim, rows), dim)).astype(np.float32)
  table = tf.Variable(values)
  # Many ids (spread over the threads, where the ops spread), 5 rows.
  ids = tf.constant(rng.choice(rows, 20000), tf.int64)
  with guard([Region(table, ids.numpy())]):
    got = ops.gather_rows(table, ids)
  np.testing.assert_array_equal(got.numpy(), values[ids.numpy()])
  np.testing.assert_array_equal(table.numpy(), values)


def gradient_forms(rng, dim: int, occurrences: int) -> dict:
  """The same per-occurrence gradients as a tensor, pieces, picked rows."""
  grads = rng.normal(size=(occurrences, dim)).astype(np.float32)
  source = rng.normal(size=(occurrences + 3, dim)).astype(np.float32)
  positions = rng.permutation(occurrences + 3)[:occurrences].astype(np.int32)
  scales = rng.uniform(0.5, 2.0, occurrences).astype(np.float32)
  half = occurrences // 2
  return {
    "tensor": lambda: PickedRows.dense(tf.constant(grads)),
    "pieces": lambda: PickedRows.of_pieces(
      [tf.constant(grads[:half]), tf.constant(grads[half:])]
    ),
    "picked": lambda: PickedRows.at(
      [tf.constant(source[:4]), tf.constant(source[4:])],
      tf.constant(positions),
      tf.constant(scales),
    ),
  }


def update_case(
  ops, name: str, dim: int, rng, rows_total=None, occurrences=7
) -> None:
  """``apply_rows`` under the guard equals it unguarded on twins: 4
  distinct rows, ``occurrences`` gradient rows."""
  table = resolve(
    tpe.FeatureConfig(tpe.TableConfig(8, dim, name="t")), OPTIMIZERS[name]()
  ).tables[0]
  given = spread_rows(4 * dim, 4)
  count = rows_total or table_rows(4 * dim, given)
  ids = tf.constant([given[2], given[0], given[3], given[1]], tf.int64)
  index = tf.constant(
    np.concatenate([[0, 1, 2, 3], rng.integers(0, 4, occurrences - 4)]),
    tf.int32,
  )
  for form, grads in gradient_forms(rng, dim, occurrences).items():
    what = f"{name} dim {dim}, {form}"
    initial = {
      key: rng.uniform(0.1, 1.0, size=(count, dim)).astype(np.float32)
      for key in ("parameters", *table.optimizer.SLOT_NAMES)
    }
    guarded = {key: tf.Variable(v) for key, v in initial.items()}
    twin = {key: tf.Variable(v) for key, v in initial.items()}
    regions = [Region(v, ids.numpy()) for v in guarded.values()]
    with guard(regions):
      apply_rows(table, guarded, ids, grads(), count, index, ops)
    apply_rows(table, twin, ids, grads(), count, index, ops)
    for key, variable in guarded.items():
      got = variable.numpy()
      message = f"{what}: {key}"
      np.testing.assert_array_equal(got, twin[key].numpy(), message)
      untouched = np.ones(count, bool)
      untouched[ids.numpy()] = False
      np.testing.assert_array_equal(
        got[untouched], initial[key][untouched], message
      )
      changed = got[ids.numpy()] != initial[key][ids.numpy()]
      assert changed.any(axis=1).all(), message


def vocabulary_case(ops, rng) -> None:
  """A dynamic vocabulary's steps touch only their keys' buckets: 64
  buckets of a page in every array (512 int64 rows or probation
  entries), 6 keys; keys on probation, then admitted."""
  vocabulary = tpe.DynamicVocabulary(
    bucket_size=PAGE // 8, min_count=2, probation_size=PAGE // 8
  )
  guarded = VocabularyVariables(vocabulary, 64 * PAGE // 8)
  twin = VocabularyVariables(vocabulary, 64 * PAGE // 8)
  layout = guarded.layout
  keys = rng.integers(-(2**62), 2**62, 6)
  _, buckets = layout.local_buckets(tf.constant(keys))
  buckets = sorted(set(buckets.numpy().tolist()))
  rows = [
    r
    for b in buckets
    for r in range(layout.first_row(b), layout.first_row(b + 1))
  ]
  per_bucket = guarded.probation
  entries = [
    e for b in buckets for e in range(b * per_bucket, (b + 1) * per_bucket)
  ]
  regions = [Region(guarded[name], rows) for name in ROW_ARRAYS]
  regions += [Region(guarded[name], entries) for name in ENTRY_ARRAYS]
  for occurrences in (keys[:4], keys, np.repeat(keys, 2)):
    occurrences = tf.constant(occurrences, tf.int64)
    with guard(regions):
      got = advance(guarded, occurrences, ops)
    want = advance(twin, occurrences, ops)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_array_equal(a.numpy(), b.numpy())
  for name, variable in guarded.variables.items():
    np.testing.assert_array_equal(
      variable.numpy(), twin[name].numpy(), err_msg=name
    )
  assert (guarded["last_step"].numpy() > 0).sum() == len(keys)  # admitted


def training_step_case(rng, strategy, pipelined: bool) -> str:
  """Traced ``TPUEmbedding`` steps (a table 2 features share; on 2
  replicas row-sharded, each replica looking up the same batch): the
  lookups and updates of the batches' rows, nothing else of the tables.
  Pipelined: two steps (the second applies the first's held update).

  Returns:
    The step's ops (``engine.step_ops``).
  """
  dim = 64
  given = spread_rows(4 * dim, 8)
  rows = table_rows(4 * dim, given)
  init = rng.normal(size=(rows, dim)).astype(np.float32)

  def make():
    table = tpe.TableConfig(
      rows, dim, name="big", initializer=tf.constant_initializer(init)
    )
    with strategy.scope():
      emb = tpe.TPUEmbedding(
        {"item": tpe.FeatureConfig(table), "user": tpe.FeatureConfig(table)},
        tpe.Adagrad(0.1),
        pipeline_execution_with_tensor_core=pipelined,
        row_sharding_threshold=rows // 2,
      )
    emb.build()
    return emb

  def step_of(emb):
    def replica_step(item, user):
      emb.enqueue({"item": item, "user": user})
      activations = emb.dequeue()
      emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
      return activations

    return tf.function(lambda *batch: strategy.run(replica_step, batch))

  batches = [
    (
      tf.constant([given[0], given[3], given[0], given[5]], tf.int64),
      tf.ragged.constant(
        [[given[1], given[2]], [], [given[4]], [given[1]]], tf.int64
      ),
    ),
    (
      tf.constant([given[6], given[3], given[7], given[0]], tf.int64),
      tf.ragged.constant([[given[7]], [given[2]], [], []], tf.int64),
    ),
  ][: 2 if pipelined else 1]
  guarded, twin = make(), make()
  step, twin_step = step_of(guarded), step_of(twin)
  step.get_concrete_function(*batches[0])  # Traced before the guard.
  store = guarded.backend.stores["big"]
  assert len(store.blocks) == strategy.num_replicas_in_sync, store.layout
  regions = []
  for index, block in enumerate(store.blocks):
    first, count = store.block_rows(index)
    mine = [r - first for r in given if first <= r < first + count]
    regions += [Region(variable, mine) for variable in block.values()]
  with guard(regions):
    got = [step(*batch) for batch in batches]
  want = [twin_step(*batch) for batch in batches]
  for got_step, want_step in zip(got, want, strict=True):
    for key in want_step:
      for a, b in zip(
        strategy.experimental_local_results(got_step[key]),
        strategy.experimental_local_results(want_step[key]),
        strict=True,
      ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
  twin_store = twin.backend.stores["big"]
  for block, twin_block in zip(store.blocks, twin_store.blocks, strict=True):
    for key, variable in block.items():
      np.testing.assert_array_equal(
        variable.numpy(), twin_block[key].numpy(), err_msg=key
      )
  return repr(guarded.engine.step_ops)


def control() -> None:
  """A dense read of a guarded table: must end the process (SIGSEGV)."""
  table = tf.Variable(np.ones([table_rows(256, [0]), 64], np.float32))
  with guard([Region(table, [0])]):
    print("control: a dense read under the guard", flush=True)
    total = tf.reduce_sum(table)
    print(f"control: the dense read was not stopped ({float(total)})")


def main() -> None:
  # Two CPU devices, for 2 replicas (set before TensorFlow starts).
  (cpu,) = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
  )
  # The control's SIGSEGV needs no core file.
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  rng = np.random.default_rng(5)
  module = kernels.load()
  all_ops = [("tensorflow", TENSORFLOW_OPS)]
  if module is not None:
    all_ops += [
      ("kernel", KernelOps(module, spread=True)),
      ("kernel", KernelOps(module, spread=False)),
    ]
  for kind, ops in all_ops:
    for dim in DIMS:
      gather_case(ops, dim, rng)
    print(f"guarded {kind} gather_rows ({ops})", flush=True)
    names = FUSED if kind == "kernel" else sorted(OPTIMIZERS)
    for name in names:
      for dim in DIMS:
        update_case(ops, name, dim, rng)
    print(f"guarded {kind} update ({ops}): {', '.join(names)}", flush=True)
    vocabulary_case(ops, rng)
    print(f"guarded {kind} vocabulary_step ({ops})", flush=True)
  if module is not None:  # Over 8 MiB (huge pages), over 16384 gradient
    # rows (the update split over threads).
    update_case(all_ops[1][1], "adagrad", 64, rng, 40000, occurrences=40000)
    print("guarded kernel update of a 10 MiB table, on threads", flush=True)
  mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  for name, strategy, pipelined in (
    ("one device", tf.distribute.get_strategy(), False),
    ("2 replicas, sharded", mirrored, False),
    ("one device, pipelined", tf.distribute.get_strategy(), True),
  ):
    ops = training_step_case(rng, strategy, pipelined)
    print(f"guarded training step, {name} ({ops})", flush=True)
  control()


if __name__ == "__main__":
  sys.exit(main())
