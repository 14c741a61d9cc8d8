"""Where a config's words come from: `config=NAME` looked up in . and configs/, `base:` chains of YAML files,
and the `key=value` words of the command line. `maxlm.config` applies them to the sections."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from maxlm.config import schema
from maxlm.config.names import PEER_NAMES
from maxlm.config.schema import CliText, ConfigError
from maxlm.config.sections import LEVERS

# The shipped configs live in the package (maxlm/configs/, package data in the wheel); the checkout's top-level
# configs/ is a link to them. So `config=llama8b.yml` finds them from an installed package as from a checkout.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # maxlm/configs
MAX_BASE_DEPTH = 32


def _is_file(path: Path) -> bool:
  try:
    return path.is_file()
  except (OSError, ValueError):  # a name too long for the file system, a NUL byte
    return False


def is_shipped(path: Path) -> bool:
  """`path` is one of the shipped configs (maxlm/configs/, or the checkout's configs/ link to it)."""
  try:
    return path.resolve().is_relative_to(CONFIG_DIR.resolve())
  except (OSError, ValueError):
    return False


def resolve_config_path(name: str) -> Path:
  p = Path(name)
  for cand in (p, CONFIG_DIR / name, CONFIG_DIR / f"{name}.yml"):
    if _is_file(cand):
      return cand
  shipped = sorted(f.name for f in CONFIG_DIR.glob("*.yml"))
  close = difflib.get_close_matches(p.name if p.name.endswith(".yml") else f"{p.name}.yml", shipped, n=1, cutoff=0.8)
  hint = f"; did you mean config={close[0]}?" if close else f"; shipped: {', '.join(shipped)}"
  raise ConfigError(f"config file {schema.show(name)} not found (looked in . and {CONFIG_DIR}){hint}")


def yaml_layers(path: Path, chain: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
  """[(file, its keys)] from the deepest `base:` to `path`, each applied over the one before."""
  chain = chain + (path,)
  data = schema.read_yaml(path)
  if "base" not in data:
    return [(path, data)]
  base = data.pop("base")
  if not isinstance(base, str) or not base.strip():
    raise ConfigError(f"config file '{path}': 'base' must name one YAML file, got {schema.show(base)}")
  # beside the file first, then among the shipped configs (a config of one's own anywhere may build on them)
  found = [c for c in (path.parent / base, CONFIG_DIR / base, CONFIG_DIR / f"{base}.yml") if _is_file(c)]
  if not found:
    raise ConfigError(f"config file '{path}': base file {schema.show(base)} not found (looked in {path.parent} "
                      f"and {CONFIG_DIR})")
  base_path = found[0]
  if base_path.resolve() in {p.resolve() for p in chain}:
    loop = " -> ".join(str(p) for p in chain + (base_path,))
    raise ConfigError(f"config file '{path}': 'base' includes a file twice: {loop}")
  if len(chain) >= MAX_BASE_DEPTH:
    raise ConfigError(f"config file '{path}': more than {MAX_BASE_DEPTH} nested 'base' files")
  return yaml_layers(base_path, chain) + [(path, data)]


def load_yaml(path: Path) -> dict[str, Any]:
  """Read a config YAML; `base: other.yml` includes another file first (relative to this one)."""
  out: dict[str, Any] = {}
  for _, data in yaml_layers(Path(path)):
    out = schema.merge(out, data)
  return out


# The options of the commands that read config words (train, --dry-run, plan): only for the hint of a misspelt one.
COMMAND_OPTIONS = ("--dry-run", "--compile-only", "--json", "--devices", "--nodes", "--device-memory-gb", "--all",
                   "--simulate", "--help")


def _meant(word: str, rest: list[str]) -> str:
  """How to write a word that is not key=value: a misspelt option, a config file, `--key value` or `key value`."""
  if word.endswith((".yml", ".yaml")):
    return f"a config file is given as config={word}"
  option = difflib.get_close_matches(word.replace("_", "-"), COMMAND_OPTIONS, n=1, cutoff=0.8)
  if word.startswith("-") and option:
    return f"did you mean the option {option[0]}?"
  if rest and "=" not in rest[0] and word.lstrip("-"):
    key = word.lstrip("-")
    return f"write {PEER_NAMES.get(key.lower().replace('-', '_'), key)}={rest[0]}"  # `--steps 5`: train.steps=5
  return "e.g. train.steps=100"


def parse_overrides(args: list[str]) -> tuple[str | None, dict[str, Any]]:
  """Split CLI words into the `config=` file and a nested dict of `key=value` overrides."""
  config_file, updates = None, {}
  for i, arg in enumerate(args):
    if "=" not in arg:
      raise ConfigError(f"argument {schema.show(arg)} is not key=value; {_meant(arg, args[i + 1:])}")
    key, raw = arg.split("=", 1)
    key = key.strip().lstrip("-")
    if key == "config":
      if not raw.strip():
        raise ConfigError("argument 'config=' needs a file name (e.g. config=llama8b.yml)")
      if config_file is not None:
        raise ConfigError(f"argument 'config=' given twice ({config_file!r}, {raw!r}); "
                          "combine files with 'base:' in YAML")
      config_file = raw
      continue
    updates = schema.merge(updates, schema.nest(key, CliText(raw)))
  return config_file, updates


def free_levers(written: set[str]) -> str:
  """plan.levers=auto made concrete: the levers not among the keys the user wrote, in LEVERS order ("none" where
  the user wrote them all). A lever key the user set is theirs: the planner keeps it as written."""
  return ",".join(k for k in LEVERS if k not in written) or "none"


def leaf_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
  """The dotted keys of a nested dict's leaves (a section written empty counts as none of its keys)."""
  out: set[str] = set()
  for k, v in data.items():
    out |= leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
  return out
