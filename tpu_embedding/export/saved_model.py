"""SavedModel export of all or a subset of an embedding's tables.

``export_for_serving`` writes a SavedModel whose ``serving_default``
signature maps raw ids (and dense features) to predictions, for TensorFlow
Serving or ``tf.saved_model.load``. It holds plain-variable copies of the
selected tables only: no optimizer slots, no other table, no
``tpu_embedding`` object, so it loads with TensorFlow alone.

SavedModel signatures take dense tensors only. An embedding feature of the
signature is declared with a ``FeatureSpec`` and fed as follows (``B`` is
the batch size, ``-1`` is padding):

==================  =====================================  ================
``FeatureSpec``     fed as                                 activations
==================  =====================================  ================
``shape=[None]``    ``[B]`` ids, one per example           ``(B, dim)``
``shape=[None, L]`` ``[B, L]`` ids padded with ``-1``      ``(B, dim)``,
                    (``L`` may be None: any width)         the combiner
sequence feature    ``[B, L]`` ids padded with ``-1``      ``(B, S, dim)``
``shape=[None, L]`` (``S = max_sequence_length``)          (cut/padded)
``weights=True``    also ``<name>_weights``: ``[B, L]``    weighted
                    float32, same shape; ignored at pads   combiner
==================  =====================================  ================

Inside the signature the ids ``!= -1`` of a ``[B, L]`` tensor become a
``tf.SparseTensor`` (``padded_to_sparse``) looked up exactly like
``tpu_embedding.serving_embedding_lookup`` looks up that sparse tensor: so
``[[3, -1], [-1, -1]]`` is "id 3" and "no id" (zeros), and other negative
ids are dropped or rejected as that lookup does. Rank-1 ids are a dense
lookup. Ids at or above ``vocabulary_size`` fail the request.

The model is called with one dict keyed by the signature's input names:
activations for ``FeatureSpec`` inputs, dense ``tf.TensorSpec`` inputs as
fed. ``ServingLookup`` is the same lookup on the embedding's *current*
tables (live, any layout), for evaluation or serving inside a Python
model; ``tools/export.py`` exports from a checkpoint instead.

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import export
  >>> users = tpe.TableConfig(10, 2, name="users", combiner="sum",
  ...                         initializer=tpe.RowIdInitializer())
  >>> items = tpe.TableConfig(20, 2, name="items")
  >>> emb = tpe.TPUEmbedding({"user": tpe.FeatureConfig(users),
  ...                         "item": tpe.FeatureConfig(items)}, tpe.SGD(0.1))
  >>> result = export.export_for_serving(
  ...     tempfile.mkdtemp(), emb, model=lambda x: x["user"] * 10.0,
  ...     input_signature={"user": export.FeatureSpec([None, None])},
  ...     tables=["users"])
  >>> loaded = tf.saved_model.load(result.export_dir)
  >>> serve = loaded.signatures["serving_default"]
  >>> ids = tf.constant([[1, 2], [4, -1]], tf.int64)
  >>> serve(user=ids)["predictions"].numpy()
  array([[30., 30.],
         [40., 40.]], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import tensorflow as tf
from absl import logging

from tpu_embedding.export.from_delta import ExportSource
from tpu_embedding.export.from_delta import SourceKeys
from tpu_embedding.export.from_delta import record_source
from tpu_embedding.export.from_delta import source_keys
from tpu_embedding.export.quantize import check_table_dtype
from tpu_embedding.export.quantize import table_variables
from tpu_embedding.export.signature import FeatureSpec
from tpu_embedding.export.signature import PreprocessedSignature
from tpu_embedding.export.signature import _activation_shape
from tpu_embedding.export.signature import _parse_signature
from tpu_embedding.export.signature import _Signature
from tpu_embedding.export.signature import padded_to_sparse
from tpu_embedding.export.signature import weights_name
from tpu_embedding.export.streamed import write_rows
from tpu_embedding.export.subset import ServingLookup
from tpu_embedding.export.subset import TableSelection
from tpu_embedding.export.subset import table_stores_of
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.tables.base import TableStore
from tpu_embedding.types import FeatureConfigNest
from tpu_embedding.types import Nested

if TYPE_CHECKING:
  from tpu_embedding.embedding import TPUEmbedding
  from tpu_embedding.serving import TPUEmbeddingForServing

#: The model served: a Keras model (called with ``training=False``),
#: ``tf.Module`` or callable taking ``{signature input name: tensor}``.
ServedModel = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class ExportResult:
  """What ``export_for_serving`` wrote.

  Attributes:
    export_dir: the SavedModel directory.
    signature_name: the signature's key.
    inputs: ``{input name: TensorSpec}`` of the signature.
    outputs: ``{output name: TensorSpec}`` of the signature.
    tables: the exported tables' names.
    table_dtype: the type the tables are stored in.
    extra_signatures: ``{name: {input name: TensorSpec}}`` of the other
      signatures (``PreprocessedSignature``), same outputs.

  Example:
    >>> from tpu_embedding.export import ExportResult
    >>> ExportResult("/tmp/m/1", "serving_default", {}, {}, ("users",)).tables
    ('users',)
  """

  export_dir: str
  signature_name: str
  inputs: dict[str, tf.TensorSpec]
  outputs: dict[str, tf.TensorSpec]
  tables: tuple[str, ...]
  table_dtype: str = "float32"
  extra_signatures: dict[str, dict[str, tf.TensorSpec]] = dataclasses.field(
    default_factory=dict
  )


def _is_keras(model: object) -> bool:
  return any(
    c.__module__.split(".")[0] in ("keras", "tf_keras")
    for c in type(model).__mro__
  )


class _ModelInputs(dict[str, tf.Tensor]):
  """The model's input dict; a missing key names the signature's inputs."""

  def __missing__(self, key: str) -> tf.Tensor:
    raise KeyError(_missing_input_message(key, sorted(self)))


def _missing_input_message(key: object, available: list[str]) -> str:
  return (
    f"The model reads input {key!r}, which is missing from "
    f"input_signature (its inputs: {available}). Add it as a FeatureSpec "
    "(embedding ids) or a tf.TensorSpec (dense feature)."
  )


def _check_keras_inputs(model: Any, names: list[str]) -> None:
  """A Keras model with named dict inputs must get all of them."""
  try:
    inputs = model.input
  except (AttributeError, ValueError):
    return  # Subclassed or unbuilt: found when tracing instead.
  if isinstance(inputs, Mapping):
    missing = sorted(set(inputs) - set(names))
    if missing:
      raise ValueError(_missing_input_message(missing[0], sorted(names)))


def _named_outputs(outputs: Nested) -> dict[str, tf.Tensor]:
  """The signature's outputs: a dict of tensors with valid names."""
  if isinstance(outputs, Mapping):
    flat = flatten_with_paths(dict(outputs))
    return {re.sub(r"[^A-Za-z0-9_]", "_", path): t for path, t in flat}
  if isinstance(outputs, (list, tuple)):
    return {f"predictions_{i}": t for i, t in enumerate(outputs)}
  return {"predictions": outputs}


def _make_serve(
  lookup: ServingLookup, signature: _Signature, model: ServedModel | None
) -> Callable[[dict[str, tf.Tensor]], dict[str, tf.Tensor]]:
  """The signature's body: padded ids → activations → model."""

  def serve(inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    values = {}
    for name, (spec, path, feature) in signature.features.items():
      ids = inputs[name]
      weights = inputs[weights_name(name)] if spec.weights else None
      if ids.shape.rank > 1:
        ids, weights = padded_to_sparse(ids, weights, spec.padding)
      activations = lookup(
        {path: ids}, None if weights is None else {path: weights}
      )[path]
      values[name] = tf.ensure_shape(
        activations, _activation_shape(spec, feature)
      )
    values.update({name: inputs[name] for name in signature.dense})
    if model is None:
      return _named_outputs(values)
    if _is_keras(model):
      return _named_outputs(model(values, training=False))
    return _named_outputs(model(_ModelInputs(values)))

  return serve


def _preprocessed(
  serve: Any, name: str, extra: PreprocessedSignature, signature: _Signature
) -> Callable[[dict[str, tf.Tensor]], dict[str, tf.Tensor]]:
  """Signature ``name``'s body: its inputs → ``extra.preprocess`` → the
  main signature's ``serve`` (one lookup and model, called alike)."""

  def serve_preprocessed(inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    made = dict(extra.preprocess(dict(inputs)))
    missing = sorted(set(signature.specs) - set(made))
    unknown = sorted(set(made) - set(signature.specs))
    if missing or unknown:
      raise ValueError(
        f"Signature {name!r}: preprocess must return the main signature's "
        f"inputs {sorted(signature.specs)}; missing {missing}, unknown "
        f"{unknown}."
      )
    for key, spec in signature.specs.items():
      tensor = tf.convert_to_tensor(made[key])
      if tensor.dtype != spec.dtype or not spec.shape.is_compatible_with(
        tensor.shape
      ):
        raise ValueError(
          f"Signature {name!r}: preprocess returns {key!r} as "
          f"{tensor.dtype.name} {tensor.shape}; the main signature takes "
          f"{spec.dtype.name} {spec.shape}."
        )
      made[key] = tensor
    return serve(made)

  return serve_preprocessed


def _embedding_variable_ids(stores: Mapping[str, TableStore]) -> dict[int, str]:
  """``{id(variable): table}`` of every variable the tables are held in."""
  found = {}
  for name, store in stores.items():
    for variable in store.variables.values():
      found[id(variable)] = name
    for variable in store.held_variables():
      found[id(variable)] = name
  return found


def _ordered(
  variables: list[tf.Variable], keys: SourceKeys | None
) -> list[tf.Variable]:
  """``variables`` by their source checkpoint key (else their name); ties
  (unnamed ``tf.Module`` variables) keep their order."""

  def natural(name: str) -> list[tuple[int, str]]:  # "w/10" after "w/2"
    return [
      (int(part), "") if part.isdigit() else (-1, part)
      for part in re.split(r"(\d+)", name)
    ]

  return [
    variable
    for _, _, variable in sorted(
      (
        natural(keys.model[id(variable)] if keys else variable.name),
        index,
        variable,
      )
      for index, variable in enumerate(variables)
    )
  ]


def export_for_serving(
  export_dir: str,
  embedding: TPUEmbedding | TPUEmbeddingForServing,
  model: ServedModel | None,
  input_signature: Mapping[str, FeatureSpec | tf.TensorSpec],
  tables: TableSelection = None,
  *,
  feature_config: FeatureConfigNest | None = None,
  signature_name: str = "serving_default",
  table_dtype: str = "float32",
  source: ExportSource | None = None,
  extra_signatures: Mapping[str, PreprocessedSignature] | None = None,
) -> ExportResult:
  """Writes a SavedModel serving ``model`` on the embedding's tables.

  The signature ``signature_name`` takes the inputs of
  ``input_signature`` (see the module docstring for the id convention),
  looks up each ``FeatureSpec`` input in its table, and calls
  ``model({name: activations or dense tensor})``: one dict keyed by the
  signature's input names (Keras models are called with
  ``training=False``). Its outputs are the model's: a dict keeps its keys,
  a tensor is ``"predictions"``, a list gives ``"predictions_<i>"``. With
  ``model=None`` the outputs are the activations. Each of
  ``extra_signatures`` is another signature of the same model: its
  inputs, preprocessed into this signature's (e.g. raw strings into ids),
  then served alike, with the same outputs.

  The SavedModel holds plain copies of the selected tables (taken now;
  whatever the layout they trained on: one device, row-sharded or
  replicated under ``MirroredStrategy``, parameter servers) and the
  variables the model reads, nothing else: no optimizer slot, no other
  table, no ``tpu_embedding`` object. It loads with TensorFlow alone
  (``tf.saved_model.load``, TF Serving, ``saved_model_cli``). Export an
  embedding trained under ``TPUStrategy`` or ``MultiWorkerMirroredStrategy``
  from its checkpoint with ``tools/export.py``. A table kept on disk
  (``DiskTier``) is written from its files chunk by chunk, never held
  whole (``export/streamed.py``; float16 is refused for it).

  With ``table_dtype`` ``"float16"``, ``"bfloat16"`` or ``"int8"``
  (row-wise: int8 values with a float32 scale and offset per row) the
  tables are stored in that type, about 1/2 or a bit over 1/4 of the
  bytes, and each request dequantizes the rows it looks up, with
  TensorFlow ops only; each activation is then within the type's error
  bound of the float32 export's (tabled in
  ``tpu_embedding.export.quantize``).

  Args:
    export_dir: where to write the SavedModel.
    embedding: a ``TPUEmbedding`` or ``TPUEmbeddingForServing``.
    model: a Keras model, ``tf.Module`` or callable taking the input dict,
      or None to serve the activations.
    input_signature: ``{input name: FeatureSpec or tf.TensorSpec}``. A
      ``FeatureSpec`` (or an integer ``tf.TensorSpec`` named after a
      feature path) is embedding ids; any other ``tf.TensorSpec`` is a dense
      feature passed to the model as is. Names are letters, digits and
      ``_``.
    tables: None to export every table, or the names (or ``TableConfig``
      objects) of a subset, e.g. the query tower's tables only.
    feature_config: the embedding's feature config; read from the
      embedding by default.
    signature_name: the signature's key.
    table_dtype: the type the tables are stored in, one of
      ``quantize.TABLE_DTYPES``: ``"float32"`` (as trained),
      ``"float16"``, ``"bfloat16"`` or ``"int8"``.
    source: the checkpoint the embedding and model were restored from
      (``ExportSource``): recorded in the SavedModel, so that
      ``apply_delta`` makes the next version from it and a delta of that
      checkpoint. None: nothing is recorded.
    extra_signatures: ``{name: PreprocessedSignature}``: more signatures,
      each taking its own inputs and preprocessing them (TensorFlow ops
      only, no variables) into the inputs of ``signature_name``, which
      then serves them. None: that one signature.

  Returns:
    An ``ExportResult`` with the signature's inputs and outputs.

  Raises:
    ValueError: for an unknown table, a signature feature whose table is
      not exported, an input the model needs but the signature lacks, a
      model that reads the embedding's own variables, invalid specs, an
      unknown ``table_dtype`` or values it cannot hold, an extra signature
      named like another, whose preprocessing holds variables or does not
      return the main signature's inputs.
    RuntimeError: if called inside a ``tf.function``.

  Example:
    >>> import tempfile
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.export import FeatureSpec, export_for_serving
    >>> table = tpe.TableConfig(100, 4, name="movies")
    >>> emb = tpe.TPUEmbedding(
    ...     {"movie": tpe.FeatureConfig(table),
    ...      "history": tpe.FeatureConfig(table, max_sequence_length=3)},
    ...     tpe.Adagrad(0.1))
    >>> result = export_for_serving(
    ...     tempfile.mkdtemp(), emb, model=None,
    ...     input_signature={"movie": FeatureSpec([None]),
    ...                      "history": FeatureSpec([None, None])})
    >>> {k: v.shape.as_list() for k, v in sorted(result.outputs.items())}
    {'history': [None, 3, 4], 'movie': [None, 4]}
  """
  if not tf.executing_eagerly():
    raise RuntimeError("export_for_serving must be called eagerly.")
  start = time.time()
  table_dtype = check_table_dtype(table_dtype)
  lookup = ServingLookup(
    embedding,
    tables,
    feature_config=feature_config,
    copy=True,
    table_dtype=table_dtype,
  )
  signature = _parse_signature(input_signature, lookup.subset)
  if model is None and signature.dense:
    raise ValueError(
      f"Dense inputs {sorted(signature.dense)} need a model to use them."
    )
  if model is not None and _is_keras(model):
    _check_keras_inputs(model, list(signature.features) + list(signature.dense))
  serve = tf.function(
    _make_serve(lookup, signature, model), input_signature=[signature.specs]
  )
  logging.info("Tracing the serving signature %r.", signature_name)
  try:
    concrete = serve.get_concrete_function()
  except KeyError as e:
    if "missing from input_signature" in str(e):
      raise ValueError(e.args[0]) from None
    raise
  extra = _trace_extra_signatures(
    extra_signatures or {}, signature_name, serve, signature, concrete
  )
  copies = lookup.copies
  vocabularies = lookup.vocabulary_variables
  own = {id(v) for t in copies.values() for v in table_variables(t)} | {
    id(v) for state in vocabularies.values() for v in state.values()
  }
  model_variables = [v for v in concrete.variables if id(v) not in own]
  leaked = _embedding_variable_ids(table_stores_of(embedding))
  for variable in model_variables:
    if id(variable) in leaked:
      raise ValueError(
        f"The model reads the embedding's table {leaked[id(variable)]!r} "
        "directly; the exported model must receive activations (from the "
        "signature's lookups) instead of calling the embedding."
      )
  keys = None
  if source is not None:  # every exported value found, before any write
    keys = source_keys(
      source, {name: lookup.stores[name] for name in copies}, model_variables
    )
  root = tf.Module()
  root.tables = copies
  root.vocabularies = vocabularies
  # Keyed in the SavedModel by position: ordered by what the source
  # checkpoint (else the variable) calls each, not by when the trace met
  # it, so that every export of one model keys it alike.
  root.model_variables = _ordered(model_variables, keys)
  root.serve = serve
  root.extra_signatures = {name: fn for name, (fn, _) in extra.items()}
  logging.info(
    "Writing SavedModel to %s (tables %s as %s, %d model variables).",
    export_dir,
    list(lookup.table_names),
    table_dtype,
    len(model_variables),
  )
  signatures = {signature_name: concrete}
  signatures.update({name: c for name, (_, c) in extra.items()})
  tf.saved_model.save(root, export_dir, signatures=signatures)
  write_rows(export_dir, root, lookup.stores)  # disk-tiered tables' rows
  if keys is not None:
    record_source(export_dir, keys, root, table_dtype)
  outputs = {
    name: tf.TensorSpec(t.shape, t.dtype, name=name)
    for name, t in concrete.structured_outputs.items()
  }
  logging.info(
    "Exported %s in %.1fs: inputs %s, outputs %s.",
    export_dir,
    time.time() - start,
    {k: (v.dtype.name, v.shape.as_list()) for k, v in signature.specs.items()},
    {k: (v.dtype.name, v.shape.as_list()) for k, v in outputs.items()},
  )
  return ExportResult(
    export_dir,
    signature_name,
    dict(signature.specs),
    outputs,
    lookup.table_names,
    table_dtype,
    {
      name: dict(c.structured_input_signature[0][0])
      for name, (_, c) in extra.items()
    },
  )


def _trace_extra_signatures(
  extra_signatures: Mapping[str, PreprocessedSignature],
  signature_name: str,
  serve: Any,
  signature: _Signature,
  concrete: Any,
) -> dict[str, tuple[Any, Any]]:
  """``{name: (tf.function, concrete function)}`` of the extra signatures,
  checked: valid names, no variable of their own."""
  traced = {}
  served = {id(v) for v in concrete.variables}
  for name, extra in extra_signatures.items():
    if name == signature_name or not isinstance(name, str) or not name:
      raise ValueError(
        f"Extra signature name {name!r} must be a non-empty string other "
        f"than the main signature's {signature_name!r}."
      )
    if not isinstance(extra, PreprocessedSignature):
      raise TypeError(
        f"extra_signatures[{name!r}] is a {type(extra).__name__}; expected "
        "a PreprocessedSignature."
      )
    fn = tf.function(
      _preprocessed(serve, name, extra, signature),
      input_signature=[extra.specs(name)],
    )
    logging.info("Tracing the serving signature %r.", name)
    traced_fn = fn.get_concrete_function()
    own = [v.name for v in traced_fn.variables if id(v) not in served]
    if own:
      raise ValueError(
        f"Signature {name!r}: preprocess reads variables {own}; only the "
        "main signature's variables are exported (and updated by "
        "apply_delta), so preprocessing takes constants only."
      )
    traced[name] = (fn, traced_fn)
  return traced
