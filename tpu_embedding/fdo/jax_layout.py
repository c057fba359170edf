"""keras-rs on JAX: jax-tpu-embedding's own stacking, as a ``Layout``.

keras-rs 0.4.0 on JAX does not stack as TensorFlow does: its
``DistributedEmbedding`` (``table_stacking="auto"``, the default) converts
its configs to jax-tpu-embedding's ``FeatureSpec`` (keras-rs'
``keras_to_jte_feature_configs``, keyed by the features' joined paths) and
calls jax-tpu-embedding's ``auto_stack_tables`` (tables of the same padded
width, optimizer and combiner, split where a stack's activations would
pass 2 MiB per SparseCore; each next table rotated by the SparseCores per
chip), then ``prepare_feature_specs_for_training``. ``jax_layout`` calls
those same functions (installed: ``pip install "tpu_embedding[fdo-jax]"``)
and reads back the stacks, offsets and rotations they set, so the stacked
tables, and the limits measured on them, are keras-rs' on JAX. A stack's
limit in keras-rs is the largest of its tables' ``max_ids_per_partition``
(``DistributedEmbedding.sparsecore_build``), so each of its tables gets
the stack's limits (``FdoStats.keras_rs_limits``).

JAX also differs on samples: a dense ``[B, k]`` input is ``B`` samples of
``k`` ids (TensorFlow's ``TPUEmbeddingV2``: ``B * k`` samples), so the
collector reads a JAX layout's features row by row.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.fdo import jax_layout
  >>> table = tpe.TableConfig(8, 2, name="t")
  >>> jax_layout.is_keras_rs_nest({"f": tpe.FeatureConfig(table)})
  False
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.fdo import layout as layout_lib
from tpu_embedding.fdo.topologies import Topology

#: How to get what ``stacking="jax"`` needs.
INSTALL = 'pip install "tpu_embedding[fdo-jax]"'


def _modules() -> tuple[Any, Any, Any]:
  try:
    import keras
    from jax_tpu_embedding.sparsecore.lib.nn import embedding
    from jax_tpu_embedding.sparsecore.lib.nn import table_stacking
    from keras_rs.src.layers.embedding.jax import config_conversion
  except ImportError as error:
    raise ValueError(
      "stacking='jax' (keras-rs on JAX) stacks with jax-tpu-embedding and "
      f"keras-rs, which do not import here ({error}); {INSTALL} (Python "
      "3.11+)."
    ) from None
  del keras
  return embedding, table_stacking, config_conversion


def is_keras_rs_nest(feature_config: Any) -> bool:
  """Whether every leaf of ``feature_config`` is a keras-rs
  ``FeatureConfig``."""
  from tpu_embedding.layers import keras_rs_configs

  leaves = tf.nest.flatten(feature_config)
  return bool(leaves) and all(
    keras_rs_configs.is_keras_rs_feature(leaf) for leaf in leaves
  )


def check(feature_config: Any) -> None:
  """Raises ``ValueError`` where ``stacking="jax"`` cannot be measured:
  jax-tpu-embedding or keras-rs missing, or not keras-rs configs."""
  _modules()
  if not is_keras_rs_nest(feature_config):
    raise ValueError(
      "stacking='jax' measures keras-rs on JAX, so it takes keras-rs "
      "FeatureConfigs (keras_rs.layers.FeatureConfig); for this package's "
      "or TensorFlow's configs use stacking='tensorflow' or 'none'."
    )


def jax_layout(
  keras_rs_config: Any,
  paths: list[str],
  topo: Topology,
  global_shapes: dict[str, tuple[int, ...]],
) -> layout_lib.Layout:
  """The ``Layout`` keras-rs on JAX stacks ``keras_rs_config`` into.

  Args:
    keras_rs_config: the nest of keras-rs ``FeatureConfig``.
    paths: the features' paths, in ``tf.nest.flatten`` order.
    topo: the ``Topology``.
    global_shapes: per path, the global batch's shape (its rows are JAX's
      samples).

  Returns:
    A ``Layout`` with jax-tpu-embedding's stacks (``stacking == "jax"``).
  """
  import keras

  check(keras_rs_config)
  embedding, table_stacking, config_conversion = _modules()
  # keras-rs' DistributedEmbedding: {joined path: FeatureConfig}.
  with_paths = keras.tree.flatten_with_path(keras_rs_config)
  by_path = {".".join(str(e) for e in p): fc for p, fc in with_paths}
  leaves = tf.nest.flatten(keras_rs_config)
  theirs = [fc for _, fc in with_paths]
  if len(leaves) != len(paths) or any(
    a is not b for a, b in zip(leaves, theirs, strict=True)
  ):
    raise ValueError("keras-rs and TensorFlow flatten the configs apart.")
  specs = config_conversion.keras_to_jte_feature_configs(by_path)
  keras_path = dict(zip(paths, by_path, strict=True))
  for path in paths:
    rows = global_shapes[path][0] // topo.num_chips
    if rows % topo.num_sc_per_chip:
      raise ValueError(
        f"Feature {path!r}: {rows} rows per chip do not split over "
        f"{topo.num_sc_per_chip} SparseCores per chip; give global batches "
        "divisible by the number of SparseCores."
      )
  for path in paths:
    spec = specs[keras_path[path]]
    # The batch the data gives (global: jax-tpu-embedding's shapes are).
    batch = global_shapes[path][0]
    spec.output_shape = [batch, spec.table_spec.embedding_dim]
  # jax-tpu-embedding warns, per stack of several tables, that the
  # tables' limits are ignored for 256 until updated: true of its stacking
  # call, not of the limits measured here (keras-rs updates them).
  with layout_lib.without_absl_warning("Stacking multiple tables together"):
    table_stacking.auto_stack_tables(
      specs, topo.num_chips, topo.num_sc_per_chip
    )
  embedding.prepare_feature_specs_for_training(
    specs, topo.num_chips, topo.num_sc_per_chip
  )
  nchips = topo.num_chips
  features = []
  stacks: dict[str, dict[str, Any]] = {}
  for path in paths:
    spec = specs[keras_path[path]]
    table = spec.table_spec
    stacked = table.stacked_table_spec
    transform = spec.id_transformation
    features.append(
      layout_lib._FeatureLayout(
        path=path,
        table=table.name,
        stack=stacked.stack_name,
        vocabulary_size=int(table.vocabulary_size),
        col_offset=int(transform.col_offset),
        col_shift=int(transform.col_shift),
        # jax-tpu-embedding's offsets count global samples; a chip's are
        # 1 / num_chips of them.
        row_offset=int(transform.row_offset) // nchips,
        sample_count=global_shapes[path][0] // nchips,
      )
    )
    entry = stacks.setdefault(
      stacked.stack_name,
      {"spec": stacked, "tables": {}, "features": []},
    )
    entry["tables"][table.name] = table
    entry["features"].append(path)
  result = {}
  for name, entry in stacks.items():
    stacked = entry["spec"]
    tables = sorted(
      entry["tables"].values(),
      key=lambda t: t.setting_in_stack.row_offset_in_shard,
    )
    result[name] = layout_lib.StackLayout(
      name=name,
      tables=tuple(t.name for t in tables),
      features=tuple(entry["features"]),
      sample_count=int(stacked.total_sample_count) // nchips,
      vocabulary_size=int(stacked.stack_vocab_size),
      dim=int(stacked.stack_embedding_dim),
      row_offsets={
        t.name: int(t.setting_in_stack.row_offset_in_shard) * topo.num_sc_shards
        for t in tables
      },
      rotations={
        t.name: int(t.setting_in_stack.shard_rotation) for t in tables
      },
    )
  return layout_lib.Layout.from_parts(topo, result, features, "jax")
