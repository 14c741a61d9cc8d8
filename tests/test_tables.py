"""The one table each (maxlm/tables.py) against what it stands for: TE's recipe classes, the checkpoint names the
model gives, the memory estimate's order of the remat policies, device kinds as JAX spells them, and bytes."""

import re
from pathlib import Path

import pytest

from maxlm.config import load_config
from maxlm.plan import memory as sizing
from maxlm.tables import GPUS, PRECISIONS, REMATS, gpu, human_bytes

MODEL_SOURCE = Path(__file__).resolve().parent.parent / "maxlm" / "model.py"


def test_human_bytes():
  assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 80 * 10**9, 2**60)] == \
      ["0 B", "1023 B", "1.0 KiB", "1.5 KiB", "74.5 GiB", "1.0 EiB"]


def test_each_gpu_row_is_found_by_its_own_name_and_kinds_match_as_jax_spells_them():
  """A row listed after one whose name it contains would never be found (GH200 after H200, GB200 after B200)."""
  for row in GPUS:
    assert gpu(f"NVIDIA {row.name}") is row
  kinds = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200", "NVIDIA GH200 480GB": "GH200",
           "NVIDIA B200": "B200", "NVIDIA GB200": "GB200", "NVIDIA H20": "H20", "NVIDIA A100-SXM4-80GB": "A100"}
  assert {k: gpu(k).name for k in kinds} == kinds
  assert gpu("cpu") is None and gpu("TPU v5 lite") is None
  assert {g.arch for g in GPUS} == {"hopper", "blackwell", "ampere"}


def test_precisions_imply_their_state_and_dtypes():
  # written out: fp16 alone is loss-scaled and computes in float16; delayed scaling alone keeps FP8 state
  assert [p for p in PRECISIONS.values() if p.loss_scaling] == [PRECISIONS["fp16"]]
  assert {n: p.compute_dtype for n, p in PRECISIONS.items() if p.compute_dtype} == {"fp16": "float16"}
  assert [n for n, p in PRECISIONS.items() if p.fp8_state] == ["fp8_delayed"]
  assert [n for n, p in PRECISIONS.items() if not p.quantized] == ["bf16", "fp16"]
  assert {n: p.gpu for n, p in PRECISIONS.items() if p.quantized} == {
      "fp8_delayed": "Hopper", "fp8_current": "Hopper", "mxfp8": "Blackwell", "nvfp4": "Blackwell"}


@pytest.mark.te
def test_each_quantized_precision_names_a_te_recipe_class():
  from maxlm.layers.te_env import import_te
  import_te()
  from transformer_engine.common import recipe
  for p in PRECISIONS.values():
    if p.quantized:
      assert isinstance(getattr(recipe, p.recipe), type), p.name


def test_remat_rows_name_what_the_model_names_and_what_the_estimates_count():
  named = set(re.findall(r'checkpoint_name\(.*, "(\w+)"\)', MODEL_SOURCE.read_text()))
  assert {"qkv_proj", "context"} <= named
  for r in REMATS.values():
    assert set(r.names) <= named, r.name
    assert set(r.recomputed) <= {"qkv", "out", "mlp", "attn"}, r.name
    assert {t.lstrip("-") for t in (*r.kept, *r.redone)} <= {"input", "qkv", "context", "dots", "whole",
                                                               "norm_act"}, r.name
  assert [r.name for r in REMATS.values() if r.te_only] == ["recompute_norm_act"]


def test_remat_policies_run_from_the_most_kept_to_the_least():
  """The planner tries them in table order, fastest first: each keeps less than the one before (the memory
  estimate's activations for the 8B shape strictly decrease) and recomputes no less."""
  base = ["config=llama8b", "model.backend=te"]
  acts = [sizing.estimate(load_config([*base, f"model.remat={name}"]), 8)["activations"] for name in REMATS]
  assert all(a > b for a, b in zip(acts, acts[1:])), dict(zip(REMATS, acts))
  redone = [len(r.recomputed) for r in REMATS.values()]
  assert redone == sorted(redone)
