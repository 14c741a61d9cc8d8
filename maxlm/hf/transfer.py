"""Moving weights between HF safetensors, Orbax parameter trees and device params, one tensor at a time.

Every path goes through the one table in `maxlm.hf.weights`. Host memory holds one layer's tensors at a
time in the streaming conversions (`hf_to_orbax`, `export_hf` from an Orbax tree); loading onto devices
(`load_hf_params`) holds one whole parameter (all layers of a stacked one) at a time on the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax
import numpy as np

from maxlm.checkpoint import CheckpointError
from maxlm.checkpoint.verify import slice_checksum
from maxlm.config import ModelConfig
from maxlm.hf.orbax_io import OrbaxReader, OrbaxWriter
from maxlm.hf.safetensors_io import MAX_SHARD_BYTES, SafetensorsReader, ShardedWriter
from maxlm.hf.weights import Entry, hf_tensor_list, iter_entries, param_path, table

# Tensors an HF checkpoint may hold that carry nothing maxlm needs (old checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_tensors(reader: SafetensorsReader, m: ModelConfig) -> None:
  """Every tensor the config needs is there; nothing is left over that maxlm would silently drop."""
  wanted = {name for name, _ in hf_tensor_list(m)}
  for name in sorted(set(reader.tensors) - wanted):
    if name.endswith(_IGNORED_SUFFIXES) or (m.tie_embeddings and name == "lm_head.weight"):
      continue  # a tied head saved anyway is the embedding again
    raise CheckpointError(f"{reader.dir}: unexpected tensor {name!r} (no place for it in a Llama/Mistral/Mixtral "
                          f"model with this config.json)")
  for name in sorted(wanted - set(reader.tensors)):
    reader.get(name)  # raises, naming the missing tensor


def source_dtype(reader: SafetensorsReader, m: ModelConfig) -> str:
  """The dtype of the HF tensors `m` is made of (what an export writes by default, so that a round trip is
  bit for bit): their one dtype, or float32 when they mix float16/bfloat16/float32 (it holds each exactly;
  float64 files, which maxlm holds in float32 at most, give float32 too)."""
  dtypes = {reader.dtype(name) for name, _ in hf_tensor_list(m)}
  return dtypes.pop() if len(dtypes) == 1 and dtypes <= {"float16", "bfloat16"} else "float32"


def _dtype(name: str, e: Entry) -> np.dtype:
  """The dtype `name` holds the entry's parameter in: float32 at least where the entry says so (the router)."""
  dt = np.dtype(jax.numpy.dtype(name))
  return np.promote_types(dt, np.float32) if e.float32 else dt


def _reader(src: Path | SafetensorsReader) -> SafetensorsReader:
  return src if isinstance(src, SafetensorsReader) else SafetensorsReader(src)


def _from_hf(reader: SafetensorsReader, e: Entry, layer: int | None) -> np.ndarray:
  return e.to_maxlm([reader.get(n, s) for n, s in zip(e.hf_names(layer), e.shapes)])


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
  for k in path:
    tree = tree[k]
  return tree


def load_hf_params(src: Path | SafetensorsReader, m: ModelConfig, shardings) -> dict:
  """The params tree of `m` (scanned or not, as `m.scan_layers` says) from HF safetensors (a directory or
  its reader), placed with `shardings` (a tree like the params) in `m.param_dtype`."""
  reader = _reader(src)
  check_tensors(reader, m)
  params: dict = {}
  for e in table(m):
    pdt = _dtype(m.param_dtype, e)
    layers = range(m.n_layers) if e.per_layer else [None]
    if e.per_layer and m.scan_layers:
      host = np.empty((m.n_layers, *e.shape), pdt)  # [L, ...] one stacked parameter at a time
      for i in layers:
        host[i] = _from_hf(reader, e, i)
      groups = [(param_path(e, None, True), host)]
    else:
      groups = [(param_path(e, i, False), _from_hf(reader, e, i).astype(pdt)) for i in layers]
    for path, host in groups:
      _set(params, path, jax.device_put(host, _get(shardings, path)))
      del host
  return params


def hf_to_orbax(src: Path | SafetensorsReader, out_params: Path, m: ModelConfig, dtype: str,
                scan: bool = True) -> int:
  """Write the Orbax parameter tree of `m` (stacked layers when `scan`) from HF safetensors (a directory
  or its reader), one layer of one parameter at a time, in `dtype`. Returns the bytes written
  (uncompressed)."""
  reader = _reader(src)
  check_tensors(reader, m)
  writer = OrbaxWriter(out_params)
  total = 0
  for e in table(m):
    dt = _dtype(dtype, e)
    if e.per_layer and scan:
      arr = writer.create(param_path(e, None, True), (m.n_layers, *e.shape), dt, stacked=True)
      for i in range(m.n_layers):
        arr[i].write(_from_hf(reader, e, i).astype(dt)).result()
    else:
      for i in range(m.n_layers) if e.per_layer else [None]:
        arr = writer.create(param_path(e, i, False), e.shape, dt, stacked=False)
        arr.write(_from_hf(reader, e, i).astype(dt)).result()
    total += int(np.prod(e.shape)) * dt.itemsize * (m.n_layers if e.per_layer else 1)
  writer.close()
  return total


def export_hf(read: Callable[[Entry, int | None], np.ndarray], m: ModelConfig, out_dir: Path, dtype: str,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
  """Write HF safetensors for `m`; `read(entry, layer)` gives one maxlm parameter (one layer's slice of a
  per-layer one) as numpy. Shards are written as tensors come. Returns the bytes written."""
  writer = ShardedWriter(out_dir, hf_tensor_list(m), np.dtype(jax.numpy.dtype(dtype)), max_shard_bytes)
  for layer, e in iter_entries(m):
    for name, tensor in zip(e.hf_names(layer), e.to_hf(read(e, layer))):
      writer.write(name, tensor)
  writer.close()
  return writer.total


def device_reader(params, m: ModelConfig) -> Callable[[Entry, int | None], np.ndarray]:
  """`read` for export_hf from a params tree of jax arrays (one layer copied to the host at a time)."""
  scan = "layers" in params

  def read(e: Entry, layer: int | None) -> np.ndarray:
    x = _get(params, param_path(e, layer, scan))
    return np.asarray(jax.device_get(x[layer] if e.per_layer and scan else x))
  return read


def orbax_reader(params_dir: Path, m: ModelConfig, arrays: dict | None = None,
                 ) -> Callable[[Entry, int | None], np.ndarray]:
  """`read` for export_hf from an Orbax parameter tree on disk, one layer's slice at a time. With the
  checkpoint's `meta.arrays` each array's checksum is added up slice by slice and checked when its
  last slice has been read (CheckpointError naming the array)."""
  src = OrbaxReader(params_dir)
  scan = m.scan_layers
  sums: dict[str, int] = {}

  def read(e: Entry, layer: int | None) -> np.ndarray:
    path = param_path(e, layer, scan)
    stacked = e.per_layer and scan
    x = src.read(path, layer if stacked else None)
    key = ".params" + "".join(f"['{k}']" for k in path)
    if arrays is not None:
      if key not in arrays or tuple(arrays[key][0]) != ((m.n_layers,) if stacked else ()) + tuple(e.shape):
        raise CheckpointError(f"{params_dir}: parameter {'/'.join(path)} does not fit the checkpoint's config")
      start = layer * x.size if stacked else 0
      sums[key] = (sums.get(key, 0) + slice_checksum(x, start)) % 2**32
      if (not stacked or layer == m.n_layers - 1) and sums[key] != arrays[key][2]:
        raise CheckpointError(f"{params_dir}: parameter {'/'.join(path)} differs from its saved checksum")
    return x
  return read
