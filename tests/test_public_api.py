"""The import surface mirrors ``tf.tpu.experimental.embedding``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import tensorflow as tf

import tpu_embedding as tpe

TF_EMB = tf.tpu.experimental.embedding

#: TensorFlow names this package does not provide, and why.
NOT_PROVIDED = {
  "CustomCombiner": "SparseCore-only custom combiners are not implemented",
  "CustomOptimizer": "SparseCore-only custom optimizers are not implemented",
  "SparseCoreEmbeddingConfig": "TPU-only; passed through on TPU",
  "TPUEmbeddingV0": "legacy TPU-only class",
}

SAME_SIGNATURE = [
  "TableConfig",
  "FeatureConfig",
  "SGD",
  "Adagrad",
  "AdagradMomentum",
  "Adam",
  "FTRL",
  "QuantizationConfig",
  "RowIdInitializer",
  "TPUEmbeddingForServing",
  "serving_embedding_lookup",
]


def test_every_tensorflow_name_is_provided_or_documented_as_missing():
  tf_names = {n for n in dir(TF_EMB) if not n.startswith("_")}
  missing = tf_names - set(tpe.__all__)
  assert missing == set(NOT_PROVIDED)
  for name in tpe.__all__:
    assert hasattr(tpe, name), name


def _parameters(obj):
  target = obj.__init__ if inspect.isclass(obj) else obj
  params = inspect.signature(target).parameters
  return [
    (name, p.default) for name, p in params.items() if name not in ("self",)
  ]


@pytest.mark.parametrize("name", SAME_SIGNATURE)
def test_signatures_match_tensorflow(name):
  ours, theirs = (
    _parameters(getattr(tpe, name)),
    _parameters(getattr(TF_EMB, name)),
  )
  # TensorFlow's parameters, in order, then our keyword-only additions
  # (TableConfig's vocabulary).
  target = getattr(tpe, name)
  target = target.__init__ if inspect.isclass(target) else target
  signature = inspect.signature(target).parameters
  extra = [n for n, _ in ours[len(theirs) :]]
  assert all(signature[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extra)
  ours = ours[: len(theirs)]
  assert [n for n, _ in ours] == [n for n, _ in theirs]
  for (param, mine), (_, tf_default) in zip(ours, theirs, strict=True):
    if param == "dtype":
      continue  # tf.float32 either way (ours normalizes through tf.as_dtype).
    assert mine == tf_default, param


def test_tpu_embedding_accepts_tensorflow_arguments():
  theirs = [n for n, _ in _parameters(TF_EMB.TPUEmbeddingV2)]
  ours = [n for n, _ in _parameters(tpe.TPUEmbeddingV3)]
  # TensorFlow's arguments, in order, then our keyword-only additions.
  assert ours[: len(theirs)] == theirs
  extra = inspect.signature(tpe.TPUEmbeddingV3).parameters
  assert all(
    extra[name].kind is inspect.Parameter.KEYWORD_ONLY
    for name in ours[len(theirs) :]
  )
  assert tpe.TPUEmbedding is tpe.TPUEmbeddingV3 is tpe.TPUEmbeddingV2
  for method in ("build", "enqueue", "dequeue", "apply_gradients"):
    tf_method = getattr(TF_EMB.TPUEmbedding, method)
    tf_params = [n for n, _ in _parameters(tf_method)]
    ours_method = getattr(tpe.TPUEmbedding, method)
    our_params = [n for n, _ in _parameters(ours_method)]
    # TensorFlow's parameters, in order, then keyword-only additions
    # (apply_gradients' skip and step_id).
    assert our_params[: len(tf_params)] == tf_params, method
    signature = inspect.signature(ours_method).parameters
    assert all(
      signature[name].kind is inspect.Parameter.KEYWORD_ONLY
      for name in our_params[len(tf_params) :]
    ), method
  assert list(inspect.signature(tpe.TPUEmbedding.apply_gradients).parameters)[
    -2:
  ] == ["skip", "step_id"]


def _public_objects():
  for info in pkgutil.walk_packages(tpe.__path__, "tpu_embedding."):
    module = importlib.import_module(info.name)
    yield info.name, module
    for name, obj in vars(module).items():
      if name.startswith("_") or not (
        inspect.isclass(obj) or inspect.isfunction(obj)
      ):
        continue
      if getattr(obj, "__module__", None) == info.name:
        yield f"{info.name}.{name}", obj


def _undocumented(name: str, obj) -> str | None:
  """What ``obj``'s docstring lacks, or None."""
  doc = inspect.getdoc(obj)
  if not doc:
    return f"{name} has no docstring"
  if inspect.ismodule(obj) or (
    inspect.isclass(obj) and obj.__name__ in tpe.__all__
  ):
    if "Example" not in doc:
      return f"{name} has no Example"
  return None


def test_public_objects_are_documented():
  """One test for every public module, class and function (each failure
  listed): a docstring, with an Example for modules and exported classes."""
  objects = list(_public_objects())
  assert len(objects) > 300  # The walk found the package.
  missing = [m for name, obj in objects if (m := _undocumented(name, obj))]
  assert not missing, "\n".join(missing)
