"""`maxlm <command> [args ...]`: the one command; each subcommand is `python -m <module>` of the table below.

`maxlm train ...` is exactly `python -m maxlm.train ...` (same arguments, output and exit codes);
`maxlm <command> --help` shows that command's own help. Commands are listed only once their module
exists, and listing them reads each module's docstring without importing it (no JAX start-up).
The commands are thin modules over the library (maxlm/cli/<command>.py; the tools are maxlm/tools/), sharing
one grammar, maxlm/cli/grammar.py: `maxlm CMD key=value ... --flag` (train, its --dry-run, plan and doctor take
config words and their own --options, parsed there too).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from importlib import metadata
from pathlib import Path


# command -> module; each module has a docstring whose first line is its summary, and
# `main(argv: list[str] | None = None) -> int`. A command whose module does not exist yet is not offered.
COMMANDS = {
  "train": "maxlm.cli.train",
  "prepare": "maxlm.cli.prepare",
  "doctor": "maxlm.tools.doctor",
  "eval": "maxlm.cli.eval",
  "generate": "maxlm.cli.generate",
  "convert": "maxlm.cli.convert",
  "convergence": "maxlm.tools.convergence",
  "plan": "maxlm.cli.plan",
}

EXIT_BAD_INPUT = 2
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding maxlm/


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
