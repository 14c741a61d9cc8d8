"""The collectives of a compiled step, read from its HLO text: what each moves per step, and over which links.

`inventory(hlo_text, devices_per_node)` walks the optimized HLO module (`compiled.as_text()`) from its ENTRY
computation through every call (while bodies times their trip count, `known_trip_count` in the backend config;
conditional branches, async wrappers and fusions once per call) and lists each collective with the number
of times one step runs it:

* all-gather: `bytes` is the gathered (full) result; on the wire each device receives (n - 1) / n of it.
* reduce-scatter: `bytes` is the full operand (the result times the group size); on the wire (n - 1) / n.
* all-reduce: `bytes` is the operand; a ring moves 2 (n - 1) / n of it per device.
* all-to-all: `bytes` is the operand; (n - 1) / n of it leaves each device.
* collective-permute: `bytes` is the operand, sent once per device.

n is the size of the replica group, read from `replica_groups` in any of XLA's three spellings (explicit
`{{0,1},{2,3}}`, iota `[2,2]<=[4]` / `[2,2]<=[2,2]T(1,0)`, and the mesh form `mesh['axis_0'=2,'axis_1'=4]
{'axis_1'}`) or from `source_target_pairs`. A group whose devices sit on more than one node (device id //
devices_per_node) goes over the network (`dcn`), the others over NVLink (`ici`). `network` is what one GPU's
own NIC carries of a group spread over g nodes with k of its devices on each (one NIC per GPU, as in an HGX
node with 8 x 400 Gb/s): a node takes in the (g - 1) / g of a gathered buffer that lives on other nodes,
spread over its k NICs, so S (g - 1) / (g k) for all-gather and reduce-scatter, twice that for all-reduce;
an all-to-all sends each device's own (g - 1) / g of its operand off the node; a permute across nodes, S.

`fsdp_expectation` is what FSDP should move per step: each sharded weight gathered twice per micro-batch
(forward, and again for the backward: neither keeps the gathered weights), its gradient reduce-scattered
once, in the compute dtype. XLA:GPU's asynchronous pairs
(`all-gather-start` / `all-gather-done`) are counted once, at the done (whose shape is the result); a
combined collective (a tuple of several arrays) is one collective with the bytes of all of them.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from maxlm.config import ModelConfig
from maxlm.model import count_params

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
               "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
               "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
               "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass
class Collective:
  kind: str  # one of KINDS
  name: str  # the instruction's name
  bytes: int  # the full buffer (see the module doc)
  group: int  # devices in one replica group
  times: int  # how often one step runs it
  dcn: bool  # a group spans nodes
  exact: bool = True  # False where a loop's trip count was unknown (counted once)
  nodes: int = 1  # nodes one group spans

  @property
  def network(self) -> float:
    """Bytes one GPU's NIC carries per run (see the module doc); 0 within a node."""
    g = self.nodes
    if g <= 1:
      return 0.0
    if self.kind == "collective-permute":
      return float(self.bytes)
    if self.kind == "all-to-all":
      return self.bytes * (g - 1) / g
    per_node = max(1, self.group // g)
    return self.bytes * (g - 1) / (g * per_node) * (2 if self.kind == "all-reduce" else 1)

  @property
  def wire(self) -> float:
    """Bytes each device sends (= receives) per run, on a ring (see the module doc)."""
    n = self.group
    if n <= 1:
      return 0.0
    share = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.kind, (n - 1) / n)
    return self.bytes * share


def array_bytes(shape_text: str) -> int:
  """Bytes of every array in an HLO shape (a tuple counts all its members)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype not in DTYPE_BYTES:
      raise ValueError(f"unknown HLO element type {dtype!r} in {shape_text[:80]!r}")
    total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def _split_type(rest: str) -> tuple[str, str]:
  """('shape', 'opcode(...)...') of the text after `name = `: the shape is a token or a balanced (tuple)."""
  if not rest.startswith("("):
    shape, _, tail = rest.partition(" ")
    return shape, tail
  depth = 0
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i + 1], rest[i + 1:].lstrip()
  raise ValueError(f"unbalanced HLO shape: {rest[:80]!r}")


def _groups(attrs: str, n_devices: int | None) -> list[list[int]]:
  """The replica groups (device ids) of a collective; [] where none are given (all devices)."""
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
                r"\s*\{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    sizes = [int(s) for _, s in axes]
    arr = _device_ids(m.group(2), math.prod(sizes)).reshape(sizes)
    names = [a for a, _ in axes]
    varying = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
    fixed = [i for i in range(len(names)) if i not in varying]
    arr = arr.transpose(fixed + varying).reshape(-1, math.prod(sizes[i] for i in varying) if varying else 1)
    return arr.tolist()
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    arr = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      arr = arr.transpose([int(x) for x in m.group(3).split(",")])
    return arr.reshape(shape[0], -1).tolist()
  m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
  if m and m.group(1).strip():
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
  if "replica_groups=" in attrs and not m:  # a spelling not read above: never guess the groups
    raise ValueError(f"unread replica_groups in {attrs[attrs.index('replica_groups='):][:160]!r}")
  return [list(range(n_devices))] if n_devices else []


def _device_ids(text: str | None, n: int) -> np.ndarray:
  """The device order of a mesh-form group: iota ("[8,8]T(1,0)": arange reshaped, transposed, flattened), a
  list ("0,2,1,3"), or none (arange)."""
  if not text:
    return np.arange(n)
  m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if m:
    arr = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
    return (arr.transpose([int(x) for x in m.group(2).split(",")]) if m.group(2) else arr).reshape(-1)
  return np.array([int(x) for x in text.split(",") if x.strip()])


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """{computation name: its instruction lines}, and the ENTRY computation's name."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = m.group(1)
        comps[current] = []
        if line.startswith("ENTRY"):
          entry = current
    elif line.startswith("}"):
      current = None
    else:
      comps[current].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in this HLO text")
  return comps, entry


def parse(text: str, devices_per_node: int | None = None, n_devices: int | None = None) -> list[Collective]:
  """Every collective one step runs (see the module doc), with how often."""
  comps, entry = _computations(text)
  out: list[Collective] = []
  stack = [(entry, 1, True)]
  while stack:  # every call site of every computation, from ENTRY down
    name, times, exact = stack.pop()
    for line in comps.get(name, ()):
      m = _INSTR.match(line)
      if not m:
        continue
      shape, rest = _split_type(m.group(2))
      opcode = rest.split("(", 1)[0]
      if opcode == "while":
        n = _trip_count(comps, name, rest)
        for callee in _CALLS.findall(rest):
          stack.append((callee, times * (n or 1), exact and n is not None))
        continue
      for callee in _CALLS.findall(rest):
        stack.append((callee, times, exact))
      for group in _BRANCHES.findall(rest):
        stack.extend((c.strip().lstrip("%"), times, exact) for c in group.split(",") if c.strip())
      kind = opcode[:-5] if opcode.endswith("-done") else opcode
      if kind not in KINDS or opcode.endswith("-start"):
        continue
      if opcode.endswith("-done"):  # the attributes are the start's
        start = _start_of(comps[name], rest)
        attrs = start if start is not None else rest
      else:
        attrs = rest
      groups = _groups(attrs, n_devices)
      size = len(groups[0]) if groups else (n_devices or 1)
      if kind == "collective-permute":
        size = 2 if groups else 1
      nbytes = array_bytes(shape)
      if kind == "reduce-scatter":
        nbytes *= size
      per_node = devices_per_node or 0
      nodes = max((len({d // per_node for d in g}) for g in groups), default=1) if per_node else 1
      out.append(Collective(kind, m.group(1), nbytes, size, times, nodes > 1, exact, nodes))
  return out


def _instruction(lines: list[str], name: str) -> str | None:
  """The text after `name = <shape> ` of an instruction of a computation."""
  pattern = re.compile(r"^\s*(?:ROOT\s+)?%?" + re.escape(name) + r"\s*=\s*(.*)$")
  for line in lines:
    m = pattern.match(line)
    if m:
      return _split_type(m.group(1))[1]
  return None


def _constant(lines: list[str], name: str) -> int | None:
  """The integer value of a scalar constant (through one copy or convert), else None."""
  for _ in range(3):
    text = _instruction(lines, name)
    if text is None:
      return None
    m = re.match(r"constant\((-?\d+)\)", text)
    if m:
      return int(m.group(1))
    m = re.match(r"(?:copy|convert|bitcast)\(%?([\w.\-]+)\)", text)
    if not m:
      return None
    name = m.group(1)
  return None


def _trip_count(comps: dict[str, list[str]], where: str, rest: str) -> int | None:
  """A while loop's trip count: `known_trip_count`, else read off its condition, `i < N` (or `N > i`; <= and
  >= count one more) on the induction variable of `known_induction_variable`, and that variable's constant
  initial value in the loop's operand tuple, step 1 (as jax lowers scan and fori_loop: the accumulation loop
  over micro-batches carries no known_trip_count on XLA:GPU, its first trip peeled). None where unreadable."""
  trip = _TRIP.search(rest)
  if trip:
    return int(trip.group(1))
  var = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}', rest)
  cond = re.search(r"condition=%?([\w.\-]+)", rest)
  operand = re.match(r"while\(%?([\w.\-]+)\)", rest)
  if not (var and cond and operand):
    return None
  lines = comps.get(cond.group(1), [])
  root = next((ln for ln in lines if ln.lstrip().startswith("ROOT")), "")
  fused = re.search(r"fusion\(.*calls=%?([\w.\-]+)", root)
  if fused:  # the compare inside a fusion
    lines = comps.get(fused.group(1), [])
    root = next((ln for ln in lines if ln.lstrip().startswith("ROOT")), "")
  cmp = re.search(r"compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=(\w+)", root)
  if not cmp:
    return None
  left, right = _constant(lines, cmp.group(1)), _constant(lines, cmp.group(2))
  direction = cmp.group(3)
  if right is not None and left is None and direction in ("LT", "LE"):
    bound, inclusive = right, direction == "LE"
  elif left is not None and right is None and direction in ("GT", "GE"):
    bound, inclusive = left, direction == "GE"
  else:
    return None
  init_tuple = _instruction(comps[where], operand.group(1))
  if init_tuple is None or not init_tuple.startswith("tuple("):
    return None
  args = [a.strip().lstrip("%") for a in init_tuple[len("tuple("):].split(")", 1)[0].split(",")]
  k = int(var.group(1))
  init = _constant(comps[where], args[k]) if k < len(args) else None
  return None if init is None else max(0, bound - init + (1 if inclusive else 0))


def _start_of(lines: list[str], done_rest: str) -> str | None:
  """The text of the `-start` instruction a `-done` waits for."""
  operand = re.match(r"[\w-]+\(%?([\w.\-]+)", done_rest)
  if not operand:
    return None
  pattern = re.compile(r"^\s*(?:ROOT\s+)?%?" + re.escape(operand.group(1)) + r"\s*=\s*(.*)$")
  for line in lines:
    m = pattern.match(line)
    if m:
      return _split_type(m.group(1))[1]
  return None


def inventory(text: str, devices_per_node: int | None = None, n_devices: int | None = None) -> dict:
  """Per kind: {"count": runs per step, "bytes": full buffers per step, "wire": bytes each device sends per
  step, "ici_wire" / "dcn_wire": of that, in groups within a node / across nodes, "network": bytes through
  each GPU's NIC}; "exact": False where a loop's trip count was unknown; "ops": each collective (kind, bytes,
  group, nodes, times, wire, network)."""
  ops = parse(text, devices_per_node, n_devices)
  out = {k: {"count": 0, "bytes": 0, "wire": 0.0, "ici_wire": 0.0, "dcn_wire": 0.0, "network": 0.0} for k in KINDS}
  for c in ops:
    row = out[c.kind]
    row["count"] += c.times
    row["bytes"] += c.times * c.bytes
    row["wire"] += c.times * c.wire
    row["dcn_wire" if c.dcn else "ici_wire"] += c.times * c.wire
    row["network"] += c.times * c.network
  out["exact"] = all(c.exact for c in ops)
  out["ops"] = [{"kind": c.kind, "bytes": c.bytes, "group": c.group, "nodes": c.nodes, "times": c.times,
                 "wire": c.wire, "network": c.network} for c in ops]
  return out


def fsdp_expectation(m: ModelConfig, grad_accum: int, degrees: dict[str, int]) -> dict[str, int]:
  """Bytes per step FSDP should gather and reduce-scatter (see the module doc): the GEMM weights of the layers
  (one pipeline stage's) and the LM head, as one tensor-parallel shard holds them, in the compute dtype; none
  where the fsdp x context degree is 1 (`embed` is split over both: maxlm/parallel/sharding.py ZERO)."""
  if degrees.get("fsdp", 1) * degrees.get("context", 1) <= 1:
    return {"all-gather": 0, "reduce-scatter": 0}
  counts = count_params(m)
  weights = (counts["matmul"] - m.d_model * m.vocab_size) // degrees.get("pipeline", 1) + m.d_model * m.vocab_size
  nbytes = weights // degrees.get("tensor", 1) * (4 if m.dtype == "float32" else 2)
  return {"all-gather": 2 * grad_accum * nbytes, "reduce-scatter": grad_accum * nbytes}
