"""The one home of the checkpoint file format (TensorFlow's V2 bundles).

* ``parts``: the part writer: slice specs, chunks, parts written by every
  worker, merged and committed atomically; ``save_id``.
* ``rows``: the row reader: a table's rows read part by part (whole
  pieces checksummed, larger ones by byte ranges), ``read_tensors``.
* ``index``: where each saved piece's bytes lie (the index's format).
* ``slicing``: what state spread over workers saves (``WorkerParts``).
* ``full``, ``deltas``, ``manager``: full saves, delta saves and
  ``CheckpointManager``, built on them (public: ``tpu_embedding.checkpoints``).

Example:
  >>> from tpu_embedding.checkpointing import parts
  >>> parts.slice_spec([6, 2], [(0, 3), (0, -1)])
  '6 2 0,3:-'
"""
