"""A quantized target with its unquantized MTP drafter (as NVIDIA's and Qwen's releases ship):
the drafter's weights are the checkpoint's bf16 tensors bit for bit, and greedy speculative
output equals greedy non-speculative output of the same quantized target."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.quantize_cli import make_tiny_quantized

LIMITS = dict(max_batch_size=4, max_seq_len=128, max_cache_gib=0.02, page_size=8)
CASES = [("nemotron_h", "nvfp4"), ("qwen3_5_moe", "fp8")]


@pytest.mark.parametrize("arch,method", CASES)
def test_quantized_target_unquantized_mtp_drafter(tmp_path, arch, method):
    path = make_tiny_quantized(arch, tmp_path / arch, method, mtp_layers=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (1, 9, 30)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), **LIMITS).generate(prompts, params)]
    llm = LLM(str(path), spec=SpecConfig("mtp", 2), **LIMITS)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats()["draft_steps"] > 0

    target, draft = llm.deployed.target, llm.deployed.draft
    assert not next(i for i in draft.infos if i.name == "prequantized_weights").num_matches
    assert next(i for i in target.infos if i.name == "prequantized_weights").num_matches > 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        keys = set(h.keys())
        checked = 0
        for name, p in draft.gm.named_parameters():
            key = "mtp." + name[len("eagle_drafter."):]
            if name.startswith("eagle_drafter.") and p.dim() == 2 and key in keys:
                ckpt = h.get_tensor(key)
                assert ckpt.dtype == torch.bfloat16 and key + "_scale" not in keys
                assert torch.equal(p.detach(), ckpt.float()), key  # bf16 → fp32 is exact
                checked += 1
    assert checked >= 4  # q/k/v/o (+ eh_proj / fc, shared experts)


def test_draft_quantize_still_quantizes_the_drafter(tmp_path):
    path = make_tiny_quantized("nemotron_h", tmp_path / "n", "fp8", mtp_layers=1)
    llm = LLM(str(path), spec=SpecConfig("mtp", 2, draft_quantize="int8"), **LIMITS)
    info = next(i for i in llm.deployed.draft.infos if i.name == "quantize_int8_weights")
    assert info.num_matches > 0
