"""TPU topologies with SparseCores: generations, slice presets, ``Topology``.

A SparseCore embedding is spread over every SparseCore of a slice: its
``num_chips`` chips times ``num_sc_per_chip`` SparseCores each (the
*shards*; TensorFlow shards ids with a bit mask, so there must be a power
of two of them). ``topology`` reads Cloud TPU slice names, which count
TensorCores (``v5p-8`` is 4 chips).

Example:
  >>> from tpu_embedding.fdo import topologies
  >>> topologies.topology("v6e-16")
  Topology(num_chips=16, num_sc_per_chip=2, name='v6e-16')
  >>> topologies.Topology(2, 4).num_sc_shards
  8
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Generation:
  """A TPU generation with SparseCores.

  Attributes:
    sparse_cores_per_chip: SparseCores per chip.
    cores_per_chip: TensorCores per chip, which is what the number in a
      slice name (``v5p-8``) counts.
  """

  sparse_cores_per_chip: int
  cores_per_chip: int


#: The TPU generations that have SparseCores. Slice names count TensorCores
#: (``v5p-8`` is 4 chips; ``v6e-8`` is 8 chips; ``v7x-8`` is 4 chips).
GENERATIONS: dict[str, Generation] = {
  "v5p": Generation(sparse_cores_per_chip=4, cores_per_chip=2),
  "v6e": Generation(sparse_cores_per_chip=2, cores_per_chip=1),
  "v7x": Generation(sparse_cores_per_chip=4, cores_per_chip=2),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """The SparseCores an embedding is spread over.

  Attributes:
    num_chips: TPU chips (TensorFlow's ``num_replicas_in_sync`` under
      ``TPUStrategy``).
    num_sc_per_chip: SparseCores per chip.
    name: the preset it came from, if any.
  """

  num_chips: int
  num_sc_per_chip: int
  name: str | None = None

  def __post_init__(self):
    for field in ("num_chips", "num_sc_per_chip"):
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
          f"Topology {field} must be a positive integer; got {value!r}."
        )
    shards = self.num_sc_shards
    if shards & (shards - 1):
      raise ValueError(
        f"Topology {self.describe()}: {self.num_chips} chips x "
        f"{self.num_sc_per_chip} SparseCores = {shards} SparseCore shards, "
        "not a power of two; TPUEmbeddingV2 shards ids with a bit mask and "
        "needs a power of two."
      )

  @property
  def num_sc_shards(self) -> int:
    """SparseCores in all: the shards a table's rows are spread over."""
    return self.num_chips * self.num_sc_per_chip

  def describe(self) -> str:
    core = f"{self.num_chips} chips x {self.num_sc_per_chip} SparseCores"
    return f"{self.name} ({core})" if self.name else core

  def to_json(self) -> dict[str, Any]:
    return {
      "name": self.name,
      "num_chips": self.num_chips,
      "num_sc_per_chip": self.num_sc_per_chip,
    }


def topology(spec: Any) -> Topology:
  """A ``Topology`` from a preset name, a pair or a ``Topology``.

  Args:
    spec: ``"v5p-8"``, ``"v6e-16"``, ``"v7x-8"`` (generation and the
      slice's TensorCore count, as Cloud TPU names slices), a generation
      alone (``"v6e"``: one chip), ``(num_chips, num_sc_per_chip)``, a
      ``{"num_chips": ..., "num_sc_per_chip": ...}`` dict or a
      ``Topology``.

  Returns:
    The ``Topology``.

  Raises:
    ValueError: for an unknown generation or a malformed name.

  Example:
    >>> topology("v5p-8")
    Topology(num_chips=4, num_sc_per_chip=4, name='v5p-8')
    >>> topology("v6e-16").num_sc_shards
    32
  """
  if isinstance(spec, Topology):
    return spec
  if isinstance(spec, Mapping):
    return Topology(
      int(spec["num_chips"]), int(spec["num_sc_per_chip"]), spec.get("name")
    )
  if isinstance(spec, (tuple, list)) and len(spec) == 2:
    return Topology(int(spec[0]), int(spec[1]))
  if not isinstance(spec, str):
    raise ValueError(
      f"Unknown TPU topology {spec!r}: give a name such as 'v5p-8', a "
      "(num_chips, num_sc_per_chip) pair or a Topology."
    )
  name = spec.strip().lower()
  generation, _, count = name.partition("-")
  if generation not in GENERATIONS:
    raise ValueError(
      f"Unknown TPU topology {spec!r}: the TPU generations with "
      f"SparseCores are {sorted(GENERATIONS)} (e.g. 'v5p-8', 'v6e-16'); "
      "for another, pass (num_chips, num_sc_per_chip)."
    )
  gen = GENERATIONS[generation]
  if not count:
    return Topology(1, gen.sparse_cores_per_chip, name)
  if not count.isdigit() or int(count) % gen.cores_per_chip:
    raise ValueError(
      f"Unknown TPU topology {spec!r}: a {generation} slice is named "
      f"'{generation}-N' with N TensorCores, a multiple of "
      f"{gen.cores_per_chip}."
    )
  return Topology(
    int(count) // gen.cores_per_chip, gen.sparse_cores_per_chip, name
  )
