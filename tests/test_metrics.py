"""Throughput accounting and the metric sinks."""

import io
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxlm.metrics import MetricsWriter, device_peak_flops, duration, echo, progress_line, throughput

ROOT = Path(__file__).resolve().parent.parent

F64 = 2.0 ** -53  # float64 unit roundoff


def tensorboard_scalars(run_dir, tag="loss"):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(run_dir / "tensorboard"))
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def age_event_files(run_dir):
  """Give the event files written so far an older timestamp, as an attempt that died earlier has (a
  writer opened within the same second reuses the name and would overwrite them: no TensorBoard
  purge would be needed then)."""
  for f in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
    parts = f.name.split(".")
    parts[3] = "1000000000"  # events.out.tfevents.<unix seconds>.<host>
    f.rename(f.with_name(".".join(parts)))


def test_peaks_and_mfu():
  assert device_peak_flops("NVIDIA H200") == device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert device_peak_flops("cpu") is None
  # 2.5 s on 4 devices: 65536 / 2.5 = 26214.4 tok/s; 1.154e15 FLOPs / 2.5 s / 4 = 115.4 TFLOP/s per device.
  # float64: at most 4 roundings in each quantity.
  t = throughput(tokens=65536, flops=1.154e15, seconds=2.5, n_devices=4, peak=989e12)
  assert t["tokens_per_sec"] == pytest.approx(26214.4, rel=4 * F64, abs=0)
  assert t["tflops_per_device"] == pytest.approx(115.4, rel=4 * F64, abs=0)
  assert t["mfu"] == pytest.approx(115.4 / 989, rel=8 * F64, abs=0)
  cpu = throughput(1, 8e12, 2.0, 8, None)
  assert cpu["mfu"] is None and cpu["tflops_per_device"] == pytest.approx(0.5, rel=4 * F64, abs=0)


def test_writer_appends_and_a_resume_drops_rows_after_its_step(tmp_path):
  w = MetricsWriter(tmp_path)
  for step in (10, 20, 30):
    w.write(step, {"loss": 1.0 / step, "mfu": None})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 40, "lo')  # a row cut short by kill -9
  w = MetricsWriter(tmp_path, start_step=20)  # resumed from the step-20 checkpoint
  w.write(30, {"loss": 0.5})
  w.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [10, 20, 30] and rows[-1]["loss"] == 0.5 and rows[0]["mfu"] is None
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_progress_line():
  line = progress_line(5, 10, {"loss": 2.0, "learning_rate": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 2000.0,
                               "tflops_per_device": 1.5, "mfu": 0.25, "eval_loss": 2.5})
  assert line == "step 5/10 | loss 2.0000 | eval 2.5000 | lr 1.00e-03 | gnorm 0.500 | 2.0k tok/s | " \
                 "1.5 TFLOP/s/dev | MFU 25.0%"


def test_a_restart_from_step_0_drops_the_dead_attempts_rows_in_both_sinks(tmp_path):
  w = MetricsWriter(tmp_path)  # an attempt killed before its first checkpoint
  for step in (1, 2, 3, 4):
    w.write(step, {"loss": 10.0 + step})
  w.close()
  age_event_files(tmp_path)
  w = MetricsWriter(tmp_path)  # the rerun starts again from step 0 (the default start)
  for step in (1, 2):
    w.write(step, {"loss": 1.0 * step})
  w.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert rows == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
  assert tensorboard_scalars(tmp_path) == [(1, 1.0), (2, 2.0)]


def test_a_resume_replaces_the_steps_logged_after_its_checkpoint_in_tensorboard(tmp_path):
  """Logged every step, checkpointed at 20, killed after 22: the resumed run logs 21 and 22 again, and
  TensorBoard shows each step once, with the resumed values (19 and 20 are not logged again)."""
  w = MetricsWriter(tmp_path)
  for step in (19, 20, 21, 22):
    w.write(step, {"loss": float(step)})
  w.close()
  age_event_files(tmp_path)
  w = MetricsWriter(tmp_path, start_step=20)
  for step in (21, 22):
    w.write(step, {"loss": step + 0.5})
  w.close()
  assert tensorboard_scalars(tmp_path) == [(19, 19.0), (20, 20.0), (21, 21.5), (22, 22.5)]


def test_every_logged_row_is_on_disk_at_once(tmp_path):
  """A killed run (never closed) keeps every metrics.jsonl row it logged."""
  w = MetricsWriter(tmp_path, tensorboard=False)
  w.write(7, {"loss": 3.0})
  assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 7, "loss": 3.0}
  w.close()


def test_every_logged_step_reaches_tensorboard_within_seconds(tmp_path):
  """A killed run (never closed) keeps what it logged: events are on disk within a few seconds."""
  import time
  w = MetricsWriter(tmp_path)
  w.write(5, {"loss": 3.0, "mfu": None})
  deadline, got = time.monotonic() + 5.0, []
  while not got and time.monotonic() < deadline:
    time.sleep(0.2)
    got = tensorboard_scalars(tmp_path)
  w.close()
  assert got == [(5, 3.0)]


def test_nonfinite_values_are_logged_readably_and_only_tensorboardXs_warning_is_dropped(tmp_path, caplog):
  """NaN / Inf are not JSON: the row holds them as strings that float() reads back. maxlm reports
  non-finite steps itself, so tensorboardX's per-value warning is silenced, and nothing else."""
  with caplog.at_level(logging.WARNING):
    w = MetricsWriter(tmp_path)
    w.write(3, {"loss": math.nan, "grad_norm": math.inf})
    logging.getLogger("maxlm.test").warning("other warnings still show")
    w.close()
  row = json.loads((tmp_path / "metrics.jsonl").read_text())
  assert math.isnan(float(row["loss"])) and float(row["grad_norm"]) == math.inf
  assert [r.getMessage() for r in caplog.records] == ["other warnings still show"]
  assert math.isnan(tensorboard_scalars(tmp_path)[0][1])


def test_progress_line_with_time_memory_and_saves():
  line = progress_line(50, 600, {"loss": 5.75, "learning_rate": 3e-3, "grad_norm": 0.4, "tokens_per_sec": 6100.0,
                                 "tflops_per_device": 0.01, "mfu": None, "peak_memory_gb": 48.9, "save_s": 1.25,
                                 "elapsed_s": 83.0, "eta_s": 1000.0, "nonfinite_steps": 2}, flops_known=False)
  assert line == ("step 50/600 | loss 5.7500 | lr 3.00e-03 | gnorm 0.400 | 6.1k tok/s | TFLOP/s n/a | MFU n/a | "
                  "mem 48.9 GB | save 1.2 s | skipped 2 | 1:23 elapsed, ETA 16:40")


def test_progress_line_shows_no_eta_at_the_last_step_or_when_unknown():
  m = {"loss": 1.0, "learning_rate": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 64960.0, "tflops_per_device": 2.0,
       "mfu": None, "elapsed_s": 4000.0}
  head = "step {}/600 | loss 1.0000 | lr 1.00e-03 | gnorm 0.500 | 65.0k tok/s | 2.0 TFLOP/s/dev | MFU n/a | "
  assert progress_line(600, 600, {**m, "eta_s": 0.0}) == head.format(600) + "1:06:40 elapsed"
  assert progress_line(599, 600, m) == head.format(599) + "1:06:40 elapsed"


def test_progress_line_under_fp16_loss_scaling():
  """fp16: the loss scale, and the updates its overflows skipped once there are any."""
  m = {"loss": 1.0, "learning_rate": 1e-3, "grad_norm": 0.5, "loss_scale": 32768.0}
  head = "step 3/9 | loss 1.0000 | lr 1.00e-03 | gnorm 0.500 | MFU n/a | "
  assert progress_line(3, 9, {**m, "overflow_steps": 0}) == head + "scale 32768"
  assert progress_line(3, 9, {**m, "loss_scale": 0.5, "overflow_steps": 2}) == head + "scale 0.5, 2 overflow skips"
  assert progress_line(3, 9, {**m, "loss_scale": None}) == head.removesuffix(" | ")


def test_duration():
  cases = {0: "0:00", 0.4: "0:00", -3.0: "0:00", 59.6: "1:00", 1234.5: "20:34", 3599.4: "59:59",
           3600: "1:00:00", 5000: "1:23:20", 90061: "25:01:01"}
  assert {s: duration(s) for s in cases} == cases


def test_echo_reaches_a_piped_stdout_at_once(monkeypatch):
  """The progress line is visible at once also when stdout is a pipe or a file (block-buffered)."""
  raw = io.BytesIO()
  monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(raw, 1 << 16), encoding="utf-8"))
  echo("step 1/2 | loss 3.0000")
  assert raw.getvalue() == b"step 1/2 | loss 3.0000\n"


def test_tensorboardx_is_imported_without_torch(tmp_path):
  """tensorboardX tries `import torch` when imported (3.4 s on a machine with torch installed): maxlm.metrics
  imports it with torch blocked, and leaves torch importable afterwards. A stand-in `torch` package on the path
  records whether it was imported; tensorboard events are still written."""
  fake = tmp_path / "fake" / "torch"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("import os\nopen(os.environ['TORCH_MARK'], 'a').write('imported\\n')\n")
  mark = tmp_path / "mark"
  (tmp_path / "run").mkdir()
  code = ("import sys; import maxlm.metrics as m; assert 'torch' not in sys.modules, 'torch imported'; "
          f"w = m.MetricsWriter({str(tmp_path / 'run')!r}, enabled=True); w.write(1, {{'loss': 1.0}}); w.close(); "
          "import torch; print('after', 'torch' in sys.modules)")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), str(ROOT)]), "TORCH_MARK": str(mark)}
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip().endswith("after True")
  assert mark.read_text() == "imported\n"  # once: by the explicit import after maxlm.metrics, never by tensorboardX
  assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
