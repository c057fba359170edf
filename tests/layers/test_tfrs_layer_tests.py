"""tensorflow-recommenders' own layer tests pass with our layers.

The installed tensorflow-recommenders ships the tests of its
``TPUEmbedding`` and ``PartialTPUEmbedding`` layers. Each is copied to a
temporary directory with only its import of the tfrs layer swapped for
ours (``REWRITES``: whole lines, each of which must be found), and run by
pytest in a fresh interpreter with ``TF_USE_LEGACY_KERAS=1`` (tfrs code is
tf-keras code): TensorFlow's config classes, tf-keras legacy optimizers,
sparse and ragged ``tf.keras.Input``\\ s, custom training loops under the
default strategy, scalar ids. No test is excluded: none needs a TPU.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from tests.layers.tf_keras_pytest import run_pytest_under_tf_keras

#: tfrs test file (relative to the package) -> {its line: our line}.
REWRITES: dict[str, dict[str, str]] = {
  "layers/embedding/tpu_embedding_layer_test.py": {
    "from tensorflow_recommenders.layers.embedding"
    " import tpu_embedding_layer": (
      "from tpu_embedding.layers import tpu_embedding as tpu_embedding_layer"
    ),
  },
  "experimental/layers/embedding/partial_tpu_embedding_test.py": {
    "import tensorflow_recommenders as tfrs": "import tpu_embedding.layers",
    # The same line in each of its four tests.
    "    embedding_layer = tfrs.experimental.layers.embedding"
    ".PartialTPUEmbedding(": (
      "    embedding_layer = tpu_embedding.layers.PartialTPUEmbedding("
    ),
  },
}

#: Imports or uses of tfrs that must not survive the rewrite.
_TFRS_USE = re.compile(
  r"^\s*(from|import)\s+tensorflow_recommenders\b|\btfrs\.", re.MULTILINE
)


def rewrite(source: str, lines: dict[str, str], path: str) -> str:
  """``source`` with each of ``lines`` (whole lines) replaced.

  Raises:
    AssertionError: if a line is not found, or tfrs is still used.
  """
  out = source.splitlines()
  for old, new in lines.items():
    found = [i for i, line in enumerate(out) if line == old]
    assert found, f"{path}: line not found (tfrs changed?): {old!r}"
    for i in found:
      out[i] = new
  text = "\n".join(out) + "\n"
  leftover = _TFRS_USE.search(text)
  assert leftover is None, f"{path} still uses tfrs: {leftover.group(0)!r}"
  return text


def test_tfrs_layer_tests_pass_with_our_layers(tmp_path):
  spec = importlib.util.find_spec("tensorflow_recommenders")
  assert spec and spec.origin, "pip install tensorflow-recommenders"
  package = pathlib.Path(spec.origin).parent
  copies = []
  for relative, lines in REWRITES.items():
    source = (package / relative).read_text()
    copy = tmp_path / pathlib.Path(relative).name
    copy.write_text(rewrite(source, lines, relative))
    copies.append(copy)

  suite, output = run_pytest_under_tf_keras(
    [c.name for c in copies], tmp_path, tmp_path
  )
  ran: dict[str, int] = {c.stem: 0 for c in copies}
  for case in suite.iter("testcase"):
    skipped = case.find("skipped")
    if skipped is not None:
      # tf.test.TestCase's own ``test_session`` helper skips itself.
      assert case.get("name") == "test_session", output
      continue
    ran[case.get("classname", "").split(".")[0]] += 1
  for name, count in ran.items():
    if count == 0:
      pytest.fail(f"no test of {name} ran:\n{output}")
