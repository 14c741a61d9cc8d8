"""The one grammar of the `maxlm` commands: `maxlm CMD [SUBCOMMAND] key=value ... --flag`.

`parse_args` splits the words into the command's own settings (undotted keys, typed), config overrides (dotted
keys, e.g. model.dtype=float32) and --flags; `parse_options` serves the commands whose key=value words are all
config words (train and its --dry-run, plan, doctor): their --options, the rest left for `load_config`.
`command_main` is every command module's `main`: `--help` prints the module's docstring, and a MaxlmError
(maxlm/errors.py) becomes one `maxlm: error:` line and its exit code.
"""

from __future__ import annotations

import math
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


# The options that size a run for devices it may not have (the dry run, `maxlm plan`): a positive number each.
SIZING = {"--devices": int, "--nodes": int, "--device-memory-gb": float}


def parse_options(argv: list[str], flags=(), values: dict[str, type] | None = None, optional=()
                  ) -> tuple[dict, list[str]]:
  """(own options, the other words in order) of a command whose key=value words are config words.

  flags: `--name` words (own["name"] = True). values: {"--name": int | float | str}: `--name V` or `--name=V`, a
  positive finite number (UsageError otherwise), or for str any word. optional: `--name [WORD]`: own["name"] = the next word when it
  holds no '=' (`--help SECTION`), else None; `-h` is `--help`. Own keys are the names without the dashes, '-'
  as '_'. Every other word stays for `load_config`, whose messages say what a stray word was meant to be."""
  own, rest, i = {}, [], 0
  while i < len(argv):
    word = "--help" if argv[i] == "-h" else argv[i]
    name, eq, value = word.partition("=")
    key = name.lstrip("-").replace("-", "_")
    if word in flags:
      own[key] = True
    elif word in optional:
      takes = i + 1 < len(argv) and "=" not in argv[i + 1]
      own.setdefault(key, argv[i + 1] if takes else None)
      i += takes
    elif values and name in values:
      if not eq:
        if i + 1 >= len(argv):
          raise UsageError(f"argument {name} needs a value")
        i, value = i + 1, argv[i + 1]
      own[key] = _positive(name, value, values[name])
    else:
      rest.append(argv[i])
    i += 1
  return own, rest


def _positive(name: str, value: str, typ: type):
  if typ is str:  # a word (a name), checked by its command
    return value
  try:
    number = typ(value)
  except ValueError:
    number = 0
  if not number > 0 or not math.isfinite(number):
    raise UsageError(f"argument {name} must be a positive number, got {value!r}")
  return number


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
