"""Error texts shared across modules.

Texts that TensorFlow's ``tf.tpu.experimental.embedding`` raises are kept
word for word where a user may match on them; the rest name the feature path
or table, say what was received and what is allowed.

Example:
  >>> from tpu_embedding import errors
  >>> errors.UNIQUE_TABLE_NAMES.format(name="t")
  'Tables must have a unique name. Multiple tables with name t found.'
"""

import tensorflow as tf

UNIQUE_TABLE_NAMES = (
  "Tables must have a unique name. Multiple tables with name {name} found."
)
UNSUPPORTED_OPTIMIZER = (
  "{type} is an unsupported optimizer class. Please pass an instance of one "
  "of the optimizer classes under tpu_embedding (or "
  "tf.tpu.experimental.embedding)."
)
NOT_BUILT = (
  "{method} called on unbuilt TPUEmbedding object. Please either call "
  "enqueue first or manually call the build method."
)
DENSE_WEIGHTS = (
  "Weight specified for dense input {path}, which is not allowed. Weight "
  "will always be 1 in this case."
)
WEIGHT_TYPE = (
  "Weight for {path} is type {weight_type} which does not match type input "
  "which is {input_type}."
)
SEQUENCE_DENSE = (
  "Feature {path} is a sequence feature but a dense tensor was passed."
)
SEQUENCE_WEIGHTS = (
  "Weight specified for {path}, but this is a sequence feature "
  "(max_sequence_length={length}); sequence features take no weights."
)
UNKNOWN_INPUT_TYPE = (
  "Input {path} is of unknown type {type}. Please only pass Tensor, "
  "SparseTensor or RaggedTensor as input to enqueue."
)
NON_INTEGER_IDS = (
  "Input {path} has ids of dtype {dtype}; embedding ids must be an integer "
  "dtype (int32 or int64)."
)
NON_FLOAT_WEIGHTS = (
  "Weight for {path} has dtype {dtype}; weights must be a floating dtype "
  "(float16, bfloat16, float32 or float64)."
)
DENSE_RANK = (
  "Input {path}: only rank 1 and above dense tensors are supported, got a "
  "dense tensor of rank {rank}."
)
SPARSE_RANK = (
  "Input {path}: only rank 2 and above sparse tensors are supported, got a "
  "sparse tensor of rank {rank}."
)
RAGGED_RANK = (
  "Input {path}: only rank 2 ragged tensors are supported, got a ragged "
  "tensor of rank {rank}."
)
INCONSISTENT_SHAPE = (
  "Inconsistent shape founded for input feature {path}, Output shape is set "
  "to be {old}, But got incoming output shape {new}. Every step must give "
  "each replica the per-replica batch the embedding was built with: feed "
  "per-replica values (strategy.experimental_distribute_dataset), keep the "
  "batch size fixed (batch(..., drop_remainder=True)), or build with "
  "per_replica_input_shapes of unknown batch size."
)
GRADIENT_SHAPE = (
  "Found gradient of shape {shape} at path {path}. Expected shape {expected}."
)
GRADIENT_TYPE = "found non-tensor type: {type} at path {path}."
DYNAMIC_KEY_DTYPE = (
  "Input {path} has keys of dtype {dtype}; table '{table}' has a "
  "DynamicVocabulary taking {expected} keys."
)
EMPTY_STRING_KEYS = (
  "Input {path} has empty string keys for table '{table}' (a "
  "DynamicVocabulary); every key must be a non-empty string."
)
DYNAMIC_ON_TPU = (
  "Table {table!r} has a DynamicVocabulary, which TensorFlow's TPU "
  "embedding and its configs do not have: dynamic tables train off TPU "
  "only (any other strategy)."
)
DYNAMIC_EXPORT = (
  "Tables {tables} have a DynamicVocabulary: their raw keys are mapped by "
  "its vocabulary's state, which was not given here. Look them up with the "
  "trained TPUEmbedding (embedding(features), export.ServingLookup, "
  "export.export_for_serving), or restore a checkpoint into "
  "TPUEmbeddingForServing (tools/export.py does)."
)
IDS_OUT_OF_RANGE = (
  "Input {path} has ids outside [0, {vocabulary_size}) for table "
  "'{table}' (vocabulary_size={vocabulary_size}). Offending ids (first 10):"
)
WEIGHTS_MISMATCH = (
  "Weight for {path} does not match its ids: the weights' {what} differ "
  "from the ids' {what}; weights must have exactly the same {what}."
)
WRONG_STRATEGY = (
  "TPUEmbedding was created under {created} but is used under {current}. "
  "Create it under the strategy that runs it: `with strategy.scope(): "
  "embedding = tpe.TPUEmbedding(...)`."
)
XLA_LAYOUT = (
  "XLA (jit_compile=True) compiles embedding steps on one replica whose "
  "tables are its own; this step runs under {strategy}{dynamic}. Compile "
  "with jit_compile=False (the Keras layers tell Keras so themselves)."
)
DEQUEUE_WITHOUT_ENQUEUE = (
  "dequeue called without a preceding enqueue in the same function. Call "
  "`enqueue(features, ...)` before `dequeue()` inside the same "
  "`tf.function` (or both eagerly)."
)
APPLY_WITHOUT_DEQUEUE = (
  "apply_gradients called without a preceding dequeue in the same "
  "function: the gradients must be those of the activations returned by "
  "the last `dequeue()` call."
)
APPLY_AFTER_EVALUATION_ENQUEUE = (
  "apply_gradients called after `enqueue(..., training=False)`: an "
  "evaluation step's lookups keep nothing to update. Enqueue with "
  "`training=True` (the default) for a step that applies gradients."
)

SKIP_ON_TPU = (
  "apply_gradients(skip=...) is not available under TPUStrategy: "
  "TensorFlow's TPU embedding applies every step's update unconditionally."
)
SKIP_UPDATES_ALL_ROWS = (
  "apply_gradients(skip=...) cannot skip the update of table '{table}': its "
  "optimizer ({optimizer}) changes every row at every step (e.g. "
  "Adam(lazy_adam=False)); use a lazy optimizer."
)
SKIP_SHAPE = "apply_gradients(skip=...) takes a scalar bool, got shape {shape}."
STEP_ID_VALUE = (
  "apply_gradients(step_id=...) takes a scalar integer, got {value!r}."
)
STEP_ID_VARIABLE = (
  "apply_gradients(step_id=...) takes a value fixed when the step is "
  "scheduled (e.g. a tf.int64 argument of the scheduled function), not a "
  "variable: a re-run step would read another value."
)

NOT_OFF_TPU = (
  "TPUEmbedding.{what} is not available under TPUStrategy: the tables live "
  "in TensorFlow's TPU embedding, not in this package's table stores. Use "
  "embedding_tables / variables, or save a checkpoint and restore it into "
  "TPUEmbeddingForServing (or tools/export.py) to read them on CPU."
)

TABLES_EXCEED_MEMORY = (
  "tpu_embedding: tables need {needed} in this process ({tables}) but "
  "{available} is available ({source}); use smaller tables, keep the "
  "largest on a local disk behind a RAM cache (row_sharding_threshold="
  "PlacementPolicy(disk=DiskTier(directory, cache_bytes, tables)), "
  "docs/large_tables.md), spread them over more processes "
  "(MultiWorkerMirroredStrategy, ParameterServerStrategy), or set {env}=1 "
  "(or build inside "
  "`with tpu_embedding.memory.unchecked():`) to build anyway."
)


class TableMemoryError(tf.errors.ResourceExhaustedError):
  """Tables (with their optimizer slots) do not fit in this process's memory.

  Raised by ``TPUEmbedding.build()`` before any variable is allocated
  (``memory.py``). A ``tf.errors.ResourceExhaustedError``, the error
  TensorFlow raises when an allocation fails, so code catching that one
  catches this one too.

  Attributes:
    message: the one-line message.
  """

  def __init__(self, message: str):
    """Creates the error with its one-line ``message``."""
    super().__init__(None, None, message)

  def __reduce__(self) -> tuple[type, tuple[str]]:
    return (type(self), (self.message,))
