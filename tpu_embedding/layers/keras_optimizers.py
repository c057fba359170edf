"""A layer's ``optimizer``: Keras optimizers as embedding ones, by table.

``embedding_optimizer`` takes whatever a layer's ``optimizer`` may be: a
name (``OPTIMIZER_NAMES``), a Keras optimizer (below), one of TensorFlow's
TPU embedding optimizers (``tf_configs``) or one of this package's.

The layers take a Keras ``SGD``, ``Adagrad``, ``Adam`` or ``Ftrl`` (Keras 3,
tf-keras, or ``tf_keras.optimizers.legacy``) as the tables' optimizer, as
tensorflow-recommenders does: it becomes this package's optimizer of the
same name with the same hyper-parameters, and the tables train with TPU
semantics (only looked-up rows change; a row's gradient is the sum over
its occurrences in the batch). Keras' optimizer object never touches the
tables and holds none of their slots.

The translation is driven by tables:

- ``KERAS_MAPPINGS``: for each Keras class name, our class, the Keras
  arguments passed under the same name and meaning, and the arguments
  accepted only at one value;
- ``COMMON_FIXED`` / ``IGNORED``: Keras' base-optimizer arguments that must
  stay off, and those with no effect on the update;
- ``_learning_rate``, ``_weight_decay``, ``_clipvalue``: the arguments that
  translate by a formula.

Every argument of ``get_config()`` is in one of them, or the translation
raises: nothing is silently dropped.

The mappings, for the rows ``w`` a batch looked up and their gradients
``g`` summed over the batch (Keras' update is the same unless said below):

- ``SGD(lr)`` -> ``SGD(lr)``: :math:`w \\leftarrow w - lr\\,g`.
- ``Adagrad(lr, initial_accumulator_value)`` -> ``Adagrad`` with both:
  :math:`a \\leftarrow a + g^2,\\; w \\leftarrow w - lr\\,g/\\sqrt{a}`.
- ``Adam(lr, beta_1, beta_2, epsilon)`` -> ``Adam`` with all four, TPU
  Adam as tensorflow-recommenders translates it (below):
  :math:`m \\leftarrow \\beta_1 m + (1-\\beta_1) g,\\;
  v \\leftarrow \\beta_2 v + (1-\\beta_2) g^2,\\;
  w \\leftarrow w - lr\\, m/\\sqrt{v + \\epsilon^2}`.
- ``Ftrl(lr, learning_rate_power, l1_regularization_strength,
  l2_regularization_strength, beta, initial_accumulator_value)`` -> ``FTRL``
  with all six. Keras' :math:`l_2 + \\beta/(2 lr)` gives the same quadratic
  term as TPU FTRL's :math:`(n'^{-p} + \\beta)/lr + 2 l_2`: equal updates.
- A learning rate schedule -> the callable
  :math:`lr_t = \\mathrm{schedule}(t)`, ``t`` the Keras optimizer's
  ``iterations``; a zero-argument callable is passed on as it is.
- ``decay=d`` (tf-keras legacy's time decay) ->
  :math:`lr_t = lr(t) / (1 + d\\,t)`, as legacy Keras computes it.
- ``weight_decay=d`` -> ``weight_decay_factor=d`` with
  ``multiply_weight_decay_factor_by_learning_rate=True``:
  :math:`w \\leftarrow w - d\\,lr\\,w` before the update, as Keras.
- ``clipvalue=c`` -> ``clipvalue=c``:
  :math:`g \\leftarrow \\mathrm{clip}(g, -c, c)`.

Where TPU semantics differ from Keras' dense update (the differences of
tensorflow-recommenders' translation, kept so that models move over
unchanged):

- Adam has no bias correction and adds epsilon inside the square root
  (``sum_inside_sqrt=True``), where Keras steps by
  :math:`lr\\sqrt{1-\\beta_2^t}/(1-\\beta_1^t) \\cdot m/(\\sqrt{v}+\\epsilon)`.
  Step ``t`` (from 1) is :math:`(1-\\beta_1^t)/\\sqrt{1-\\beta_2^t}` times
  Keras' (3.2 at ``t = 1`` with the defaults, tending to 1); a callable
  learning rate can correct for it (see ``tpu_embedding.Adam``).
- Adagrad's ``epsilon`` is accepted only at Keras' default (1e-7) and not
  used: the TPU rule has none (tensorflow-recommenders and keras-rs do the
  same). As :math:`a \\ge` ``initial_accumulator_value`` :math:`> 0`, it
  would change :math:`\\sqrt{a}` by a relative :math:`10^{-7}/(2a)` at
  most.
- Only looked-up rows are updated and decayed (Keras decays every row of
  a dense variable at every step); duplicate ids are summed before
  ``clipvalue``.

A learning rate schedule is evaluated at the Keras optimizer's
``iterations``, which only that optimizer's ``apply_gradients`` advances:
give the same optimizer object to ``model.compile`` (or apply it in your
loop), as with tensorflow-recommenders. Within a step the tables are
updated while gradients are computed, before Keras increments
``iterations``, so step ``k`` (from 0) uses the schedule's value at ``k``,
as the dense layers do. A callable learning rate is called at every update.
Every other hyper-parameter, a float learning rate included, is read once,
when the layer is created: later changes to the Keras optimizer (e.g. by a
``ReduceLROnPlateau`` callback) do not reach the tables.

Refused, with a ValueError naming the argument: any other Keras optimizer
(``RMSprop``, ``AdamW``, ``Nadam``, ...), ``SGD(momentum != 0)``,
``nesterov=True``, ``Adam(amsgrad=True)``,
``Ftrl(l2_shrinkage_regularization_strength != 0)``, ``clipnorm``,
``global_clipnorm``, ``use_ema=True``, ``loss_scale_factor``,
``gradient_accumulation_steps``, Adagrad's ``epsilon`` other than 1e-7.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.layers.keras_optimizers import embedding_optimizer
  >>> embedding_optimizer("adagrad")
  Adagrad(learning_rate=0.001)
  >>> from tpu_embedding.layers.keras_optimizers import to_embedding_optimizer
  >>> to_embedding_optimizer(tf.keras.optimizers.Adagrad(0.5, clipvalue=1.0))
  Adagrad(learning_rate=0.5, clipvalue=(-1.0, 1.0))
  >>> to_embedding_optimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))
  Traceback (most recent call last):
  ...
  ValueError: Keras SGD(momentum=0.9) cannot train embedding tables: the ...
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding import optimizers
from tpu_embedding.layers import tf_configs
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.optimizers.base import check_number
from tpu_embedding.types import LearningRate


class Fixed(NamedTuple):
  """A Keras argument accepted at one value only.

  Attributes:
    value: the value that translates (Keras' default).
    reason: why no other value does, for the error message.
  """

  value: Any
  reason: str


class KerasMapping(NamedTuple):
  """How one Keras optimizer class translates.

  Attributes:
    embedding_class: our optimizer class.
    hyper_parameters: Keras arguments passed to ``embedding_class`` under
      the same name, with the same meaning.
    fixed: the class' own arguments accepted at one value only.
  """

  embedding_class: type[Optimizer]
  hyper_parameters: tuple[str, ...]
  fixed: Mapping[str, Fixed]


_NESTEROV = Fixed(False, "Nesterov momentum needs momentum (see momentum)")

#: Keras class name -> its translation; the same for Keras 3, tf-keras and
#: tf-keras legacy (whose arguments share names and meanings).
KERAS_MAPPINGS: dict[str, KerasMapping] = {
  "SGD": KerasMapping(
    embedding_class=optimizers.SGD,
    hyper_parameters=(),
    fixed={
      "momentum": Fixed(
        0.0,
        "the embedding SGD has no momentum (tpu_embedding.AdagradMomentum "
        "is Adagrad with momentum)",
      ),
      "nesterov": _NESTEROV,
    },
  ),
  "Adagrad": KerasMapping(
    embedding_class=optimizers.Adagrad,
    hyper_parameters=("initial_accumulator_value",),
    fixed={
      "epsilon": Fixed(
        1e-7,
        "the embedding Adagrad has no epsilon; Keras' default is accepted "
        "and not used (a relative change of 1e-7 / (2 * accumulator) at "
        "most)",
      ),
    },
  ),
  "Adam": KerasMapping(
    embedding_class=optimizers.Adam,
    hyper_parameters=("beta_1", "beta_2", "epsilon"),
    fixed={
      "amsgrad": Fixed(False, "the embedding Adam has no AMSGrad maximum"),
    },
  ),
  "Ftrl": KerasMapping(
    embedding_class=optimizers.FTRL,
    hyper_parameters=(
      "learning_rate_power",
      "l1_regularization_strength",
      "l2_regularization_strength",
      "beta",
      "initial_accumulator_value",
    ),
    fixed={
      "l2_shrinkage_regularization_strength": Fixed(
        0.0, "the embedding FTRL has no L2 shrinkage"
      ),
    },
  ),
}

#: Keras base-optimizer arguments accepted at their "off" value only.
COMMON_FIXED: dict[str, Fixed] = {
  "clipnorm": Fixed(
    None, "embedding optimizers clip values, not norms (use clipvalue)"
  ),
  "global_clipnorm": Fixed(
    None, "embedding optimizers clip values, not norms (use clipvalue)"
  ),
  "use_ema": Fixed(False, "the tables keep no moving average"),
  "loss_scale_factor": Fixed(None, "the tables' gradients are not rescaled"),
  "gradient_accumulation_steps": Fixed(
    None, "the tables are updated at every step"
  ),
}

#: Keras arguments with no effect on the update (given ``COMMON_FIXED``).
IGNORED: dict[str, str] = {
  "name": "a label",
  "jit_compile": "how Keras compiles its own update",
  "is_legacy_optimizer": "which Keras class it is",
  "ema_momentum": "used only with use_ema=True",
  "ema_overwrite_frequency": "used only with use_ema=True",
}

#: Keras arguments translated by a formula (see the module docstring).
FORMULAS = ("learning_rate", "decay", "weight_decay", "clipvalue")

#: What the refusals suggest instead.
ACCEPTED = (
  "Keras (3, tf-keras or tf_keras.optimizers.legacy) SGD, Adagrad, Adam or "
  "Ftrl, the names 'sgd', 'adagrad', 'adam', 'ftrl', or an instance of "
  "tpu_embedding.SGD, Adagrad, AdagradMomentum, Adam or FTRL"
)


@dataclasses.dataclass(frozen=True)
class _Family:
  """One Keras' optimizer classes."""

  label: str
  classes: Any  # the module holding SGD, Adagrad, Adam, Ftrl
  optimizer_base: type
  schedule_base: type


def _families() -> list[_Family]:
  """The Keras versions already imported (only they can make optimizers)."""
  families = []
  keras = sys.modules.get("keras")
  if keras is not None and hasattr(keras, "optimizers"):
    families.append(
      _Family(
        "Keras",
        keras.optimizers,
        keras.optimizers.Optimizer,
        keras.optimizers.schedules.LearningRateSchedule,
      )
    )
  tf_keras = sys.modules.get("tf_keras")
  if tf_keras is not None and hasattr(tf_keras, "optimizers"):
    schedule = tf_keras.optimizers.schedules.LearningRateSchedule
    legacy = tf_keras.optimizers.legacy
    families += [
      _Family(
        "tf-keras",
        tf_keras.optimizers,
        tf_keras.optimizers.Optimizer,
        schedule,
      ),
      _Family("tf-keras legacy", legacy, legacy.Optimizer, schedule),
    ]
  return families


def is_keras_optimizer(optimizer: Any) -> bool:
  """Whether ``optimizer`` is a Keras 3 or tf-keras (legacy) optimizer.

  Example:
    >>> import tensorflow as tf
    >>> is_keras_optimizer(tf.keras.optimizers.RMSprop())
    True
    >>> is_keras_optimizer("sgd")
    False
  """
  return any(isinstance(optimizer, f.optimizer_base) for f in _families())


def _identify(optimizer: Any) -> tuple[_Family, str]:
  """The family and class name of a translatable Keras optimizer."""
  families = _families()
  for family in families:
    for name in KERAS_MAPPINGS:
      if type(optimizer) is getattr(family.classes, name, None):
        return family, name
  raise ValueError(
    f"Keras optimizer {type(optimizer).__name__} "
    f"({type(optimizer).__module__}) has no embedding-table equivalent. "
    f"Pass {ACCEPTED}. (Subclasses are refused too: they may change the "
    "update rule.)"
  )


@dataclasses.dataclass(frozen=True, eq=False)
class KerasLearningRate:
  """A Keras optimizer's learning rate at its current step, as a callable.

  :math:`lr_t = base(t) / (1 + decay \\cdot t)` with ``t`` the optimizer's
  ``iterations``; ``base(t)`` is the schedule's value at ``t``, a zero-
  argument callable's value, or a constant. Two are equal if they read the
  same optimizer, base and decay.

  Attributes:
    optimizer: the Keras optimizer whose ``iterations`` is the step.
    base: a Keras ``LearningRateSchedule``, a zero-argument callable or a
      float.
    is_schedule: whether ``base`` takes the step.
    decay: tf-keras legacy's ``decay`` (0: none).
  """

  optimizer: Any
  base: Any
  is_schedule: bool
  decay: float = 0.0

  def __call__(self) -> tf.Tensor:
    step = self.optimizer.iterations
    if self.is_schedule:
      rate = self.base(step)
    elif callable(self.base):
      rate = self.base()
    else:
      rate = self.base
    rate = tf.cast(rate, tf.float32)
    if self.decay:
      rate = rate / (1.0 + self.decay * tf.cast(step, tf.float32))
    return rate

  def __eq__(self, other: Any) -> bool:
    return (
      isinstance(other, KerasLearningRate)
      and other.optimizer is self.optimizer
      and other.base is self.base
      and other.decay == self.decay
    )

  def __hash__(self) -> int:
    return hash((id(self.optimizer), id(self.base), self.decay))

  def __repr__(self) -> str:
    base = type(self.base).__name__ if self.is_schedule else repr(self.base)
    decay = f" / (1 + {self.decay} * t)" if self.decay else ""
    return f"<{base}{decay} at t = {type(self.optimizer).__name__}.iterations>"


def _plain(value: Any) -> Any:
  """A Python float for a float; a float32 value as the user wrote it.

  Keras 3 and tf-keras keep the learning rate in a float32 variable (and
  tf-keras legacy, once used, its other hyper-parameters too), so
  ``get_config`` returns 0.009999999776482582 or ``np.float32(0.01)`` for
  0.01: the shortest decimal with the same float32 is the number the user
  wrote. Other floats, and other values, are returned unchanged.
  """
  if not isinstance(value, (float, np.floating)):
    return value
  value = float(value)
  single = np.float32(value)
  return float(str(single)) if float(single) == value else value


def _learning_rate(
  optimizer: Any, config: Mapping[str, Any], family: _Family, where: str
) -> LearningRate:
  """Our learning rate for a Keras optimizer (see the module docstring)."""
  decay = config.get("decay") or 0.0
  if decay:
    check_number(f"{where} decay", decay, minimum=0.0)
  raw = compat.keras_learning_rate(optimizer)
  is_schedule = isinstance(raw, family.schedule_base)
  if is_schedule or callable(raw):
    base: Any = raw
  else:
    base = config["learning_rate"]
    if not decay:
      return base
  # tf-keras legacy creates ``iterations`` on first use: create it now,
  # eagerly and under the optimizer's strategy, not inside a traced step.
  _ = optimizer.iterations
  return KerasLearningRate(optimizer, base, is_schedule, float(decay))


def _weight_decay(config: Mapping[str, Any]) -> dict[str, Any]:
  """Keras' decoupled ``w -= d * lr * w`` as our decay arguments."""
  decay = config.get("weight_decay")
  if not decay:
    return {}
  return {
    "weight_decay_factor": float(decay),
    "multiply_weight_decay_factor_by_learning_rate": True,
  }


def _clipvalue(config: Mapping[str, Any]) -> dict[str, Any]:
  """Keras' element-wise ``clipvalue=c`` as ours (``[-c, c]``)."""
  clip = config.get("clipvalue")
  return {} if clip is None else {"clipvalue": float(clip)}


def to_embedding_optimizer(optimizer: Any) -> Optimizer:
  """This package's optimizer equivalent to a Keras optimizer.

  Args:
    optimizer: a Keras 3, tf-keras or tf-keras legacy ``SGD``, ``Adagrad``,
      ``Adam`` or ``Ftrl`` (exactly these classes).

  Returns:
    A new ``tpu_embedding.SGD``, ``Adagrad``, ``Adam`` or ``FTRL``.

  Raises:
    ValueError: for another optimizer or an argument with no equivalent,
      naming it and what is accepted.

  Example:
    >>> import tensorflow as tf
    >>> to_embedding_optimizer(tf.keras.optimizers.Ftrl(
    ...     0.1, l1_regularization_strength=0.01, beta=0.5))
    FTRL(learning_rate=0.1, l1_regularization_strength=0.01, beta=0.5)
  """
  family, name = _identify(optimizer)
  mapping = KERAS_MAPPINGS[name]
  config = {key: _plain(v) for key, v in optimizer.get_config().items()}
  fixed = {**COMMON_FIXED, **mapping.fixed}
  kwargs: dict[str, Any] = {}
  for key, value in config.items():
    if key in mapping.hyper_parameters:
      kwargs[key] = value
    elif key in fixed:
      if value != fixed[key].value:
        raise ValueError(
          f"{family.label} {name}({key}={value!r}) cannot train embedding "
          f"tables: {fixed[key].reason}. Only {key}={fixed[key].value!r} is "
          f"accepted. Pass {ACCEPTED}."
        )
    elif key not in IGNORED and key not in FORMULAS:
      raise ValueError(
        f"{family.label} {name} argument {key!r} has no translation to an "
        "embedding optimizer (it is not in "
        "tpu_embedding/layers/keras_optimizers.py's tables)."
      )
  where = f"Keras {name}"
  kwargs["learning_rate"] = _learning_rate(optimizer, config, family, where)
  kwargs.update(_weight_decay(config), **_clipvalue(config))
  return mapping.embedding_class(**kwargs)


#: Optimizer names the layers accept, with Keras' default learning rates
#: (the defaults of these classes): sgd 0.01, the others 0.001.
OPTIMIZER_NAMES = {
  "sgd": optimizers.SGD,
  "adagrad": optimizers.Adagrad,
  "adam": optimizers.Adam,
  "ftrl": optimizers.FTRL,
}


def embedding_optimizer(optimizer: Any) -> Optimizer | None:
  """The embedding optimizer for whatever a layer's ``optimizer`` may be.

  Args:
    optimizer: ``"sgd"``, ``"adagrad"``, ``"adam"``, ``"ftrl"`` (default
      hyper-parameters); a Keras ``SGD``, ``Adagrad``, ``Adam`` or ``Ftrl``
      (Keras 3, tf-keras or tf-keras legacy; ``to_embedding_optimizer``);
      one of TensorFlow's TPU embedding optimizers (rebuilt by
      ``tf_configs``); an instance of this package's optimizers; or None
      (lookups only).

  Returns:
    The optimizer object (None for None).

  Raises:
    ValueError: for an unknown name, a Keras optimizer or argument with no
      embedding equivalent, or another type.
  """
  if optimizer is None or isinstance(optimizer, Optimizer):
    return optimizer
  if isinstance(optimizer, str):
    if optimizer.lower() not in OPTIMIZER_NAMES:
      raise ValueError(
        f"Unknown optimizer name '{optimizer}'. Please use one of "
        f"{sorted(OPTIMIZER_NAMES)}, a Keras SGD, Adagrad, Adam or Ftrl, or "
        "an optimizer object such as tpu_embedding.Adagrad(0.1)."
      )
    return OPTIMIZER_NAMES[optimizer.lower()]()
  if is_keras_optimizer(optimizer):
    return to_embedding_optimizer(optimizer)
  if tf_configs.is_tf_optimizer(optimizer):
    return tf_configs.from_tf_optimizer(optimizer)
  raise ValueError(
    f"{type(optimizer)} is not an embedding optimizer. Pass {ACCEPTED}."
  )
