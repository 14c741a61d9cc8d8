"""`python -m maxlm.train --dry-run`: numbers checked against counts written out here from the published
shapes, memory per device from the sharding rules by hand, no parameter-sized allocation, one-line errors."""

import json
import os
import subprocess
import sys

import jax
import pytest

from maxlm.plan import fit as plan_fit
from maxlm.plan import target as plan_target
from maxlm.cli.dryrun import FLAGS, plan
from maxlm.cli.grammar import SIZING, parse_options
from maxlm.cli.train import main
from maxlm.config import load_config
from maxlm.layers import RECIPES
from maxlm.model import count_params
from maxlm.tables import PRECISIONS

# Llama 3 8B: d=4096, 32 layers, 32 heads / 8 kv heads of 128, ffn 14336, vocab 128256, untied.
L8_LAYER = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336  # qkv, out, SwiGLU (3 matrices)
L8_NORMS = (2 * 32 + 1) * 4096  # two RMSNorm scales per layer + the final one
L8_EMBED = 128256 * 4096
L8_TOTAL = 32 * L8_LAYER + L8_NORMS + 2 * L8_EMBED  # embedding + LM head
# Llama 3 70B: d=8192, 80 layers, 64 heads / 8 kv heads of 128, ffn 28672.
L70_TOTAL = (80 * (8192 * (64 + 16) * 128 + 64 * 128 * 8192 + 3 * 8192 * 28672) + 161 * 8192
             + 2 * 128256 * 8192)


def dry(capsys, *args):
  code = main(["--dry-run", *args])
  out = capsys.readouterr()
  return code, out.out, out.err


def test_llama8b_counts_flops_and_memory(capsys):
  assert L8_TOTAL == 8_030_261_248  # the published 8.03B
  code, out, err = dry(capsys, "--json", "config=llama8b", "--devices", "8")
  assert code == 0 and err == ""
  p = json.loads(out)
  assert p["params"]["total"] == L8_TOTAL
  assert p["params"]["non_embedding"] == L8_TOTAL - L8_EMBED == 7_504_924_672
  assert (p["mesh"]["data"], p["mesh"]["fsdp"], p["mesh"]["tensor"]) == (1, 8, 1)
  # README's MFU convention: 6 * N * tokens + 6 * B * S^2 * (heads * head_dim) * layers, N = every matmul
  # weight (LM head too, not the embedding lookup); llama8b.yml: batch 8 x 8192.
  b, s = 8, 8192
  n_matmul = 32 * L8_LAYER + 4096 * 128256
  flops = 6 * n_matmul * b * s + 6 * b * s**2 * 32 * 128 * 32
  assert p["flops"]["per_step"] == flops and p["flops"]["per_token"] == flops / (b * s)
  # FSDP over 8: every weight matrix is split 8 ways on its `embed` dimension; RMSNorm scales are replicated.
  params = 4 * (L8_TOTAL - L8_NORMS) // 8 + 4 * L8_NORMS
  mem = p["memory"]["per_device_bytes"]
  assert mem["params"] == params and mem["gradients"] == params
  assert mem["optimizer"] == 2 * params + 2 * 4  # Adam mu, nu like the params + two int32 step counts
  assert mem["fp8_meta"] == 0
  # one row per device, fp32 + bf16 copy, of the 1024 positions llama8b.yml's model.loss_chunk holds at once
  assert mem["logits"] == (8 // 8) * 1024 * 128256 * (4 + 2)
  assert mem["head"] == (8 // 8) * 1024 * 128256 * 2  # the LM head's bf16 output alone: less than the gradients
  assert mem["lower_bound"] == params + (2 * params + 8) + params  # params, moments, gradients
  assert mem["total"] == mem["lower_bound"] + mem["logits"] + mem["activations"] and mem["activations"] > 0
  assert p["data"]["source"] == "random tokens" and p["data"]["tokens_total"] == 100000 * b * s


def test_text_report_and_tensor_parallel(capsys):
  code, out, _ = dry(capsys, "config=llama8b", "mesh.fsdp=4", "mesh.tensor=2", "--devices=8",
                     "--device-memory-gb=141")
  assert code == 0
  assert "params  8,030,261,248 total, 7,504,924,672 without the token embedding" in out
  assert "data 1 x fsdp 4 x context 1 x tensor 2" in out and "141" not in out.split("device")[0]
  assert "131.3 GiB   fits" in out  # 141e9 B; the estimate (~29 GiB) fits
  _, out, _ = dry(capsys, "config=llama8b", "model.loss_chunk=0", "--devices=8", "--device-memory-gb=15")
  assert "does NOT fit" in out  # lower bound 15.0 GiB (params, moments, gradients) > 14.0 GiB



def test_no_gpu_verdict_points_to_sizing_for_gpus(capsys, monkeypatch):
  """On a machine without a GPU the dry run sizes against its own memory: a config too big for it says where to
  size it for GPUs instead (a laptop user checking the 8B for an H200 got only 'does NOT fit'). Not with --devices,
  and not when it fits."""
  code, out, _ = dry(capsys, "config=llama8b")
  assert code == 0 and "does NOT fit" in out
  assert out.rstrip().splitlines()[-1] == (
      "note    no GPU here: the verdict is for this machine's memory. For GPUs: `maxlm plan config=... --devices N "
      "--simulate` (what the planner would choose on N H200s), or this dry run with --devices N --device-memory-gb G")
  _, out, _ = dry(capsys, "config=llama8b", "--devices=1", "--device-memory-gb=20")
  assert "does NOT fit" in out and "no GPU here" not in out
  _, out, _ = dry(capsys, "config=default.yml")
  assert "   fits" in out and "no GPU here" not in out and "warning" not in out


@pytest.mark.parametrize("ram, verdict", [(2**40, "fits"), (2**20, "does NOT fit (the run stops at start)")])
def test_what_the_offload_pins_against_this_hosts_ram(capsys, monkeypatch, ram, verdict):
  """The tiny config with optim.offload=host_params on "GPUs" (the test switch) of a host with `ram`: the pinned
  bytes are the float32 parameters and both float32 moments, 12 bytes a parameter over the 8 devices (fsdp),
  twice on jax 0.10; the RAM is the host's over its 8 devices. plan.mode=off: the config as written."""
  monkeypatch.setenv("MAXLM_TEST_GPU_PATHS", "1")
  monkeypatch.setenv("MAXLM_TEST_DEVICE_BYTES", str(2**34))
  monkeypatch.setenv("MAXLM_TEST_HOST_BYTES", str(ram))
  args = ["config=tiny.yml", "model.backend=flax", "optim.offload=host_params", "plan.mode=off"]
  code, out, _ = dry(capsys, *args, "--json")
  mem = json.loads(out)["memory"]
  copies = 2 if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11) else 1
  n = count_params(load_config(args).model)["total"]
  assert code == 0 and mem["host_ram_per_device"] == ram // 8
  assert mem["host_pinned"] == n * 12 // 8 * copies and mem["host_copies"] == copies
  assert mem["host_fits"] == (verdict == "fits")
  _, out, _ = dry(capsys, *args)
  line = next(ln for ln in out.splitlines() if ln.startswith("  host RAM"))
  assert line.endswith(f", at most 90% may be: {verdict}"), line


def test_a_trial_shorter_than_the_warmup_is_warned(capsys):
  _, out, _ = dry(capsys, "config=llama8b", "train.steps=30", "--devices=8")
  assert "\nwarning optim.warmup_steps=2000 is not below train.steps=30: the learning rate ends at 4.35e-06" in out
  _, out, _ = dry(capsys, "--json", "config=llama8b", "train.steps=30", "--devices=8")
  assert [w[:40] for w in json.loads(out)["warnings"]] == ["optim.warmup_steps=2000 is not below tra"]

@pytest.mark.te
def test_fp8_metadata_from_the_state_and_from_the_formula(fake_fp8_gpu):
  # Tiny (2 layers): 4 GEMMs per layer x (input, kernel, grad) x (amax history 1024 + scale) x 4 B.
  expected = 2 * 4 * 3 * (1024 + 1) * 4
  cfg = load_config(["model.precision=fp8_delayed", "model.backend=te"])
  p = plan(cfg, 1)
  assert p["memory"]["per_device_bytes"]["fp8_meta"] == expected
  assert p["memory"]["fp8_meta_from"] == "the abstract state" and p["precision_here"]["ok"]


@pytest.mark.te
def test_fp8_sized_on_a_machine_without_fp8(capsys):
  code, out, _ = dry(capsys, "model.precision=fp8_delayed", "model.backend=te", "--json")
  p = json.loads(out)
  assert code == 0 and p["memory"]["per_device_bytes"]["fp8_meta"] == 2 * 4 * 3 * 1025 * 4
  assert p["memory"]["fp8_meta_from"] == "the formula in maxlm/plan/memory.py"
  anywhere = [n for n in PRECISIONS if n not in RECIPES]  # bf16 (and fp16): no TE recipe, any device
  assert p["precision_here"] == {"supported": anywhere, "ok": False}
  _, out, _ = dry(capsys, "model.precision=fp8_delayed", "model.backend=te")
  assert f"does not run on this machine (supported here: {', '.join(anywhere)})" in out


def test_llama70b_without_allocating(tmp_path):
  """70B in fp32 is 282 GB of parameters; the dry run's whole process must stay far below the smallest
  weight it would otherwise hold (the 4.2 GB embedding; any stacked layer weight is larger still)."""
  # The peak is VmHWM, the high-water mark of this process's own address space. getrusage's ru_maxrss survives
  # exec on Linux, so a child forked from a big pytest worker (seen: 2.1 GB) would report the worker's peak.
  code = ("import re, sys\nfrom maxlm.train import main\n"
          "rc = main(['--dry-run', '--json', 'config=llama70b', 'data.global_batch_size=64',"
          " '--devices', '64', '--nodes', '8'])\n"
          "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())\n"
          "print(int(hwm[1]) * 1024, file=sys.stderr)\nsys.exit(rc)\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                     timeout=300)
  assert r.returncode == 0, r.stderr
  p = json.loads(r.stdout)
  assert L70_TOTAL == p["params"]["total"] == 70_553_706_496
  # llama70b.yml shards over every device, across nodes too (dcn_fsdp=-1, dcn_data=1)
  assert (p["mesh"]["data"], p["mesh"]["fsdp"], p["mesh"]["inter_node"]) == (1, 64, [1, 1, 8, 1, 1, 1])
  peak_rss = int(r.stderr.strip().splitlines()[-1])
  assert peak_rss < 128256 * 8192 * 4 / 2  # half the embedding alone: no parameter was materialized
  assert list(tmp_path.iterdir()) == []  # nothing written


def test_llama70b_with_pipeline_stages_across_nodes(capsys):
  """mesh.dcn_pipeline=4 on 8 nodes of 8: 4 stages of 20 layers, FSDP over the 16 devices of each stage. The text
  names the axis and the schedule; a device holds its stage's FSDP shard of the layers."""
  args = ("config=llama70b", "--devices", "64", "--nodes", "8", "mesh.dcn_pipeline=4", "train.grad_accum=4",
          "model.scan_layers=true")  # the stages split the scanned stack (llama70b.yml unrolls it)
  code, out, _ = dry(capsys, "--json", *args)
  p = json.loads(out)
  assert code == 0 and (p["mesh"]["pipeline"], p["mesh"]["fsdp"], p["mesh"]["inter_node"]) == (4, 16, [4, 1, 2, 1, 1, 1])
  d, f, v, n = 8192, 28672, 128256, 80
  layer = d * (64 + 2 * 8) * 128 + 64 * 128 * d + 3 * d * f  # qkv, out, SwiGLU: over 4 stages x 16 fsdp
  # fp32: the layers' norms over the stages only; embedding and head over fsdp; the final norm whole
  assert p["memory"]["per_device_bytes"]["params"] == 4 * (n * layer // 64 + n * 2 * d // 4 + 2 * v * d // 16 + d)
  code, out, _ = dry(capsys, *args)
  assert code == 0 and "mesh    64 device(s) on 8 node(s): pipeline 4 x data 1 x fsdp 16 x context 1 x tensor 1" in out
  assert "; 4 stages of 20 layers over 4 micro-batches (GPipe), bubble 43% of a step" in out


def test_data_summary_from_names_and_metadata(tmp_path, capsys):
  (tmp_path / "a.txt").write_text("one\ntwo\n")
  (tmp_path / "b.txt").write_text("three\n")
  code, out, _ = dry(capsys, "--json", "data.type=text", f"data.paths={tmp_path}/*.txt")
  d = json.loads(out)["data"]
  assert code == 0 and d["sources"] == [{"path": f"{tmp_path}/*.txt", "files": 2, "bytes": 14, "format": "text"}]
  shards = tmp_path / "prepared"
  shards.mkdir()
  (shards / "s0.arrayrecord").write_bytes(b"")  # never opened by the dry run
  (shards / "maxlm_data.json").write_text(json.dumps({
      "tokenizer": {"sha256": "0" * 64, "vocab_size": 8192}, "dtype": "uint16", "documents": 10,
      "tokens": 1024, "shards": [{"file": "s0.arrayrecord", "documents": 10, "tokens": 1024}]}))
  code, out, _ = dry(capsys, "--json", "data.type=arrayrecord", f"data.paths={shards}", "train.steps=4")
  d = json.loads(out)["data"]
  assert code == 0 and d["sources"][0]["tokens"] == 1024 and d["sources"][0]["documents"] == 10
  assert d["epochs"] == 4 * 8 * 128 / 1024  # steps x batch x seq_len over the corpus


@pytest.mark.parametrize("args, message", [
    (["config=llama8b", "--devices", "3"], "not divisible by the 3 data-parallel devices"),
    (["--devices=abc"], "argument --devices must be a positive number, got 'abc'"),
    (["--nodes"], "argument --nodes needs a value"),
    (["model.n_heads=5"], "model.n_heads (5) must be a multiple of model.n_kv_heads (2)"),
    (["data.type=text", "data.paths=nowhere.txt"], "data file 'nowhere.txt' not found"),
    (["config=llama8b", "--devices", "6", "--nodes", "4"], "6 devices do not split evenly over 4 nodes"),
    (["config=llama8b", "--devices", "24", "--nodes", "3", "mesh.dcn_pipeline=3", "mesh.dcn_data=1",
      "train.grad_accum=4"], "model.n_layers=32 does not split into the 3 pipeline stages of mesh.pipeline=1 x "
                             "mesh.dcn_pipeline=3"),
    (["model.backend=flax", "model.remat=recompute_norm_act"], "model.remat=recompute_norm_act needs model.backend=te"),
    (["config=llama8b", "data.seq_len=4098", "mesh.context=2", "--devices=8"],
     "data.seq_len=4098 is not divisible by 2 x the context-parallel degree 2 (mesh.context x mesh.dcn_context)"),
    (["config=llama8b", "mesh.context=3", "--devices=8"], "mesh.data=1 x mesh.fsdp=-1 x mesh.context=3"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
  monkeypatch.chdir(tmp_path)
  code, out, err = dry(capsys, *args)
  assert code == 2 and out == ""
  assert err.count("\n") == 1 and err.startswith("maxlm: error: ") and message in err
  assert list(tmp_path.iterdir()) == []


def test_context_axis_in_the_mesh_line(capsys):
  """Llama 3 8B at 131,072 tokens on 8 devices split 2 (fsdp) x 4 (context): the mesh line names the axis and
  the attention strategy, and the logits and activations per device are a quarter of the sequence's."""
  args = ["config=llama8b", "data.seq_len=131072", "--devices=8"]
  code, out, _ = dry(capsys, *args, "data.global_batch_size=2", "mesh.fsdp=2", "mesh.context=4")
  assert code == 0 and "data 1 x fsdp 2 x context 4 x tensor 1" in out
  assert "attention over the context axis: ring" in out  # 32768 tokens per device: auto picks the ring
  code, out, _ = dry(capsys, "--json", *args, "data.global_batch_size=2", "mesh.fsdp=2", "mesh.context=4",
                     "mesh.context_strategy=all_gather")
  cp = json.loads(out)
  assert code == 0 and cp["mesh"]["context"] == 4 and cp["mesh"]["context_strategy"] == "all_gather"
  # the same 8 devices all on fsdp, a row each: each device holds 131072 positions of a row, not a quarter
  code, out, _ = dry(capsys, "--json", *args, "data.global_batch_size=8")
  fsdp = json.loads(out)
  assert code == 0 and fsdp["mesh"]["fsdp"] == 8 and fsdp["mesh"]["context"] == 1
  cp_mem, fsdp_mem = cp["memory"]["per_device_bytes"], fsdp["memory"]["per_device_bytes"]
  assert cp_mem["activations"] * 4 == fsdp_mem["activations"]
  assert cp_mem["logits"] * 4 == fsdp_mem["logits"]


def test_flag_parsing():
  """The dry run's options through the one grammar (maxlm/cli/grammar.py): `--devices 16` and `--nodes=2` alike."""
  opts, rest = parse_options(["--dry-run", "--json", "config=x", "--devices", "16", "--nodes=2", "a.b=1",
                              "--device-memory-gb", "0.5"], FLAGS, SIZING)
  assert opts == {"dry_run": True, "json": True, "devices": 16, "nodes": 2, "device_memory_gb": 0.5}
  assert rest == ["config=x", "a.b=1"]


def test_mistral_window_counts_only_attended_pairs(capsys):
  # Mistral 7B v0.1: vocab 32000, window 4096 < seq_len 8192. Per row and head, causal attention with a
  # window W over S positions attends S*W - W^2/2 (query, key) pairs (S^2/2 without a window); each pair
  # costs 12 FLOPs per head dimension (QK^T and PV at 2 FLOPs each, x3 for forward + backward), which
  # without a window is the README's 6 * B * S^2 * heads * head_dim per layer.
  layer = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336
  total = 32 * layer + 65 * 4096 + 2 * 32000 * 4096
  b, s, w = 8, 8192, 4096
  flops = 6 * (32 * layer + 4096 * 32000) * b * s + 12 * b * (s * w - w * w / 2) * 32 * 128 * 32
  code, out, _ = dry(capsys, "--json", "config=mistral7b", "--devices", "8")
  p = json.loads(out)
  assert code == 0 and p["params"]["total"] == total == 7_241_732_096  # the published 7.24B
  assert p["flops"]["per_step"] == flops


def test_the_dry_run_prints_the_start_up_limits_the_planners_compiles_give(monkeypatch, capsys):
  """On a (faked) GPU the dry run plans as the run does; made-up compiles of 5 s and 7 s (the first too big, the
  second fitting): the first compile's limit is train.watchdog_first_step_s, the second's 10 x the 5 s before it
  (floor 1 s), by hand; the first step's limit at least train.watchdog_first_step_s."""
  def made_up(self, c):
    self.on_measure(self.clock.expect(c))
    self.clock.add(c, 5.0 if not self.clock.seen else 7.0)
    return {"device": self.usable + 1 if len(self.clock.seen) == 1 else self.usable // 2, "how": "measured"}
  monkeypatch.setattr(plan_target, "_local_memory", lambda dev: 2**30)
  monkeypatch.setattr(plan_fit, "gpu_here", lambda: True)
  monkeypatch.setattr(plan_target.Target, "measure", made_up)
  code = main(["--dry-run", "--json", "model.backend=flax", "data.type=synthetic", "data.global_batch_size=16",
                     "plan.levers=train.grad_accum", "plan.timed=0", "train.watchdog_factor=10",
                     "train.watchdog_floor_s=1", "train.watchdog_first_step_s=1800"])
  p = json.loads(capsys.readouterr().out)
  assert code == 0 and p["watchdog"]["plan_compiles_s"] == [1800, 50] and p["watchdog"]["first_step_s"] == 1800
