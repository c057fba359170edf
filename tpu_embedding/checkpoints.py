"""Checkpoints in which each worker writes and reads only its own rows.

The public names of ``tpu_embedding.checkpointing``: full saves
(``write``, ``restore``: ``checkpointing/full.py``), deltas
(``write_delta``, ``apply_deltas``: ``checkpointing/deltas.py``) and
``CheckpointManager`` with a directory's chain of saves
(``checkpointing/manager.py``).

Example:
  >>> import tpu_embedding as tpe
  >>> tpe.checkpoints.chain_end("/run/ckpt-2", [])
  '/run/ckpt-2'
"""

from __future__ import annotations

from tpu_embedding.checkpointing.deltas import DeltaMismatchError
from tpu_embedding.checkpointing.deltas import apply_deltas
from tpu_embedding.checkpointing.deltas import write_delta
from tpu_embedding.checkpointing.full import restore
from tpu_embedding.checkpointing.full import write
from tpu_embedding.checkpointing.manager import DELTA_STATE  # noqa: F401
from tpu_embedding.checkpointing.manager import CheckpointManager
from tpu_embedding.checkpointing.manager import chain_end
from tpu_embedding.checkpointing.manager import latest_with_deltas
from tpu_embedding.checkpointing.manager import saved_chain
from tpu_embedding.checkpointing.manager import write_chain
from tpu_embedding.checkpointing.parts import key_id

__all__ = [
  "CheckpointManager",
  "DeltaMismatchError",
  "apply_deltas",
  "chain_end",
  "key_id",
  "latest_with_deltas",
  "restore",
  "saved_chain",
  "write",
  "write_chain",
  "write_delta",
]
