"""gpt-oss on the CPU fast path (`kernels="fast"`, MXFP4 experts as MXFP4 blocks): the fusions
that take its layers give the unfused graph's bits, and its decode / verify steps replay as CPU
graphs.

- ggml_linears joins the biased q/k/v projections into one kernel call (their biases joined):
  the three calls' bits; the one-call experts (ops/ggml_moe_int.py) need no host read, so
- fuse_rope_attention takes the layers (sinks as the fused op's last argument): the slices, the
  two RoPEs and the cached attention's bits;
- engine/cpu_graphs.py records the steps (the per-expert loop's host read of the counts refused
  it): greedy with replays = eager greedy, speculative = plain.
Oracles: the same deployment with the fusion off (bit for bit), eager decoding (same tokens).
Not here: fuse_moe_blocks (its C block wants a shared expert and unbiased experts) and
fuse_decoder_layers (bias-free linears, a SwiGLU MLP) do not take gpt-oss's layers.
"""
from __future__ import annotations

import re

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.deploy.build import build
from specdeploy.deploy.passes import ggml_linears
from specdeploy.models import gpt_oss
from specdeploy.ops.ggml_linear import kernel_unavailable

pytest.importorskip("gguf")
from tests.checkpoint.test_gguf_gpt_oss import write_gpt_oss_gguf  # noqa: E402
from tests.deploy.test_gpt_oss_blocks import LIMITS, _logits  # noqa: E402
from tests.models.test_gpt_oss import _mxfp4_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"GGUF block kernels unavailable: {kernel_unavailable()}")
FAST = dict(LIMITS, kernels="fast")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """A GGUF as llama.cpp's `--outtype q8_0` writes a released checkpoint: MXFP4 experts, the
    attention's linears Q8_0 (the safetensors release keeps them in full precision: fp32
    linears, not the block kernels these fusions take)."""
    d = tmp_path_factory.mktemp("gpt_oss_fused")
    out, _, _ = _mxfp4_checkpoint(gpt_oss.make_tiny(d / "st", seed=3), d / "mxfp4")
    return write_gpt_oss_gguf(out, d / "q8_0.gguf", q8_0=True)


def _count(dep, name: str) -> int:
    return sum(n.op == "call_function" and name in str(n.target) for n in dep.gm.graph.nodes)


def test_biased_qkv_in_one_call_and_fused_attention_give_the_unfused_bits(mxfp4, monkeypatch):
    ids = [(11 * i + 2) % 120 for i in range(40)]
    fused = build(str(mxfp4), **FAST)
    n = gpt_oss.tiny_hf_config()["num_hidden_layers"]
    assert re.search(rf"fuse_rope_attention +{n} matches", fused.report())
    assert _count(fused, "qkv_attention") == n
    no_attn = build(str(mxfp4), disabled=frozenset({"fuse_rope_attention"}), **FAST)
    assert _count(no_attn, "qkv_attention") == 0
    want = _logits(no_attn, ids)
    assert torch.equal(_logits(fused, ids), want)
    # q, k and v each on their own call (their biases their own): the same bits again
    monkeypatch.setattr(ggml_linears, "_bias_tensor", lambda gm, node: None)
    apart = build(str(mxfp4), disabled=frozenset({"fuse_rope_attention"}), **FAST)
    calls = [_count(d, "linear_on_blocks") for d in (no_attn, apart)]
    assert calls[1] == calls[0] + 2 * n, calls  # 3 calls a layer instead of 1
    assert torch.equal(_logits(apart, ids), want)


def test_cpu_graphs_replay_gpt_oss_steps_losslessly(mxfp4):
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 44))]
    eager = LLM(str(mxfp4), max_batch_size=2, max_seq_len=96, cpu_graphs=False)
    want = [o.token_ids for o in eager.generate(prompts, sp)]
    graphs = LLM(str(mxfp4), max_batch_size=2, max_seq_len=96, cpu_graphs=True)
    assert [o.token_ids for o in graphs.generate(prompts, sp)] == want
    runner = getattr(graphs.deployed, "target", graphs.deployed).graph_runner
    assert runner.refused == {} and runner.replays >= 15, (runner.replays, runner.refused)
    spec = LLM(str(mxfp4), max_batch_size=2, max_seq_len=96, cpu_graphs=True,
               spec={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                     "prompt_lookup_min": 1, "controller": "off"})
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    runner = getattr(spec.deployed, "target", spec.deployed).graph_runner
    verify = sum(v for k, v in runner.replays_by_tokens.items() if k > 1)
    assert runner.refused == {} and verify > 0, (runner.replays_by_tokens, runner.refused)
