"""Tensor / expert parallelism of pre-quantized checkpoints (FP8, NVFP4): each rank cuts the
quantized tensors and their scales with its slice of the weight (deploy/passes/shard.py) and
computes on them. Oracle: greedy output of the same checkpoint on one process, token for token;
rank 0 runs as many quantized linears and expert sets as the single process, on about half the
quantized bytes."""
from __future__ import annotations

import re

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.deploy.shard_slice import slice_quantized
from specdeploy.quantize_cli import make_tiny_quantized

LIMITS = dict(max_batch_size=4, max_seq_len=96, max_cache_gib=0.02, page_size=8)
CASES = [("llama", "fp8", 1), ("llama", "fp8-block", 1), ("qwen3_5_moe", "fp8", 2),
         ("nemotron_h", "nvfp4", 1), ("nemotron_h", "nvfp4", 2),
         ("deepseek_v3", "fp8-block", 1)]  # (absorbed MLA: W_UK / W_UV cut from kv_b by heads)


def _info(dep):
    return next(i for i in dep.infos if i.name == "prequantized_weights")


def _mib(info) -> float:
    return float(re.search(r"on ([0-9.]+) MiB", info.detail).group(1))


def _tiny(arch: str, quant: str, out):
    """The tiny checkpoint quantized. Widths where a rank's cut holds whole scale groups:
    NemotronH's shared expert 64 (its default 48 leaves each rank 24 input columns of the down
    projection, not whole NVFP4 groups of 16); Llama's MLP 256 for block FP8's 128 columns."""
    from specdeploy.checkpoint.quantizer import quantize_checkpoint
    from specdeploy.models import llama, nemotron_h

    src = out.parent / f"{out.name}_src"
    if arch == "nemotron_h":
        hf = dict(nemotron_h.tiny_hf_config(0), moe_shared_expert_intermediate_size=64)
        return quantize_checkpoint(nemotron_h.make_tiny(src, hf_config=hf), out, quant)
    if arch == "llama" and quant == "fp8-block":
        src = llama.make_tiny(src, config_overrides={"intermediate_size": 256})
        return quantize_checkpoint(src, out, quant)
    return make_tiny_quantized(arch, out, quant)


@pytest.mark.parametrize("arch,quant,ep", CASES, ids=[f"{a}-{q}-ep{e}" for a, q, e in CASES])
def test_tp2_prequantized_greedy_equals_tp1(tmp_path, arch, quant, ep):
    path = _tiny(arch, quant, tmp_path / arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (1, 9, 30)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    one = LLM(str(path), **LIMITS)
    want = [o.token_ids for o in one.generate(prompts, params)]
    single = _info(one.deployed)
    llm = LLM(str(path), tensor_parallel_size=2, expert_parallel_size=ep, dist_timeout=30,
              **LIMITS)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        info = _info(llm.deployed)
        assert info.num_matches == single.num_matches > 0, (info.detail, single.detail)
        assert _mib(info) < 0.75 * _mib(single), (info.detail, single.detail)
    finally:
        llm.shutdown()


def test_tp2_quantized_mtp_drafter_stays_quantized(tmp_path):
    """A block-FP8 MTP layer (GLM-4.5 as released): each rank's drafter computes on its cut of
    the FP8 tensors (the shard pass once looked for them on the program's root only, and the
    drafter's slices ran dequantized), and greedy MTP speculation equals one-process plain."""
    from specdeploy import SpecConfig

    path = make_tiny_quantized("glm4_moe", tmp_path / "glm", "fp8-block", mtp_layers=1)
    prompts, params = [[5, 6, 7, 8, 9], list(range(3, 30))], SamplingParams(max_tokens=10,
                                                                             ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), **LIMITS).generate(prompts, params)]
    llm = LLM(str(path), spec=SpecConfig("mtp", 2, controller="off"), tensor_parallel_size=2,
              dist_timeout=30, **LIMITS)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert _info(llm.deployed.draft).num_matches == 4 + 3 + 1  # attention, shared, routed
    finally:
        llm.shutdown()


def test_tp2_refuses_a_cut_through_nvfp4_groups(tmp_path):
    """The stock tiny NemotronH (shared expert 48: 24 input columns a rank) cannot be cut along
    NVFP4's 16-column scale groups: a clear error naming the weight, not a wrong model."""
    path = make_tiny_quantized("nemotron_h", tmp_path / "nh", "nvfp4")
    with pytest.raises(ValueError, match="shared_experts.down_proj.weight.*NVFP4 scale groups"):
        LLM(str(path), tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    # the refused build leaves the process able to start ranks again
    llm = LLM(str(_tiny("llama", "fp8", tmp_path / "ll")), tensor_parallel_size=2,
              dist_timeout=30, **LIMITS)
    try:
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_rowwise_cut_through_a_scale_group_is_refused():
    from specdeploy.ops.fp8_linear import quantize_fp8_block, row_scales_from_blocks
    from specdeploy.ops.nvfp4_linear import quantize_nvfp4

    w = torch.randn(8, 256)
    q, s = quantize_fp8_block(w)
    from specdeploy.ops.fp8_linear import Fp8Weight

    fp8 = Fp8Weight(q, row_scales_from_blocks(s, 8, 128), 128)
    half = torch.arange(128)
    cut = slice_quantized(fp8, 2, None, 1, half, "w")
    assert torch.equal(cut.weight.view(torch.uint8), q.view(torch.uint8)[:, :128])
    assert torch.equal(cut.scale, fp8.scale[:, :1])
    with pytest.raises(ValueError, match="cut through FP8 scale groups of 128"):
        slice_quantized(fp8, 2, None, 1, torch.arange(64), "w")
    p, s4, s2 = quantize_nvfp4(torch.randn(8, 64))
    from specdeploy.ops.nvfp4_linear import Nvfp4Weight

    nv = Nvfp4Weight(p, s4, s2)
    cut = slice_quantized(nv, 2, None, 1, torch.arange(32, 64), "w")
    assert torch.equal(cut.weight, p[:, 16:]) and torch.equal(cut.scale.view(torch.uint8),
                                                                s4.view(torch.uint8)[:, 2:])
    with pytest.raises(ValueError, match="nibble pairs|scale groups"):
        slice_quantized(nv, 2, None, 1, torch.arange(1, 33), "w")
