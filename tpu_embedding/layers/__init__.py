"""Keras layers: the tensorflow-recommenders and keras-rs embedding layers.

``TPUEmbedding`` and ``PartialTPUEmbedding`` (tensorflow-recommenders') and
``DistributedEmbedding`` (keras-rs'), training inside ``model.fit`` on the
default strategy, ``OneDeviceStrategy``, ``MirroredStrategy`` and
``MultiWorkerMirroredStrategy`` (see ``distributed_fit`` for the Keras 3
fix the layers apply there to their models, and ``fix_distributed_fit`` /
``enable_distributed_fit`` for other models). They subclass the Keras
``tf.keras`` resolves to when this module is imported: Keras 3, or tf-keras
when ``TF_USE_LEGACY_KERAS=1`` (see ``keras_compat``).

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import layers
  >>> table = tpe.TableConfig(1000, 8, name="items")
  >>> layer = layers.TPUEmbedding({"item": tpe.FeatureConfig(table)}, "adam")
  >>> layer.embedding_tables[table].shape
  TensorShape([1000, 8])
"""

from tpu_embedding.layers.distributed_embedding import DistributedEmbedding
from tpu_embedding.layers.distributed_fit import disable_distributed_fit
from tpu_embedding.layers.distributed_fit import distributed_fit_enabled
from tpu_embedding.layers.distributed_fit import enable_distributed_fit
from tpu_embedding.layers.distributed_fit import fix_distributed_fit
from tpu_embedding.layers.partial_tpu_embedding import PartialTPUEmbedding
from tpu_embedding.layers.replicated_embedding import ReplicatedEmbedding
from tpu_embedding.layers.tpu_embedding import TPUEmbedding

__all__ = [
  "DistributedEmbedding",
  "PartialTPUEmbedding",
  "ReplicatedEmbedding",
  "TPUEmbedding",
  "disable_distributed_fit",
  "distributed_fit_enabled",
  "enable_distributed_fit",
  "fix_distributed_fit",
]
