"""Every command in README.md's ```bash blocks runs as printed, on a CPU.

The commands are read from the README itself, so a command added there is run here (or must be given a reason
in NOT_HERE). Each runs in one working directory, with the README's placeholders replaced as PLACEHOLDERS
says (a tiny HF Llama for /models/Llama-3.1-8B, a tiny run of the default model for runs/my-run), and:
* `maxlm train` / `python -m maxlm.train` commands that name a GPU-sized shipped config, or that would train
  for more than MAX_CPU_STEPS steps, run with `--dry-run` appended: config, mesh, data and sizing are checked as
  the trainer checks them, and the command must exit 0. The others train for real.
* commands that hand `maxlm train` arguments to another program (nsys, sbatch, mpirun, docker) have those
  arguments checked with `--dry-run` in the same way; `docker run ... maxlm` runs the image's default command,
  `maxlm doctor`, here.
* `make train` and `make test` are the README's two commands: `make test` is this suite, and `make train`'s job
  (configs/default.yml, 300 steps, ~3 CPU-minutes) is the `default` case of the cpu convergence tier that CI runs.
"""

import importlib
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from maxlm.config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GOLDEN_HF = ROOT / "tests" / "golden" / "hf" / "llama3"
MAX_CPU_STEPS = 100
GPU_CONFIGS = {"llama8b", "llama3.1-8b", "llama70b", "llama2-7b", "mistral7b", "llama3.2-1b", "llama3.2-3b"}

# README placeholder -> what stands in for it here ({work}: the command's working directory).
PLACEHOLDERS = {"/models/Llama-3.1-8B": str(GOLDEN_HF), "path/tokenizer.model": "{work}/path/tokenizer.model",
                "distributed.num_processes=N": "distributed.num_processes=2",
                "distributed.process_id=i": "distributed.process_id=0"}
# Programs that are not on this machine (or need a cluster or a GPU): their maxlm arguments are dry-run.
WRAPPERS = ("nsys", "sbatch", "launch/mpi/train.sh", "docker")
# Commands run nowhere here, and why: each must still appear in the README (a stale entry fails).
NOT_HERE = {
    "make test": "the suite itself",
    "make train": "configs/default.yml's 300 steps: the cpu convergence tier's `default` case (CI runs it)",
    "tensorboard": "a server; the run directory it reads is checked by the quickstart command before it",
}


def readme_commands(text: str) -> list[str]:
  """The commands of the ```bash blocks: continuation lines joined, comments and blank lines dropped."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    joined = re.sub(r"\\\n\s*", " ", block)
    for line in joined.splitlines():
      line = re.sub(r"\s+#.*$", "", line).strip()
      if line and not line.startswith("#"):
        out.append(line)
  return out


def _words(command: str, work: Path) -> list[str]:
  """The command's words with placeholders replaced and `[optional ...]` groups dropped."""
  for literal, stand_in in PLACEHOLDERS.items():
    command = command.replace(literal, stand_in.format(work=work))
  command = re.sub(r"\s\[[^\]]*\]", "", command)
  return shlex.split(command)


def _maxlm_train_args(words: list[str]) -> list[str] | None:
  """The `maxlm train` arguments in a command, or None when it runs no training."""
  for i, w in enumerate(words):
    if w == "maxlm.train" and i and words[i - 1] == "-m":
      return words[i + 1:]
    if w == "maxlm" and words[i + 1:i + 2] == ["train"]:
      return words[i + 2:]
    if w.endswith(("train.sbatch", "train_container.sbatch", "launch/mpi/train.sh")):
      return words[i + 1:]
  return None


def _kind(command: str) -> str:
  """The NOT_HERE entry of a command ('' when it runs here): by its start, or its program's name."""
  program = Path(command.split()[0]).name
  for prefix in NOT_HERE:
    if command.startswith(prefix) or program == prefix:
      return prefix
  return ""


def _needs_dry_run(args: list[str]) -> bool:
  cfg = load_config([a for a in args if "=" in a and not a.startswith("-")])
  named = next((a.split("=", 1)[1] for a in args if a.startswith("config=")), "")
  return Path(named).name.removesuffix(".yml") in GPU_CONFIGS or cfg.train.steps > MAX_CPU_STEPS


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
  """A working directory holding what the README's commands refer to: corpus/*.jsonl for `prepare`, a
  SentencePiece model at path/tokenizer.model, and runs/my-run, a finished tiny run of the default model."""
  work = tmp_path_factory.mktemp("readme")
  (work / "corpus").mkdir()
  (work / "corpus" / "a.jsonl").write_text("".join(f'{{"text": "It is a truth {i} universally acknowledged."}}\n'
                                                   for i in range(50)))
  (work / "path").mkdir()
  shutil.copy(ROOT / "maxlm" / "assets" / "austen_sp8k.model", work / "path" / "tokenizer.model")
  (work / "new.txt").write_text("Emma Woodhouse, handsome, clever, and rich.\n")
  code = _call(["maxlm.train", "config=default.yml", "run_name=my-run", "train.steps=2", "train.eval_every=0"],
               work)
  assert code == 0
  return work


def _call(words: list[str], work: Path) -> int:
  """`python -m MODULE ARGS` as MODULE.main(ARGS), in this process (no JAX start-up per command), in `work`."""
  old = Path.cwd()
  os.chdir(work)
  try:
    return importlib.import_module(words[0]).main(words[1:])
  finally:
    os.chdir(old)


def _as_run_here(command: str, work: Path) -> list[str]:
  """[module, args...]: how `command` is checked here."""
  words = _words(command, work)
  while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
    words = words[1:]
  args = _maxlm_train_args(words)
  head = words[0]
  wrapped = any(head == w or head.endswith(w) for w in WRAPPERS)
  if args is not None:
    if wrapped or _needs_dry_run(args):
      return ["maxlm.train", *args, "--dry-run"]
    return ["maxlm.train", *args]
  if head == "docker" and "maxlm" in words:  # the image's entrypoint is `maxlm`, its default command `doctor`
    return ["maxlm.cli", *(words[words.index("maxlm") + 1:] or ["doctor"])]
  assert not wrapped, f"{command!r} wraps no maxlm train command: say how to check it here"
  if Path(head).name == "python" and words[1:2] == ["-m"]:
    return words[2:]
  if head == "maxlm":
    return ["maxlm.cli", *words[1:]]
  raise AssertionError(f"README command {command!r}: no way to run it here; add it to NOT_HERE with a reason")


COMMANDS = readme_commands(README.read_text())


def test_the_readme_has_commands_and_every_reason_is_still_needed():
  assert len(COMMANDS) >= 10
  for prefix in NOT_HERE:
    assert any(_kind(c) == prefix for c in COMMANDS), f"NOT_HERE[{prefix!r}] matches no README command"


def test_readme_commands_run_as_printed(workspace, capsys):
  """In README order, so that a command that makes something (prepare's shards) comes before its users."""
  ran = 0
  for command in COMMANDS:
    if _kind(command):
      continue
    words = _as_run_here(command, workspace)
    code = _call(words, workspace)
    err = capsys.readouterr().err
    assert code == 0, f"README command {command!r} ran as {words} and failed ({code}):\n{err[-3000:]}"
    ran += 1
  assert ran >= 10


DOCS = [README, ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "results" / "LOG.md",
        *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
  """Every relative link of the README, the benchmark tables and their log, and docs/ names a file that exists
  (code blocks aside): a table row's raw file, a moved section's new home."""
  text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
  missing = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    path = target.split("#", 1)[0]
    if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
      missing.append(target)
  assert not missing, f"{doc.relative_to(ROOT)}: links to nothing: {missing}"
