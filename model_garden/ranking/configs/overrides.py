"""Overriding an experiment config: nested dicts, YAML files, flag strings.

Model Garden's ``--config_file`` (YAML) and ``--params_override`` apply
here too:

* ``override(config, {"task": {"model": {"embedding_dim": 16}}})``
  returns a new config; every key must name a field (the error lists the
  valid ones) and values are converted to the field's type (``"5"`` to an
  int, a list to a tuple, ...).
* ``parse_params_override("task.train_data.global_batch_size=512,
  trainer.train_steps=100")`` turns the flag's ``key=value`` list (or a
  YAML/JSON mapping) into such a dict. Values are Python-like literals:
  ``16``, ``0.5``, ``true``, ``[64, 32, 16]``, ``'text'`` or bare text.
* ``load_yaml(path)`` reads a YAML file (PyYAML when installed; JSON,
  which is YAML too, otherwise).

Example:
  >>> from model_garden.ranking.configs import definitions, overrides
  >>> config = definitions.ExperimentConfig()
  >>> changes = overrides.parse_params_override(
  ...   "trainer.train_steps=100,task.model.bottom_mlp=[64, 16]")
  >>> config = overrides.override(config, changes)
  >>> config.trainer.train_steps, config.task.model.bottom_mlp
  (100, (64, 16))
"""

from __future__ import annotations

import ast
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

_TRUE = ("true", "yes", "on")
_FALSE = ("false", "no", "off")


def _type_hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _alternatives(kind: Any) -> tuple[Any, ...]:
  """The members of a union type, or the type itself."""
  if typing.get_origin(kind) in (typing.Union, types.UnionType):
    return typing.get_args(kind)
  return (kind,)


def _convert(value: Any, kind: Any, path: str) -> Any:
  """``value`` as a ``kind`` (a field's type), or ValueError."""
  errors = []
  # Try the exact kind of value first (so 8 stays an int in int | tuple),
  # text last (so 128 becomes a number in str | float).
  alternatives = sorted(
    _alternatives(kind),
    key=lambda k: (
      0 if isinstance(k, type) and type(value) is k else 2 if k is str else 1
    ),
  )
  for alternative in alternatives:
    try:
      return _convert_to(value, alternative, path)
    except (TypeError, ValueError) as e:
      errors.append(str(e))
  raise ValueError(errors[0] if len(errors) == 1 else "; ".join(errors))


def _convert_to(value: Any, kind: Any, path: str) -> Any:
  if kind is type(None):
    if value is None or (isinstance(value, str) and value.lower() == "none"):
      return None
    raise ValueError(f"{path}: expected None, got {value!r}.")
  if dataclasses.is_dataclass(kind):
    raise ValueError(f"{path}: expected a mapping of fields, got {value!r}.")
  if typing.get_origin(kind) is tuple:
    if isinstance(value, str):
      value = _literal(value)
    if not isinstance(value, (list, tuple)):
      raise ValueError(f"{path}: expected a list, got {value!r}.")
    item = typing.get_args(kind)[0]
    return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
  if kind is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
      return value.lower() in _TRUE
    raise ValueError(f"{path}: expected true or false, got {value!r}.")
  if kind is int:
    if isinstance(value, str):
      value = _literal(value)
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise ValueError(f"{path}: expected an integer, got {value!r}.")
  if kind is float:
    if isinstance(value, str):
      value = _literal(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    raise ValueError(f"{path}: expected a number, got {value!r}.")
  if kind is str:
    if isinstance(value, (list, tuple, dict)):
      raise ValueError(f"{path}: expected text, got {value!r}.")
    return str(value)
  raise TypeError(f"{path}: unsupported field type {kind!r}.")


def _literal(text: str) -> Any:
  """A Python / YAML-ish literal, or the text itself."""
  stripped = text.strip()
  lowered = stripped.lower()
  if lowered in _TRUE:
    return True
  if lowered in _FALSE:
    return False
  if lowered in ("none", "null", "~"):
    return None
  try:
    return ast.literal_eval(stripped)
  except (ValueError, SyntaxError):
    return stripped


def override(config: Any, changes: Mapping[str, Any], path: str = "") -> Any:
  """A copy of the dataclass ``config`` with ``changes`` applied.

  Args:
    config: a (frozen) dataclass instance, e.g. ``ExperimentConfig``.
    changes: ``{field: value or nested mapping}``; dotted keys
      (``"task.model"``) are accepted too.
    path: the prefix of ``config`` in error messages.

  Returns:
    The new config (``config`` itself is unchanged).

  Raises:
    ValueError: for an unknown field (listing the valid ones) or a value
      that does not fit the field's type.

  Example:
    >>> from model_garden.ranking.configs import definitions, overrides
    >>> c = overrides.override(definitions.LearningRateConfig(),
    ...                        {"warmup_steps": "10"})
    >>> c.warmup_steps
    10
  """
  hints = _type_hints(type(config))
  names = [f.name for f in dataclasses.fields(config)]
  updates: dict[str, Any] = {}
  for key, value in _expand_dotted(changes).items():
    where = f"{path}{key}"
    if key not in names:
      raise ValueError(
        f"Unknown config key {where!r}. Valid keys"
        f"{' under ' + path.rstrip('.') if path else ''}: {', '.join(names)}."
      )
    current = updates.get(key, getattr(config, key))
    if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
      updates[key] = override(current, value, f"{where}.")
    else:
      updates[key] = _convert(value, hints[key], where)
  return dataclasses.replace(config, **updates)


def _expand_dotted(changes: Mapping[str, Any]) -> dict[str, Any]:
  """``{"a.b": 1, "a": {"c": 2}}`` → ``{"a": {"b": 1, "c": 2}}``."""
  expanded: dict[str, Any] = {}
  for key, value in changes.items():
    if not isinstance(key, str):
      raise ValueError(f"Config keys must be text, got {key!r}.")
    head, _, rest = key.partition(".")
    if rest:
      value = {rest: value}
    if isinstance(value, Mapping) and isinstance(expanded.get(head), dict):
      expanded[head] = _merge(expanded[head], _expand_dotted(value))
    elif isinstance(value, Mapping):
      expanded[head] = _expand_dotted(value)
    else:
      expanded[head] = value
  return expanded


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
  merged = dict(base)
  for key, value in extra.items():
    if isinstance(value, dict) and isinstance(merged.get(key), dict):
      merged[key] = _merge(merged[key], value)
    else:
      merged[key] = value
  return merged


def _split_top_level(text: str) -> list[str]:
  """Splits on commas outside brackets and quotes."""
  parts, depth, quote, start = [], 0, "", 0
  for i, char in enumerate(text):
    if quote:
      quote = "" if char == quote else quote
    elif char in "'\"":
      quote = char
    elif char in "[({":
      depth += 1
    elif char in "])}":
      depth -= 1
    elif char == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def parse_params_override(text: str) -> dict[str, Any]:
  """The ``--params_override`` flag as a nested dict.

  Args:
    text: ``"a.b=1,c.d=[1, 2]"``, a YAML / JSON mapping (block or flow
      style: ``"{a: {b: 1}}"``, ``"a: {b: 1}"``), or the path of a YAML
      file (``.yaml``, ``.yml``, ``.json``), as Model Garden's flag takes.

  Returns:
    ``{"a": {"b": 1}, "c": {"d": [1, 2]}}``.

  Raises:
    ValueError: for an entry that is not ``key=value``, or text that is
      neither that nor a YAML mapping.

  Example:
    >>> from model_garden.ranking.configs import overrides
    >>> overrides.parse_params_override("a.b=1,a.c=true,d=[1, 2],e=x")
    {'a': {'b': 1, 'c': True}, 'd': [1, 2], 'e': 'x'}
    >>> overrides.parse_params_override("a: {b: 1, c: [1, 2]}")
    {'a': {'b': 1, 'c': [1, 2]}}
  """
  text = text.strip()
  if not text:
    return {}
  if _is_yaml_file(text):
    return load_yaml(text)
  entries = _split_top_level(text)
  if text.startswith("{") or "\n" in text or "=" not in entries[0]:
    try:
      return parse_yaml(text)
    except ValueError as e:
      raise ValueError(
        f"--params_override must be key=value entries, a YAML mapping or a "
        f"YAML file; got {text!r} ({e})"
      ) from None
  changes: dict[str, Any] = {}
  for entry in entries:
    key, sep, value = entry.partition("=")
    if not sep or not key.strip():
      raise ValueError(
        f"--params_override entries must be key=value, got {entry!r} (in "
        f"{text!r})."
      )
    changes = _merge(changes, _expand_dotted({key.strip(): _literal(value)}))
  return changes


def parse_yaml(text: str, source: str = "") -> dict[str, Any]:
  """A YAML (or JSON) mapping as a dict.

  Uses PyYAML when it is installed; otherwise only JSON (a subset of
  YAML) is understood.

  Args:
    text: the YAML.
    source: the file it came from, named by every error ("": the text
      was given inline, and an error quotes its start instead).

  Raises:
    ValueError: if the text is not a mapping, or is YAML without PyYAML.
  """
  where = f"{source}: " if source else ""
  try:
    import yaml  # noqa: PLC0415 (optional dependency)
  except ImportError:
    yaml = None
  if yaml is not None:
    try:
      value = yaml.safe_load(text)
    except yaml.YAMLError as e:
      detail = " ".join(str(e).split())
      if source:
        detail = detail.replace('"<unicode string>"', "the file")
        raise ValueError(f"{where}not valid YAML ({detail}).") from None
      raise ValueError(f"Not valid YAML ({detail}): {text[:200]!r}") from None
  else:
    try:
      value = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(
        f"{where}reading YAML needs PyYAML (`pip install pyyaml`); without "
        f"it only JSON is understood ({e})."
      ) from None
  if value is None:
    return {}
  if not isinstance(value, dict):
    raise ValueError(
      f"{where}expected a mapping of config fields, got {value!r}."
    )
  return value


def load_yaml(path: str) -> dict[str, Any]:
  """Reads a YAML (or JSON) config file (any TensorFlow filesystem) as a
  dict.

  Raises:
    ValueError: if the file does not exist or holds no mapping.

  Example:
    >>> import os, tempfile
    >>> from model_garden.ranking.configs import overrides
    >>> path = os.path.join(tempfile.mkdtemp(), "c.yaml")
    >>> _ = open(path, "w").write('{"trainer": {"train_steps": 7}}')
    >>> overrides.load_yaml(path)
    {'trainer': {'train_steps': 7}}
  """
  import tensorflow as tf  # noqa: PLC0415 (any TensorFlow filesystem)

  if not tf.io.gfile.exists(path):
    raise ValueError(f"Config file {path!r} does not exist.")
  with tf.io.gfile.GFile(path, "r") as f:
    return parse_yaml(f.read(), source=path)


def _is_yaml_file(text: str) -> bool:
  """Whether ``--params_override`` names a file rather than holding text."""
  return "\n" not in text and text.endswith((".yaml", ".yml", ".json"))
