"""Dynamic vocabularies: raw keys mapped to a bounded set of rows.

``config.py`` holds ``DynamicVocabulary`` (the rules, with their math);
``buckets.py`` where keys live; ``transition.py`` one training step of
the state, in TensorFlow ops.
"""

from tpu_embedding.vocabularies.config import DynamicVocabulary

__all__ = ["DynamicVocabulary"]
