"""The kernel seam: the row operations of a step, and who serves them.

A training step's row operations (deduplication, row gathers, the
combiner's sum, the split by owner, a dynamic vocabulary's step, the
fused sparse update and the changed-row flags) come from one ``StepOps``
object, passed down explicitly from the engine to the lookup, the
backends, the exchanges and the table stores:

* ``TENSORFLOW_OPS`` (``StepOps``): TensorFlow's own ops. Always right;
  what lookups for serving, SavedModels, tables on a GPU, on parameter
  servers or on other workers get.
* ``XLA_OPS`` (``XlaOps``): TensorFlow's ops with static shapes, for
  functions compiled by XLA (``jit_compile=True``).
* ``KernelOps``: this package's C++ kernels (CPU kernels, loaded into this
  process), the same outputs bit for bit. Each method falls back to
  TensorFlow's ops for inputs its kernel does not take.

``select_ops`` is the one place that decides, from the function being
traced and the devices holding an engine's tables: ``XLA_OPS`` for XLA,
TensorFlow's in a SavedModel and for lookups outside training, the
kernels only where the library loads and every table variable lives in
this process's CPU memory.

Example:
  >>> import tensorflow as tf
  >>> ops = select_ops(["/job:localhost/replica:0/task:0/device:GPU:0"])
  >>> ops is TENSORFLOW_OPS  # A table on a GPU: never a CPU kernel.
  True
  >>> unique, index = ops.unique(tf.constant([5, 2, 5], tf.int64))
  >>> unique.numpy().tolist(), index.numpy().tolist()
  ([5, 2], [0, 1, 0])
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.kernels import load
from tpu_embedding.kernels.fused_update import Rounding
from tpu_embedding.kernels.fused_update import fused_apply
from tpu_embedding.kernels.gather_rows import gather_pieces_with_kernel
from tpu_embedding.kernels.gather_rows import gather_pieces_with_tensorflow
from tpu_embedding.kernels.gather_rows import gather_rows_with_kernel
from tpu_embedding.kernels.mark_rows import mark_rows_with_kernel
from tpu_embedding.kernels.mark_rows import mark_rows_with_tensorflow
from tpu_embedding.kernels.segment_sum import segment_sum_with_kernel
from tpu_embedding.kernels.segment_sum import segment_sum_with_tensorflow
from tpu_embedding.kernels.split_by_owner import OwnerSplit
from tpu_embedding.kernels.split_by_owner import split_with_kernel
from tpu_embedding.kernels.split_by_owner import split_with_tensorflow
from tpu_embedding.kernels.static_unique import unique_static
from tpu_embedding.kernels.unique import Ids
from tpu_embedding.kernels.unique import unique_with_kernel
from tpu_embedding.kernels.unique import unique_with_tensorflow
from tpu_embedding.kernels.vocabulary_step import vocabulary_step
from tpu_embedding.row_storage import decode


class StepOps:
  """A step's row operations, by TensorFlow's ops (``TENSORFLOW_OPS``).

  ``KernelOps`` computes the same outputs with this package's kernels.
  """

  #: Whether this package's kernels serve (for logs and reports).
  kernels: ClassVar[bool] = False

  def unique(
    self, ids: Ids, offsets: Sequence[int] | None = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """``tf.unique(ids, out_idx=tf.int32)``: ``(distinct ids, int32 index)``.

    Args:
      ids: a vector of ids, or parts whose concatenation it is.
      offsets: None, or per part a number added to its ids (a stack's row
        offset of each member table).
    """
    return unique_with_tensorflow(ids, offsets)

  def gather_rows(self, variable: Any, ids: tf.Tensor) -> tf.Tensor:
    """``tf.gather(variable, ids)`` for a ``[rows, dim]`` table variable,
    as float32 whatever its stored type (``row_storage.RowStorage``)."""
    return decode(tf.gather(variable, ids))

  def gather_pieces(
    self, pieces: list[tf.Tensor], index: tf.Tensor
  ) -> tf.Tensor:
    """``tf.gather(tf.concat(pieces, 0), index)`` (``gather_rows.py``)."""
    return gather_pieces_with_tensorflow(pieces, index)

  def gather_occurrences(
    self, variable: Any, ids: tf.Tensor, index: tf.Tensor, one_per_row: bool
  ) -> PickedRows:
    """The row of each occurrence of a table variable's distinct ``ids``
    (``index``: the position in ``ids`` of each): the distinct rows,
    gathered once and picked in place (``PickedRows.at([rows], index)``).

    ``KernelOps`` reads the rows of occurrences that are output rows of
    their own (``one_per_row``, ``lookup.RowRequest``) straight from the
    table instead, in order (positions None): the same rows, each copied
    once. (Bags keep the distinct rows: their sum reads them in place.)
    """
    del one_per_row
    return PickedRows.at([self.gather_rows(variable, ids)], index)

  def segment_sum(
    self,
    rows: PickedRows,
    segments: tf.Tensor,
    num_segments: tf.Tensor,
  ) -> tf.Tensor:
    """``[num_segments, dim]`` sums of the (scaled) picked rows by output
    row (``segment_sum.py``)."""
    return segment_sum_with_tensorflow(rows, segments, num_segments)

  def split_by_owner(
    self,
    ids: tf.Tensor,
    block_starts: Sequence[int],
    index: tf.Tensor | None = None,
    positions: bool = False,
    slots: bool = False,
  ) -> OwnerSplit:
    """Each owner's share of ``ids`` (or of the occurrences ``ids[index]``;
    ``split_by_owner.py``)."""
    return split_with_tensorflow(ids, block_starts, index, positions, slots)

  def vocabulary_step(
    self, variables: Any, occurrences: tf.Tensor
  ) -> tuple[tf.Tensor, tf.Tensor] | None:
    """``(rows, new_rows)`` of a dynamic vocabulary's step, or None: the
    TensorFlow ops of ``vocabularies/transition.py`` then run it."""
    del variables, occurrences
    return None

  def fused_apply(
    self,
    table: TableConfig,
    block: dict[str, Any],
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor,
    rounding: Rounding | None = None,
  ) -> list[Any] | None:
    """The fused sparse update's ops, or None: the TensorFlow path of
    ``tables/updates.apply_rows`` then runs (``fused_update.py``);
    ``rounding``: how the block writes 16-bit rows (``RowStorage``)."""
    del table, block, ids, grads, index, rounding
    return None

  def mark_rows(self, flags: Any, rows: tf.Tensor) -> Any:
    """Sets an int8 flag variable to 1 at ``rows`` (a store's changed
    rows, ``tables/changed_rows.py``; ``mark_rows.py``)."""
    return mark_rows_with_tensorflow(flags, rows)

  def __repr__(self) -> str:
    return "TENSORFLOW_OPS"


#: TensorFlow's ops: serving, SavedModels, and tables this process's CPU
#: kernels must not touch.
TENSORFLOW_OPS = StepOps()


class XlaOps(StepOps):
  """A step's row ops for XLA (``XLA_OPS``): static shapes throughout.

  TensorFlow's ops, but deduplication returns a buffer as long as its
  input, padded with ``static_unique.PADDING_ID`` (rows past every table,
  which XLA's gathers clamp and its scatters and segment sums drop), so
  nothing in the step has a shape only the data knows.
  """

  def unique(
    self, ids: Ids, offsets: Sequence[int] | None = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    return unique_static(ids, offsets)

  def __repr__(self) -> str:
    return "XLA_OPS"


#: The ops of steps and lookups traced for XLA (``jit_compile=True``).
XLA_OPS = XlaOps()


def lookup_ops() -> StepOps:
  """The ops of a lookup outside training (serving, SavedModels): no
  tables for the kernels (``select_ops(())``)."""
  return select_ops(())


@dataclasses.dataclass(frozen=True, repr=False)
class KernelOps(StepOps):
  """A step's row operations by this package's kernels (same outputs).

  Attributes:
    module: the loaded kernel module (``kernels.load()``).
    spread: whether a kernel spreads its rows over the CPU threads; not
      where the step's kernel chains already run one op on every core
      (there each kernel runs on its chain's thread: measured 1.16x faster
      steps on 2 and 4 replicas of 2 cores, 1.08x on one device with 26
      tables).
  """

  module: Any
  spread: bool = True
  kernels: ClassVar[bool] = True

  def unique(
    self, ids: Ids, offsets: Sequence[int] | None = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    return unique_with_kernel(self.module, ids, offsets)

  def gather_rows(self, variable: Any, ids: tf.Tensor) -> tf.Tensor:
    return decode(
      gather_rows_with_kernel(self.module, variable, ids, self.spread)
    )

  def gather_pieces(
    self, pieces: list[tf.Tensor], index: tf.Tensor
  ) -> tf.Tensor:
    return gather_pieces_with_kernel(self.module, pieces, index, self.spread)

  def gather_occurrences(
    self, variable: Any, ids: tf.Tensor, index: tf.Tensor, one_per_row: bool
  ) -> PickedRows:
    if not one_per_row:
      return super().gather_occurrences(variable, ids, index, one_per_row)
    # Measured on 26 one-hot tables: steps 4 % (Zipf ids) to 16 % (uniform)
    # faster; for bags 12-31 % slower (each repeat's row copied again where
    # the sum reads the distinct rows in place), hence one per row only.
    occurrences = tf.gather(ids, index)
    return PickedRows.dense(self.gather_rows(variable, occurrences))

  def segment_sum(
    self,
    rows: PickedRows,
    segments: tf.Tensor,
    num_segments: tf.Tensor,
  ) -> tf.Tensor:
    return segment_sum_with_kernel(
      self.module, rows, segments, num_segments, self.spread
    )

  def split_by_owner(
    self,
    ids: tf.Tensor,
    block_starts: Sequence[int],
    index: tf.Tensor | None = None,
    positions: bool = False,
    slots: bool = False,
  ) -> OwnerSplit:
    return split_with_kernel(
      self.module, ids, block_starts, index, positions, slots
    )

  def vocabulary_step(
    self, variables: Any, occurrences: tf.Tensor
  ) -> tuple[tf.Tensor, tf.Tensor] | None:
    return vocabulary_step(self.module, variables, occurrences)

  def fused_apply(
    self,
    table: TableConfig,
    block: dict[str, Any],
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor,
    rounding: Rounding | None = None,
  ) -> list[Any] | None:
    return fused_apply(
      self.module, table, block, ids, grads, index, self.spread, rounding
    )

  def mark_rows(self, flags: Any, rows: tf.Tensor) -> Any:
    return mark_rows_with_kernel(self.module, flags, rows)

  def __repr__(self) -> str:
    return f"KernelOps(spread={self.spread})"


def in_this_process_cpu(device: str, host: str | None = None) -> bool:
  """Whether a variable on ``device`` lives in this process's CPU memory.

  Args:
    device: a variable's device string (``variable.device``).
    host: this process's address (``/job:<j>/replica:<r>/task:<t>``);
      None: TensorFlow's (``compat.host_address_space()``).

  Returns:
    False for a GPU (or any other accelerator), an unplaced variable
    (``""``), a parameter server or another task; True for a CPU of
    ``/job:localhost`` or of this process's job, replica and task.
  """
  spec = tf.DeviceSpec.from_string(device or "")
  if spec.device_type != "CPU":
    return False
  if spec.job == "localhost":
    return True
  here = tf.DeviceSpec.from_string(
    compat.host_address_space() if host is None else host
  )
  return (
    spec.job in (None, here.job)
    and spec.replica in (None, here.replica or 0)
    and spec.task in (None, here.task or 0)
  )


def select_ops(
  devices: Iterable[str], concurrent: int = 1, host: str | None = None
) -> StepOps:
  """The ops of the function being traced, on tables held on ``devices``.

  ``XLA_OPS`` in a function compiled by XLA (the kernels have no XLA
  lowering, and XLA needs static shapes; TensorFlow's ops alone, so
  servable too). Else ``TENSORFLOW_OPS`` in a function traced for a
  SavedModel (TF Serving loads no kernel library). Else the kernels
  (``KernelOps``) only where the library loads and every device is a CPU
  of this process (``in_this_process_cpu``): never for a table on a GPU,
  a parameter server or another worker, nor for no tables (a lookup
  outside training). Else ``TENSORFLOW_OPS``, the same numbers.

  Args:
    devices: the devices of every variable of the engine's tables (and
      slots); none for a lookup outside training.
    concurrent: the step's independent kernel chains that run at once in
      this process: each replica runs one per table or stack (its
      deduplication, gather and update). With one per CPU core or more,
      kernels do not also spread their rows over the threads.
    host: this process's address; None: TensorFlow's.

  Raises:
    ValueError: for ``concurrent`` below 1.

  Example:
    >>> cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    >>> select_ops([cpu, "/job:ps/replica:0/task:0/device:CPU:0"])
    TENSORFLOW_OPS
  """
  if concurrent < 1:
    raise ValueError(f"concurrent must be >= 1, got {concurrent}.")
  if compat.in_xla_context():
    return XLA_OPS
  if compat.in_save_context():
    return TENSORFLOW_OPS
  devices = list(devices)
  if not devices or not all(in_this_process_cpu(d, host) for d in devices):
    return TENSORFLOW_OPS
  module = load()
  if module is None:
    return TENSORFLOW_OPS
  return KernelOps(module, spread=concurrent < cores())


@functools.cache
def cores() -> int:
  """The CPU threads an op can spread over (TensorFlow's intra-op pool)."""
  configured = tf.config.threading.get_intra_op_parallelism_threads()
  return configured or len(os.sched_getaffinity(0))
