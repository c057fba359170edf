"""The shared part of every embedding optimizer.

An optimizer is three things (as in optax): hyper-parameters, a typed tuple
of slot rows, and a pure row-update function. The update of one step, for the
rows ``w`` that the batch looked up and their summed gradients ``g``, is

.. math::

   g &\\leftarrow \\mathrm{clip}(g, g_{min}, g_{max})
       && \\text{(clipvalue)} \\\\
   w &\\leftarrow w - \\lambda \\, w
       && \\lambda = d \\text{ or } d \\cdot lr
          \\text{ (decoupled weight decay)} \\\\
   (w, s) &\\leftarrow \\mathrm{rule}(w, s, g, lr)
       && \\text{(the optimizer's own rule)} \\\\
   w &\\leftarrow \\mathrm{clip}(w, w_{min}, w_{max})
       && \\text{(clip\\_weight\\_min/max)}

Only rows that were looked up change (TPU "lazy" updates); a row's gradient
is the sum over all its occurrences in the batch.

Example:
  >>> import tpu_embedding as tpe
  >>> opt = tpe.SGD(learning_rate=0.1, clipvalue=1.0)
  >>> opt.clip_gradient_min, opt.clip_gradient_max
  (-1.0, 1.0)
"""

from __future__ import annotations

import abc
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any
from typing import ClassVar
from typing import NamedTuple
from typing import TypeAlias
from typing import Union

import tensorflow as tf

from tpu_embedding.initializers import Initializer
from tpu_embedding.optimizers import learning_rates

#: A learning rate: a Python float or a zero-argument callable returning a
#: scalar (float or tensor), evaluated each time gradients are applied.
LearningRate: TypeAlias = Union[float, Callable[[], Any]]

#: Gradient clipping: a positive scalar ``c`` (clip to ``[-c, c]``) or a
#: ``(min, max)`` tuple where either side may be ``None``.
ClipValue: TypeAlias = Union[float, tuple[float | None, float | None]]

#: ``slot_variable_creation_fn(table_variable, slot_names, initializers)``
#: returns ``{slot_name: variable}``.
SlotVariableCreationFn = Callable[
  [tf.Variable, list[str], list[Initializer]], dict[str, tf.Variable]
]

#: An optimizer's slot rows: its ``Slots`` NamedTuple of tensors.
SlotRows = tuple[tf.Tensor, ...]


class _NoSlots(NamedTuple):
  """The empty slot tuple of optimizers without state (SGD)."""


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(
  name: str, value: Any, *, minimum: float | None = None, strict: bool = False
) -> None:
  """Raises ValueError unless ``value`` is a finite real ``>= minimum``.

  Args:
    name: the argument name used in the message.
    value: the value given.
    minimum: the smallest allowed value (None: no bound).
    strict: whether ``minimum`` itself is excluded.
  """
  if not _is_number(value) or not math.isfinite(value):
    raise ValueError(
      f"Argument `{name}` must be a finite number. Received: {value!r}"
    )
  if minimum is not None and (value < minimum or (strict and value == minimum)):
    relation = ">" if strict else ">="
    raise ValueError(
      f"Argument `{name}` must be {relation} {minimum}. Received: {value}"
    )


def check_initial_accumulator(value: Any) -> None:
  """Raises TensorFlow's ValueError unless ``value`` is a finite float > 0."""
  if not isinstance(value, (int, float)) or value <= 0:
    raise ValueError(
      "Argument `initial_accumulator_value` must be a positive float. "
      f"Received: {value}"
    )
  check_number("initial_accumulator_value", value)


class Optimizer(metaclass=abc.ABCMeta):
  """Base class of the embedding optimizers (hyper-parameters + row rule).

  Subclasses set ``SLOT_NAMES`` and ``Slots`` (a NamedTuple with those field
  names), implement ``slot_initializers`` and ``_rule``.

  Attributes:
    learning_rate: float, or a zero-argument callable read at every update.
    use_gradient_accumulation: kept for TPU translation. Off TPU, duplicate
      ids are always summed before the update (the accurate mode).
    clip_weight_min: lower bound for weights after the update (None: none).
    clip_weight_max: upper bound for weights after the update (None: none).
    clip_gradient_min: lower bound for the summed row gradient (None: none).
    clip_gradient_max: upper bound for the summed row gradient (None: none).
    weight_decay_factor: decoupled weight decay ``d`` (None or 0: none).
    multiply_weight_decay_factor_by_learning_rate: decay by ``d * lr``.
    slot_variable_creation_fn: optional callable creating the slot variables.
    low_dimensional_packing_status: kept for TPU translation.
  """

  SLOT_NAMES: tuple[str, ...] = ()
  Slots: type[SlotRows] = _NoSlots

  #: The fused update kernel's name for this class's rule
  #: (``kernels/fused_update.py``), or None where the kernel has none.
  #: Read by ``fused_rule`` on the class that sets it only.
  FUSED_RULE: ClassVar[str | None] = None

  #: The 16-bit types this rule's slots may be stored in
  #: (``RowStorage.slots``), and why not others: slots summing squared
  #: gradients need bfloat16's range (float16 underflows below 6e-8).
  SLOTS_IN_16_BITS: ClassVar[tuple[str, ...]] = ("bfloat16",)
  SLOTS_IN_16_BITS_WHY: ClassVar[str] = (
    "its slots sum squared gradients, which float16's range (6e-8 to "
    "65504) loses"
  )

  def __init__(
    self,
    learning_rate: LearningRate,
    use_gradient_accumulation: bool,
    clip_weight_min: float | None,
    clip_weight_max: float | None,
    weight_decay_factor: float | None,
    multiply_weight_decay_factor_by_learning_rate: bool | None,
    clipvalue: ClipValue | None = None,
    slot_variable_creation_fn: SlotVariableCreationFn | None = None,
    low_dimensional_packing_status: bool = False,
  ):
    if not callable(learning_rate):
      check_number("learning_rate", learning_rate, minimum=0.0)
    if slot_variable_creation_fn is not None and not callable(
      slot_variable_creation_fn
    ):
      raise ValueError(
        "Argument `slot_variable_creation_fn` must be either None or a "
        f"callable. Received: {slot_variable_creation_fn}"
      )
    for name, bound in (
      ("clip_weight_min", clip_weight_min),
      ("clip_weight_max", clip_weight_max),
    ):
      if bound is not None:
        check_number(name, bound)
    if (
      clip_weight_min is not None
      and clip_weight_max is not None
      and clip_weight_min > clip_weight_max
    ):
      raise ValueError(
        "Argument `clip_weight_min` must be <= `clip_weight_max`. "
        f"Received: {clip_weight_min} > {clip_weight_max}"
      )
    if weight_decay_factor is not None:
      check_number("weight_decay_factor", weight_decay_factor, minimum=0.0)
    if not use_gradient_accumulation and clipvalue is not None:
      raise ValueError(
        "When `use_gradient_accumulation` is False, gradient clipping "
        "cannot be used and `clipvalue` should be left as None. "
        f"Received value {clipvalue} for argument `clipvalue`."
      )
    self.learning_rate = learning_rate
    self.use_gradient_accumulation = use_gradient_accumulation
    self.clip_weight_min = clip_weight_min
    self.clip_weight_max = clip_weight_max
    self.clip_gradient_min, self.clip_gradient_max = _parse_clipvalue(clipvalue)
    self.weight_decay_factor = weight_decay_factor
    self.multiply_weight_decay_factor_by_learning_rate = (
      multiply_weight_decay_factor_by_learning_rate
    )
    self.slot_variable_creation_fn = slot_variable_creation_fn
    self.low_dimensional_packing_status = low_dimensional_packing_status

  # --- slots ---------------------------------------------------------------

  @abc.abstractmethod
  def slot_initializers(self) -> list[Initializer]:
    """Returns one initializer per name in ``SLOT_NAMES``."""

  def create_slots(
    self,
    table: tf.Variable,
    variable_creator: Callable[[str, Initializer], tf.Variable],
  ) -> dict[str, tf.Variable]:
    """Creates this optimizer's slot variables for one table.

    Args:
      table: the table variable (passed to ``slot_variable_creation_fn``).
      variable_creator: ``(slot_name, initializer) -> variable``.

    Returns:
      ``{slot_name: variable}`` in ``SLOT_NAMES`` order.
    """
    names = list(self.SLOT_NAMES)
    initializers = self.slot_initializers()
    if self.slot_variable_creation_fn is not None:
      slots = self.slot_variable_creation_fn(table, names, initializers)
      if set(slots) != set(names):
        raise ValueError(
          f"`slot_variable_creation_fn` of {type(self).__name__} returned "
          f"slots {sorted(slots)}; expected exactly {names}."
        )
      return {name: slots[name] for name in names}
    return {
      name: variable_creator(name, init)
      for name, init in zip(names, initializers, strict=True)
    }

  @property
  def fused_rule(self) -> str | None:
    """The fused kernel's rule for this optimizer, or None.

    Only the class that names a rule (``FUSED_RULE``) has it: a subclass
    may change the update, so it runs the TensorFlow path unless it names
    the rule again (having kept its parent's update).
    """
    return type(self).__dict__.get("FUSED_RULE")

  @property
  def updates_all_rows(self) -> bool:
    """Whether every row changes each step (only non-lazy Adam)."""
    return False

  # --- the update ----------------------------------------------------------

  def learning_rate_tensor(self) -> tf.Tensor:
    """The current learning rate as a float32 scalar (a callable's value
    is shared by every table of an update: ``learning_rates.py``)."""
    if callable(self.learning_rate):
      return learning_rates.evaluate(self.learning_rate)
    return tf.cast(self.learning_rate, tf.float32)

  def apply(
    self, params: tf.Tensor, slots: SlotRows, grads: tf.Tensor, lr: tf.Tensor
  ) -> tuple[tf.Tensor, SlotRows]:
    """Updates gathered rows; a pure function of its inputs.

    Args:
      params: ``[n, dim]`` rows of the table.
      slots: ``self.Slots`` of ``[n, dim]`` slot rows.
      grads: ``[n, dim]`` gradients, summed over duplicate ids.
      lr: scalar learning rate.

    Returns:
      ``(new_params, new_slots)``.
    """
    if self.clip_gradient_min is not None or self.clip_gradient_max is not None:
      grads = _clip(grads, self.clip_gradient_min, self.clip_gradient_max)
    if self.weight_decay_factor:
      decay = tf.constant(self.weight_decay_factor, tf.float32)
      if self.multiply_weight_decay_factor_by_learning_rate:
        decay = decay * lr
      params = params - decay * params
    params, slots = self._rule(params, slots, grads, lr)
    if self.clip_weight_min is not None or self.clip_weight_max is not None:
      params = _clip(params, self.clip_weight_min, self.clip_weight_max)
    return params, slots

  @abc.abstractmethod
  def _rule(
    self, params: tf.Tensor, slots: Any, grads: tf.Tensor, lr: tf.Tensor
  ) -> tuple[tf.Tensor, SlotRows]:
    """The optimizer's own row rule (no clipping, no decay).

    ``slots`` is a ``self.Slots`` (typed ``Any`` so that each subclass
    declares its own ``Slots`` NamedTuple).
    """

  # --- value semantics -----------------------------------------------------

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments that rebuild an equal optimizer."""
    config: dict[str, Any] = {}
    for name in inspect.signature(type(self).__init__).parameters:
      if name == "self":
        continue
      if name == "clipvalue":
        clip = (self.clip_gradient_min, self.clip_gradient_max)
        config[name] = None if clip == (None, None) else clip
      else:
        config[name] = getattr(self, name)
    return config

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> Optimizer:
    return cls(**config)

  def __eq__(self, other: Any) -> bool:
    return type(self) is type(other) and vars(self) == vars(other)

  def __hash__(self) -> int:
    return hash((type(self).__name__, tuple(vars(self).items())))

  def __repr__(self) -> str:
    defaults = {
      name: p.default
      for name, p in inspect.signature(type(self).__init__).parameters.items()
    }
    parts = []
    for name, value in self.get_config().items():
      if name == "learning_rate" or value != defaults.get(name):
        parts.append(f"{name}={value!r}")
    return f"{type(self).__name__}({', '.join(parts)})"


#: ``Optimizer.__init__``'s arguments: the hyper-parameters every optimizer
#: shares (``shared_arguments``).
SHARED_ARGUMENTS = tuple(inspect.signature(Optimizer.__init__).parameters)[1:]


def shared_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
  """The shared hyper-parameters among a subclass constructor's
  ``locals()``, for ``Optimizer.__init__``."""
  return {k: arguments[k] for k in SHARED_ARGUMENTS if k in arguments}


def _parse_clipvalue(
  clipvalue: ClipValue | None,
) -> tuple[float | None, float | None]:
  """``c`` -> ``(-c, c)``; ``(lo, hi)`` as is; None -> ``(None, None)``."""
  if clipvalue is None:
    return None, None
  if isinstance(clipvalue, tuple):
    if len(clipvalue) != 2:
      raise ValueError(
        "Argument `clipvalue` must be a number or a (min, max) tuple. "
        f"Received: {clipvalue}"
      )
    low, high = clipvalue
    for side in (low, high):
      if side is not None:
        check_number("clipvalue", side)
    if low is not None and high is not None and low > high:
      raise ValueError(
        f"Argument `clipvalue` must have min <= max. Received: {clipvalue}"
      )
    return low, high
  check_number("clipvalue", clipvalue, minimum=0.0, strict=True)
  return -1.0 * clipvalue, clipvalue


def _clip(x: tf.Tensor, low: float | None, high: float | None) -> tf.Tensor:
  if low is not None:
    x = tf.maximum(x, low)
  if high is not None:
    x = tf.minimum(x, high)
  return x


def constant_initializer(value: float = 0.0) -> Initializer:
  """A constant initializer for slots that also initializes shards."""
  return tf.constant_initializer(value, support_partition=True)
