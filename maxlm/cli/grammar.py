"""The one grammar of the `maxlm` commands: `maxlm CMD [SUBCOMMAND] key=value ... --flag`.

`parse_args` splits the words into the command's own settings (undotted keys, typed), config overrides (dotted
keys, e.g. model.dtype=float32) and --flags; `command_main` is every command module's `main`: `--help` prints the
module's docstring, and a MaxlmError (maxlm/errors.py) becomes one `maxlm: error:` line and its exit code.
"""

from __future__ import annotations

import os
import shlex
import sys

from maxlm.errors import BadInput, MaxlmError, report
from maxlm.runtime import env as runtime


class UsageError(BadInput, ValueError):
  """A bad command-line argument (one line)."""


def parse_args(argv: list[str], keys: dict[str, type], repeated=(), positional: str | None = None
               ) -> tuple[dict, list[str], set[str]]:
  """key=value words -> (own settings, config overrides (dotted keys), --flags).

  `repeated` keys collect every value in a list. With `positional`, the command also takes bare words (not
  key=value, not starting with '-'; e.g. input files, which the shell expands): own[positional] is their list (a
  word holding '=' is always key=value).
  """
  own: dict = {k: [] for k in (*repeated, *([positional] if positional else []))}
  overrides, flags = [], set()
  for word in argv:
    if word.startswith("--") and "=" not in word:
      flags.add(word)
      continue
    if "=" not in word:
      if positional and not word.startswith("-"):
        own[positional].append(word)
        continue
      raise UsageError(f"argument {word!r} is not key=value (see --help){_bare_hint(word, keys)}")
    key, value = word.split("=", 1)
    if "." in key:
      overrides.append(word)
      continue
    if key not in keys:
      raise UsageError(f"unknown argument {key!r} (arguments: {', '.join(keys)}; config keys are dotted, "
                       f"e.g. model.dtype=float32)")
    own[key] = _convert(key, value, keys[key]) if key not in repeated else own[key] + [value]
  return own, overrides, flags


def _bare_hint(word: str, keys: dict[str, type]) -> str:
  """The key a bare word was likely meant for: an existing path as checkpoint=, other text as prompt=."""
  if "checkpoint" in keys and os.path.exists(word):
    return f"; write checkpoint={word}"
  if "prompt" in keys and not word.startswith("-"):
    return f"; write prompt={shlex.quote(word)}"
  return ""


def _convert(key: str, value: str, typ: type):
  try:
    if typ is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError
      return value.lower() in ("true", "1")
    return typ(value)
  except ValueError:
    raise UsageError(f"argument {key}={value!r} is not {'a boolean' if typ is bool else 'an ' + typ.__name__}"
                     ) from None


def command_main(doc: str, run, argv: list[str] | None) -> int:
  """A command module's `main`: `--help` prints its docstring; `run(argv)` is the command. A MaxlmError
  (maxlm/errors.py) becomes one `maxlm: error:` line and its class's exit code (2 bad input, 3 checkpoint, 1 run
  failure). Other exceptions keep their traceback (internal bugs)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if any(a in ("-h", "--help") for a in argv):
    print(doc.strip(), flush=True)
    return 0
  line = runtime.size_cpu_pool()  # before the command starts JAX: simulated CPU devices (maxlm/runtime/env.py)
  if line:
    print(f"maxlm: {line}", file=sys.stderr, flush=True)
  try:
    return run(argv)
  except MaxlmError as e:
    return report(e)
