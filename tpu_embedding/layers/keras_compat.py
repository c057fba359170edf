"""The Keras the layers are built on: the one ``tf.keras`` resolves to.

TensorFlow 2.21 resolves ``tf.keras`` to Keras 3, or to tf-keras (Keras 2)
when ``TF_USE_LEGACY_KERAS=1`` is set before Keras is first loaded. The
layers subclass ``tf.keras.layers.Layer``, decided once, when
``tpu_embedding.layers`` is imported, so they plug into the same Keras as
the user's models (``keras.Model`` with Keras 3; ``tf.keras.Model`` and
``tfrs.Model`` with tf-keras). Everything that differs between the two
Keras versions is in this module.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.layers import keras_compat
  >>> keras_compat.Layer is tf.keras.layers.Layer
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import TypeAlias

import tensorflow as tf

from tpu_embedding import compat

#: Whether TensorFlow's ``tf.keras`` is Keras 3 (False: tf-keras). Asking
#: ``tf.keras`` itself keeps TensorFlow's rule the only one.
IS_KERAS_3 = not tf.keras.layers.Layer.__module__.startswith("tf_keras")

if IS_KERAS_3:
  import keras
else:
  import tf_keras as keras  # noqa: F401 (installed with TF_USE_LEGACY_KERAS)

#: The base class of every layer in ``tpu_embedding.layers`` (an explicit
#: alias: mypy, meeting it inside the package's import cycle, would take it
#: for a variable).
Layer: TypeAlias = keras.layers.Layer


def in_symbolic_call() -> bool:
  """Whether Keras is calling a layer only to infer its output shapes.

  Keras 3 traces ``call`` in a scratch graph to build functional models
  and, under a ``tf.distribute`` strategy, to build any model before
  ``fit``. There it feeds the mean of the first batch over the replicas,
  which turns integer ids into floats: a lookup must not run then.

  Returns:
    True inside Keras 3's symbolic scope; always False with tf-keras.
  """
  if not IS_KERAS_3:
    return False
  return compat.keras_in_symbolic_scope()


def register_serializable(cls: type) -> type:
  """Registers ``cls`` for Keras saving as ``tpu_embedding>ClassName``."""
  register: Callable[[type], Any] = keras.saving.register_keras_serializable(
    package="tpu_embedding"
  )
  return register(cls)
