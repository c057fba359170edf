"""Ranking inputs: Criteo (raw TSV, PaddleRec sample, synthetic), MovieLens.

Modules: ``criteo`` (reader and config), ``criteo_tsv`` and ``paddlerec``
(line parsers), ``text_files`` (sharded text files read as chunks of
numbered lines), ``bad_records`` (raise on, or skip and count, bad lines),
``multi_hot`` (DLRM-DCNv2 multi-hot ids), ``synthetic`` (Criteo-like
generated data), ``movielens`` (MovieLens 100K from an installed package)
and ``movielens_tfds`` (the same through TFDS).
"""
