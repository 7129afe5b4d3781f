"""Tensor / expert parallelism of GGUF checkpoints: each rank cuts a weight's blocks with its
slice of the weight (deploy/shard_slice.py `slice_blocks`) and computes on them, so a rank
holds its share of the blocks instead of fp32 slices (~7x the bytes of Q4).

Oracles: the blocks' dequantized values against the same cut of the whole weight's (exact),
and greedy output of the same GGUF on one process, token for token.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.deploy.shard_slice import slice_blocks
from specdeploy.ops.ggml_linear import dequantize, kernel_unavailable, make_weight

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import Q, random_kquant  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"ggml kernel unavailable: {kernel_unavailable()}")


def _weight(kind: str, shape, cols=None, seed=0):
    rng = np.random.default_rng(seed)
    qt = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "iq2_xxs": Q.IQ2_XXS, "iq1_m": Q.IQ1_M,
          "tq1_0": Q.TQ1_0, "bf16": Q.BF16}[kind]
    if kind in ("q4_k", "iq2_xxs", "iq1_m", "tq1_0"):
        raw = random_kquant(qt, shape, rng)
    else:
        raw = gguf.quants.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), qt)
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(
        *shape[:-1], -1).copy())
    return make_weight(kind, blocks, tuple(shape), cols)


@pytest.mark.parametrize("kind,k", [("q8_0", 128), ("q4_k", 1024), ("iq2_xxs", 1024),
                                    ("iq1_m", 1024), ("tq1_0", 1024), ("bf16", 128)])
def test_block_cuts_keep_the_values(kind, k):
    gw = _weight(kind, (12, k))
    full = dequantize(gw)
    rows = torch.tensor([3, 4, 5, 9])
    assert torch.equal(dequantize(slice_blocks(gw, 2, None, 0, rows)), full[rows])
    half = torch.arange(k // 2, k)
    assert torch.equal(dequantize(slice_blocks(gw, 2, None, 1, half)), full[:, half])
    # a cut through a block keeps no blocks (the weight keeps its fp32 slice)
    assert slice_blocks(gw, 2, None, 1, torch.arange(8, k // 2 + 8)) is None


def test_block_cuts_of_reordered_columns():
    """Qwen3.5's ssm_out: the stored columns are the HF ones reordered (GGMLWeight.gather); a
    rank's HF columns that are whole stored blocks keep them, with the order inside."""
    k, qk = 1024, 256
    # stored column of HF column j: heads of 128 tiled in another order, as the converter does
    heads = torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])
    cols = (heads[:, None] * 128 + torch.arange(128)).reshape(-1)
    gw = _weight("q4_k", (8, k), cols=cols, seed=1)
    full = dequantize(gw)
    x = torch.randn(3, k)
    for rank in range(2):
        idx = torch.arange(rank * k // 2, (rank + 1) * k // 2)
        cut = slice_blocks(gw, 2, None, 1, idx)
        assert cut is not None and cut.blocks.shape[-1] == (k // 2) // qk * 144
        assert torch.equal(dequantize(cut), full[:, idx])
        from specdeploy.ops.ggml_linear import ggml_linear
        torch.testing.assert_close(ggml_linear(x[:, idx].contiguous(), cut),
                                   x[:, idx] @ full[:, idx].t(), rtol=1e-5, atol=1e-6)
    # HF columns whose stored places straddle a block: no blocks
    assert slice_blocks(gw, 2, None, 1, torch.arange(128, 384)) is None


def test_block_cuts_of_stacked_experts():
    gw = _weight("q4_0", (4, 6, 64), seed=2)
    full = dequantize(gw)
    cut = slice_blocks(gw, 3, (2, 4), 1, torch.tensor([0, 1, 2]))  # experts 2-3, rows 0-2
    assert cut.shape == (2, 3, 64) and torch.equal(dequantize(cut), full[2:4, :3])
    cut = slice_blocks(gw, 3, (0, 2), 2, torch.arange(32, 64))  # experts 0-1, columns 32-63
    assert cut.shape == (2, 6, 32) and torch.equal(dequantize(cut), full[:2, :, 32:])


LIMITS = dict(max_batch_size=4, max_seq_len=96, max_cache_gib=0.02, page_size=8)
# (the tiny GGUF writers with a tokenizer, which LLM needs: NemotronH's attention, Mamba2 and
# MoE layers cover llama's linears)
CASES = [("nemotron_h", 1, "exact"), ("nemotron_h", 2, "exact"), ("qwen3_5_moe", 2, "exact"),
         ("nemotron_h", 2, "fast")]


def _gguf(arch: str, d):
    if arch == "nemotron_h":
        from specdeploy.models import nemotron_h as nh
        from tests.checkpoint.gguf_nemotron_h_layout import write_gguf
        from tests.checkpoint.test_gguf_nemotron_h import MOE

        # widths whose rank halves are whole Q4_0 blocks (the default 32 / 48 leave 16 / 24)
        hf = dict(MOE, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64)
        src = nh.make_tiny(d / "st", seed=11, hf_config=hf)
        return write_gguf(src, d / "q8.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q4_0)
    from specdeploy.models import qwen3_5_moe as q35
    from tests.checkpoint.gguf_qwen3_5_layout import write_gguf

    # value heads of 32 (one Q8_0 block each): the rank's heads of `ssm_out`, whose stored
    # columns are the HF ones reordered (GGMLWeight.gather), are whole blocks
    hf = q35.tiny_hf_config()
    hf["text_config"] = dict(hf["text_config"], shared_expert_intermediate_size=64,
                             linear_value_head_dim=32)
    return write_gguf(q35.make_tiny(d / "st", seed=11, hf_config=hf), d / "q8.gguf",
                      qtype=Q.Q8_0, expert_qtype=Q.Q8_0)


def _same_or_near_tie(got, want, tol: float = 0.05) -> None:
    """Greedy tokens equal up to a place where the one-process run's top two were within `tol`
    (its logprob of the other run's token); logprobs close on the common prefix."""
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        lp_got, lp_want = got.logprobs[i], want.logprobs[i]
        if a != b:
            assert a in lp_want and lp_want[b] - lp_want[a] <= tol, (i, a, b, lp_want)
            return
        assert abs(lp_got[a] - lp_want[b]) <= tol, (i, lp_got, lp_want)


def _blocks_info(dep):
    infos = {i.name: i for i in dep.infos}
    return infos["ggml_linears"], infos.get("ggml_moe_experts")


@pytest.mark.parametrize("arch,ep,kernels", CASES, ids=[f"{a}-ep{e}-{k}" for a, e, k in CASES])
def test_tp2_gguf_greedy_equals_tp1_on_blocks(tmp_path, arch, ep, kernels):
    path = _gguf(arch, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (1, 9, 30)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    one = LLM(str(path), kernels=kernels, **LIMITS)
    want = one.generate(prompts, params)
    lin_one, moe_one = _blocks_info(one.deployed)
    llm = LLM(str(path), kernels=kernels, tensor_parallel_size=2, expert_parallel_size=ep,
              dist_timeout=30, **LIMITS)
    try:
        got = llm.generate(prompts, params)
        if kernels == "exact":
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
        else:  # the ranks' partial sums, rounded to 8 bits by the next layer: near-ties may go
            for g_, w_ in zip(got, want):  # either way (a tiny random model has many)
                _same_or_near_tie(g_, w_)
        lin, moe = _blocks_info(llm.deployed)
        # every linear the single process ran on blocks runs on its cut of them
        assert lin.num_matches == lin_one.num_matches > 0, (lin.detail, lin_one.detail)
        if moe_one is not None:
            assert moe.num_matches == moe_one.num_matches > 0, (moe.detail, moe_one.detail)
        fp32 = [n for n, p in llm.deployed.gm.named_parameters()
                if p.dim() >= 2 and p.dtype == torch.float32 and p.numel() >= 1024]
        assert not fp32, fp32
    finally:
        llm.shutdown()
