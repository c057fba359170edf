"""The off-TPU training step, as the engine runs it.

``activations.py`` is the one lookup path (features prepared, gated,
grouped, gathered, combined, split back into activations);
``steps.py`` keeps each step's bookkeeping (what ``enqueue`` gave, what
``dequeue`` and ``apply_gradients`` find); ``pipelining.py`` says when
updates land (at once, or one step late under
``pipeline_execution_with_tensor_core``); ``output_shapes.py`` holds
TPU's output-shape rules. ``engines/off_tpu.py`` runs them.

Example:
  >>> from tpu_embedding.step import pipelining
  >>> pipelining.UpdateSchedule.__name__
  'UpdateSchedule'
"""
