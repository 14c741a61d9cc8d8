"""Orbax parameter trees read and written one slice at a time (so conversions never hold a whole model).

An Orbax `StandardCheckpointer` tree is, on disk, one TensorStore array per leaf (zarr, keyed by the
leaf's dotted path, inside an OCDBT key-value store unless `use_ocdbt` is off) plus a `_METADATA`
file naming the leaves. Orbax's own API takes whole arrays, so here TensorStore reads and writes
single layers of the stacked `[L, ...]` parameters directly, and `write_tree` writes the `_METADATA`
that `ocp.StandardCheckpointer().restore` (and so `checkpoint.load_params`) reads: the tests restore
what it writes with plain Orbax.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tensorstore as ts

from maxlm.checkpoint import CheckpointError



_ZARR_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "bfloat16"}  # as Orbax writes them


def _kvstore(params_dir: Path, key: str, ocdbt: bool) -> dict:
  if ocdbt:
    return {"driver": "ocdbt", "base": f"file://{params_dir.absolute()}", "path": key + "/"}
  return {"driver": "file", "path": f"{params_dir.absolute()}/{key}/"}


class OrbaxReader:
  """Leaves of an Orbax parameter tree, opened lazily; `read(path, layer)` reads one layer's slice."""

  def __init__(self, params_dir: Path):
    self.dir = Path(params_dir)
    try:
      meta = json.loads((self.dir / "_METADATA").read_text())
    except (OSError, ValueError) as e:
      raise CheckpointError(f"{self.dir}: not an Orbax parameter tree (_METADATA: {e})") from None
    self.ocdbt = bool(meta.get("use_ocdbt", True))
    self.driver = "zarr3" if meta.get("use_zarr3") else "zarr"
    self.context = ts.Context()
    self._open: dict[tuple[str, ...], ts.TensorStore] = {}

  def array(self, path: tuple[str, ...]) -> ts.TensorStore:
    if path not in self._open:
      key = ".".join(path)
      try:
        self._open[path] = ts.open({"driver": self.driver, "kvstore": _kvstore(self.dir, key, self.ocdbt)},
                                   open=True, read=True, context=self.context).result()
      except Exception as e:  # noqa: BLE001 - TensorStore reports missing or damaged arrays as ValueError/OSError
        raise CheckpointError(f"{self.dir}: cannot open parameter {'/'.join(path)} "
                              f"({str(e).splitlines()[0]})") from None
    return self._open[path]

  def read(self, path: tuple[str, ...], layer: int | None = None) -> np.ndarray:
    arr = self.array(path)
    try:
      return np.asarray((arr if layer is None else arr[layer]).read().result())
    except Exception as e:  # noqa: BLE001 - TensorStore and safetensors raise many types; each means a damaged file
      raise CheckpointError(f"{self.dir}: cannot read parameter {'/'.join(path)} "
                            f"({str(e).splitlines()[0]})") from None


class OrbaxWriter:
  """Creates an Orbax parameter tree leaf by leaf; stacked leaves are written one layer at a time."""

  def __init__(self, params_dir: Path):
    self.dir = Path(params_dir)
    self.dir.mkdir(parents=True, exist_ok=False)
    self.context = ts.Context()
    self.leaves: list[tuple[str, ...]] = []

  def create(self, path: tuple[str, ...], shape: tuple[int, ...], dtype, stacked: bool) -> ts.TensorStore:
    """A new leaf; `stacked` chunks it per layer (leading axis) so each layer is written whole."""
    chunks = [1, *shape[1:]] if stacked else list(shape)
    spec = {"driver": "zarr", "kvstore": _kvstore(self.dir, ".".join(path), True),
            "metadata": {"shape": list(shape), "chunks": chunks, "dtype": _ZARR_DTYPES[np.dtype(dtype).name],
                         "compressor": {"id": "zstd", "level": 1}, "fill_value": None}}
    self.leaves.append(path)
    return ts.open(spec, create=True, context=self.context).result()

  def close(self) -> None:
    """Write `_METADATA` (the tree of leaves), which makes the directory an Orbax tree."""
    tree = {str(p): {"key_metadata": [{"key": k, "key_type": 2} for k in p],
                     "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}
            for p in self.leaves}
    meta = {"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    (self.dir / "_METADATA").write_text(json.dumps(meta))
