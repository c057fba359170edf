"""``export_for_serving(extra_signatures=...)``: more signatures, one model.

An extra signature (``PreprocessedSignature``) takes its own inputs and
preprocesses them into the main signature's; the SavedModel then serves
both, on the same tables and model variables: the extra signature's
predictions are the main one's on the preprocessed inputs, bit for bit,
float32 or int8, and ``apply_delta`` keeps both. Misuse is refused
before anything is written.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding import export
from tpu_embedding.export import FeatureSpec
from tpu_embedding.export import PreprocessedSignature

VOCAB = 50


def _embedding():
  table = tpe.TableConfig(VOCAB, 4, name="items", combiner="mean")
  config = {"item": tpe.FeatureConfig(table), "tags": tpe.FeatureConfig(table)}
  return tpe.TPUEmbedding(config, tpe.SGD(0.1))


class _Model(tf.Module):
  def __init__(self):
    super().__init__()
    self.kernel = tf.Variable(
      np.linspace(-1, 1, 9).reshape(9, 1), dtype=tf.float32
    )

  def __call__(self, x):
    z = tf.concat([x["item"], x["tags"], x["age"]], axis=1)
    return tf.sigmoid(z @ tf.cast(self.kernel, z.dtype))[:, 0]


SIGNATURE = {
  "item": FeatureSpec([None]),
  "tags": FeatureSpec([None, 2]),
  "age": tf.TensorSpec([None, 1], tf.float32),
}


def _preprocess(raw):
  """Strings → the main signature's ids; ``""`` tags are padding."""
  tags = tf.strings.to_hash_bucket_fast(raw["tags"], VOCAB)
  return {
    "item": tf.strings.to_hash_bucket_fast(raw["item"], VOCAB),
    "tags": tf.where(raw["tags"] == "", tf.constant(-1, tf.int64), tags),
    "age": tf.strings.to_number(raw["age"], tf.float32),
  }


RAW = PreprocessedSignature(
  {
    "item": tf.TensorSpec([None], tf.string),
    "tags": tf.TensorSpec([None, 2], tf.string),
    "age": tf.TensorSpec([None, 1], tf.string),
  },
  _preprocess,
)
RAW_REQUEST = {
  "item": tf.constant(["a", "b", "zz"]),
  "tags": tf.constant([["x", ""], ["y", "z"], ["", ""]]),
  "age": tf.constant([["1.5"], ["-2"], ["0"]]),
}


@pytest.fixture(scope="module")
def trained():
  return _embedding()


@pytest.mark.parametrize("table_dtype", ["float32", "int8"])
def test_the_extra_signature_serves_the_main_one_on_its_preprocessing(
  trained, tmp_path, table_dtype
):
  result = export.export_for_serving(
    str(tmp_path),
    trained,
    _Model(),
    SIGNATURE,
    table_dtype=table_dtype,
    extra_signatures={"serving_raw": RAW},
  )
  assert sorted(result.extra_signatures) == ["serving_raw"]
  assert sorted(result.extra_signatures["serving_raw"]) == [
    "age",
    "item",
    "tags",
  ]
  loaded = tf.saved_model.load(str(tmp_path))
  assert sorted(loaded.signatures) == ["serving_default", "serving_raw"]
  raw = loaded.signatures["serving_raw"](**RAW_REQUEST)["predictions"]
  main = loaded.signatures["serving_default"](**_preprocess(RAW_REQUEST))
  np.testing.assert_array_equal(raw.numpy(), main["predictions"].numpy())
  assert len(np.unique(raw.numpy())) == 3
  # One copy of each variable: the extra signature adds none.
  variables = tf.train.list_variables(str(tmp_path / "variables" / "variables"))
  assert [name for name, _ in variables if "model_variables" in name] == [
    "model_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
  ], variables


def test_misuse_is_refused_before_writing(trained, tmp_path):
  def export_with(extra):
    export.export_for_serving(
      str(tmp_path), trained, _Model(), SIGNATURE, extra_signatures=extra
    )

  spec = RAW.input_signature
  bad = {
    "serving_default": (RAW, ValueError, "other than the main"),
    "missing": (
      PreprocessedSignature(
        spec, lambda x: {k: v for k, v in _preprocess(x).items() if k != "age"}
      ),
      ValueError,
      r"missing \['age'\]",
    ),
    "dtype": (
      PreprocessedSignature(
        spec,
        lambda x: dict(
          _preprocess(x), item=tf.cast(_preprocess(x)["item"], tf.float32)
        ),
      ),
      ValueError,
      "returns 'item' as float32",
    ),
    "spec": (
      PreprocessedSignature({"item": FeatureSpec()}, _preprocess),
      TypeError,
      "expected a tf.TensorSpec",
    ),
  }
  for name, (extra, error, match) in bad.items():
    with pytest.raises(error, match=match):
      export_with({name: extra})
  offset = tf.Variable(0.0)
  with pytest.raises(ValueError, match="preprocess reads variables"):
    export_with(
      {
        "stateful": PreprocessedSignature(
          spec,
          lambda x: dict(_preprocess(x), age=_preprocess(x)["age"] + offset),
        )
      }
    )
  assert not os.listdir(tmp_path)


def test_a_keras_model_serves_both(trained, tmp_path):
  inputs = {
    "item": keras.Input((4,), name="item"),
    "tags": keras.Input((4,), name="tags"),
    "age": keras.Input((1,), name="age"),
  }
  out = keras.layers.Dense(1)(keras.layers.Concatenate()(list(inputs.values())))
  model = keras.Model(inputs, out)
  export.export_for_serving(
    str(tmp_path), trained, model, SIGNATURE, extra_signatures={"raw": RAW}
  )
  loaded = tf.saved_model.load(str(tmp_path))
  np.testing.assert_array_equal(
    loaded.signatures["raw"](**RAW_REQUEST)["predictions"].numpy(),
    loaded.signatures["serving_default"](**_preprocess(RAW_REQUEST))[
      "predictions"
    ].numpy(),
  )
