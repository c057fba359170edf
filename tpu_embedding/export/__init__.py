"""SavedModel export of all or a subset of an embedding's tables.

One module per concept:

* ``signature``: ``FeatureSpec``, an embedding feature's dense (padded)
  id tensor in a serving signature; ``PreprocessedSignature``, another
  signature whose inputs are preprocessed into those;
  ``padded_to_sparse``; ``validate_signature``.
* ``subset``: ``TableSubset``, the selected tables and their features;
  ``ServingLookup``, live CPU lookups in them (or in copies).
* ``saved_model``: ``export_for_serving``, which writes the SavedModel
  (its docstring tables how ids are fed), and its ``ExportResult``.
* ``quantize``: ``QuantizedTable``, a serving table stored as float16,
  bfloat16 or row-wise int8 (``export_for_serving(table_dtype=...)``),
  and the functions that quantize and dequantize rows.
* ``from_checkpoint``: ``ExportSpec``, ``serving_embedding_for`` and
  ``restore_for_export`` (a run's latest save, deltas included), with
  which ``tools/export.py`` exports from a checkpoint.
* ``from_delta``: ``apply_delta``, a new SavedModel version from the
  previous one and a delta checkpoint (``tools/export.py --apply_delta``),
  and the source record (``ExportSource``, ``read_source``) it checks.

Every public name is importable from ``tpu_embedding.export``.

Example:
  >>> from tpu_embedding import export
  >>> export.FeatureSpec([None, 5]).tensor_specs("genres")["genres"].shape
  TensorShape([None, 5])
"""

from tpu_embedding.export.from_checkpoint import ExportSpec
from tpu_embedding.export.from_checkpoint import restore_for_export
from tpu_embedding.export.from_checkpoint import serving_embedding_for
from tpu_embedding.export.from_delta import DeltaExport
from tpu_embedding.export.from_delta import ExportSource
from tpu_embedding.export.from_delta import apply_delta
from tpu_embedding.export.from_delta import read_source
from tpu_embedding.export.quantize import TABLE_DTYPES
from tpu_embedding.export.quantize import QuantizedRows
from tpu_embedding.export.quantize import QuantizedTable
from tpu_embedding.export.quantize import dequantize_rows
from tpu_embedding.export.quantize import quantize_rows
from tpu_embedding.export.saved_model import ExportResult
from tpu_embedding.export.saved_model import export_for_serving
from tpu_embedding.export.signature import PADDING_ID
from tpu_embedding.export.signature import FeatureSpec
from tpu_embedding.export.signature import PreprocessedSignature
from tpu_embedding.export.signature import padded_to_sparse
from tpu_embedding.export.signature import validate_signature
from tpu_embedding.export.signature import weights_name
from tpu_embedding.export.subset import ServingLookup
from tpu_embedding.export.subset import TableSelection
from tpu_embedding.export.subset import TableSubset
from tpu_embedding.export.subset import feature_config_of

__all__ = [
  "PADDING_ID",
  "TABLE_DTYPES",
  "DeltaExport",
  "ExportResult",
  "ExportSource",
  "ExportSpec",
  "FeatureSpec",
  "PreprocessedSignature",
  "QuantizedRows",
  "QuantizedTable",
  "ServingLookup",
  "TableSelection",
  "TableSubset",
  "apply_delta",
  "dequantize_rows",
  "export_for_serving",
  "feature_config_of",
  "padded_to_sparse",
  "quantize_rows",
  "read_source",
  "restore_for_export",
  "serving_embedding_for",
  "validate_signature",
  "weights_name",
]
