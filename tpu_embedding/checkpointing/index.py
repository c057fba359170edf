"""Where each saved tensor's bytes lie in a TensorFlow checkpoint.

A TensorFlow (V2) checkpoint ``<prefix>`` is an index, ``<prefix>.index``,
and data files, ``<prefix>.data-SSSSS-of-NNNNN``. The index is a sorted
table in LevelDB's format (blocks of prefix-compressed keys, an index
block of the blocks, a footer) from each key to a ``BundleEntryProto``:
the tensor's dtype, shape, data file, byte offset and size; or, for a
tensor saved in slices (by several workers, parameter servers, or in
chunks), the slices, each an entry of its own under an encoded key
(``slice_key``). A stored tensor or slice is its elements' raw bytes, in
row-major order.

TensorFlow reads a slice of a saved tensor by reading every stored piece
it overlaps whole (``RestoreV2``); it has no API saying where a piece's
bytes are. This module reads the index, so that ``rows.SavedRows`` can read
some rows of a piece alone.

Example:
  >>> slice_key("t", [(2, 3), (0, -1)]).hex()
  '0074000101028283807f'
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding import compat

#: The last 8 bytes of a LevelDB-format table (little-endian).
_MAGIC = 0xDB4775248B80FB57
#: The footer: two block handles (varints, padded to 40 bytes), the magic.
_FOOTER_BYTES = 48
#: After each block: its compression type (1 byte) and checksum (4 bytes).
_TRAILER_BYTES = 5


class UnreadableIndexError(ValueError):
  """The index is not in the format this module reads (e.g. compressed)."""


def _varint(data: bytes, position: int) -> tuple[int, int]:
  """The varint at ``position`` and the position after it."""
  value = shift = 0
  while True:
    if position >= len(data):
      raise UnreadableIndexError("truncated varint")
    byte = data[position]
    position += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value, position
    shift += 7


def _block(data: bytes, handle: bytes, position: int = 0) -> bytes:
  """The contents of the block whose handle is ``handle[position:]``."""
  offset, position = _varint(handle, position)
  size, _ = _varint(handle, position)
  if offset + size + _TRAILER_BYTES > len(data):
    raise UnreadableIndexError("a block lies past the end of the index")
  if data[offset + size] != 0:  # TensorFlow writes indexes uncompressed.
    raise UnreadableIndexError("compressed index block")
  return data[offset : offset + size]


def _entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
  """The ``(key, value)`` entries of one block, in order."""
  if len(block) < 4:
    raise UnreadableIndexError("a block too short for its restart count")
  (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
  end = len(block) - 4 * (restarts + 1)
  key = b""
  position = 0
  while position < end:
    shared, position = _varint(block, position)
    unshared, position = _varint(block, position)
    length, position = _varint(block, position)
    key = key[:shared] + block[position : position + unshared]
    position += unshared
    yield key, block[position : position + length]
    position += length


def read_entries(index: bytes) -> dict[bytes, bytes]:
  """``{key: serialized value}`` of every entry of a checkpoint's index.

  Args:
    index: the bytes of ``<prefix>.index``.

  Raises:
    UnreadableIndexError: not a LevelDB-format table, or compressed.
  """
  if len(index) < _FOOTER_BYTES:
    raise UnreadableIndexError("shorter than a footer")
  footer = index[-_FOOTER_BYTES:]
  if struct.unpack("<Q", footer[-8:])[0] != _MAGIC:
    raise UnreadableIndexError("no table magic number")
  _, position = _varint(footer, _varint(footer, 0)[1])  # the meta index
  entries: dict[bytes, bytes] = {}
  for _, handle in _entries(_block(index, footer, position)):
    entries.update(_entries(_block(index, handle)))
  return entries


class CheckpointIndex:
  """The entries of one checkpoint's index, parsed when asked for.

  Attributes:
    prefix: the checkpoint's prefix.
    header: its ``BundleHeaderProto`` (shards, endianness).
  """

  def __init__(self, prefix: str):
    with tf.io.gfile.GFile(f"{prefix}.index", "rb") as f:
      self._entries = read_entries(f.read())
    self.prefix = prefix
    self.header = compat.BundleHeaderProto.FromString(
      self._entries.get(b"", b"")
    )

  def entry(self, key: bytes) -> compat.BundleEntryProto | None:
    """The entry of ``key`` (a name, or a ``slice_key``), or None."""
    value = self._entries.get(key)
    return None if value is None else compat.BundleEntryProto.FromString(value)

  def data_file(self, entry: compat.BundleEntryProto) -> str:
    """The data file holding ``entry``'s bytes."""
    shards = self.header.num_shards
    return f"{self.prefix}.data-{entry.shard_id:05d}-of-{shards:05d}"


def _unsigned(value: int) -> bytes:
  """TensorFlow's ordered code of a non-negative number: its length, then
  its big-endian bytes."""
  size = (value.bit_length() + 7) // 8
  return bytes([size]) + value.to_bytes(size, "big")


def _signed(value: int) -> bytes:
  """TensorFlow's ordered code of a signed number: ``n`` bytes hold a
  number in ``[-2**(7n-1), 2**(7n-1))``, two's complement, big-endian,
  with ``n`` leading bits set (for a non-negative number) over it."""
  size = (value if value >= 0 else ~value).bit_length() // 7 + 1
  header = ((1 << size) - 1) << (7 * size)
  bits = (value & ((1 << (8 * size)) - 1)) ^ header
  return bits.to_bytes(size, "big")


#: How ordered code writes the bytes 0 and 255 of a string.
_ESCAPED = {0: b"\x00\xff", 255: b"\xff\x00"}


def slice_key(name: str, extents: Sequence[tuple[int, int]]) -> bytes:
  """The index key of a stored slice of tensor ``name``.

  Args:
    name: the tensor's checkpoint key.
    extents: ``(start, length)`` per dimension; length -1 for all of it.

  Returns:
    The key TensorFlow writes the slice's entry under (its
    ``EncodeTensorNameSlice``: 0, the escaped name, the rank, then each
    extent, in ordered code).
  """
  escaped = b"".join(  # 0 and 255 escaped, the others as they are
    _ESCAPED.get(byte, bytes([byte])) for byte in name.encode()
  )
  key = _unsigned(0) + escaped + b"\x00\x01" + _unsigned(len(extents))
  for start, length in extents:
    key += _signed(start) + _signed(length)
  return key
