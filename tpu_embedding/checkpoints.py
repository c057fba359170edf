"""Checkpoints in which each worker writes and reads only its own rows.

The public names of ``tpu_embedding.checkpointing``: full saves
(``write``, ``restore``: ``checkpointing/full.py``), deltas
(``write_delta``, ``apply_deltas``: ``checkpointing/deltas.py``) and
``CheckpointManager`` with a directory's chain of saves
(``checkpointing/manager.py``).

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(tpe.TableConfig(8, 2)),
  ...                        tpe.SGD(0.1))
  >>> emb.build()
  >>> checkpoint = tf.train.Checkpoint(embedding=emb)
  >>> path = tpe.checkpoints.write(checkpoint, tempfile.mkdtemp() + "/ckpt")
  >>> _ = tpe.checkpoints.restore(checkpoint, path)
"""

from __future__ import annotations

from tpu_embedding.checkpointing.deltas import DeltaMismatchError
from tpu_embedding.checkpointing.deltas import apply_deltas
from tpu_embedding.checkpointing.deltas import write_delta
from tpu_embedding.checkpointing.full import restore
from tpu_embedding.checkpointing.full import write
from tpu_embedding.checkpointing.keys import key_id
from tpu_embedding.checkpointing.manager import DELTA_STATE  # noqa: F401
from tpu_embedding.checkpointing.manager import CheckpointManager
from tpu_embedding.checkpointing.manager import chain_end
from tpu_embedding.checkpointing.manager import latest_with_deltas
from tpu_embedding.checkpointing.manager import saved_chain
from tpu_embedding.checkpointing.manager import write_chain

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
