"""A training run's saved config: ``<model_dir>/params.yaml``.

``model_garden.ranking.train`` writes the effective config of a run to
``params.yaml`` in its model directory (JSON, which is YAML);
``read_params`` reads it back as an ``ExperimentConfig``, so that tools
(``tools/export.py --model_dir``) rebuild the run's model without being
told its experiment, files or overrides.

Example:
  >>> import dataclasses, json, os, tempfile
  >>> from model_garden.ranking import configs
  >>> from model_garden.ranking.configs import params_file
  >>> model_dir = tempfile.mkdtemp()
  >>> config = configs.get_config("dcn_criteo_cpu_small")
  >>> with open(os.path.join(model_dir, "params.yaml"), "w") as f:
  ...   json.dump(dataclasses.asdict(config), f)
  >>> params_file.read_params(model_dir) == config
  True
"""

from __future__ import annotations

import os

import tensorflow as tf

from model_garden.ranking.configs import definitions
from model_garden.ranking.configs import overrides

#: The file a training run writes its config to, in ``--model_dir``.
PARAMS_FILE = "params.yaml"


def read_params(model_dir: str) -> definitions.ExperimentConfig:
  """The config saved in ``model_dir/params.yaml`` (any TF filesystem).

  Raises:
    FileNotFoundError: when ``model_dir`` has no ``params.yaml``.
    ValueError: when it is not a valid experiment config (naming the key).
  """
  path = os.path.join(model_dir, PARAMS_FILE)
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(
      f"{path} not found: --model_dir must be a directory written by "
      "model_garden.ranking.train (it saves its config there)."
    )
  with tf.io.gfile.GFile(path) as f:
    values = overrides.parse_yaml(f.read(), source=path)
  config = overrides.override(definitions.ExperimentConfig(), values)
  return definitions.validate(config)
