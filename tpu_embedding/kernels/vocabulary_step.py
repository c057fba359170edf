"""A dynamic vocabulary's training step in one kernel (``TpeVocabularyStep``).

``vocabularies/transition.advance`` asks the step's ops
(``kernels/ops.py``) first; TensorFlow's return None and the TensorFlow
ops of ``transition.py`` run instead, with the same outputs and the same
state after the step (``tests/vocabularies/test_vocabulary.py`` runs both
against the oracle); the kernel ops call ``vocabulary_step``.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import kernels
  >>> from tpu_embedding.vocabularies.transition import VocabularyVariables
  >>> state = VocabularyVariables(tpe.DynamicVocabulary(bucket_size=4), 4)
  >>> module = kernels.load()
  >>> step = module and vocabulary_step(
  ...     module, state, tf.constant([7, 9, 7], tf.int64))
  >>> step is None or step[0].numpy().tolist() == [0, 1, 0]
  True
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

#: The state variables the kernel takes, in its input order.
STATE = (
  "keys",
  "last_step",
  "counts",
  "probation_keys",
  "probation_last_step",
  "probation_counts",
  "step",
  "evictions",
)


def vocabulary_step(
  module: Any, variables: Any, occurrences: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
  """``(rows, new_rows)`` of one step by the ``TpeVocabularyStep`` kernel.

  Args:
    module: the loaded kernel module.
    variables: a ``vocabularies.transition.VocabularyVariables``.
    occurrences: ``[m]`` int64 keys of the global batch, in order.
  """
  vocabulary = variables.vocabulary
  return module.tpe_vocabulary_step(
    *[variables[name].handle for name in STATE],
    occurrences,
    num_buckets=variables.layout.num_buckets,
    first_bucket=variables.layout.first_bucket,
    local_buckets=variables.layout.num_local_buckets,
    capacity=variables.layout.capacity,
    min_count=vocabulary.min_count,
    probation_size=variables.probation,
    lfu=vocabulary.eviction == "lfu",
    ttl_steps=vocabulary.ttl_steps or 0,
  )
