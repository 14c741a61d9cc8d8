"""Streaming safetensors I/O: read one tensor at a time from an HF directory, write shards as tensors come.

safetensors' own `safe_open` validates every file (header, offsets, size) and lists its tensors; the
bytes are read here from the offsets in the header, because safetensors' numpy API cannot return
bfloat16 (numpy has no such dtype; `ml_dtypes` supplies it), the usual dtype of HF checkpoints. The
writer is ours for the same reason and because safetensors' `save_file` needs every tensor of a
file in memory at once: here the header is computed from the planned shapes first, then each tensor
is written as it is produced, so memory holds one tensor, never a shard.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from maxlm.checkpoint import CheckpointError

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F64": np.dtype(np.float64)}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9  # HF's default shard size ("5GB")


def _header(path: Path) -> tuple[int, dict]:
  """(offset of the data buffer, header dict) of a safetensors file."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n, json.loads(f.read(n))


class SafetensorsReader:
  """The tensors of an HF model directory (one file, or shards listed by model.safetensors.index.json)."""

  def __init__(self, hf_dir: Path):
    self.dir = Path(hf_dir)
    index = self.dir / INDEX
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
      except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: unreadable index ({e})") from None
    else:
      files = sorted(p.name for p in self.dir.glob("*.safetensors"))
      if not files:
        raise CheckpointError(f"{self.dir}: no *.safetensors files (and no {INDEX})")
    self.tensors: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}  # name -> file, dtype, shape, offset
    for name in files:
      self._scan(self.dir / name)

  def _scan(self, path: Path) -> None:
    if not path.is_file():
      raise CheckpointError(f"{path}: missing (listed in {INDEX})")
    try:
      with safe_open(str(path), framework="numpy"):  # validates header, offsets and file size
        pass
      base, header = _header(path)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError and OSError; both mean damaged
      raise CheckpointError(f"{path}: not a valid safetensors file ({str(e).splitlines()[0]})") from None
    for name, info in header.items():
      if name == "__metadata__":
        continue
      if info["dtype"] not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
      self.tensors[name] = (path, info["dtype"], tuple(info["shape"]), base + info["data_offsets"][0])

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def shape(self, name: str) -> tuple[int, ...]:
    return self._info(name)[2]

  def dtype(self, name: str) -> str:
    """The numpy name of a tensor's file dtype ('bfloat16', 'float32', ...)."""
    return DTYPES[self._info(name)[1]].name

  def _info(self, name: str):
    if name not in self.tensors:
      raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the safetensors files")
    return self.tensors[name]

  def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """One tensor, in its file's dtype; `shape` checks it (CheckpointError naming the tensor)."""
    path, dtype, have, offset = self._info(name)
    if shape is not None and tuple(shape) != have:
      raise CheckpointError(f"{path}: tensor {name!r} has shape {list(have)}, the config needs {list(shape)}")
    count = int(np.prod(have))
    with open(path, "rb") as f:
      f.seek(offset)
      out = np.fromfile(f, dtype=DTYPES[dtype], count=count)
    if out.size != count:
      raise CheckpointError(f"{path}: tensor {name!r} is truncated")
    return out.reshape(have)


def plan_shards(tensors: list[tuple[str, tuple[int, ...]]], dtype: np.dtype,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
  """Tensors split in order into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
  shards, size = [[]], 0
  for name, shape in tensors:
    n = int(np.prod(shape)) * dtype.itemsize
    if shards[-1] and size + n > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, shape))
    size += n
  return shards


class ShardedWriter:
  """Writes HF safetensors shards in a planned order, one tensor at a time, plus the index.

  `write(name, array)` must be called for every planned tensor, in the planned order. One shard gives
  `model.safetensors` (as transformers writes it); several give `model-0000k-of-0000n.safetensors` and
  `model.safetensors.index.json`.
  """

  def __init__(self, out_dir: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype,
               max_shard_bytes: int = MAX_SHARD_BYTES):
    self.dir, self.dtype = Path(out_dir), np.dtype(dtype)
    self.shards = plan_shards(tensors, self.dtype, max_shard_bytes)
    n = len(self.shards)
    self.files = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    self.order = [(name, shape, k) for k, shard in enumerate(self.shards) for name, shape in shard]
    self.pos, self.f, self.total = 0, None, 0

  def _open(self, k: int) -> None:
    if self.f is not None:
      self.f.close()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in self.shards[k]:
      n = int(np.prod(shape)) * self.dtype.itemsize
      header[name] = {"dtype": NAMES[self.dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
      offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data buffer starts 8-byte aligned, as safetensors writes it
    self.f = open(self.dir / self.files[k], "wb")
    self.f.write(struct.pack("<Q", len(text)) + text)

  def write(self, name: str, array: np.ndarray) -> None:
    want, shape, k = self.order[self.pos]
    if name != want or tuple(array.shape) != tuple(shape):
      raise AssertionError(f"expected {want} {shape}, got {name} {array.shape}")
    if self.pos == 0 or self.order[self.pos - 1][2] != k:
      self._open(k)
    data = np.ascontiguousarray(array.astype(self.dtype, copy=False))
    self.f.write(memoryview(data.reshape(-1).view(np.uint8)))
    self.total += data.nbytes
    self.pos += 1

  def close(self) -> None:
    if self.f is not None:
      self.f.close()
      self.f = None
    if self.pos != len(self.order):
      raise AssertionError(f"{len(self.order) - self.pos} planned tensors were not written")
    if len(self.files) > 1:
      index = {"metadata": {"total_size": self.total},
               "weight_map": {name: self.files[k] for name, _, k in self.order}}
      (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
