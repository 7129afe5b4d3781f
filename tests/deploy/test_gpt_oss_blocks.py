"""gpt-oss's MXFP4 experts on the CPU's block kernels as MXFP4 blocks (checkpoint/gguf_mxfp4.py:
ggml's 17-byte blocks; deploy/passes/ggml_experts.py: `moe_experts_bias` on them), from the
released safetensors layout and from a GGUF in llama.cpp's converter layout.

Oracles: the fp32 experts `load_model` reads (the independently decoded MXFP4 values: tests/
models/test_gpt_oss.py checks them against its own E2M1 decoder and transformers), the same
deployment with the experts pass off (fp32 `moe_experts_bias`), plain greedy decoding for
speculative decoding, and the same values as Q8_0 blocks (tests/ops/test_ggml_mxfp4.py's own
table) on the Q8_0 kernels: the same logits, bit for bit (the kernels' integer products and
scales are the same exact numbers). Tolerances: the exact block kernel 1e-5 of the largest logit
(fp32 sums in another order); the fast kernels round every expert's activations to 8 bits (as
llama.cpp's MXFP4 x Q8_0 dot does), through 4 random layers: 5e-2 (measured 2.6e-2)."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.mxfp4 import Mxfp4Reader
from specdeploy.checkpoint.prequant import open_prequantized
from specdeploy.deploy.build import build
from specdeploy.loading import load_model
from specdeploy.models import gpt_oss
from specdeploy.ops.ggml_linear import dequantize, kernel_unavailable, make_weight

pytest.importorskip("gguf")
from tests.checkpoint.test_gguf_gpt_oss import write_gpt_oss_gguf  # noqa: E402
from tests.models.test_gpt_oss import _mxfp4_checkpoint  # noqa: E402
from tests.ops.test_ggml_mxfp4 import _as_q8_0  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"GGUF block kernels unavailable: {kernel_unavailable()}")
LIMITS = dict(max_batch_size=2, max_seq_len=96, page_size=4, max_cache_gib=0.02)
OFF = frozenset({"ggml_moe_experts"})


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss_blocks")
    out, _, _ = _mxfp4_checkpoint(gpt_oss.make_tiny(d / "st", seed=7), d / "mxfp4")
    return out


def _layers(path) -> int:
    return open_checkpoint(path).config["num_hidden_layers"]


def _on_blocks(dep) -> int:
    """Expert groups on blocks: the per-expert loop ("exact") or one C call a layer ("fast")."""
    return sum(n.op == "call_function" and getattr(n.target, "__name__", "") in (
        "experts_bias_on_blocks", "experts_one_call") for n in dep.gm.graph.nodes)


def _logits(dep, ids):
    """A 30-token prefill, then 3 decode steps: every position's logits. (Its windowed
    layers' pages too: cache/window.py, 0 the null page.)"""
    win = list(range(1, 25))
    out = [dep.forward(build_metadata([Segment(ids[:30], 0, list(range(24)), 0,
                                               num_logits=30, win_pages=win)])).logits]
    for p in range(30, 33):
        out.append(dep.forward(build_metadata([Segment(ids[p:p + 1], p, list(range(24)),
                                                       0, win_pages=win)])).logits)
    return torch.cat(out)


def test_blocks_hold_the_checkpoints_values(mxfp4):
    """Each expert matrix's MXFP4 blocks (17 bytes a block) dequantize to the fp32 parameter
    load_model reads (gate rows first: the de-interleaving matches), bit for bit."""
    reader, prequant = open_prequantized(open_checkpoint(mxfp4), 2, None)
    assert prequant is None
    model = load_model(mxfp4, dtype=torch.float32)
    n = 0
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = reader.get_blocks(name)
            assert w is not None and w.kind == "mxfp4" and w.shape == tuple(p.shape)
            assert w.blocks.nbytes == p.numel() // 32 * 17
            got = torch.stack([dequantize(type(w)(w.kind, w.blocks[e], w.shape[1:]))
                               for e in range(w.shape[0])])
            assert torch.equal(got, p), name
            n += 1
    assert n == 2 * _layers(mxfp4)
    assert reader.get_blocks("model.layers.0.self_attn.q_proj.weight") is None


@pytest.mark.parametrize("kernels,rtol", [("exact", 1e-5), ("fast", 5e-2)])
def test_experts_on_blocks_match_the_fp32_experts(mxfp4, kernels, rtol):
    on = build(str(mxfp4), kernels=kernels, **LIMITS)
    off = build(str(mxfp4), kernels=kernels, disabled=OFF, **LIMITS)
    assert _on_blocks(on) == _layers(mxfp4) and _on_blocks(off) == 0
    assert "fp32 parameters out of the graph" in on.report()
    ids = [(7 * i + 3) % 120 for i in range(40)]
    got, want = _logits(on, ids), _logits(off, ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rtol, err
    if kernels == "fast":  # the guard: 8-bit activations do move the logits
        assert err > 1e-7
        assert f"{_layers(mxfp4)} of them one C call each" in on.report()


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_mxfp4_blocks_give_the_q8_0_copys_logits(mxfp4, kernels, monkeypatch):
    """The experts as MXFP4 blocks and as Q8_0 blocks of the same values (what the loader gave
    before MXFP4 had kernels of its own): the same logits, bit for bit, with either kernel."""
    ids = [(3 * i + 2) % 120 for i in range(40)]
    native = build(str(mxfp4), kernels=kernels, **LIMITS)
    get_blocks, made = Mxfp4Reader.get_blocks, []

    def as_q8_0(self, name):
        w = get_blocks(self, name)
        if w is None:
            return None
        made.append(name)
        raw = _as_q8_0(w.blocks.reshape(-1, w.blocks.shape[-1]).numpy())
        return make_weight("q8_0", torch.from_numpy(raw).view(*w.shape[:-1], -1), w.shape)

    monkeypatch.setattr(Mxfp4Reader, "get_blocks", as_q8_0)
    q8 = build(str(mxfp4), kernels=kernels, **LIMITS)
    assert _on_blocks(native) == _on_blocks(q8) == _layers(mxfp4) == len(made) // 2
    assert torch.equal(_logits(native, ids), _logits(q8, ids))


def test_greedy_speculative_equals_plain_on_blocks(mxfp4):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    plain = LLM(str(mxfp4), max_batch_size=2, max_seq_len=96)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    spec = LLM(str(mxfp4), max_batch_size=2, max_seq_len=96,
               spec={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                     "prompt_lookup_min": 1, "controller": "off"})
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0


def test_an_mxfp4_gguf_runs_the_same_blocks(mxfp4, tmp_path):
    """llama.cpp's MXFP4 experts (ggml type 39) are the same MXFP4 blocks as the released
    safetensors' give: the same logits, bit for bit."""
    path = write_gpt_oss_gguf(mxfp4, tmp_path / "m.gguf")
    gg = build(str(path), **LIMITS)
    st = build(str(mxfp4), **LIMITS)
    assert _on_blocks(gg) == _on_blocks(st) == _layers(mxfp4)
    ids = [(5 * i + 1) % 120 for i in range(40)]
    assert torch.equal(_logits(gg, ids), _logits(st, ids))
