"""tpu_embedding: TensorFlow's TPUEmbedding mid-level API on any strategy.

``import tpu_embedding as tpe`` is a drop-in for
``tf.tpu.experimental.embedding``: the same configs, optimizers and
``enqueue`` → ``dequeue`` → ``apply_gradients`` loop, training with TPU
semantics on CPU and GPU.

Example:
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(vocabulary_size=1000, dim=16, name="items")
  >>> emb = tpe.TPUEmbedding({"item": tpe.FeatureConfig(table)},
  ...                        optimizer=tpe.Adagrad(0.1))
  >>> emb.embedding_tables[table].shape
  TensorShape([1000, 16])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpu_embedding import checkpoints
from tpu_embedding import errors
from tpu_embedding import memory
from tpu_embedding import servers
from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import QuantizationConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.embedding import TPUEmbedding
from tpu_embedding.embedding import TPUEmbeddingV3
from tpu_embedding.initializers import RowIdInitializer
from tpu_embedding.optimizers import FTRL
from tpu_embedding.optimizers import SGD
from tpu_embedding.optimizers import Adagrad
from tpu_embedding.optimizers import AdagradMomentum
from tpu_embedding.optimizers import Adam
from tpu_embedding.row_storage import RowStorage
from tpu_embedding.serving import TPUEmbeddingForServing
from tpu_embedding.serving import serving_embedding_lookup
from tpu_embedding.vocabularies import DynamicVocabulary

if TYPE_CHECKING:
  from types import ModuleType

#: TensorFlow's SparseCore class name; the same object here.
TPUEmbeddingV2 = TPUEmbeddingV3

__version__ = "0.1.0"

__all__ = [
  "Adagrad",
  "AdagradMomentum",
  "Adam",
  "DynamicVocabulary",
  "FTRL",
  "FeatureConfig",
  "QuantizationConfig",
  "RowIdInitializer",
  "RowStorage",
  "SGD",
  "TPUEmbedding",
  "TPUEmbeddingForServing",
  "TPUEmbeddingV2",
  "TPUEmbeddingV3",
  "TableConfig",
  "checkpoints",
  "errors",
  "memory",
  "servers",
  "serving_embedding_lookup",
]


def __getattr__(name: str) -> ModuleType:
  """``tpe.layers`` on first use, so importing the package loads no Keras.

  (The layers subclass whichever Keras ``tf.keras`` resolves to; see
  ``tpu_embedding.layers.keras_compat``.)
  """
  if name == "layers":
    import importlib

    return importlib.import_module("tpu_embedding.layers")
  raise AttributeError(f"module 'tpu_embedding' has no attribute {name!r}")
