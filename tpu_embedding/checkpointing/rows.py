"""The row reader: rows of a saved table, read without the rest.

TensorFlow's ``RestoreV2`` reads a slice of a saved tensor by reading every
stored piece it overlaps whole. A table saved by one process is one piece:
each worker restoring its rows from it would hold the whole table for a
while, and a parameter server restoring its block in chunks would read its
whole stored block once per chunk. ``SavedRows.read_rows`` reads rows
``[start, start + count)`` of a saved ``[rows, dim]`` tensor, part by
part, holding no more than one part at a time:

* a stored piece (the whole tensor, or one slice of it) that lies wholly
  within those rows and holds at most a chunk (``parts.chunk_rows``: what
  ``tpu_embedding.checkpoints.write`` writes at once) is read whole by
  ``RestoreV2``, which checks its checksum;
* of a larger piece, or one only partly within those rows, the rows are
  read by byte ranges of at most ``range_rows`` from its data file
  (``checkpointing/index.py`` says where a piece's bytes lie; a piece split by
  rows alone keeps each row's bytes together). Their checksum, which
  covers the whole piece, is not checked.

A checkpoint not stored so (a piece split along its columns, another
dtype, a big-endian checkpoint) is read by ``RestoreV2`` a chunk at a
time, as TensorFlow would. ``restore_blocks`` fills a table's row blocks
(``RowBlocks``) so, in place: a restore holds one part beside the tables.
Whole tensors are read by ``read_tensors`` (``RestoreV2``), on the host of
the block they fill (``reading_host``): a parameter server reads its own
rows from the checkpoint files, as TensorFlow's own restore has it do,
rather than receive each part over RPC (held there in a few copies while
it arrives, in a heap the server keeps).

Example:
  >>> import tempfile
  >>> prefix = tempfile.mkdtemp() + "/ckpt"
  >>> whole = tf.reshape(tf.range(12.0), [6, 2])
  >>> parts.write_tensors(prefix, [("t", "", whole)])
  >>> read = SavedRows(prefix).read_rows("t", (6, 2), 2, 3, tf.float32,
  ...                                    whole_rows=6, range_rows=2)
  >>> [(first, part.numpy().tolist()) for first, part in read]
  [(2, [[4.0, 5.0], [6.0, 7.0]]), (4, [[8.0, 9.0]])]
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import sys
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import parts
from tpu_embedding.checkpointing.index import CheckpointIndex
from tpu_embedding.checkpointing.index import UnreadableIndexError
from tpu_embedding.checkpointing.index import slice_key

#: Rows a restore reads at once by byte range, by default: a 64th of a
#: block, between 1 and 16 MiB (a part sent to a parameter server is held
#: there in a few copies while it arrives).
MIN_RANGE_BYTES, MAX_RANGE_BYTES = 2**20, 16 * 2**20


def range_rows(rows: int, width: int, chunk_bytes: int | None = None) -> int:
  """Rows per byte range read into a block of ``rows`` rows: as
  ``chunk_rows``, with a default of a 64th of the block, between
  ``MIN_RANGE_BYTES`` and ``MAX_RANGE_BYTES``."""
  bounds = (MIN_RANGE_BYTES, MAX_RANGE_BYTES)
  return parts.rows_per_part(rows, width, chunk_bytes, 64, bounds)


def read_tensors(
  prefix: str,
  keys: Sequence[str],
  dtypes: Sequence[tf.DType],
  specs: Sequence[str] | None = None,
  host: str = "CPU",
) -> list[tf.Tensor]:
  """TensorFlow's read of ``keys`` (whole, or their slices ``specs``)
  from the checkpoint ``prefix``, checksummed, on ``host`` (default: this
  process's CPU)."""
  with tf.device(host):
    return list(
      tf.raw_ops.RestoreV2(
        prefix=prefix,
        tensor_names=list(keys),
        shape_and_slices=list(specs or [""] * len(keys)),
        dtypes=list(dtypes),
      )
    )


@dataclasses.dataclass(frozen=True)
class _Piece:
  """A stored piece of a saved tensor: rows ``[first, first + rows)``."""

  first: int
  rows: int
  spec: str  # RestoreV2's ``shape_and_slice`` reading it whole
  entry: compat.BundleEntryProto  # where its bytes lie


def _extent(extent: Any) -> tuple[int, int]:  # a protobuf message
  """``(start, length)`` of a ``TensorSliceProto.Extent`` (all: -1)."""
  return (extent.start, extent.length if extent.HasField("length") else -1)


class SavedRows:
  """Reads rows of the tensors of one checkpoint.

  Args:
    prefix: the checkpoint's prefix (``save_path``); its index is read
      when first needed, once.
    io_device: the device that reads the files for every block
      (``tf.train.CheckpointOptions.experimental_io_device``); None
      (default): each block's own host (``reading_host``).
  """

  def __init__(self, prefix: str, io_device: str | None = None):
    self.prefix = prefix
    self.io_device = io_device

  @functools.cached_property
  def _index(self) -> CheckpointIndex | None:
    """The checkpoint's index, if this reads it (read when first used)."""
    try:
      index = CheckpointIndex(self.prefix)
    except (UnreadableIndexError, tf.errors.OpError):
      return None  # RestoreV2 reads it (and says what is wrong with it).
    little = compat.BundleHeaderProto.LITTLE
    if index.header.endianness != little or sys.byteorder != "little":
      return None
    return index

  def saved_dtype(self, key: str) -> tf.DType | None:
    """The type ``key`` is saved in (None where this does not read the
    index: ``read_rows`` then reads the type asked for)."""
    index = self._index
    entry = None if index is None else index.entry(key.encode())
    return None if entry is None else tf.as_dtype(entry.dtype)

  def holds(self, key: str) -> bool:
    """Whether the checkpoint holds ``key`` (True where its index cannot
    be read here: ``read_rows`` then says what is wrong)."""
    return self._index is None or self._index.entry(key.encode()) is not None

  def read_rows(
    self,
    key: str,
    full_shape: Sequence[int],
    start: int,
    count: int,
    dtype: tf.DType,
    *,
    whole_rows: int,
    range_rows: int,
    host: str = "CPU",
  ) -> Iterator[tuple[int, tf.Tensor]]:
    """Rows ``[start, start + count)`` of checkpoint ``key``, part by part.

    Args:
      key: the tensor's checkpoint key.
      full_shape: its ``[rows, dim]``.
      start: the first row read.
      count: rows read.
      dtype: its dtype.
      whole_rows: the most rows of a stored piece read whole.
      range_rows: the most rows read at once by byte range.
      host: the CPU device that reads parts ``RestoreV2`` reads (default:
        this process's); byte ranges are read by this process.

    Yields:
      ``(first row, value)`` of each part, in order.
    """
    end = start + count
    pieces = [
      piece
      for piece in self._pieces(key, full_shape, dtype) or ()
      if piece.first < end and start < piece.first + piece.rows
    ]
    held = sum(min(end, p.first + p.rows) - max(start, p.first) for p in pieces)
    if held != count:
      # Not stored by rows: TensorFlow reads it (or says why it cannot).
      for first in range(start, end, whole_rows):
        rows = min(whole_rows, end - first)
        spec = parts.slice_spec(full_shape, [(first, rows), (0, -1)])
        yield first, read_tensors(self.prefix, [key], [dtype], [spec], host)[0]
      return
    for piece in sorted(pieces, key=lambda p: p.first):
      low, high = max(start, piece.first), min(end, piece.first + piece.rows)
      whole = (low, high) == (piece.first, piece.first + piece.rows)
      # (TensorFlow reads no float16 slice: ``Dtype half not supported``.)
      by_tensorflow = not piece.spec or dtype != tf.float16
      if whole and piece.rows <= whole_rows and by_tensorflow:
        (value,) = read_tensors(self.prefix, [key], [dtype], [piece.spec], host)
        yield low, value
        continue
      for first in range(low, high, range_rows):
        rows = min(range_rows, high - first)
        yield first, self._read_bytes(key, piece, first, rows, dtype)

  def read_float32_rows(
    self,
    key: str,
    full_shape: Sequence[int],
    start: int,
    count: int,
    dtype: tf.DType,
    chunk_bytes: int | None = None,
  ) -> Iterator[tuple[int, tf.Tensor]]:
    """``read_rows`` in the type ``key`` is saved in (``dtype`` where the
    index is not read), each part cast to float32 (exact from 16 bits);
    parts of at most ``chunk_bytes`` (None: the defaults of
    ``parts.chunk_rows`` and ``range_rows``)."""
    width = int(full_shape[1])
    pieces = self.read_rows(
      key,
      full_shape,
      start,
      count,
      self.saved_dtype(key) or dtype,
      whole_rows=parts.chunk_rows(count, width, chunk_bytes),
      range_rows=range_rows(count, width, chunk_bytes),
    )
    for first, value in pieces:
      yield first, tf.cast(value, tf.float32)

  def _read_bytes(
    self, key: str, piece: _Piece, first: int, rows: int, dtype: tf.DType
  ) -> tf.Tensor:
    """Rows ``[first, first + rows)`` of ``piece``, from its data file."""
    assert self._index is not None  # (pieces come from the index)
    width = int(piece.entry.shape.dim[1].size)
    size = rows * width * dtype.size
    offset = piece.entry.offset + (first - piece.first) * width * dtype.size
    try:
      with tf.io.gfile.GFile(self._index.data_file(piece.entry), "rb") as f:
        f.seek(offset)
        data = f.read(size)
    except tf.errors.OutOfRangeError:  # (past the end of the file)
      data = b""
    if len(data) != size:
      raise tf.errors.DataLossError(
        None, None, f"{self.prefix}: the data file of '{key}' is truncated."
      )
    with tf.device("CPU"):
      return tf.constant(
        np.frombuffer(data, dtype.as_numpy_dtype).reshape(rows, width)
      )

  def _pieces(
    self, key: str, full_shape: Sequence[int], dtype: tf.DType
  ) -> list[_Piece] | None:
    """The stored pieces of ``key``, or None where they are not stored by
    rows as this reads them."""
    index = self._index
    entry = None if index is None else index.entry(key.encode())
    if index is None or entry is None or entry.dtype != dtype.as_datatype_enum:
      return None
    shape = [int(d.size) for d in entry.shape.dim]
    if len(shape) != 2 or shape != [int(d) for d in full_shape]:
      return None
    if not entry.slices:
      return [_Piece(0, shape[0], "", entry)]
    pieces = []
    for stored in entry.slices:
      extents = [_extent(e) for e in stored.extent]
      if len(extents) != 2 or extents[1] not in ((0, -1), (0, shape[1])):
        return None  # Split along the columns.
      first, rows = extents[0]
      rows = shape[0] if rows < 0 else rows
      found = index.entry(slice_key(key, extents))
      if found is None or found.size != rows * shape[1] * dtype.size:
        return None
      pieces.append(
        _Piece(first, rows, parts.slice_spec(shape, extents), found)
      )
    return pieces


class RowBlocks(abc.ABC):
  """A table variable held as row blocks, which a restore fills in place
  (``tpu_embedding.checkpoints.restore``)."""

  @property
  @abc.abstractmethod
  def shape(self) -> tf.TensorShape:
    """The whole ``[vocabulary_size, dim]``."""

  @abc.abstractmethod
  def row_blocks(self) -> list[tuple[tf.Variable, int]]:
    """This process's blocks, each with its first row."""

  def restore_rows(
    self, saved: SavedRows, key: str, chunk_bytes: int | None = None
  ) -> None:
    """Reads this process's rows of checkpoint ``key``, part by part."""
    restore_blocks(self.row_blocks(), saved, key, self.shape, chunk_bytes)


def restore_rows(
  variable: Any, saved: SavedRows, key: str, chunk_bytes: int | None = None
) -> None:
  """Reads checkpoint ``key`` into ``variable``, part by part: this
  process's row blocks (``RowBlocks``), or a plain variable as one block."""
  if isinstance(variable, RowBlocks):
    variable.restore_rows(saved, key, chunk_bytes)
  else:
    restore_blocks([(variable, 0)], saved, key, variable.shape, chunk_bytes)


def reading_host(device: str) -> str:
  """The CPU that reads a checkpoint's parts into a block on ``device``:
  that device's host (a parameter server's own CPU; ``RestoreV2`` runs on
  CPUs only), or this process's where ``device`` names none.

  Example:
    >>> reading_host("/job:ps/replica:0/task:1/device:CPU:0")
    '/job:ps/replica:0/task:1/device:CPU:0'
    >>> reading_host("/job:worker/replica:0/task:0/device:GPU:1")
    '/job:worker/replica:0/task:0/device:CPU:0'
    >>> reading_host("")
    'CPU'
  """
  spec = tf.DeviceSpec.from_string(device)
  if spec.job is None:
    return "CPU"
  return spec.replace(device_type="CPU", device_index=0).to_string()


def restore_blocks(
  blocks: Sequence[tuple[tf.Variable, int]],
  saved: SavedRows,
  key: str,
  full_shape: Sequence[int],
  chunk_bytes: int | None = None,
) -> None:
  """Reads each block's rows of checkpoint ``key`` into it, part by part.

  Each part is read alone (``SavedRows.read_rows``) and scattered into its
  rows in place, so the restore holds one part beside the blocks. A part
  saved in another float type than its block's is cast to it (round to
  nearest: a table's ``RowStorage`` may differ from the saving run's).

  Args:
    blocks: ``(variable, its first row)`` per block.
    saved: the checkpoint.
    key: the tensor's checkpoint key.
    full_shape: the tensor's ``[rows, dim]``.
    chunk_bytes: the most bytes read at once (at least one row); None:
      ``parts.chunk_rows`` for stored pieces read whole, ``range_rows`` for byte
      ranges.
  """
  rows, width = int(blocks[0][0].shape[0]), int(full_shape[1])
  sizes = {
    "whole_rows": parts.chunk_rows(rows, width, chunk_bytes),
    "range_rows": range_rows(rows, width, chunk_bytes),
  }
  saved_dtype = saved.saved_dtype(key)
  for variable, start in blocks:
    count = int(variable.shape[0])
    dtype = saved_dtype or variable.dtype
    host = saved.io_device or reading_host(variable.device)
    pieces = saved.read_rows(
      key, full_shape, start, count, dtype, **sizes, host=host
    )
    for first, value in pieces:
      with tf.device(variable.device):
        tf.raw_ops.ResourceScatterUpdate(
          resource=variable.handle,
          indices=tf.range(
            first - start, first - start + value.shape[0], dtype=tf.int64
          ),
          updates=tf.cast(value, variable.dtype),
        )
      del value
