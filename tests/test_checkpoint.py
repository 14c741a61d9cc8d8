"""Checkpointer unit tests (in-process, 8 simulated CPU devices from conftest): round trip onto other
meshes, data position (per stream, from another process count), corruption detection
and fallback, NaN refusal, failed saves, retention, parameter-only loads."""

import json
import os
import re
import resource
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

from maxlm.build import build_step
from maxlm.checkpoint import CheckpointError, Checkpointer, load_params, start
from maxlm.checkpoint.verify import json_digest, reason
from maxlm.config import CheckpointConfig, DataConfig, MeshConfig, load_config, to_dict
from maxlm.data import make_train_iterator, merge_states
from maxlm.parallel.mesh import make_mesh
from maxlm.trainer import Trainer


def _start(t, cfg):
  """maxlm.checkpoint.start for a Trainer, as the trainer takes it: the state into `t`; the Checkpointer."""
  r = start(t.state, t.state_shardings, t.train_data, cfg)
  t.state = r.state
  return r.checkpointer

TINY = ["model.backend=flax", "model.n_layers=1", "model.d_model=64", "model.vocab_size=512",
        "model.remat=none", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=8",
        "optim.warmup_steps=0"]


def _trainer(*extra):
  cfg = load_config(TINY + list(extra))
  t = Trainer(cfg)
  t.build()
  return cfg, t


def _host(tree):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _same(a, b) -> bool:
  return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


@jax.jit
def _advance(state):
  """A stand-in for a train step (every array changes, the step counts): far cheaper to compile."""
  return jax.tree_util.tree_map(
      lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.integer) else x * 1.5 + 0.25, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Checkpoints of steps 2 and 3 of a run on mesh (data, fsdp, tensor) = (2, 2, 2)."""
  cfg, t = _trainer("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert dict(t.mesh.shape) == {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
  root = tmp_path_factory.mktemp("saved") / "checkpoints"
  ckpt = Checkpointer(root, CheckpointConfig(enabled=True, keep=5))
  states, data = {}, {}
  for step in (1, 2, 3):
    next(t.train_data)
    t.state = _advance(t.state)
    if step >= 2:
      ckpt.save(step, t.state, t.train_data.get_state(), to_dict(cfg))
      states[step], data[step] = _host(t.state), json.loads(json.dumps(t.train_data.get_state()))
  next_batch = next(t.train_data)
  ckpt.close()
  return {"root": root, "states": states, "data": data, "next_batch": next_batch, "cfg": cfg, "trainer": t}


def _copy(saved, tmp_path) -> Path:
  dest = tmp_path / "checkpoints"
  shutil.copytree(saved["root"], dest)
  return dest


def _target(*extra):
  """(config, restore target, its shardings) for a run, without initializing or compiling anything."""
  cfg = load_config(TINY + list(extra))
  t = Trainer(cfg)
  built = build_step(cfg, t.mesh, abstract=True)
  target, shardings = built.state, built.state_shardings
  t.train_data.close()
  return cfg, target, shardings


def _restore(directory, *extra):
  cfg, target, shardings = _target(*extra)
  ckpt = Checkpointer(directory, CheckpointConfig(enabled=True, keep=5))
  try:
    return ckpt.restore_latest(target, to_dict(cfg)), shardings
  finally:
    ckpt.close()


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _largest_file(step_dir: Path, item: str = "params") -> Path:
  return max((p for p in (step_dir / item).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _zstd_frames(b: bytes):
  """(start, end, content size) of each zstd frame in `b` (RFC 8878: magic, header, blocks, optional checksum)."""
  i = b.find(_ZSTD_MAGIC)
  while i >= 0:
    fhd, single = b[i + 4], b[i + 4] & 0x20
    j = i + 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    k = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    size, j = int.from_bytes(b[j:j + k], "little") + (256 if k == 2 else 0), j + k
    while j + 3 <= len(b):
      h = int.from_bytes(b[j:j + 3], "little")
      j += 3 + (1 if (h >> 1) & 3 == 1 else h >> 3)  # an RLE block holds one byte
      if h & 1:  # the last block
        if j + (4 if fhd & 4 else 0) <= len(b):
          yield i, j + (4 if fhd & 4 else 0), size
        break
    i = b.find(_ZSTD_MAGIC, i + 4)


def _zstd_decode(frame: bytes, size: int) -> bytes | None:
  """`frame` decoded as Orbax reads a chunk (TensorStore's zarr zstd codec), or None where that fails."""
  ctx = ts.Context()
  kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
  kv[".zarray"] = json.dumps({"zarr_format": 2, "shape": [size], "chunks": [size], "dtype": "|u1", "order": "C",
                              "compressor": {"id": "zstd", "level": 1}, "fill_value": 0, "filters": None}).encode()
  kv["0"] = bytes(frame)
  try:
    return ts.open({"driver": "zarr", "kvstore": {"driver": "memory"}}, context=ctx).result().read().result().tobytes()
  except ValueError:
    return None


def test_restore_onto_other_meshes_is_identical(saved, tmp_path):
  for mesh in (("mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"), ("mesh.fsdp=2", "mesh.context=4")):
    r, shardings = _restore(_copy(saved, tmp_path / mesh[-1]), *mesh)
    assert r.step == 3 and _same(_host(r.state), saved["states"][3])
    for x, want in zip(jax.tree_util.tree_leaves(r.state), jax.tree_util.tree_leaves(shardings)):
      assert x.sharding == want
  # one device: abstract_state() on a 1-device mesh is the restore target
  cfg = saved["cfg"]
  mesh1 = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  target = build_step(cfg, mesh1, abstract=True).state
  ckpt = Checkpointer(saved["root"], CheckpointConfig(enabled=True))
  one = ckpt.restore_latest(target, to_dict(saved["cfg"]))
  ckpt.close()
  assert one.step == 3 and _same(_host(one.state), saved["states"][3])
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree_util.tree_leaves(one.state))


def test_restored_data_state_continues_the_batches(saved, tmp_path):
  r, _ = _restore(_copy(saved, tmp_path), "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.data == saved["data"][3]
  it = Trainer(saved["cfg"]).train_data
  it.set_state(r.data)
  b = next(it)
  assert all(np.array_equal(b[k], saved["next_batch"][k]) for k in b)


def test_truncated_latest_falls_back_in_one_line(saved, tmp_path, capsys):
  root = _copy(saved, tmp_path)
  bad = _largest_file(root / "3")
  os.truncate(bad, bad.stat().st_size // 2)
  r, _ = _restore(root, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.step == 2 and _same(_host(r.state), saved["states"][2])
  lines = [ln for ln in capsys.readouterr().out.splitlines() if "is unusable" in ln]
  assert len(lines) == 1 and "step 3" in lines[0] and str(bad.relative_to(root / "3")) in lines[0]
  assert not (root / "3").exists() and len(list((tmp_path / "checkpoints.corrupt").iterdir())) == 1


def test_flipped_bits_are_caught_by_checksums(saved, tmp_path, capsys):
  """One bit flipped in a parameter's stored values where Orbax and TensorStore read on without noticing: only
  maxlm's checksums catch it. Orbax stores every array chunk as a zstd frame (zarr compressor, level 1, no content
  checksum) of Huffman-coded bytes, so a parameter's raw float32 bytes never appear in the files, and a bit flipped
  at a fixed offset (once: the middle of the largest file) can break a frame's header or code tables or an OCDBT
  node instead: Orbax's read fails, which falls back too but with other wording. So the bit is picked: in the
  largest frame of `params` that holds a chunk of a saved float32 array, the first byte from its middle whose
  flipped bit TensorStore's own zstd decoder decodes without error to a chunk with one value changed (which always
  changes maxlm's checksum, a sum of per-element bijective hashes)."""
  root = _copy(saved, tmp_path)
  frames = [(e - s, str(f), s, e, n) for f in sorted((root / "3" / "params").rglob("*")) if f.is_file()
            for s, e, n in _zstd_frames(f.read_bytes())]
  _, f, start, end, n = max(frames)
  data = bytearray(Path(f).read_bytes())
  chunk = _zstd_decode(data[start:end], n)
  leaves = [x.tobytes() for x in saved["states"][3] if x.dtype == np.float32]
  assert chunk is not None and sum(x.count(chunk[:16]) for x in leaves) == 1  # raw values of one saved array
  for i in range(start + (end - start) // 2, end):
    data[i] ^= 0x40
    flipped = _zstd_decode(data[start:end], n)
    if flipped is not None and np.sum(np.frombuffer(flipped, np.uint32) != np.frombuffer(chunk, np.uint32)) == 1:
      break
    data[i] ^= 0x40
  else:
    pytest.fail(f"no bit of {f}[{start}:{end}] decodes silently to one changed value")
  Path(f).write_bytes(data)
  r, _ = _restore(root, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.step == 2 and _same(_host(r.state), saved["states"][2])
  out = capsys.readouterr().out
  assert "checkpoint step 3 is unusable (1 array(s) differ from their saved checksums (.params[" in out


def test_same_size_edit_of_the_data_position_falls_back(saved, tmp_path, capsys):
  """One digit of the newest checkpoint's data-iterator position changed, file size kept (so the
  size manifest cannot see it): the sha256 in `meta` catches it and the previous checkpoint is used."""
  root = _copy(saved, tmp_path)
  f = root / "3" / "data" / "metadata"
  text = f.read_text()
  m = re.search(r'"next_index": (\d+)', text)
  assert m, text
  edited = text[:m.end() - 1] + str((int(text[m.end() - 1]) + 1) % 10) + text[m.end():]
  assert len(edited) == len(text) and edited != text
  f.write_text(edited)
  r, _ = _restore(root, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.step == 2 and r.data == saved["data"][2] and _same(_host(r.state), saved["states"][2])
  lines = [ln for ln in capsys.readouterr().out.splitlines() if "is unusable" in ln]
  assert len(lines) == 1 and "checkpoint step 3" in lines[0] and f"{root / '3' / 'data'} differs" in lines[0]
  assert not (root / "3").exists() and len(list((tmp_path / "checkpoints.corrupt").iterdir())) == 1


def test_a_checkpoint_without_data_digests_is_unusable(saved, tmp_path, capsys):
  """Every checkpoint maxlm writes holds the sha256 of its data and config items; one without them (damaged,
  or of an unreleased earlier format) is moved aside and the previous one is used."""
  root = _copy(saved, tmp_path)
  f = root / "3" / "meta" / "metadata"
  meta = json.loads(f.read_text())
  del meta["digests"]
  f.write_text(json.dumps(meta))
  manifest = root / "3" / "maxlm_files.json"  # keep the size manifest true to the edited file
  files = json.loads(manifest.read_text())
  files["files"]["meta/metadata"] = f.stat().st_size
  manifest.write_text(json.dumps(files))
  r, _ = _restore(root, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.step == 2 and "has no digests of the data and config items" in capsys.readouterr().out


def test_garbled_metadata_falls_back(saved, tmp_path):
  root = _copy(saved, tmp_path)
  (root / "3" / "meta" / "metadata").write_text("{not json")
  r, _ = _restore(root, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.step == 2


def test_no_usable_checkpoint_names_the_files(saved, tmp_path):
  root = _copy(saved, tmp_path)
  bad = [_largest_file(root / "3"), _largest_file(root / "2", "state")]
  for f in bad:
    os.truncate(f, 7)
  with pytest.raises(CheckpointError) as e:
    _restore(root, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  msg = str(e.value)
  assert "no usable checkpoint" in msg and "\n" not in msg
  assert all(str(f) in msg for f in bad)
  assert (root / "3").exists() and (root / "2").exists()  # nothing moved when nothing is usable


def test_other_model_is_a_clear_error_not_corruption(saved, tmp_path):
  root = _copy(saved, tmp_path)
  with pytest.raises(CheckpointError, match=r"does not fit this model.*model\.d_model: 64 -> 32"):
    _restore(root, "model.d_model=32")
  assert sorted(p.name for p in root.iterdir()) == ["2", "3"]


def test_non_finite_state_is_never_saved(saved, tmp_path):
  cfg, t = saved["cfg"], saved["trainer"]
  ckpt = Checkpointer(tmp_path / "c", CheckpointConfig(enabled=True))
  ckpt.save(1, t.state, t.train_data.get_state(), to_dict(cfg))
  ckpt.wait()
  nan_first = lambda x: x.at[(0,) * x.ndim].set(np.nan)
  bad = t.state.replace(params=jax.tree_util.tree_map(nan_first, t.state.params))
  with pytest.raises(CheckpointError, match=r"refusing to save checkpoint step 2: non-finite.*step 1"):
    ckpt.save(2, bad, t.train_data.get_state(), to_dict(cfg))
  ckpt.close()
  assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["1"]


def test_failed_save_reports_and_keeps_earlier(saved, tmp_path):
  cfg, t = saved["cfg"], saved["trainer"]
  ckpt = Checkpointer(tmp_path / "c", CheckpointConfig(enabled=True, keep=1))
  ckpt.save(1, t.state, t.train_data.get_state(), to_dict(cfg))
  ckpt.wait()
  # the file-size limit makes every write past 64 KiB fail (EFBIG), like a full disk (root ignores chmod)
  old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
  old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (65536, old_limit[1]))
  try:
    with pytest.raises(CheckpointError) as e:
      ckpt.save(2, t.state, t.train_data.get_state(), to_dict(cfg))
      ckpt.wait()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    signal.signal(signal.SIGXFSZ, old_handler)
  msg = str(e.value)
  assert "saving checkpoint step 2" in msg and "File too large" in msg and "latest: step 1" in msg, msg
  assert "\n" not in msg
  ckpt.close()
  r, _ = _restore(tmp_path / "c", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.step == 1


def test_retention_keeps_last_k_and_every_mth(saved, tmp_path):
  cfg, t = saved["cfg"], saved["trainer"]
  ckpt = Checkpointer(tmp_path / "c", CheckpointConfig(enabled=True, keep=2, keep_period=3, async_save=False))
  for step in range(1, 8):
    ckpt.save(step, t.state, t.train_data.get_state(), to_dict(cfg))
  ckpt.close()
  assert sorted(int(p.name) for p in (tmp_path / "c").iterdir()) == [3, 6, 7]


def test_load_params_from_step_or_run_directory(saved, tmp_path):
  _, target, _ = _target("mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1")
  target = target.params
  n = len(jax.tree_util.tree_leaves(target))
  for path, step in ((saved["root"] / "2", 2), (saved["root"], 3)):
    params = load_params(str(path), target)
    assert _same(_host(params), saved["states"][step][1:1 + n])  # TrainState leaves: step, params, ...
  with pytest.raises(CheckpointError, match="does not fit this model"):
    load_params(str(saved["root"]), _target("model.d_model=32")[1].params)
  with pytest.raises(CheckpointError, match="no such file"):
    load_params(str(tmp_path / "nope"), target)


def test_trainer_start_loads_params_only_or_resumes(saved, tmp_path, capsys):
  t, live = saved["trainer"], saved["trainer"].state
  mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"output_dir={tmp_path}", "run_name=r"]
  n = len(jax.tree_util.tree_leaves(live.params))
  try:
    t.state = live.replace(step=live.step * 0, params=jax.tree_util.tree_map(lambda x: x * 0, live.params))
    cfg = load_config(TINY + mesh + ["checkpoint.enabled=false", f"checkpoint.load_params={saved['root'] / '2'}"])
    assert _start(t, cfg) is None  # checkpointing disabled: nothing to resume, params loaded
    assert _same(_host(t.state.params), saved["states"][2][1:1 + n]) and int(t.state.step) == 0
    assert _same(_host(t.state.opt_state), _host(live.opt_state))  # untouched
    shutil.copytree(saved["root"], tmp_path / "r" / "checkpoints")
    cfg = load_config(TINY + mesh + ["checkpoint.enabled=true",
                                     f"checkpoint.load_params={saved['root'] / '2'}"])
    _start(t, cfg).close()  # resuming wins over load_params
    assert _same(_host(t.state), saved["states"][3]) and t.train_data.get_state() == saved["data"][3]
    out = capsys.readouterr().out
    assert "resumed from checkpoint step 3" in out and "ignoring checkpoint.load_params" in out
  finally:
    t.state = live


# --- the data position: one state per stream (global batch row), any process count ------------------------


def _rewrite_data(root: Path, step: int, data: dict) -> None:
  """Replace checkpoint `step`'s data item by `data`, keeping its sha256 in `meta` and the size manifest
  true (as a run that saved `data` would have written them)."""
  d = root / str(step)
  (d / "data" / "metadata").write_text(json.dumps(data))
  meta = json.loads((d / "meta" / "metadata").read_text())
  meta["digests"]["data"] = json_digest(data)
  (d / "meta" / "metadata").write_text(json.dumps(meta))
  manifest = json.loads((d / "maxlm_files.json").read_text())
  for f in ("data/metadata", "meta/metadata"):
    manifest["files"][f] = (d / f).stat().st_size
  (d / "maxlm_files.json").write_text(json.dumps(manifest))


def test_data_item_holds_every_stream(saved):
  """The saved data item is keyed by stream (row of the global batch of 8), not by process."""
  data = json.loads((saved["root"] / "3" / "data" / "metadata").read_text())
  assert data == {"process_count": 1, **saved["data"][3]}
  assert data["streams"] == 8 and data["batches"] == 3
  assert sorted(data["rows"], key=int) == [str(r) for r in range(8)]
  assert all(s == {"next_index": 3} for s in data["rows"].values())  # synthetic rows: the step


def test_position_of_two_processes_restores_in_one(saved, tmp_path):
  """A checkpoint whose data item a 2-process run saved (both processes' stream states merged) restores its
  data position into this 1-process run: the batches continue those of an uninterrupted 1-process run."""
  cfg = DataConfig(seq_len=32, global_batch_size=8, packing_bins=4)  # the embedded corpus
  whole = [next(it) for it in [make_train_iterator(cfg, 8192)] for _ in range(9)]
  two = [make_train_iterator(cfg, 8192, p, 2) for p in range(2)]
  for _ in range(6):
    for it in two:
      next(it)
  root = _copy(saved, tmp_path)
  _rewrite_data(root, 3, {"process_count": 2, **merge_states([it.get_state() for it in two])})
  r, _ = _restore(root, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  assert r.step == 3 and _same(_host(r.state), saved["states"][3])
  one = make_train_iterator(cfg, 8192)
  one.set_state(r.data)
  for want in whole[6:]:
    got = next(one)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_reason_keeps_the_os_error_when_a_long_message_is_cut():
  # a TensorStore-like chain: Orbax's wrapper around an OSError whose errno text sits mid-message,
  # followed by enough detail that the line is cut to its first 150 and last 250 characters
  middle = "Error writing local file: [OS error os_error_code=27 File too large] " + "x" * 300
  try:
    try:
      raise OSError(f"head {'h' * 200} {middle} {'tail ' * 60}")
    except OSError as inner:
      raise ValueError("orbax wrapper") from inner
  except ValueError as e:
    text = reason(e)
  assert text.startswith("OSError: head") and " ... " in text and "\n" not in text
  assert os.strerror(27) in text, text  # the OS's own words for errno 27 (EFBIG) survive the cut
  short = reason(OSError("disk quota exceeded"))
  assert short == "OSError: disk quota exceeded"
