"""Keras 3 ``fit`` / ``evaluate`` where Keras itself fails under a strategy.

Keras 3 (3.0 to at least 3.15.1, the Keras TensorFlow 2.21 installs) raises
in two places of its TensorFlow trainer under ``tf.distribute``, for any
model (keras-team/keras#20585, tensorflow/tensorflow#72388):

1. Build from the first batch. ``TensorFlowTrainer._maybe_symbolic_build``
   averages the first batch over the replicas with one ``strategy.reduce``.
   A MultiWorkerMirroredStrategy with two or more workers accepts no
   structure there ("Attempt to convert a value ... to a Tensor"), and no
   strategy can average ragged or sparse ids ("'RaggedTensor' object has no
   attribute 'device'").
2. Reduction of the logs. ``reduce_per_replica`` averages the loss and
   metrics across workers with ``strategy.reduce("MEAN", v, axis=0)``;
   scalars have no axis 0 ("Invalid reduction dimension 0 for input with 0
   dimensions").

The fix is per model. :func:`fix_distributed_fit` overrides three methods of
one model *instance*, and nothing in Keras:

* ``_maybe_symbolic_build``: in exactly the failing cases, hands Keras'
  own build this worker's first replica batch instead of the average
  (building needs only shapes and dtypes, which the replicas share, and
  integer ids stay integers); otherwise Keras' own average, as Keras does.
* ``train_step`` / ``test_step``: on several workers only, return scalar
  logs as ``[1]`` vectors, which Keras' ``axis=0`` mean reduces to the
  mean over all replicas, a scalar again. The model's own steps (a
  subclass's ``train_step`` included) still do the work.

Everything else is Keras' own, so a model that trains without the fix
trains the same with it (bit for bit: dense batches on one worker). Undo
with ``fix_distributed_fit(model, enabled=False)``. ``predict`` works in
Keras as is.

Why a process-wide hook remains. Keras tells a layer nothing about the
model holding it until the model calls it, and a model built by ``fit``
calls its layers for the first time *after* failure 1. So our layers cannot
fix their model themselves. Instead, creating one of them under a
``MirroredStrategy`` or ``MultiWorkerMirroredStrategy`` replaces one
attribute, ``TensorFlowTrainer._maybe_symbolic_build``, with a hook that
applies :func:`fix_distributed_fit` to the models that hold one of our
layers, the first time ``fit``/``evaluate`` builds them, and passes every
other model to Keras' original unchanged. :func:`enable_distributed_fit`
extends the hook to every model built under those strategies. The hook is:

* version-gated: installed on Keras 3 up to
  :data:`LAST_KERAS_KNOWN_TO_NEED_FIX`; on a newer Keras only if the
  private functions involved still have the parameters the fix expects
  (else a warning naming each changed function, and nothing is replaced)
  and still contain the reductions that fail (else Keras has fixed them
  and is left alone);
* logged once (absl INFO) when installed, naming what it replaces;
* undone by :func:`disable_distributed_fit` (the original function object
  is put back, and the models the hook fixed are restored; our layers no
  longer install it until :func:`enable_distributed_fit`), or scoped with
  :func:`distributed_fit_enabled`.

Nothing is replaced until one of our layers is created under those
strategies or the fix is requested. tf-keras (``TF_USE_LEGACY_KERAS=1``)
needs no fix and is left alone.

Example:
  >>> from tpu_embedding.layers import distributed_fit
  >>> with distributed_fit.distributed_fit_enabled() as installed:
  ...   installed == distributed_fit.IS_KERAS_3
  True
"""

from __future__ import annotations

import contextlib
import inspect
import re
import types
import warnings
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import TypeVar

import tensorflow as tf
from absl import logging

from tpu_embedding import compat
from tpu_embedding.layers.keras_compat import IS_KERAS_3
from tpu_embedding.layers.keras_compat import keras

ISSUE = "https://github.com/keras-team/keras/issues/20585"

#: The last Keras release known to need the fix (and checked to have the
#: private functions it relies on in the expected shape).
LAST_KERAS_KNOWN_TO_NEED_FIX = "3.15.1"

#: The parameter names the fix expects, per private name of
#: ``keras.src.backend.tensorflow.trainer`` it wraps or relies on.
EXPECTED_PARAMETERS = {
  "TensorFlowTrainer._maybe_symbolic_build": (
    "self",
    "iterator",
    "data_batch",
  ),
  "reduce_per_replica": ("values", "strategy", "reduction"),
  "_collective_all_reduce_multi_worker": ("strategy",),
}

#: The strategies whose Keras 3 ``fit`` the fix concerns.
_MIRRORED = (
  tf.distribute.MirroredStrategy,
  tf.distribute.MultiWorkerMirroredStrategy,
)

_BUILD = "_maybe_symbolic_build"
_OVERRIDDEN = (_BUILD, "train_step", "test_step")
_MODEL_STATE = "_tpu_embedding_distributed_fit"
_MISSING = object()


class _Hook:
  """The process-wide state: which models the hook fixes, what it replaced."""

  mode: str | None = None  # None, "layers" (models with our layers), "all"
  replaced: Any = _MISSING  # TensorFlowTrainer.__dict__ entry it replaced
  keras_build: Callable[..., Any] | None = None  # Keras' method, resolved
  layers_may_install = True  # False after disable_distributed_fit()
  fixed: weakref.WeakSet = weakref.WeakSet()  # models the hook fixed


def enable_distributed_fit() -> bool:
  """Fixes Keras 3 ``fit``/``evaluate`` for every model (see module).

  Installs the hook on ``TensorFlowTrainer._maybe_symbolic_build`` (logged
  once), for all models built under a ``MirroredStrategy`` or
  ``MultiWorkerMirroredStrategy``, not only those holding our layers.
  Idempotent; call it in every process of a cluster before ``model.fit``.

  Returns:
    Whether the fix is in place: False under tf-keras (which needs none),
    on a Keras that no longer needs it, and, with a warning, on a Keras
    whose private functions changed.

  Example:
    >>> with distributed_fit_enabled():  # Scoped; the call itself lasts.
    ...   enable_distributed_fit() == IS_KERAS_3
    True
  """
  _Hook.layers_may_install = True
  return _set_mode("all")


def disable_distributed_fit() -> None:
  """Restores Keras exactly; our layers no longer install the fix.

  Puts the original ``TensorFlowTrainer._maybe_symbolic_build`` back (the
  same function object) and removes the fix from the models the hook fixed
  (not from those given to :func:`fix_distributed_fit`). Idempotent.
  :func:`enable_distributed_fit` turns it on again.

  Example:
    >>> with distributed_fit_enabled():
    ...   disable_distributed_fit()
    ...   installed()
    False
  """
  _Hook.layers_may_install = False
  _set_mode(None)


@contextlib.contextmanager
def distributed_fit_enabled() -> Iterator[bool]:
  """:func:`enable_distributed_fit` inside a ``with`` block only.

  On exit, the state before the block is restored (removed, or installed
  for the models holding our layers only).

  Yields:
    What :func:`enable_distributed_fit` returns.

  Example:
    >>> before = installed()
    >>> with distributed_fit_enabled() as fixed:
    ...   pass  # model.fit(...) of any model under a mirrored strategy
    >>> installed() == before  # the state before the block is back
    True
  """
  mode, layers_may_install = _Hook.mode, _Hook.layers_may_install
  try:
    yield enable_distributed_fit()
  finally:
    _Hook.layers_may_install = layers_may_install
    _set_mode(mode)


def installed() -> bool:
  """Whether the hook replaces Keras' ``_maybe_symbolic_build`` now.

  Example:
    >>> with distributed_fit_enabled():
    ...   installed() == IS_KERAS_3
    True
  """
  return _Hook.mode is not None


def fix_distributed_fit(model: Any, enabled: bool = True) -> bool:
  """Fixes (or unfixes) ``fit``/``evaluate`` of one Keras 3 model.

  Overrides this model instance's ``_maybe_symbolic_build``,
  ``train_step`` and ``test_step`` (see module); Keras and every other
  model are untouched. Needs no hook, so it suits models without our
  layers when nothing process-wide is wanted.

  Args:
    model: a Keras 3 ``keras.Model``, created under its strategy's scope.
    enabled: False removes the fix again (the model's own methods are
      back; its ``fit`` retraces).

  Returns:
    Whether the model is fixed now: always False under tf-keras, on a
    Keras that no longer needs it and (with a warning) on one whose
    private functions changed.

  Example:
    >>> model = keras.Sequential([keras.layers.Dense(1)])
    >>> fix_distributed_fit(model) == IS_KERAS_3
    True
    >>> fix_distributed_fit(model, enabled=False)
    False
  """
  state = model.__dict__.get(_MODEL_STATE)
  if not enabled:
    if state is not None:
      _unfix(model)
    return False
  if state is not None:
    state["by_hook"] = False  # Now requested: disabling the hook keeps it.
    _Hook.fixed.discard(model)
    return True
  trainer = _checked_trainer()
  if trainer is None:
    return False
  _fix(model, trainer, by_hook=False)
  return True


def is_fixed(model: Any) -> bool:
  """Whether ``model`` carries the fix (requested or applied by the hook).

  Example:
    >>> is_fixed(keras.Sequential())
    False
  """
  return _MODEL_STATE in model.__dict__


def needs_fix(strategy: tf.distribute.Strategy) -> bool:
  """Whether Keras 3 ``fit`` under ``strategy`` can hit the failures.

  Example:
    >>> needs_fix(tf.distribute.get_strategy())
    False
  """
  return IS_KERAS_3 and isinstance(strategy, _MIRRORED)


#: The layer classes whose models the hook fixes (``fixes_models_holding``).
_LAYER_CLASSES: list[type] = []

LayerClass = TypeVar("LayerClass", bound=type)


def fixes_models_holding(layer_class: LayerClass) -> LayerClass:
  """Class decorator: the hook fixes the models holding such layers.

  The layers register themselves, so this module never imports them (the
  layers import it: ``base.EmbeddingLayer``). Subclasses are covered.

  Args:
    layer_class: a Keras layer class.

  Returns:
    ``layer_class``, unchanged.
  """
  if layer_class not in _LAYER_CLASSES:
    _LAYER_CLASSES.append(layer_class)
  return layer_class


def install_for_layers(strategy: tf.distribute.Strategy) -> bool:
  """Installs the hook for models holding our layers, if ``strategy`` needs it.

  Called by our layers when they are created; does nothing after
  :func:`disable_distributed_fit` or when the hook already covers every
  model.

  Returns:
    Whether the hook is installed.

  Example:
    >>> before = installed()
    >>> # The default strategy needs no fix: nothing changes.
    >>> install_for_layers(tf.distribute.get_strategy()) == before
    True
  """
  if not needs_fix(strategy) or not _Hook.layers_may_install:
    return installed()
  if _Hook.mode == "all":
    return True
  return _set_mode("layers")


# --- the version gate ---------------------------------------------------------


def _version(text: str) -> tuple[int, ...]:
  """``"3.15.1"`` (or ``"3.16.0.dev2025"``) as ``(3, 15, 1)``."""
  return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _keras_function(trainer: Any, name: str) -> Any:
  """The Keras function ``name`` of ``trainer``, never our hook."""
  if name == f"TensorFlowTrainer.{_BUILD}" and _Hook.mode is not None:
    return _Hook.keras_build
  value = trainer
  for part in name.split("."):
    value = getattr(value, part, None)
  return value


def _parameters(function: Any) -> tuple[str, ...] | None:
  try:
    return tuple(inspect.signature(function).parameters)
  except (TypeError, ValueError):  # None, or not introspectable
    return None


def _checked_trainer() -> Any:
  """Keras' TensorFlow trainer module if the fix applies, else None.

  Warns when Keras' private functions changed; logs when a Keras newer
  than :data:`LAST_KERAS_KNOWN_TO_NEED_FIX` no longer needs the fix.
  """
  if not IS_KERAS_3:
    return None
  version = keras.__version__
  trainer = compat.keras_tensorflow_trainer()
  changed = []
  for name, expected in EXPECTED_PARAMETERS.items():
    function = None if trainer is None else _keras_function(trainer, name)
    found = _parameters(function)
    if found != expected:
      shown = "missing" if found is None else f"({', '.join(found)})"
      changed.append(
        f"keras.src.backend.tensorflow.trainer.{name}: expected "
        f"({', '.join(expected)}), found {shown}"
      )
  if changed:
    warnings.warn(
      f"tpu_embedding: Keras {version} changed the private functions the "
      f"model.fit fix for MirroredStrategy and MultiWorkerMirroredStrategy "
      f"({ISSUE}) relies on, so it is not installed: " + "; ".join(changed),
      RuntimeWarning,
      stacklevel=3,
    )
    return None
  if _version(version) > _version(LAST_KERAS_KNOWN_TO_NEED_FIX):
    if not _keras_still_fails(trainer):
      logging.info(
        "tpu_embedding: Keras %s no longer averages the first batch or "
        "reduces the logs on axis 0 (%s); the model.fit fix is not needed "
        "and Keras is left alone.",
        version,
        ISSUE,
      )
      return None
  return trainer


def _keras_still_fails(trainer: Any) -> bool:
  """Whether Keras' code still holds the two reductions that fail."""
  try:
    build = _keras_function(trainer, f"TensorFlowTrainer.{_BUILD}")
    build = inspect.getsource(build)
    reduce = inspect.getsource(trainer.reduce_per_replica)
  except (OSError, TypeError):  # No source: the signatures matched.
    return True
  return ".reduce(" in build or "axis=0" in reduce


# --- the hook -----------------------------------------------------------------


def _set_mode(mode: str | None) -> bool:
  """Installs the hook for ``mode`` (see :class:`_Hook`), or removes it."""
  if mode == _Hook.mode:
    return installed()
  for model in list(_Hook.fixed):  # The hook re-fixes them when they build.
    _unfix(model)
  if mode is None:
    _remove()
    return False
  if _Hook.mode is None:
    trainer = _checked_trainer()
    if trainer is None:
      return False
    _install(trainer, mode)
  else:
    logging.info(
      "tpu_embedding: the model.fit fix now applies to %s.", _scope(mode)
    )
  _Hook.mode = mode
  return True


def _scope(mode: str) -> str:
  if mode == "all":
    return (
      "every model built under MirroredStrategy or MultiWorkerMirroredStrategy"
    )
  return "the models holding tpu_embedding layers (others get Keras' own build)"


def _install(trainer: Any, mode: str) -> None:
  cls = trainer.TensorFlowTrainer
  _Hook.replaced = cls.__dict__.get(_BUILD, _MISSING)
  _Hook.keras_build = getattr(cls, _BUILD)
  setattr(cls, _BUILD, _hooked_build)
  logging.info(
    "tpu_embedding: replaced keras.src.backend.tensorflow.trainer."
    "TensorFlowTrainer._maybe_symbolic_build (Keras %s) with a hook that "
    "fixes model.fit/evaluate under MirroredStrategy and "
    "MultiWorkerMirroredStrategy (%s): it overrides the build, train_step "
    "and test_step of %s. Undo with "
    "tpu_embedding.layers.disable_distributed_fit().",
    keras.__version__,
    ISSUE,
    _scope(mode),
  )


def _remove() -> None:
  if _Hook.mode is None:
    return
  trainer = compat.keras_tensorflow_trainer()
  cls = trainer.TensorFlowTrainer
  if _Hook.replaced is _MISSING:
    delattr(cls, _BUILD)
  else:
    setattr(cls, _BUILD, _Hook.replaced)
  _Hook.mode, _Hook.replaced, _Hook.keras_build = None, _MISSING, None
  logging.info(
    "tpu_embedding: restored Keras' own "
    "TensorFlowTrainer._maybe_symbolic_build; the model.fit fix is off."
  )


def _hooked_build(self: Any, iterator: Any = None, data_batch: Any = None):
  """``TensorFlowTrainer._maybe_symbolic_build`` while the hook is in."""
  keras_build = _Hook.keras_build
  if _hook_applies(self):
    _fix(self, compat.keras_tensorflow_trainer(), by_hook=True)
    return self._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
  assert keras_build is not None  # Set whenever the hook is installed.
  return keras_build(self, iterator=iterator, data_batch=data_batch)


def _hook_applies(model: Any) -> bool:
  if _Hook.mode is None or not needs_fix(model._distribute_strategy):
    return False
  return _Hook.mode == "all" or _holds_our_layers(model)


def _holds_our_layers(model: Any) -> bool:
  ours = tuple(_LAYER_CLASSES)
  return any(isinstance(layer, ours) for layer in model._flatten_layers())


# --- the per-model fix --------------------------------------------------------


def _fix(model: Any, trainer: Any, by_hook: bool) -> None:
  """Overrides the model instance's build and steps (see module)."""
  saved = {name: model.__dict__.get(name, _MISSING) for name in _OVERRIDDEN}
  multi_worker = trainer._collective_all_reduce_multi_worker
  train_step, test_step = model.train_step, model.test_step

  def maybe_symbolic_build(self, iterator=None, data_batch=None):
    keras_build = type(self)._maybe_symbolic_build
    if keras_build is _hooked_build:
      keras_build = _Hook.keras_build
    strategy = self._distribute_strategy
    if iterator is not None and isinstance(strategy, _MIRRORED):
      for _, _, batches in iterator:
        batch = next(batches)
        break
      if multi_worker(strategy) or has_composite_values(strategy, batch):
        data_batch = first_replica_batch(strategy, batch)
      else:  # What Keras does, and can do: dense batches on one worker.
        data_batch = keras_mean_batch(strategy, batch)
      iterator = None  # Keras builds from data_batch then.
    return keras_build(self, iterator=iterator, data_batch=data_batch)

  def logs_for_keras(logs):
    if not multi_worker(model.distribute_strategy):
      return logs
    return tf.nest.map_structure(_scalar_as_vector, logs)

  def fixed_train_step(data):
    return logs_for_keras(train_step(data))

  def fixed_test_step(data):
    return logs_for_keras(test_step(data))

  # object.__setattr__: plain instance attributes, not tracked by Keras or
  # by tf.train.Checkpoint.
  object.__setattr__(
    model, _BUILD, types.MethodType(maybe_symbolic_build, model)
  )
  object.__setattr__(model, "train_step", fixed_train_step)
  object.__setattr__(model, "test_step", fixed_test_step)
  object.__setattr__(model, _MODEL_STATE, {"saved": saved, "by_hook": by_hook})
  if by_hook:
    _Hook.fixed.add(model)
  _forget_step_functions(model)
  logging.debug("tpu_embedding: model.fit fix applied to %s.", model.name)


def _unfix(model: Any) -> None:
  state = model.__dict__.get(_MODEL_STATE)
  if state is None:
    return
  for name, value in state["saved"].items():
    if value is _MISSING:
      object.__delattr__(model, name)
    else:
      object.__setattr__(model, name, value)
  object.__delattr__(model, _MODEL_STATE)
  _Hook.fixed.discard(model)
  _forget_step_functions(model)


def _forget_step_functions(model: Any) -> None:
  """Makes Keras trace ``train_step``/``test_step`` anew at the next fit."""
  model.train_function = None
  model.test_function = None


def _scalar_as_vector(value: Any) -> Any:
  """A scalar tensor as ``[value]``: Keras' ``axis=0`` mean accepts it."""
  if tf.is_tensor(value) and value.shape.rank == 0:
    return tf.expand_dims(value, 0)
  return value


# --- batches ------------------------------------------------------------------


def first_replica_batch(strategy: tf.distribute.Strategy, batch: Any) -> Any:
  """``batch`` with each distributed value replaced by this worker's first.

  Example:
    >>> first_replica_batch(tf.distribute.get_strategy(), {"x": 1})
    {'x': 1}
  """

  def first(value):
    if isinstance(value, tf.distribute.DistributedValues):
      return strategy.experimental_local_results(value)[0]
    return value

  return tf.nest.map_structure(first, batch)


def has_composite_values(strategy: tf.distribute.Strategy, batch: Any) -> bool:
  """Whether ``batch`` holds ragged or sparse tensors (Keras can't average).

  Example:
    >>> has_composite_values(
    ...   tf.distribute.get_strategy(), {"ids": tf.ragged.constant([[1]])}
    ... )
    True
  """
  return any(
    isinstance(value, (tf.RaggedTensor, tf.SparseTensor))
    for value in tf.nest.flatten(first_replica_batch(strategy, batch))
  )


def keras_mean_batch(strategy: tf.distribute.Strategy, batch: Any) -> Any:
  """Keras 3's own build batch: the mean over the replicas, if distributed.

  Example:
    >>> keras_mean_batch(tf.distribute.get_strategy(), {"x": 1})
    {'x': 1}
  """
  distributed = [
    isinstance(value, tf.distribute.DistributedValues)
    for value in tf.nest.flatten(batch)
  ]
  if all(distributed):
    return strategy.reduce("MEAN", batch, axis=None)
  return batch
