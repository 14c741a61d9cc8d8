"""The `maxlm` command: help from module docstrings (without importing JAX), dispatch, one-line errors,
and the same output and exit codes as `python -m maxlm.<module>`."""

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from maxlm import cli
from maxlm.cli import train
from maxlm.cli.grammar import UsageError, parse_args, parse_options

# subprocess runs compile like the suite's own (conftest): XLA's CPU backend at optimization level 0
FAST_CPU = "--xla_backend_optimization_level=0"

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=2",
        "model.vocab_size=128", "model.backend=flax", "train.steps=2", "train.log_every=1", "train.eval_every=0"]


def run(args, module=None, env=None):
  """`maxlm ARGS` through the installed console script when there is one (else `python -m maxlm.cli`),
  or `python -m MODULE ARGS`."""
  e = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1 " + FAST_CPU, "JAX_PLATFORMS": "cpu", **(env or {})}
  script = Path(sys.executable).parent / "maxlm"
  if module:
    cmd = [sys.executable, "-m", module]
  else:
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "maxlm.cli"]
  return subprocess.run(cmd + list(args), cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)


def test_console_script_is_declared_and_installed():
  """pyproject's [project.scripts] as installed (pip install -e . / scripts/setup.sh), and its file."""
  eps = metadata.entry_points(group="console_scripts", name="maxlm")
  assert [ep.value for ep in eps] == ["maxlm.cli:main"]
  assert (Path(sys.executable).parent / "maxlm").exists()


def test_help_lists_existing_commands_with_their_summary(capsys):
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  listed = [ln.split()[0] for ln in out.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()]
  on_disk = [c for c, mod in cli.COMMANDS.items()
             if (ROOT / (mod.replace(".", "/") + ".py")).is_file() or (ROOT / mod.replace(".", "/") / "__init__.py").is_file()]
  assert listed == on_disk and {"train", "prepare", "doctor"} <= set(listed)
  lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()[0] in listed}
  assert "Train a model: maxlm train [config=FILE] [key=value ...]" in lines["train"]
  assert "Tokenize text/JSONL/Parquet files into ArrayRecord shards" in lines["prepare"]
  assert "Check this machine for a run" in lines["doctor"]


def test_a_command_whose_module_is_missing_is_not_offered(monkeypatch, capsys):
  monkeypatch.setitem(cli.COMMANDS, "ghost", "maxlm.no_such_module")
  assert cli.main(["--help"]) == 0
  assert "ghost" not in capsys.readouterr().out
  assert cli.main(["ghost"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("maxlm: error: unknown command 'ghost' (commands: train, prepare") and err.count("\n") == 1


def test_every_command_module_follows_the_contract():
  """Docstring first line = summary; main(argv: list[str] | None = None) -> int; runnable with -m."""
  for cmd, mod in cli.available().items():
    module = importlib.import_module(mod)
    assert module.__doc__ and module.__doc__.strip().splitlines()[0].strip(), cmd
    params = inspect.signature(module.main).parameters
    assert list(params) == ["argv"] and params["argv"].default is None, cmd
    runnable = cli.module_file(mod)
    if runnable.name == "__init__.py":
      runnable = runnable.with_name("__main__.py")
    assert 'if __name__ == "__main__"' in runnable.read_text() or runnable.name == "__main__.py", cmd


def test_help_does_not_import_jax():
  code = "import sys; from maxlm.cli import main; main(['--help']); print('jax' in sys.modules)"
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False", r.stderr


def test_unknown_and_missing_command_are_one_line_exit_2():
  r = run(["trian", "train.steps=1"])
  assert r.returncode == 2 and r.stdout == ""
  assert r.stderr == f"maxlm: error: unknown command 'trian' (commands: {', '.join(cli.available())})\n"
  r = run([])
  assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("maxlm: error: no command given")


def test_version_and_help_alias(capsys):
  assert cli.main(["--version"]) == 0
  assert capsys.readouterr().out == f"maxlm {metadata.version('maxlm')}\n"
  assert cli.main(["help"]) == 0 and "commands:" in capsys.readouterr().out


@pytest.mark.parametrize("cmd, module", [("train", "maxlm.train"), ("prepare", "maxlm.cli.prepare"),
                                         ("doctor", "maxlm.tools.doctor"), ("convergence", "maxlm.tools.convergence")])
def test_command_help_is_the_modules_help(cmd, module, capsys):
  assert importlib.import_module(module).main(["--help"]) == 0
  own = capsys.readouterr().out
  via_cli = run([cmd, "--help"])  # through the console script, in a fresh process
  assert via_cli.returncode == 0 and len(own) > 200
  assert via_cli.stdout == own


def test_help_alias(capsys):
  assert train.main(["--help"]) == 0
  own = capsys.readouterr().out
  assert cli.main(["help", "train"]) == 0 and capsys.readouterr().out == own


def test_bad_config_exit_code_and_message_match_python_m():
  args = ["train", "model.n_layer=3"]
  via_cli, via_module = run(args), run(args[1:], module="maxlm.train")
  assert via_cli.returncode == via_module.returncode == 2
  assert via_cli.stderr == via_module.stderr == (
      "maxlm: error: unknown config key 'model.n_layer' (did you mean 'model.n_layers'?)\n")


@pytest.mark.slow
def test_tiny_run_through_either_entry(tmp_path):
  via_cli = run(["train", f"output_dir={tmp_path}", "run_name=cli", *TINY])
  via_module = run([f"output_dir={tmp_path}", "run_name=module", *TINY], module="maxlm.train")
  assert via_cli.returncode == via_module.returncode == 0, via_cli.stderr[-2000:] + via_module.stderr[-2000:]
  rows = {name: [json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
          for name in ("cli", "module")}
  assert [r["step"] for r in rows["cli"]] == [r["step"] for r in rows["module"]] == [1, 2]
  assert [r["loss"] for r in rows["cli"]] == [r["loss"] for r in rows["module"]]  # same seed, same run


def test_exit_code_of_a_failing_command_passes_through(tmp_path):
  """A non-zero code other than 2 (prepare: nothing to read) comes back unchanged."""
  args = [str(tmp_path / "missing.txt"), f"out={tmp_path / 'out'}"]
  via_cli, via_module = run(["prepare", *args]), run(args, module="maxlm.cli.prepare")
  assert via_cli.returncode == via_module.returncode != 0
  assert via_cli.stderr == via_module.stderr and via_cli.stderr.startswith("maxlm: error:")
  assert not (tmp_path / "out").exists()


def test_grammar_splits_settings_overrides_and_flags():
  own, overrides, flags = parse_args(["n=3", "model.dtype=float32", "--json", "name=a=b", "tag=x", "tag=y"],
                                     {"n": int, "name": str, "tag": str}, repeated=("tag",))
  assert own == {"n": 3, "name": "a=b", "tag": ["x", "y"]}
  assert overrides == ["model.dtype=float32"] and flags == {"--json"}
  with pytest.raises(UsageError, match="argument 'corpus.txt' is not key=value"):  # no positional: bare words fail
    parse_args(["corpus.txt"], {"n": int})
  with pytest.raises(UsageError, match="unknown argument 'm'"):
    parse_args(["m=1"], {"n": int})
  with pytest.raises(UsageError, match=r"argument n='x' is not an int"):
    parse_args(["n=x"], {"n": int})


def test_grammar_positional_words():
  """`positional=NAME` collects the bare words (files, globs, directories) in order; a word holding '=' stays
  key=value, and a word starting with '-' (an old `-o DIR`) is never taken for a file."""
  own, overrides, flags = parse_args(["a.txt", "out=d", "dir/", "*.jsonl", "--overwrite", "data.x=1"],
                                     {"out": str}, positional="inputs")
  assert own == {"inputs": ["a.txt", "dir/", "*.jsonl"], "out": "d"}
  assert overrides == ["data.x=1"] and flags == {"--overwrite"}
  assert parse_args(["out=d"], {"out": str}, positional="inputs")[0] == {"inputs": [], "out": "d"}
  for word in ("-o", "-"):
    with pytest.raises(UsageError, match=f"argument '{word}' is not key=value"):
      parse_args(["a.txt", word, "d"], {"out": str}, positional="inputs")
  with pytest.raises(UsageError, match="unknown argument 'a'"):
    parse_args(["a=b.txt"], {"out": str}, positional="inputs")


def test_grammar_options_of_commands_that_take_config_words():
  """`parse_options` (train, --dry-run, plan, doctor): the command's own --options out, every other word left in
  order for load_config (whose messages name a stray word), `--help SECTION` taking the next word unless it holds
  '=', `-h` as `--help`, numbers as `--name N` or `--name=N`."""
  words = ["config=x.yml", "--steps", "5", "--json", "-h", "model", "output_dir=o", "--devices=4", "--dryrun"]
  own, rest = parse_options(words, ("--json",), {"--devices": int}, optional=("--help",))
  assert own == {"json": True, "help": "model", "devices": 4}
  assert rest == ["config=x.yml", "--steps", "5", "output_dir=o", "--dryrun"]
  assert parse_options(["--help", "a.b=1"], optional=("--help",)) == ({"help": None}, ["a.b=1"])
  assert parse_options(["a.b=1", "--help"], optional=("--help",)) == ({"help": None}, ["a.b=1"])
  for argv, message in ((["--nodes"], "argument --nodes needs a value"),
                        (["--nodes", "0"], "argument --nodes must be a positive number, got '0'"),
                        (["--gb=inf"], "argument --gb must be a positive number, got 'inf'"),
                        (["--nodes", "--json"], "argument --nodes must be a positive number, got '--json'")):
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
      parse_options(argv, ("--json",), {"--nodes": int, "--gb": float})
