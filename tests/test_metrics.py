"""Throughput accounting and the metric sinks."""

import json

import pytest

from maxlm.metrics import MetricsWriter, device_peak_flops, progress_line, throughput


def test_peaks_and_mfu():
  assert device_peak_flops("NVIDIA H200") == device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert device_peak_flops("cpu") is None
  t = throughput(tokens=65536, flops=577e12, seconds=1.0, n_devices=1, peak=989e12)
  assert t["tokens_per_sec"] == 65536 and t["tflops_per_device"] == pytest.approx(577.0)
  assert t["mfu"] == pytest.approx(577 / 989)
  assert throughput(1, 8e12, 1.0, 8, None)["mfu"] is None and throughput(1, 8e12, 1.0, 8, None)[
      "tflops_per_device"] == pytest.approx(1.0)


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
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  w = MetricsWriter(tmp_path)  # an attempt killed before its first checkpoint
  for step in (1, 2, 3, 4):
    w.write(step, {"loss": 10.0 + step})
  w.close()
  w = MetricsWriter(tmp_path, start_step=0)  # the rerun starts again from step 0
  for step in (1, 2):
    w.write(step, {"loss": 1.0 * step})
  w.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert rows == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
  acc = EventAccumulator(str(tmp_path / "tensorboard"))
  acc.Reload()
  assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0)]


def test_every_logged_step_reaches_tensorboard_within_seconds(tmp_path):
  """A killed run (never closed) keeps what it logged: events are on disk within a few seconds."""
  import time

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  w = MetricsWriter(tmp_path)
  w.write(5, {"loss": 3.0, "mfu": None})
  deadline, got = time.monotonic() + 5.0, []
  while not got and time.monotonic() < deadline:
    time.sleep(0.2)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("loss")] if "loss" in acc.Tags()["scalars"] else []
  w.close()
  assert got == [(5, 3.0)]


def test_progress_line_with_time_memory_and_saves():
  line = progress_line(50, 600, {"loss": 5.75, "learning_rate": 3e-3, "grad_norm": 0.4, "tokens_per_sec": 6100.0,
                                 "tflops_per_device": 0.01, "mfu": None, "peak_memory_gb": 48.9, "save_s": 1.25,
                                 "elapsed_s": 83.0, "eta_s": 1000.0, "nonfinite_steps": 2}, flops_known=False)
  assert line == ("step 50/600 | loss 5.7500 | lr 3.00e-03 | gnorm 0.400 | 6.1k tok/s | TFLOP/s n/a | MFU n/a | "
                  "mem 48.9 GB | save 1.2 s | skipped 2 | 1:23 elapsed, ETA 16:40")
