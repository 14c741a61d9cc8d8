"""Per-device memory estimate: every part checked against arithmetic written out here by hand."""

import dataclasses
import time

import pytest

from maxlm.config import ConfigError, load_config
from maxlm.plan.measure import measure
from maxlm.plan.memory import check_fits, estimate
from maxlm.tables import human_bytes

GiB = 2**30

# Tiny (the defaults): d=128, ffn=384, 4 heads / 2 kv heads of 32, vocab 8192, 2 layers, untied.
TINY_LAYER = 128 * (4 + 2 * 2) * 32 + 4 * 32 * 128 + 3 * 128 * 384  # qkv + out proj + SwiGLU = 196608
TINY_PARAMS = 2 * TINY_LAYER + (2 * 2 + 1) * 128 + 2 * 8192 * 128  # + norms + embedding + head = 2491008
# Llama 3 8B: d=4096, ffn=14336, 32 heads / 8 kv heads of 128, vocab 128256, 32 layers, untied.
L8_LAYER = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336  # 218103808
L8_PARAMS = 32 * L8_LAYER + 65 * 4096 + 2 * 128256 * 4096  # 8030261248 (the published 8.03B)
L8_LOGITS_ROW = 8192 * 128256 * (4 + 2)  # one row of [S, V] in fp32 for the loss + the bf16 copy
L8_HEAD_ROW = 8192 * 128256 * 2  # one row of the LM head's bf16 output alone


def with_(cfg, **sections):
  changed = {s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
  return dataclasses.replace(cfg, **changed)


def test_tiny_on_one_device():
  est = estimate(load_config([]), 1)
  assert TINY_PARAMS == 2491008
  assert est["params"] == 4 * TINY_PARAMS and est["gradients"] == 4 * TINY_PARAMS  # fp32
  assert est["optimizer"] == 2 * 4 * TINY_PARAMS  # Adam mu and nu in fp32
  assert est["logits"] == 8 * 128 * 8192 * (4 + 2)  # batch 8, seq 128, vocab 8192
  assert est["head"] == 8 * 128 * 8192 * 2  # the LM head's bf16 output: more than the gradients here
  # held at once: params + moments, and the larger of the gradients (16 * TINY_PARAMS / 4 = 10.0e6 B) and the
  # head's output (16.8e6 B); the total adds up every part
  assert est["lower_bound"] == 12 * TINY_PARAMS + 8 * 128 * 8192 * 2
  assert est["total"] == 16 * TINY_PARAMS + est["logits"] + est["activations"] and est["activations"] > 0


def test_llama8b_on_8_devices_fsdp():
  cfg = load_config(["config=llama8b", "model.loss_chunk=0"])  # mesh.fsdp=-1 -> 8; batch 8 -> 1 row per device;
  # the whole logits (the formula of an unchunked head; test_chunked_loss_holds_one_chunk_of_logits covers the chunk)
  est = estimate(cfg, 8)
  assert L8_PARAMS == 8030261248
  assert est["params"] == 4 * L8_PARAMS // 8 and est["optimizer"] == 8 * L8_PARAMS // 8
  assert est["logits"] == 1 * L8_LOGITS_ROW
  # gradients (4.0e9 B) outweigh one row's head output (2.1e9 B): params, moments and gradients, 14.96 GiB
  assert est["head"] == L8_HEAD_ROW and est["lower_bound"] == 16 * L8_PARAMS // 8
  check_fits(cfg, 8, 80 * 10**9)
  with pytest.raises(ConfigError, match="needs at least 15.0 GiB per device"):
    check_fits(cfg, 8, 14 * GiB)


def test_mesh_degrees_divide_the_right_parts():
  cfg = load_config(["config=llama8b", "model.loss_chunk=0", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
  est = estimate(cfg, 8)
  assert est["params"] == 4 * L8_PARAMS // (2 * 2)  # fsdp x tensor
  assert est["logits"] == (8 // (2 * 2)) * 8192 * (128256 // 2) * 6  # batch / (data x fsdp), vocab / tensor
  cfg = load_config(["config=llama8b", "mesh.fsdp=-1", "mesh.dcn_fsdp=2"])  # 2 nodes x 4 devices: fsdp 8
  assert estimate(cfg, 8, n_nodes=2)["params"] == 4 * L8_PARAMS // 8


def test_pipeline_stages_split_the_layer_stack_and_the_head_sees_the_whole_batch():
  """mesh.pipeline: the stack's parameters (layers, with their norms) are divided by the stages, the embedding,
  head and final norm are not; the LM head's logits cover every micro-batch at once (GPipe), their length split
  over the 4 stages (the logical axis `stage_length`)."""
  base = ["config=llama8b", "model.loss_chunk=0", "model.scan_layers=true", "train.grad_accum=4"]
  cfg = load_config([*base, "mesh.pipeline=4", "mesh.fsdp=2"])
  est = estimate(cfg, 8)
  stack = 32 * (L8_LAYER + 2 * 4096)
  assert est["params"] == 4 * ((L8_PARAMS - stack + stack // 4) // 2)  # fsdp 2; the stack also over 4 stages
  assert est["logits"] == (8 // 2) * L8_LOGITS_ROW // 4  # the whole batch of 8 over data x fsdp = 2; 8192 / 4 positions
  flat = estimate(load_config([*base, "mesh.fsdp=2", "mesh.data=4"]), 8)  # the same 8 devices without stages
  assert flat["logits"] == L8_LOGITS_ROW  # a micro-batch of 2 rows over 8 devices: 1 row (rounded up)
  assert flat["params"] == 4 * L8_PARAMS // 2


def test_dtypes_and_micro_batch():
  cfg = load_config(["train.grad_accum=4", "model.param_dtype=bfloat16", "model.dtype=float32"])
  est = estimate(cfg, 1)
  # moments in optim.mu_dtype / nu_dtype, float32 by default, whatever the params' dtype
  assert est["params"] == 2 * TINY_PARAMS and est["optimizer"] == 2 * 4 * TINY_PARAMS
  assert est["logits"] == (8 // 4) * 128 * 8192 * 4  # micro-batch of 2 rows; fp32 logits, no second copy


def test_activations_follow_the_remat_policy():
  acts = {r: estimate(load_config([f"model.remat={r}"]), 1) for r in
          ("full", "save_attn", "save_qkv_attn", "save_dots", "save_dots_attn", "none")}
  order = [acts[r]["activations"] for r in ("full", "save_attn", "save_qkv_attn", "none")]
  assert order == sorted(order) and len(set(order)) == 4
  assert acts["full"]["activations"] < acts["save_dots"]["activations"] < acts["save_dots_attn"]["activations"]
  assert len({a["lower_bound"] for a in acts.values()}) == 1  # the certain part has no guessed activations


def test_llama8b_refused_on_one_80gb_device_with_its_numbers():
  cfg = load_config(["config=llama8b", "model.loss_chunk=0"])
  # 4 B x 8030261248 = 29.9 GiB params, 59.8 GiB moments, 29.9 GiB gradients; the head's output 8 rows x 8192 x
  # 128256 x 2 B = 15.7 GiB, less than the gradients: 119.7 GiB; a device 80e9 B = 74.5 GiB.
  with pytest.raises(ConfigError) as e:
    check_fits(cfg, 1, 80 * 10**9)
  msg = str(e.value)
  assert "\n" not in msg
  assert ("model needs at least 119.7 GiB per device (params 29.9 GiB, optimizer 59.8 GiB, gradients 29.9 GiB or "
          "the LM head's output 15.7 GiB, whichever is larger) on 1 device(s) with mesh data 1 x fsdp 1 x context 1 x tensor 1, "
          "but a device has 74.5 GiB; reduce model.n_layers/d_model/vocab_size") in msg
  acc = load_config(["config=llama8b", "model.loss_chunk=0", "train.grad_accum=2"])  # 4 rows of head output
  with pytest.raises(ConfigError, match=r"at least 127\.5 GiB per device \(params 29\.9 GiB, optimizer 59\.8 GiB, "
                     r"the gradient sum 29\.9 GiB and the LM head's output 7\.8 GiB\)"):
    check_fits(acc, 1, 80 * 10**9)
  small = load_config(["config=llama8b", "model.n_layers=4", "data.global_batch_size=1"])
  check_fits(small, 1, 80 * 10**9)  # 16 B x 1.92B params = 30.8 GB + one row of logits 6.3 GB


@pytest.mark.parametrize("change,numbers", [
    # 10**8 layers: P = 1e8 x 196608 + (2e8 + 1) x 128 + 2 x 8192 x 128 = 19686402097280 params;
    # 4P = 71.6 TiB, 8P = 143.2 TiB, head output 8 x 128 x 8192 x 2 = 16 MiB < 4P: 16P = 286.5 TiB.
    ({"model": {"n_layers": 10**8}}, "at least 286.5 TiB per device (params 71.6 TiB, optimizer 143.2 TiB, "
                                     "gradients 71.6 TiB or the LM head's output 16.0 MiB, whichever is larger)"),
    # vocab 2**40: embedding + head 2 x 2**40 x 128 x 4 B = 1.0 PiB; head output 8 x 128 x 2**40 x 2 B = 2 PiB.
    ({"model": {"vocab_size": 2**40}}, "at least 5.0 PiB per device (params 1.0 PiB, optimizer 2.0 PiB, "
                                       "gradients 1.0 PiB or the LM head's output 2.0 PiB, whichever is larger)"),
    # seq_len 2**40: head output 8 x 2**40 x 8192 x 2 B = 128 PiB; params 4 x 2491008 B = 9.5 MiB.
    ({"data": {"seq_len": 2**40}}, "at least 128.0 PiB per device (params 9.5 MiB, optimizer 19.0 MiB, "
                                   "gradients 9.5 MiB or the LM head's output 128.0 PiB, whichever is larger)"),
])
def test_absurd_sizes_are_refused_at_once(change, numbers):
  cfg = with_(load_config([]), **change)
  start = time.perf_counter()
  for _ in range(1000):
    estimate(cfg, 1)
  # ~10 us a call here; 1 ms a call leaves 100x for a loaded machine, while any loop over the 1e8
  # layers or the 2**40 positions/tokens would take seconds per call.
  assert time.perf_counter() - start < 1.0
  with pytest.raises(ConfigError, match="model needs") as e:
    check_fits(cfg, 1, 24 * GiB)
  assert numbers in str(e.value) and "but a device has 24.0 GiB" in str(e.value)


def test_config_refuses_the_absurd_vocab_and_seq_len_itself():
  for arg in (f"model.vocab_size={2**40}", f"data.seq_len={2**40}"):
    with pytest.raises(ConfigError, match="must be in \\[1, 2\\*\\*31-1\\]"):
      load_config([arg])


def test_fp8_delayed_metadata():
  # Per quantized GEMM (qkv, out, MLP in, MLP out per layer) TE keeps an fp32 amax history and an fp32
  # scale for each of input, kernel and gradient: tiny (2 layers, history 1024) = 8 x 3 x 1025 x 4 B.
  est = estimate(load_config(["model.precision=fp8_delayed"]), 1)
  assert est["fp8_meta"] == 8 * 3 * 1025 * 4
  assert est["lower_bound"] == 12 * TINY_PARAMS + 8 * 128 * 8192 * 2 + 8 * 3 * 1025 * 4
  head = estimate(load_config(["model.precision=fp8_delayed", "model.fp8_lm_head=true"]), 8)
  assert head["fp8_meta"] == 9 * 3 * 1025 * 4  # + the LM head; replicated, so not divided by 8 devices
  for args in (["model.precision=fp8_current"], ["model.precision=mxfp8"], []):
    assert estimate(load_config(args), 1)["fp8_meta"] == 0


def test_chunked_loss_holds_one_chunk_of_logits():
  base = load_config([])
  est = estimate(with_(base, model={"loss_chunk": 32}), 1)
  assert est["logits"] == 8 * 32 * 8192 * (4 + 2)  # batch 8, 32 of the 128 positions, vocab 8192
  assert estimate(with_(base, model={"loss_chunk": 1000}), 1)["logits"] == 8 * 128 * 8192 * 6  # chunk > seq
  # a quantized LM head is chunked too (its FP8 GEMMs run in the chunk loop), and keeps no FP8 state then
  fp8_head = with_(base, model={"loss_chunk": 32, "precision": "fp8_delayed", "fp8_lm_head": True})
  assert estimate(fp8_head, 1)["logits"] == 8 * 32 * 8192 * 6
  assert estimate(fp8_head, 1)["fp8_meta"] == 8 * 3 * 1025 * 4  # the 8 GEMMs of the 2 layers only
  # fp16 computes in 2 bytes whatever model.dtype says
  fp16 = with_(base, model={"precision": "fp16", "dtype": "float32"})
  assert estimate(fp16, 1)["logits"] == 8 * 128 * 8192 * (4 + 2)


def test_optimizer_state_dtype_and_host_offload():
  """optim.mu_dtype=bfloat16: 2 + 4 bytes per parameter, with optim.nu_dtype=bfloat16 2 + 2; optim.offload=host:
  none of it on the
  device (lower_bound and total drop by it) and all of it in the `host` term. Llama 3 8B on one device: the
  issue's 29.9 GiB of fp32 params, 29.9 of grads and 59.8 of fp32 moments."""
  base = load_config(["config=llama8b", "mesh.fsdp=1"])
  est = estimate(base, 1)
  assert est["optimizer"] == 8 * L8_PARAMS and est["host"] == 0 and est["params"] == est["gradients"] == 4 * L8_PARAMS
  assert human_bytes(est["optimizer"]) == "59.8 GiB" and human_bytes(est["params"]) == "29.9 GiB"
  mu16 = estimate(with_(base, optim={"mu_dtype": "bfloat16"}), 1)
  assert mu16["optimizer"] == 6 * L8_PARAMS and mu16["lower_bound"] == est["lower_bound"] - 2 * L8_PARAMS
  bf16 = estimate(with_(base, optim={"mu_dtype": "bfloat16", "nu_dtype": "bfloat16"}), 1)
  assert bf16["optimizer"] == 4 * L8_PARAMS and bf16["host"] == 0
  assert bf16["lower_bound"] == est["lower_bound"] - 4 * L8_PARAMS
  for dtype, nbytes in (("float32", 8), ("bfloat16", 4)):
    off = estimate(with_(base, optim={"mu_dtype": dtype, "nu_dtype": dtype, "offload": "host"}), 1)
    assert off["optimizer"] == 0 and off["host"] == nbytes * L8_PARAMS
    assert off["lower_bound"] == est["lower_bound"] - 8 * L8_PARAMS and off["total"] == est["total"] - 8 * L8_PARAMS
  # sharded: the host term is per device, like the rest
  assert estimate(load_config(["config=llama8b", "optim.offload=host"]), 8)["host"] == 8 * L8_PARAMS // 8
  # measured bytes (the dry run reads them off the abstract state) move to the host term too
  state = {"params": 100, "optimizer": 208, "fp8_meta": 0}
  off = estimate(with_(base, optim={"offload": "host"}), 1, state=state)
  assert (off["params"], off["gradients"], off["optimizer"], off["host"]) == (100, 100, 0, 208)


def test_host_params_moves_the_master_weights_to_the_host_and_counts_their_compute_copy():
  """optim.offload=host_params, Llama 3 8B on one 80 GB GPU (llama8b.yml: bf16 compute, untied, loss_chunk 1024,
  batch 8): no params nor moments on the device between steps (the host term: 4 + 8 B per parameter); for the step
  the compute copy: the GEMM weights, the embedding and the head in bf16 (2 B), the 65 norms in fp32 (4 B). The
  untied embedding's copy (read once by the lookup) is not certainly held; the rest is, with the head's output,
  and with the gradient sum too when accumulating. Numbers by hand from the shapes."""
  base = load_config(["config=llama8b", "mesh.fsdp=1"])
  copy = 2 * (32 * L8_LAYER + 2 * 128256 * 4096) + 4 * 65 * 4096  # 16.1e9 B
  embedding = 2 * 128256 * 4096
  head_row = 1024 * 128256 * 2  # one row's chunk of the head's bf16 output
  est = estimate(with_(base, optim={"offload": "host_params"}), 1)
  assert (est["params"], est["optimizer"], est["gradients"]) == (0, 0, 4 * L8_PARAMS)
  assert est["host"] == 12 * L8_PARAMS and (est["copy"], est["copy_embedding"]) == (copy, embedding)
  # one micro-batch of 8 rows: the gradients (32.1e9 B) outweigh the copy (less the embedding) with the head's output
  assert est["head"] == 8 * head_row and est["lower_bound"] == 4 * L8_PARAMS
  plain = estimate(base, 1)
  assert est["total"] == plain["total"] - 12 * L8_PARAMS + copy
  # 8 micro-batches of one row: the gradient sum, the copy (less the embedding) and one row's head output at once
  acc = estimate(with_(base, optim={"offload": "host_params"}, train={"grad_accum": 8}), 1)
  assert acc["lower_bound"] == 4 * L8_PARAMS + copy - embedding + head_row
  assert human_bytes(acc["lower_bound"]) == "44.1 GiB"  # 47.4e9 B: under an H100's 79.2 GiB
  check_fits(with_(base, optim={"offload": "host_params"}, train={"grad_accum": 8}), 1, int(79.2 * GiB))
  with pytest.raises(ConfigError, match=r"the params' compute copy 14\.0 GiB"):
    check_fits(with_(base, optim={"offload": "host_params"}, train={"grad_accum": 8}), 1, 40 * GiB)
  # sharded over 8 devices (FSDP): every part per device, rounded up
  est8 = estimate(load_config(["config=llama8b", "optim.offload=host_params"]), 8)
  assert est8["copy"] == -(-copy // 8) and est8["host"] == 12 * L8_PARAMS // 8
  # FP8: TE's GEMMs take the float32 master weights, so the copy is the parameters in float32
  fp8 = estimate(with_(base, optim={"offload": "host_params"}, model={"precision": "fp8_delayed"}), 1)
  assert fp8["copy"] == 4 * L8_PARAMS and fp8["copy_embedding"] == 4 * 128256 * 4096
  # tied: the embedding is the head, never cast (fp32), and certainly held
  tied = estimate(with_(base, optim={"offload": "host_params"}, model={"tie_embeddings": True}), 1)
  assert (tied["copy"], tied["copy_embedding"]) == (2 * 32 * L8_LAYER + 4 * 128256 * 4096 + 4 * 65 * 4096, 0)
  for off in ("none", "host"):
    assert estimate(with_(base, optim={"offload": off}), 1)["copy"] == 0


# Small shapes where each term of the lower bound leads (n_layers 1, vocab 65536: the embedding and the head are
# most of the 33.7M parameters), compiled on the 8 CPU devices (FSDP over 8).
BOUND = ["model.backend=flax", "data.type=synthetic", "model.n_layers=1", "model.d_model=256", "model.ffn_dim=512",
         "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=64", "model.vocab_size=65536", "data.seq_len=64",
         "model.remat=full", "model.loss_chunk=0"]


@pytest.mark.parametrize("extra,leads", [
    (["data.global_batch_size=8"], "gradients"),  # 1 row per device: head output 8.4 MB < gradients 16.8 MB
    (["data.global_batch_size=32"], "head"),  # 4 rows: 33.6 MB of head output
    (["data.global_batch_size=32", "train.grad_accum=2", "model.loss_chunk=16"], "both"),
    (["data.global_batch_size=8", "optim.mu_dtype=bfloat16", "optim.nu_dtype=bfloat16", "model.param_dtype=bfloat16",
      "optim.clip_grad_norm=0"], "gradients"),
    (["data.global_batch_size=32", "model.tie_embeddings=true", "model.dtype=float32"], "head"),
], ids=["gradients", "head", "accumulating", "bf16-state", "tied-fp32"])
def test_lower_bound_is_below_xlas_peak(extra, leads):
  """sizing's lower_bound against XLA's own per-device bytes of the compiled step (arguments + outputs +
  temporaries - aliased), on XLA:CPU as it is and with the GPU stand-ins (bf16 kept, fused attention's
  footprint: what simulated plans measure). A lower bound must never exceed either: the planner prunes a
  candidate without compiling it when it does not fit. `leads`: which term the bound takes (the test's shapes
  are chosen so that each does), so the bound is not trivially small."""
  cfg = load_config(BOUND + extra)
  est = estimate(cfg, 8)
  state = est["params"] + est["optimizer"] + est["fp8_meta"]
  want = {"gradients": state + est["gradients"], "head": state + est["head"],
          "both": state + est["gradients"] + est["head"]}[leads]
  assert est["lower_bound"] == want
  for gpu_footprint in (False, True):
    got = measure(cfg, gpu_footprint=gpu_footprint)["device"]
    assert est["lower_bound"] <= got, (gpu_footprint, est["lower_bound"], got)
