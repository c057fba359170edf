"""Ranking experiment configs: Model Garden's fields and named experiments.

``get_config(name)`` returns a registered experiment (``dlrm_criteo``,
``dcn_criteo``, ``dlrm_dcn_v2_criteo`` with Model Garden's published
settings, and ``*_cpu_small`` variants that train on a CPU in about a
minute); ``overrides`` applies YAML files and ``--params_override``
strings; ``definitions`` holds the dataclasses; ``validate`` checks a
config (``support``: keys that do not work here are rejected).

Example:
  >>> from model_garden.ranking import configs
  >>> configs.experiments()[:3]
  ['dcn_criteo', 'dcn_criteo_cpu_small', 'dlrm_criteo']
"""

from model_garden.ranking.configs import dcn_v2  # noqa: F401 (registers)
from model_garden.ranking.configs import dlrm  # noqa: F401 (registers)
from model_garden.ranking.configs import dlrm_dcnv2  # noqa: F401 (registers)
from model_garden.ranking.configs.definitions import ExperimentConfig
from model_garden.ranking.configs.overrides import load_yaml
from model_garden.ranking.configs.overrides import override
from model_garden.ranking.configs.overrides import parse_params_override
from model_garden.ranking.configs.registry import experiments
from model_garden.ranking.configs.registry import get_config
from model_garden.ranking.configs.support import validate

__all__ = [
  "ExperimentConfig",
  "experiments",
  "get_config",
  "load_yaml",
  "override",
  "parse_params_override",
  "validate",
]
