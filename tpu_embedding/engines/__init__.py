"""Engines: what runs the embedding on each platform (see ``base.py``).

Example:
  >>> from tpu_embedding import engines
  >>> engines.OffTPUEngine.__name__
  'OffTPUEngine'
"""

from tpu_embedding.engines.base import Engine
from tpu_embedding.engines.off_tpu import OffTPUEngine
from tpu_embedding.engines.selection import select_engine
from tpu_embedding.engines.tpu import SparseCoreEngine
from tpu_embedding.engines.tpu import TPUEngine

__all__ = [
  "Engine",
  "OffTPUEngine",
  "SparseCoreEngine",
  "TPUEngine",
  "select_engine",
]
