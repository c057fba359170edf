"""Optimizers as plain (JSON-able) data, for ``TableConfig.get_config``.

An optimizer's own ``get_config`` gives its constructor arguments, whatever
they are; here they become ``{"class_name", "config"}`` that JSON keeps,
which refuses what cannot be saved: a callable learning rate (a Keras
learning rate schedule becomes one) and a ``slot_variable_creation_fn``.

Example:
  >>> import tpu_embedding as tpe
  >>> data = to_config(tpe.SGD(0.1, clipvalue=1.0), "table 't'")
  >>> data["class_name"], data["config"]["clipvalue"]
  ('SGD', (-1.0, 1.0))
  >>> from_config(data)
  SGD(learning_rate=0.1, clipvalue=(-1.0, 1.0))
"""

from __future__ import annotations

from typing import Any
from typing import TypedDict

from tpu_embedding.optimizers.adagrad import Adagrad
from tpu_embedding.optimizers.adagrad_momentum import AdagradMomentum
from tpu_embedding.optimizers.adam import Adam
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.optimizers.ftrl import FTRL
from tpu_embedding.optimizers.sgd import SGD


class OptimizerDict(TypedDict):
  """An optimizer as plain data: its class and constructor arguments."""

  class_name: str
  config: dict[str, Any]


#: The optimizers that can be saved, by class name.
CLASSES: dict[str, type[Optimizer]] = {
  cls.__name__: cls for cls in (SGD, Adagrad, AdagradMomentum, Adam, FTRL)
}


def to_config(optimizer: Optimizer | None, where: str) -> OptimizerDict | None:
  """``{"class_name", "config"}`` of an optimizer (None stays None).

  Args:
    optimizer: one of this package's optimizers, or None.
    where: what the optimizer belongs to, for messages.

  Raises:
    ValueError: for a callable learning rate or a slot creation function.
  """
  if optimizer is None:
    return None
  config = optimizer.get_config()
  if callable(config["learning_rate"]):
    raise ValueError(
      f"The optimizer of {where} has a callable learning_rate (a Keras "
      "optimizer's learning rate schedule becomes one), which get_config "
      "cannot save. Use a float learning rate, or save the weights only "
      "(model.save_weights or tf.train.Checkpoint)."
    )
  if config.get("slot_variable_creation_fn") is not None:
    raise ValueError(
      f"The optimizer of {where} has a slot_variable_creation_fn, which "
      "get_config cannot save."
    )
  return {"class_name": type(optimizer).__name__, "config": config}


def from_config(data: OptimizerDict | None) -> Optimizer | None:
  """The optimizer ``to_config`` described (None stays None)."""
  if data is None:
    return None
  config = dict(data["config"])
  if isinstance(config.get("clipvalue"), list):  # JSON turned it into one.
    config["clipvalue"] = tuple(config["clipvalue"])
  return CLASSES[data["class_name"]].from_config(config)
