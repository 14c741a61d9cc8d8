"""The machinery behind `maxlm.config`: per-key help, ranges and choices; coercion; the one
validation pass; the generated `--help` text; reading one YAML file (dotted keys nested).

A config key is declared next to its definition with `option(default, help, within=..., choices=...)`:

* `within`: the allowed interval, e.g. "[0, 1)", "(0, inf)", "[1, 2**31-1]" (bounds: numbers, inf,
  2**N or 2**N-1), optionally followed by " or -1" (e.g. mesh degrees "[1, inf) or -1"). Every int
  and float key has one (tests/test_config.py walks them all); ints are also bounded to int64 when
  coerced, floats must be finite.
* `choices`: the fixed set of allowed strings.

Everything here is generic over frozen dataclasses; `maxlm.config` holds the sections themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from maxlm.errors import BadInput

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
_BOUND = re.compile(r"-?inf|-?\d+(\.\d*)?(e-?\d+)?|2\*\*\d+(-1)?")
_INTERVAL = re.compile(r"([\[(])\s*(\S+?)\s*,\s*(\S+?)\s*([\])])(?: or (-?\d+))?")


class ConfigError(BadInput, ValueError):
  """A bad configuration key, value or file; the message is one line (control characters escaped)."""


class CliText(str):
  """A value typed on the command line: a YAML scalar for typed keys, the exact text for str keys."""


@dataclasses.dataclass(frozen=True)
class Interval:
  text: str
  lo: float
  hi: float
  lo_open: bool
  hi_open: bool
  extra: int | None = None  # one more allowed value outside the interval (e.g. -1 = "auto")

  def __contains__(self, v) -> bool:
    if v == self.extra:
      return True
    above = v > self.lo if self.lo_open else v >= self.lo
    below = v < self.hi if self.hi_open else v <= self.hi
    return bool(above and below)  # NaN compares False: never inside


def _bound(text: str) -> float:
  if not _BOUND.fullmatch(text):
    raise ValueError(f"bad interval bound {text!r}")
  if text.startswith("2**"):
    exp = text[3:].removesuffix("-1")
    return 2 ** int(exp) - (1 if text.endswith("-1") else 0)
  if "inf" in text:
    return -math.inf if text.startswith("-") else math.inf
  return float(text) if any(c in text for c in ".e") else int(text)


def interval(text: str) -> Interval:
  m = _INTERVAL.fullmatch(text)
  if not m:
    raise ValueError(f"bad interval {text!r}")
  lo, hi = _bound(m[2]), _bound(m[3])
  if (m[1] == "[" and math.isinf(lo)) or (m[4] == "]" and math.isinf(hi)) or lo > hi:
    raise ValueError(f"bad interval {text!r}")
  return Interval(text, lo, hi, m[1] == "(", m[4] == ")", int(m[5]) if m[5] else None)


def option(default: Any, help: str, *, within: str | None = None, choices: tuple[str, ...] | None = None):
  """A config key: its default, a one-line help, and its allowed range or choices."""
  meta: dict[str, Any] = {"help": help}
  if within is not None:
    meta["within"] = interval(within)
  if choices is not None:
    meta["choices"] = tuple(choices)
  return dataclasses.field(default=default, metadata=meta)


@functools.cache  # a class's hints never change: evaluated once, not at every load_config (the planner's mesh search
# calls it thousands of times for the 70B on 64 GPUs; typing.get_type_hints was 70% of load_config's time)
def hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def leaf_fields(cls, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
  """(dotted key, field, type) of every non-section field, depth first in declaration order."""
  out = []
  h = hints(cls)
  for f in dataclasses.fields(cls):
    if dataclasses.is_dataclass(h[f.name]):
      out += leaf_fields(h[f.name], prefix + f.name + ".")
    else:
      out.append((prefix + f.name, f, h[f.name]))
  return out


def show(value: Any, limit: int = 60) -> str:
  """repr() for messages, shortened (a 300-digit int would drown the line)."""
  try:
    text = repr(value)
  except ValueError:  # int too large to print
    text = f"<{type(value).__name__}>"
  return text if len(text) <= limit else text[:limit - 15] + "..." + text[-12:]


def _scalar(raw: str) -> Any:
  """A command-line value as YAML reads it (so 3 is an int, true a bool, 1.5e-4 a float)."""
  if not raw.strip():
    return str(raw)
  try:
    value = yaml.safe_load(raw)
  except (yaml.YAMLError, ValueError):  # ValueError: an int of more than 4300 digits
    return str(raw)
  return str(raw) if isinstance(value, (dict, list)) else value


def coerce(key: str, value: Any, typ: Any) -> Any:
  """Check/convert one value to the field's type: bool, int (int64), float (finite) or str."""
  if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
    typ = next(t for t in typing.get_args(typ) if t is not type(None))
  if isinstance(value, CliText):
    value = str(value) if typ is str else _scalar(value)
  if typ is bool:
    if isinstance(value, bool):
      return value
  elif typ is int:
    if isinstance(value, float) and value.is_integer():  # False for NaN and inf
      value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
      if not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"config key '{key}' must fit in a 64-bit integer, got {show(value)}")
      return value
  elif typ is float:
    if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
      try:
        value = float(value)
      except ValueError:
        pass
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      try:
        out = float(value)
      except OverflowError:  # an int beyond float range
        out = math.inf
      if not math.isfinite(out):
        raise ConfigError(f"config key '{key}' must be a finite number, got {show(value)}")
      return out
  elif typ is str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      return str(value)
  else:
    return value
  raise ConfigError(f"config key '{key}' expects {typ.__name__}, got {show(value)}")


def check_fields(obj: Any, prefix: str = "") -> None:
  """The validation pass: every key against its declared range / choices; no NUL in any string."""
  for key, f, _ in leaf_fields(type(obj), prefix):
    value = obj
    for part in key[len(prefix):].split("."):
      value = getattr(value, part)
    within, choices = f.metadata.get("within"), f.metadata.get("choices")
    if within is not None:
      number = isinstance(value, (int, float)) and not isinstance(value, bool)
      if not (number and value in within):
        raise ConfigError(f"config key '{key}' must be in {within.text}, got {show(value)}")
    if choices is not None and value not in choices:
      raise ConfigError(f"config key '{key}' must be one of {', '.join(choices)}; got {show(value)}")
    if isinstance(value, str) and "\0" in value:
      raise ConfigError(f"config key '{key}' contains a NUL character: {show(value)}")


def choices_of(cls) -> dict[str, tuple[str, ...]]:
  return {key: f.metadata["choices"] for key, f, _ in leaf_fields(cls) if "choices" in f.metadata}


def _describe(key: str, f: dataclasses.Field, typ: Any) -> str:
  name = typ.__name__ if isinstance(typ, type) else str(typ)
  head = f"  {key}: {name} = {show(f.default)}"
  if "within" in f.metadata:
    head += f", in {f.metadata['within'].text}"
  if "choices" in f.metadata:
    head += f", one of {' | '.join(f.metadata['choices'])}"
  return f"{head}\n      {f.metadata.get('help', '')}"


def help_text(root: type, section: str | None = None) -> str:
  """Every key of `root` (or of one section) with type, default, range/choices and help."""
  h = hints(root)
  sections = [f.name for f in dataclasses.fields(root) if dataclasses.is_dataclass(h[f.name])]
  if section is not None and section not in sections:
    raise ConfigError(f"unknown config section {show(section)}; sections: {', '.join(sections)}")
  blocks = []
  if section is None:
    top = [_describe(f.name, f, h[f.name]) for f in dataclasses.fields(root) if f.name not in sections]
    blocks.append("top level:\n" + "\n".join(top))
  for name in sections if section is None else [section]:
    doc = " ".join((h[name].__doc__ or "").split())
    lines = [_describe(k, f, t) for k, f, t in leaf_fields(h[name], name + ".")]
    blocks.append(f"{name}: {doc}\n" + "\n".join(lines))
  return "\n\n".join(blocks) + "\n"


def nest(key: str, value: Any) -> dict[str, Any]:
  out: dict[str, Any] = value
  for part in reversed(key.split(".")):
    out = {part: out}
  return out


def merge(a: dict, b: dict) -> dict:
  out = dict(a)
  for k, v in b.items():
    out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def _undot(data: dict, where: str, prefix: str = "", inside: frozenset = frozenset()) -> dict:
  """Nest dotted YAML keys (`train.steps: 5` == `train: {steps: 5}`); a key set twice is an error."""
  if id(data) in inside:  # a YAML alias that contains itself (`a: &x {b: *x}`)
    raise ConfigError(f"{where}: the value of '{prefix[:-1]}' contains itself (a recursive YAML alias)")
  out: dict[str, Any] = {}
  for k, v in data.items():
    k = str(k)
    v = _undot(v, where, f"{prefix}{k}.", inside | {id(data)}) if isinstance(v, dict) else v
    out = _merge_once(out, nest(k, v), where, prefix)
  return out


def _merge_once(a: dict, b: dict, where: str, prefix: str) -> dict:
  out = dict(a)
  for k, v in b.items():
    if k not in out:
      out[k] = v
    elif isinstance(v, dict) and isinstance(out[k], dict):
      out[k] = _merge_once(out[k], v, where, f"{prefix}{k}.")
    else:
      raise ConfigError(f"{where} sets config key '{prefix}{k}' twice")
  return out


class _Loader(yaml.SafeLoader):
  """safe_load that refuses a key repeated in one mapping (PyYAML would silently keep the last)."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for k, _ in node.value:
      if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
        if k.value in seen:
          raise yaml.constructor.ConstructorError(None, None, f"key '{k.value}' appears twice", k.start_mark)
        seen.add(k.value)
    return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> dict[str, Any]:
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise ConfigError(f"config file '{path}' cannot be read: {e.strerror}") from None
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    raise ConfigError(f"config file '{path}' is not UTF-8 text: byte 0x{raw[e.start]:02x} on line {line}"
                      ) from None
  try:
    data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
  except yaml.MarkedYAMLError as e:
    mark = e.problem_mark or e.context_mark
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    raise ConfigError(f"config file '{path}' is not valid YAML: {e.problem or e.context}{where}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
  except ValueError:  # Python refuses to read an int of more than 4300 digits
    raise ConfigError(f"config file '{path}' holds a number too long to read (over 4300 digits)") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
  return _undot(data, f"config file '{path}'")
