"""Guards on the package's shape, read from the source with `ast` (nothing is imported):

* `maxlm/layers/` and `maxlm/data/` import no higher module: only themselves, the config modules and
  `maxlm.errors` (so the data pipeline never pulls in model code, and the layers stay the bottom of the model),
  the layers also the parallel wing (context parallelism's exchanges, under the attention kernels);
* only `maxlm/layers/` imports Transformer Engine, lazily or not;
* the trainer does not plan (`maxlm/trainer.py` imports nothing of `maxlm/plan/`);
* the wings `maxlm/config/`, `maxlm/runtime/` and `maxlm/parallel/` import only themselves and the floors below them
  (WINGS);
* a name that would confuse (UNIQUE_NAMES: `pipeline` the data's or the stages'?) names one module only;
* `maxlm/errors.py` imports nothing of maxlm (every layer may raise its errors), nor does `maxlm/tables.py` (the
  facts every floor reads: precisions, remat policies, GPU models, the byte formatter);
* the core never imports the commands (`maxlm/cli/`) or the tools (`maxlm/tools/`); they import the core;
* the commands (`maxlm/cli/`) and the tools reach a package that has a face (FACES: `maxlm.plan`) through the face
  only: `from maxlm import plan`, never `maxlm.plan.levers` (issue 59), nor does any module outside that package;
* no module is much over the ~400-line guideline (MAX_LINES) and no function over MAX_FUNCTION_LINES, but for
  those in OVER, which may only get shorter;
* the training loop stays a loop: `maxlm/trainer.py` at most TRAINER_LINES lines and its `_train` at most
  TRAIN_LOOP_LINES, its services behind the hooks of `maxlm/loop/` (issue 38.4);
* no module-level mutable state (issue 38): a name bound at module level to a mutable value (a dict, list or set
  display or comprehension, a call of MUTABLE_CALLS, an instance of a class of the same module) is a constant,
  named in UPPER_CASE (or `__all__`) and mutated nowhere in the package, unless STATE lists it with its reason;
  no `global` statement outside STATE either;
* no module rebinds an attribute of JAX (an assignment to, or `setattr` on, anything reached from a name imported
  from jax), but for those REBINDS lists with why (issue 59: each goes once JAX gives a public route).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "maxlm"
CONFIG = {"maxlm.config", "maxlm.config.schema", "maxlm.config.files", "maxlm.config.names", "maxlm.config.sections",
          "maxlm.config.rules"}
BOTTOM = {"maxlm.errors", "maxlm.tables", *CONFIG}
MAX_LINES = 450  # "about 400": a module past this is split, not tolerated
MAX_FUNCTION_LINES = 80
# A ratchet: functions still over MAX_FUNCTION_LINES, each held to its length today (shorten, never lengthen).
OVER: dict[tuple[str, str], int] = {}
TRAINER_LINES, TRAIN_LOOP_LINES = 300, 60
# Above the core: the `maxlm` command with its grammar and thin commands, and the tools (doctor, convergence).
ABOVE = ("maxlm.cli", "maxlm.tools")
# Modules outside cli/ and tools/ that may import them: `python -m maxlm.train` (README, launch/'s templates, the
# SLURM and container jobs), a thin entry over its command. Each must exist (a stale entry fails).
NOT_YET_ABOVE = {"maxlm.train"}
# Packages with a face: everything outside the package (the commands first of all) imports the package itself and
# the names it exports, never one of its modules (issue 59: `from maxlm import plan`, `plan.size(...)`, not
# `from maxlm.plan.levers import ...`). The other packages (runtime/, data/, checkpoint/, hf/) have no face yet.
FACES = ("maxlm.plan",)
# The wings, each importing only itself and what lies below it: config/ (the schema, files, sections, names) sits
# on maxlm.errors and maxlm.tables; runtime/ (process start-up, XLA settings, caches, distributed, watchdog) on
# config/, tables and errors.
WINGS = {"maxlm.config": {"maxlm.errors", "maxlm.tables"}, "maxlm.runtime": BOTTOM, "maxlm.parallel": BOTTOM}
# The floors at the bottom of the model and data, each importing only itself and these (issue 59: the parallel wing
# sits under the layers, whose context-parallel attention runs over its exchanges; data/ never sees it).
FLOORS = {"maxlm.layers": BOTTOM | {"maxlm.parallel"}, "maxlm.data": BOTTOM}
# Module names that would say two things at once: each may name one module of the package (issue 59: the pipeline
# schedules beside the data pipeline).
UNIQUE_NAMES = ("pipeline", "context", "mesh", "sharding")

# Calls that make a mutable container (by the called name: `dict()`, `collections.defaultdict()`), and calls that
# make an object whose state lives in attributes or outside the module's sight (`threading.local()`, weak
# containers): such an object is state whatever its name.
MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "ChainMap"}
OBJECT_CALLS = {"local", "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
# Methods that change a container in place; calling one on a module-level constant (anywhere) makes it state.
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
            "discard", "sort", "reverse", "difference_update", "intersection_update", "symmetric_difference_update",
            "appendleft", "extendleft", "popleft", "rotate"}
# The module-level state left, (module, name) -> why it stays (a stale entry fails: fix it and drop the line).
STATE = {
    ("maxlm.generation", "_COMPILED"): "compiled prefill/decode programs per shape bucket, reused by every "
                                       "generate() call of the process, as jax.jit's own cache is",
    ("maxlm.generation", "_TRACES"): "how often those programs were traced in this process (trace_counts(), the "
                                     "tests' count of compilations); it counts what _COMPILED holds",
    ("maxlm.checkpoint.verify", "_after_failure"): "Orbax's noise filter, installed once per process into "
                                                    "sys.unraisablehook and logging, which are the process's state",
    ("maxlm.runtime.compile_cache", "COUNTER"): "JAX's cache hits and requests, counted by a listener that "
                                                "jax.monitoring keeps for the process (it cannot be unregistered)",
    ("maxlm.runtime.compile_cache", "_active"): "what configure() set into jax.config, process-wide itself, and "
                                                "the cache's writer that it installed into JAX",
    ("maxlm.runtime.warm_start", "_dir"): "the warm start's directory, set with JAX's cache by runtime.env once "
                                          "per process start (beside jax.config's cache directory)",
    ("maxlm.runtime.warm_start", "_ahead"): "executables being loaded ahead on threads between configure() and "
                                            "the compile that takes them (prefetch)",
    ("maxlm.runtime.watchdog", "OFF"): "the null watchdog: its class has no attributes, nothing to mutate",
}


# The rebindings of JAX left, (module, target) -> why (a stale entry fails: drop it with the rebinding).
REBINDS = {
    ("maxlm.plan.standins", "jax.lax.dot_general"): "the planner's bf16 GEMMs on XLA:CPU, while a simulated step is "
                                                   "traced (the module says why no supported route reaches the GEMMs "
                                                   "inside TE and flax); open in issue 59",
    ("maxlm.plan.standins", "_lax_internal.dot_general"): "the same, for jnp.dot and flax's attend",
    ("maxlm.runtime.compile_cache", "jax_cache._cache"): "an atomically writing file cache: JAX has no public way to "
                                                        "supply one (the comment above `_install`: jax-ml/jax#39880)",
    ("maxlm.runtime.compile_cache", "jax_cache._cache_initialized"): "the same",
}


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    yield name, path, ast.parse(path.read_text(encoding="utf-8"))


def _imports(tree) -> set[str]:
  """Every module an import statement names, at any depth of the file (lazy imports too)."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names if node.module == "maxlm")
  return out


def _maxlm(name: str) -> bool:
  return name == "maxlm" or name.startswith("maxlm.")


def _within(name: str, tops) -> bool:
  """Whether module `name` is one of `tops` or inside one of them."""
  return any(name == top or name.startswith(top + ".") for top in tops)


def test_names_that_would_confuse_name_one_module():
  found = {}
  for name, path, _ in _modules():
    base = name.rsplit(".", 1)[-1] if path.name != "__init__.py" else None
    if base in UNIQUE_NAMES:
      found.setdefault(base, []).append(name)
  twice = {base: names for base, names in found.items() if len(names) > 1}
  assert not twice, f"one module per name: {twice}"
  assert set(found) == set(UNIQUE_NAMES), f"stale UNIQUE_NAMES: {sorted(set(UNIQUE_NAMES) - set(found))}"


def _above(name: str) -> bool:
  return any(name == top or name.startswith(top + ".") for top in ABOVE)


def test_layers_and_data_import_no_higher_module():
  checked = 0
  for name, path, tree in _modules():
    for floor, below in FLOORS.items():
      if name == floor or name.startswith(floor + "."):
        higher = sorted(m for m in _imports(tree) if _maxlm(m) and m != "maxlm" and not _within(m, below)
                        and not _within(m, {floor}))
        assert not higher, f"{path}: {floor} must not import {higher}"
        checked += 1
  assert checked >= 15


def test_the_core_imports_neither_commands_nor_tools():
  names, checked = set(), 0
  for name, path, tree in _modules():
    names.add(name)
    if _above(name) or name in NOT_YET_ABOVE:
      continue
    above = sorted(m for m in _imports(tree) if _above(m))
    assert not above, f"{path}: the core must not import the commands or tools {above}"
    checked += 1
  assert checked >= 60
  assert NOT_YET_ABOVE <= names, f"stale NOT_YET_ABOVE entries: {sorted(NOT_YET_ABOVE - names)}"


def _face_breaches(name: str, tree) -> list[str]:
  """The modules of a FACES package that module `name` (outside that package) imports: `import maxlm.plan.x`,
  `from maxlm.plan.x import y`, `from maxlm.plan import x` (x a module of the package), at any depth of the file."""
  out = []
  for face in FACES:
    if name == face or name.startswith(face + "."):
      continue
    folder = PACKAGE.parent.joinpath(*face.split("."))
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        out += [a.name for a in node.names if a.name.startswith(face + ".")]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        if node.module.startswith(face + "."):
          out.append(node.module)
        elif node.module == face:
          out += [f"{face}.{a.name}" for a in node.names
                  if (folder / f"{a.name}.py").is_file() or (folder / a.name / "__init__.py").is_file()]
  return out


def test_the_commands_import_only_the_faces():
  checked = 0
  for name, path, tree in _modules():
    breaches = _face_breaches(name, tree)
    assert not breaches, f"{path}: imports {sorted(breaches)}: go through the face ({', '.join(FACES)})"
    checked += name.startswith("maxlm.cli.")
  assert checked >= 10


def test_the_face_guard_sees_each_form():
  planted = ("import maxlm.plan.levers\nfrom maxlm.plan.fit import size\nfrom maxlm.plan import Sizing, target\n"
             "from maxlm import plan\nfrom maxlm.plan import search\ndef f():\n  from maxlm.plan import measure\n")
  assert sorted(_face_breaches("maxlm.cli.x", ast.parse(planted))) == [
      "maxlm.plan.fit", "maxlm.plan.levers", "maxlm.plan.measure", "maxlm.plan.target"]
  assert _face_breaches("maxlm.plan.x", ast.parse(planted)) == []  # inside the package: its own modules


def test_the_wings_import_only_what_lies_below_them():
  seen = set()
  for name, path, tree in _modules():
    for wing, below in WINGS.items():
      if name == wing or name.startswith(wing + "."):
        seen.add(wing)
        up = sorted(m for m in _imports(tree) if _maxlm(m) and m != "maxlm" and m not in below
                    and not _within(m, {wing}))
        assert not up, f"{path}: the {wing} wing must not import {up}"
  assert seen == set(WINGS)


def test_the_trainer_does_not_plan():
  """The plan is decided before the Trainer is built (the train command calls plan.for_run): trainer.py imports
  nothing of maxlm/plan/."""
  tree = ast.parse((PACKAGE / "trainer.py").read_text())
  planner = sorted(m for m in _imports(tree) if m == "maxlm.plan" or m.startswith("maxlm.plan."))
  assert not planner, f"maxlm/trainer.py imports the planner {planner}"


def test_only_layers_import_transformer_engine():
  for name, path, tree in _modules():
    te = sorted(m for m in _imports(tree) if m.split(".")[0] == "transformer_engine")
    if not name.startswith("maxlm.layers"):
      assert not te, f"{path} imports {te}: only maxlm/layers/ may import Transformer Engine"


def test_errors_and_tables_are_the_bottom():
  for name in ("errors.py", "tables.py"):
    tree = ast.parse((PACKAGE / name).read_text())
    assert not [m for m in _imports(tree) if _maxlm(m)], name


def test_module_and_function_sizes():
  for name, path, tree in _modules():
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path}: {lines} lines (guideline ~400, limit {MAX_LINES}): split it"
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1
        limit = OVER.get((str(path.relative_to(PACKAGE.parent)), node.name), MAX_FUNCTION_LINES)
        assert n <= limit, f"{path}:{node.lineno} {node.name}: {n} lines (limit {limit})"


def test_the_training_loop_is_short_and_its_services_sit_behind_the_hooks():
  path = PACKAGE / "trainer.py"
  lines = len(path.read_text(encoding="utf-8").splitlines())
  assert lines <= TRAINER_LINES, f"{path}: {lines} lines (limit {TRAINER_LINES}): move services to maxlm/loop/"
  tree = ast.parse(path.read_text(encoding="utf-8"))
  [loop] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_train"]
  n = loop.end_lineno - loop.lineno + 1
  assert n <= TRAIN_LOOP_LINES, f"{path}:{loop.lineno} _train: {n} lines (limit {TRAIN_LOOP_LINES})"
  # the services are reached through the hooks only: the loop names none of them (nor their calls)
  names = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name)} | {
      n.attr for n in ast.walk(loop) if isinstance(n, ast.Attribute)}
  services = {"watchdog", "wd", "arm", "profiler", "Profiler", "writer", "MetricsWriter", "progress_line",
              "reached", "step_started", "poll"}
  assert not names & services, sorted(names & services)
  assert {"hooks", "step_start", "step_end", "save", "fetch", "eval", "write", "end"} <= names


def _constant_name(name: str) -> bool:
  return name == "__all__" or name.lstrip("_").isupper()


def _module_state(name: str, tree) -> dict[str, int]:
  """The names a module binds at its top level to a mutable value -> (line, "container" or "object": an instance of
  the module's own class or of OBJECT_CALLS)."""
  classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
  found = {}
  for node in tree.body:
    if isinstance(node, ast.Assign):
      targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
      targets, value = [node.target], node.value
    else:
      continue
    called = None
    if isinstance(value, ast.Call):
      called = value.func.id if isinstance(value.func, ast.Name) else getattr(value.func, "attr", None)
    displays = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    kind = ("container" if isinstance(value, displays) or called in MUTABLE_CALLS else
            "object" if called in classes or called in OBJECT_CALLS else None)
    if kind:
      found.update({t.id: (node.lineno, kind) for t in targets if isinstance(t, ast.Name)})
  return found


def _globals(tree) -> dict[str, int]:
  return {g: n.lineno for n in ast.walk(tree) if isinstance(n, ast.Global) for g in n.names}


def _mutated(trees) -> set[str]:
  """Every name (bare, or as an attribute: `module.NAME`) that some code of the package mutates in place:
  `NAME.append(...)` (MUTATORS), `NAME[k] = v`, `NAME[k] += v`, `del NAME[k]`, `NAME |= ...`."""
  def ident(node):
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
  out = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        out.add(ident(node.func.value))
      elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
        out.add(ident(node.value))
      elif isinstance(node, ast.AugAssign):
        out.add(ident(node.target.value) if isinstance(node.target, ast.Subscript) else ident(node.target))
  return out - {None}


def _state_offenders(modules) -> tuple[list[str], set[tuple[str, str]]]:
  """(the offenders' lines, the (module, name) pairs seen), for `modules` = [(name, path, tree)]."""
  mutated = _mutated(tree for _, _, tree in modules)
  bad, seen = [], set()
  for name, path, tree in modules:
    where = path.relative_to(PACKAGE.parent)
    for var, (line, kind) in _module_state(name, tree).items():
      if kind == "object" or not _constant_name(var) or var in mutated:
        seen.add((name, var))
        if (name, var) not in STATE:
          why = ("an object with state" if kind == "object" else
                 "mutated in the package" if _constant_name(var) else "not an UPPER_CASE constant")
          bad.append(f"{where}:{line} {var}: module-level mutable value, {why}")
    for var, line in _globals(tree).items():
      seen.add((name, var))
      if (name, var) not in STATE:
        bad.append(f"{where}:{line} global {var}")
  return bad, seen


def test_no_module_level_mutable_state_but_the_listed():
  modules = list(_modules())
  bad, seen = _state_offenders(modules)
  assert not bad, "module-level state (move it into an object, pass it, or list it in STATE with why):\n" + (
      "\n".join(bad))
  assert not set(STATE) - seen, f"stale STATE entries (no longer state): {sorted(set(STATE) - seen)}"


def test_the_state_guard_sees_each_kind_of_offender():
  """The guard on planted modules: a lower-case cache, a constant mutated by another module (through the module's
  name), a `global` statement, threading.local, an instance of the module's class; and what it lets pass."""
  planted = {
      "maxlm.a": "import threading\nclass _C: pass\n_cache = {}\nTABLE = {'x': 1}\nLOCAL = threading.local()\n"
                 "ONE = _C()\nKINDS = ('a',)\nNAMES = ['a', 'b']\n__all__ = ['TABLE']\n"
                 "def set_level(v):\n  global _level\n  _level = v\n",
      "maxlm.b": "from maxlm import a\ndef f():\n  a.TABLE['y'] = 2\n  print(a.NAMES[0])\n",
  }
  modules = [(n, PACKAGE / f"{n.split('.')[1]}.py", ast.parse(src)) for n, src in planted.items()]
  bad, _ = _state_offenders(modules)
  assert sorted(line.split(" ", 1)[1] for line in bad) == sorted([
      "_cache: module-level mutable value, not an UPPER_CASE constant",
      "TABLE: module-level mutable value, mutated in the package",
      "LOCAL: module-level mutable value, an object with state",
      "ONE: module-level mutable value, an object with state",
      "global _level"]), bad


def _jax_names(tree) -> set[str]:
  """The names a module binds by importing jax or anything in it."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "jax")
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jax" and not node.level:
      names.update(a.asname or a.name for a in node.names)
  return names


def _root(node) -> str | None:
  while isinstance(node, (ast.Attribute, ast.Subscript)):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def _rebinds(tree) -> list[str]:
  """Each assignment to (or setattr on) an attribute reached from a jax name, as its target's source text."""
  jax_names, out = _jax_names(tree), []
  for node in ast.walk(tree):
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    for target in targets:
      for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
        if isinstance(t, ast.Attribute) and _root(t) in jax_names:
          out.append(ast.unparse(t))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
        and node.args and _root(node.args[0]) in jax_names):
      out.append(f"{node.func.id}({ast.unparse(node.args[0])}, ...)")
  return out


def test_no_module_rebinds_jax_but_the_listed():
  seen = {(name, t) for name, _, tree in _modules() for t in _rebinds(tree)}
  assert not seen - set(REBINDS), f"JAX rebound (use a supported route, or list it in REBINDS with why): {sorted(seen - set(REBINDS))}"
  assert not set(REBINDS) - seen, f"stale REBINDS entries: {sorted(set(REBINDS) - seen)}"


def test_the_rebind_guard_sees_each_form():
  planted = ("import jax\nimport jax.numpy as jnp\nfrom jax import lax\nfrom jax._src import cache as c\n"
             "from maxlm import plan\nimport os\n"
             "def f(g):\n  jax.lax.dot_general = g\n  jnp.dot = lax.add = g\n  c._cache, x = 1, 2\n"
             "  setattr(jax.config, 'x', 1)\n  plan.x = 1\n  os.environ['A'] = '1'\n  y = jax.numpy\n")
  assert sorted(_rebinds(ast.parse(planted))) == sorted([
      "jax.lax.dot_general", "jnp.dot", "lax.add", "c._cache", "setattr(jax.config, ...)"])
