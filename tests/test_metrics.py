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
