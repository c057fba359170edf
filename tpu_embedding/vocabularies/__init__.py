"""Dynamic vocabularies: raw keys mapped to a bounded set of rows.

``config.py`` holds ``DynamicVocabulary`` (the rules, with their math);
``mapping.py`` the ``DynamicMapping`` a dynamic table's resolved table
carries (its ``keys.KeyMapping``: what inputs, serving, export and the
engine ask); ``buckets.py`` where keys live; ``transition.py`` one
training step of the state, in TensorFlow ops; ``state.py`` the state's
copies and checkpoint, ``sharded_state.py`` its shards (row-sharded
tables); ``sharing.py`` what a step's replicas exchange;
``dynamic_tables.py`` what the engine calls around a lookup, and the
states serving reads.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import vocabularies
  >>> vocabularies.DynamicVocabulary is tpe.DynamicVocabulary
  True
"""

from tpu_embedding.vocabularies.config import DynamicVocabulary

__all__ = ["DynamicVocabulary"]
