"""The profiling window: XProf trace files, cudaProfilerStart/Stop at the right steps, config checks."""

import jax
import jax.numpy as jnp
import pytest

from maxlm import profiling
from maxlm.config import ConfigError, ProfileConfig, load_config
from maxlm.profiling import Profiler


class FakeCuda:
  """Stands in for the ctypes libcudart hook; records which step each call came at."""

  def __init__(self, events: list):
    self.events = events

  def start(self):
    self.events.append("cudaProfilerStart")

  def stop(self):
    self.events.append("cudaProfilerStop")


def traces(run_dir):
  return sorted((run_dir / "profile").glob("plugins/profile/*/*.xplane.pb"))


def run_steps(profiler, steps, events, after_each=None):
  """A stand-in training loop: a jitted step per iteration, wrapped like maxlm.trainer does it."""
  f = jax.jit(lambda x: x @ x.T)
  x = jnp.ones((64, 64))
  for n in steps:
    with profiler.step(n):
      events.append(f"dispatch {n}")
      y = f(x)
    profiler.step_done(n, y)
    if after_each:
      after_each(n)


def test_trace_appears_after_the_window_not_before(tmp_path):
  events, seen = [], {}
  p = Profiler(ProfileConfig(start_step=3, num_steps=2), tmp_path, is_main=True, cuda=FakeCuda(events),
               echo=events.append)
  run_steps(p, range(1, 7), events, after_each=lambda n: seen.setdefault(n, len(traces(tmp_path))))
  assert seen == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}  # written when step 4 (the window's last) is done
  calls = [e for e in events if not e.startswith("maxlm:")]
  assert calls == ["dispatch 1", "dispatch 2", "cudaProfilerStart", "dispatch 3", "dispatch 4",
                   "cudaProfilerStop", "dispatch 5", "dispatch 6"]
  data = traces(tmp_path)[0].read_bytes()
  assert profiling.STEP_ANNOTATION.encode() in data  # the step ranges are in the trace
  assert any(e.startswith("maxlm: profiled steps 3-4") for e in events)


def test_only_process_0_writes_the_trace_but_every_process_brackets_nsys(tmp_path):
  events = []
  p = Profiler(ProfileConfig(start_step=1, num_steps=1), tmp_path, is_main=False, cuda=FakeCuda(events),
               echo=events.append)
  run_steps(p, range(1, 3), events)
  assert not (tmp_path / "profile").exists()
  assert events == ["cudaProfilerStart", "dispatch 1", "cudaProfilerStop", "dispatch 2"]  # and no log lines


def test_xprof_off_keeps_the_cuda_window(tmp_path):
  events = []
  p = Profiler(ProfileConfig(start_step=2, num_steps=1, xprof=False), tmp_path, True, FakeCuda(events), lambda _: None)
  run_steps(p, range(1, 4), events)
  assert not (tmp_path / "profile").exists()
  assert events == ["dispatch 1", "cudaProfilerStart", "dispatch 2", "cudaProfilerStop", "dispatch 3"]


def test_a_run_that_stops_inside_the_window_still_writes_it(tmp_path):
  events = []
  p = Profiler(ProfileConfig(start_step=2, num_steps=5), tmp_path, True, FakeCuda(events), events.append)
  run_steps(p, range(1, 4), events)  # preempted after step 3
  assert traces(tmp_path) == []
  p.close()
  assert len(traces(tmp_path)) == 1 and events.count("cudaProfilerStop") == 1
  assert events[-1].startswith("maxlm: profiled steps from 2 until the run stopped")
  p.close()  # idempotent
  assert events.count("cudaProfilerStop") == 1


def test_resumed_inside_or_after_the_window(tmp_path):
  events = []
  p = Profiler(ProfileConfig(start_step=3, num_steps=3), tmp_path / "a", True, FakeCuda(events), events.append)
  run_steps(p, range(5, 8), events)  # resumed at step 5: steps 5 of 3-5 profiled
  assert [e for e in events if not e.startswith("maxlm:")][:3] == ["cudaProfilerStart", "dispatch 5",
                                                                   "cudaProfilerStop"]
  events.clear()
  p = Profiler(ProfileConfig(start_step=3, num_steps=3), tmp_path / "b", True, FakeCuda(events), events.append)
  run_steps(p, range(7, 9), events)
  assert "cudaProfilerStart" not in events and not (tmp_path / "b").exists()
  assert "before this run's first step 7" in events[0]


def test_disabled_by_default(tmp_path):
  assert ProfileConfig().start_step == 0
  events = []
  p = Profiler(ProfileConfig(), tmp_path, True, FakeCuda(events), events.append)
  run_steps(p, range(1, 4), events)
  assert events == ["dispatch 1", "dispatch 2", "dispatch 3"] and not (tmp_path / "profile").exists()


def test_cuda_hook_does_nothing_without_a_gpu():
  api = profiling.CudaProfilerApi()  # CPU backend: no library loaded, calls are no-ops
  assert api._lib is None
  api.start()
  api.stop()


@pytest.mark.parametrize("args, window", [(["profile.start_step=9", "profile.num_steps=3"], "9-11"),
                                          (["profile.start_step=11"], "11-13")])
def test_window_outside_the_run_is_a_config_error(args, window):
  with pytest.raises(ConfigError, match=f"profile window steps {window} .* ends after train.steps=10"):
    load_config(["train.steps=10", *args])
  load_config(["train.steps=10", "profile.start_step=8", "profile.num_steps=3"])  # ends at step 10: fine
  with pytest.raises(ConfigError, match="profile.num_steps"):
    load_config(["profile.start_step=1", "profile.num_steps=0"])


def test_bad_window_at_the_command_line(tmp_path, capsys):
  from maxlm.cli.train import main
  assert main([f"output_dir={tmp_path}", "train.steps=5", "profile.start_step=5", "profile.num_steps=2"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("maxlm: error: profile window steps 5-6")
  assert list(tmp_path.iterdir()) == []


def test_trainer_profiles_the_configured_steps(tmp_path, monkeypatch):
  """A real run: the cudaProfiler calls fall between the right progress lines; the trace is in the run dir."""
  from maxlm import trainer as trainer_lib
  from maxlm.checkpoint import Preemption
  from maxlm.loop import services

  events = []
  monkeypatch.setattr(profiling, "CudaProfilerApi", lambda: FakeCuda(events))
  monkeypatch.setattr(services, "echo", events.append)  # the progress lines (the profiler's own `echo` too)
  # A tiny model: only the order of the profiler calls and the trace file matter here.
  cfg = load_config(["model.backend=flax", "train.steps=4", "train.log_every=1", "train.eval_every=0",
                     "data.type=synthetic", "profile.start_step=2", "profile.num_steps=2",
                     "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
                     "model.ffn_dim=64", "model.n_layers=1", "model.vocab_size=128", "model.remat=none",
                     "data.seq_len=16", "data.global_batch_size=8", f"output_dir={tmp_path}", "run_name=r"])
  preemption = Preemption()
  try:
    assert trainer_lib.train(cfg, preemption) == trainer_lib.RunEnd(preempted=False)
  finally:
    preemption.close()
  order = [e.split(" |")[0] for e in events if e.startswith(("step ", "cudaProfiler"))]
  assert order == ["step 1/4", "cudaProfilerStart", "step 2/4", "cudaProfilerStop", "step 3/4", "step 4/4"]
  assert len(traces(tmp_path / "r")) == 1


@pytest.mark.gpu
def test_gpu_window_with_the_real_cuda_profiler_api(tmp_path):
  """On the GPU: libcudart is found and answers, and the XProf trace holds the GPU's activity."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  from maxlm import trainer as trainer_lib
  from maxlm.checkpoint import Preemption

  api = profiling.CudaProfilerApi()
  assert api._lib is not None
  assert api._lib.cudaProfilerStart() == 0 and api._lib.cudaProfilerStop() == 0  # cudaSuccess
  cfg = load_config(["model.backend=te", "train.steps=4", "train.log_every=1", "train.eval_every=0",
                     "data.type=synthetic", "profile.start_step=2", "profile.num_steps=2",
                     f"output_dir={tmp_path}", "run_name=r"])
  preemption = Preemption()
  try:
    assert trainer_lib.train(cfg, preemption) == trainer_lib.RunEnd(preempted=False)
  finally:
    preemption.close()
  (trace,) = traces(tmp_path / "r")
  assert b"/device:GPU:0" in trace.read_bytes()
