"""Dynamic vocabularies at run time: the state that gives keys rows.

The declaration lives with the key mappings (``keys/``):
``DynamicVocabulary`` (the rules, with their math), the ``DynamicMapping``
a dynamic table's resolved table carries, and the buckets keys live in.
Here: ``transition.py`` one training step of the state, in TensorFlow
ops; ``state.py`` the state's copies and checkpoint, ``sharded_state.py``
its shards (row-sharded tables); ``sharing.py`` what a step's replicas
exchange; ``dynamic_tables.py`` what the engine calls around a lookup, and
the states serving reads.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import vocabularies
  >>> vocabularies.DynamicVocabulary is tpe.DynamicVocabulary
  True
"""

from tpu_embedding.keys.vocabulary import DynamicVocabulary

__all__ = ["DynamicVocabulary"]
