"""`maxlm <command> [args ...]`: the one command; each subcommand is `python -m maxlm.<module>`.

`maxlm train ...` is exactly `python -m maxlm.train ...` (same arguments, output and exit codes);
`maxlm <command> --help` shows that command's own help. Commands are listed only once their module
exists, and listing them reads each module's docstring without importing it (no JAX start-up).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from importlib import metadata
from pathlib import Path

from maxlm.errors import BadInput, MaxlmError, report

# command -> module; each module has a docstring whose first line is its summary, and
# `main(argv: list[str] | None = None) -> int`. A command whose module does not exist yet is not offered.
COMMANDS = {
  "train": "maxlm.train",
  "prepare": "maxlm.data.prepare",
  "doctor": "maxlm.doctor",
  "eval": "maxlm.eval",
  "generate": "maxlm.generate",
  "convert": "maxlm.convert",
  "convergence": "maxlm.convergence",
  "plan": "maxlm.plan_cmd",
}

EXIT_BAD_INPUT = 2
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class UsageError(BadInput, ValueError):
  """A bad command-line argument (one line)."""


def parse_args(argv: list[str], keys: dict[str, type], repeated=()) -> tuple[dict, list[str], set[str]]:
  """key=value words -> (own settings, config overrides (dotted keys), --flags)."""
  own: dict = {k: [] for k in repeated}
  overrides, flags = [], set()
  for word in argv:
    if word.startswith("--") and "=" not in word:
      flags.add(word)
      continue
    if "=" not in word:
      raise UsageError(f"argument {word!r} is not key=value (see --help)")
    key, value = word.split("=", 1)
    if "." in key:
      overrides.append(word)
      continue
    if key not in keys:
      raise UsageError(f"unknown argument {key!r} (arguments: {', '.join(keys)}; config keys are dotted, "
                       f"e.g. model.dtype=float32)")
    own[key] = _convert(key, value, keys[key]) if key not in repeated else own[key] + [value]
  return own, overrides, flags


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
  try:
    return run(argv)
  except MaxlmError as e:
    return report(e)


def module_file(module: str) -> Path | None:
  """The source of `module` (a module file or a package's __init__.py) inside this package, or None."""
  base = _PACKAGE_ROOT.joinpath(*module.split("."))
  for path in (base.with_suffix(".py"), base / "__init__.py"):
    if path.is_file():
      return path
  return None


def available() -> dict[str, str]:
  """The commands whose module exists, in table order."""
  return {cmd: mod for cmd, mod in COMMANDS.items() if module_file(mod) is not None}


def summary(module: str) -> str:
  """First line of the module's docstring, read from its source (importing it would start JAX)."""
  path = module_file(module)
  doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) if path else None
  return doc.strip().splitlines()[0].replace("`", "") if doc else ""


def version() -> str:
  try:
    return metadata.version("maxlm")
  except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    return "unknown (not installed)"


def help_text() -> str:
  cmds = available()
  width = max(len(c) for c in cmds)
  lines = ["usage: maxlm <command> [args ...]", "", "LLM pretraining on NVIDIA GPUs (JAX, Transformer Engine).",
           "", "commands:"]
  lines += [f"  {cmd:<{width}}  {summary(mod)}" for cmd, mod in cmds.items()]
  lines += ["", "`maxlm <command> --help` explains one command; `maxlm <command> ...` is the same as",
            "`python -m <module> ...` (same arguments and exit codes).", "",
            "options:", "  -h, --help     this list", "  --version      the installed maxlm version"]
  return "\n".join(lines)


def _print(text: str) -> int:
  try:
    print(text, flush=True)
  except BrokenPipeError:  # `maxlm --help | head`: the reader left; exit quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  return 0


def _fail(msg: str) -> int:
  print(f"maxlm: error: {msg}", file=sys.stderr, flush=True)
  return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  cmds = available()
  if not argv:
    return _fail(f"no command given (commands: {', '.join(cmds)}; see maxlm --help)")
  cmd, rest = argv[0], argv[1:]
  if cmd in ("-h", "--help"):
    return _print(help_text())
  if cmd == "--version":
    return _print(f"maxlm {version()}")
  if cmd == "help":  # `maxlm help train` == `maxlm train --help`
    if not rest:
      return _print(help_text())
    cmd, rest = rest[0], ["--help"]
  if cmd not in cmds:
    return _fail(f"unknown command {cmd!r} (commands: {', '.join(cmds)})")
  return importlib.import_module(cmds[cmd]).main(rest)


if __name__ == "__main__":
  sys.exit(main())
