"""fuse_moe_blocks: each MoE block of a hybrid MoE GGUF (NemotronH: sigmoid routing with a
selection bias, latent projections, a relu2 shared expert; Qwen3.5: softmax top-k, a swiglu
shared expert behind a sigmoid gate) runs as one C call (the fallback chain never runs) and gives
the unfused graph's logits bit for bit over prefill, decode, verify and mixed steps (the oracle:
the same deployment without the pass)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.deploy.build import build
from specdeploy.ops import ggml_int, moe_block
from specdeploy.ops.ggml_linear import kernel_unavailable

pytestmark = pytest.mark.skipif(
    kernel_unavailable() is not None or ggml_int.kernel_unavailable() is not None,
    reason=f"ggml kernels unavailable: {kernel_unavailable() or ggml_int.kernel_unavailable()}")
pytest.importorskip("gguf")
Q = pytest.importorskip("tests.checkpoint.test_gguf").Q

CASES = {  # name: (writer, matrices, experts, MoE layers)
    "nemotron_q8_0": ("nemotron", "Q8_0", "Q8_0", 2),  # tiled linears, tiled experts
    "nemotron_kquants": ("nemotron", "Q4_K", "Q6_K", 2),  # integer-dot linears and experts
    "qwen3_5_q8_0": ("qwen3_5", "Q8_0", "Q8_0", 4),  # + fp32 linears (widths not in 32s)
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    from tests.deploy.test_fast_rows_invariant import _nemotron, _qwen

    arch, q, e, layers = CASES[request.param]
    writer = {"nemotron": _nemotron, "qwen3_5": _qwen}[arch]
    return writer(tmp_path_factory.mktemp(request.param), getattr(Q, q), getattr(Q, e)), layers


KW = dict(kernels="fast", max_batch_size=3, max_seq_len=64, page_size=4, max_cache_gib=0.05,
          spec={"method": "ngram", "num_speculative_tokens": 2})


def _names(dep) -> list[str]:
    return [getattr(n.target, "__name__", "") for n in dep.target.gm.graph.nodes
            if n.op == "call_function"]


def test_fused_blocks_give_the_chains_bits(case, monkeypatch):
    from tests.deploy.test_fuse_mixers import _run

    path, layers = case
    off = build(str(path), disabled=frozenset({"fuse_moe_blocks"}), **KW)
    on = build(str(path), **KW)
    info = {i.name: i for i in on.target.infos}["fuse_moe_blocks"]
    assert info.num_matches == layers, info
    names = _names(on)
    assert names.count("moe_block") == layers and "experts_one_call" not in names
    assert len(names) < len(_names(off)) - 8 * layers  # each block was >= 9 more calls

    def no_chain(chain, ext):
        raise AssertionError("the fused MoE block ran its fallback chain")

    want = _run(off)
    monkeypatch.setattr(moe_block, "run_chain", no_chain)
    got = _run(on)
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max().item()


def test_an_input_the_kernel_does_not_take_runs_the_chain(case, monkeypatch):
    """A block input that requires grad (training through the deployed graph) is refused by the
    fused path: the chain's callables run, and give (within fp32 rounding: with grad on, the
    routing and activations are torch's) what the fused call gives without grad."""
    from specdeploy.cache.metadata import Segment, build_metadata

    path, _ = case
    on = build(str(path), **KW)
    target = on.target
    seen = {}

    class Grab(torch.fx.Interpreter):
        def run_node(self, n):
            if getattr(n.target, "__name__", "") == "moe_block" and not seen:
                seen["fn"] = n.target
                seen["args"] = self.fetch_args_kwargs_from_env(n)[0]
            return super().run_node(n)

    meta = build_metadata([Segment(list(range(5, 17)), 0, [0, 1, 2, 3], 0, 1)])
    with torch.no_grad():
        Grab(target.gm).run(*target._feed(meta, None))
    fn, args = seen["fn"], list(seen["args"])
    ran = []
    real = moe_block.run_chain
    monkeypatch.setattr(moe_block, "run_chain", lambda c, e: ran.append(1) or real(c, e))
    with torch.no_grad():
        want = fn(*args)
    assert not ran
    with torch.enable_grad():
        args[0] = args[0].detach().clone().requires_grad_(True)
        got = fn(*args)
    assert ran == [1]
    torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-4)


def test_refused_shapes_keep_the_chain():
    """parts_fit refuses widths that do not line up (the pass then keeps the chain)."""
    lc = moe_block.LinearCall

    class E:
        moe_call = type("M", (), {"h": 64, "e": 8})()

    good = moe_block.Parts(lc(0, -1, 0, 8, 64, 0, None), None, None, lc(0, 0, 0, 96, 64, 0, None),
                           lc(0, 0, 0, 64, 48, 0, None), None, E, False, 2, 1, 1, True, 1.0,
                           moe_block.SWIGLU, 48)
    assert moe_block.parts_fit(good)
    assert not moe_block.parts_fit(good._replace(sh_ff=64))  # up narrower than 2 x ff
    assert not moe_block.parts_fit(good._replace(router=lc(0, -1, 0, 7, 64, 0, None)))
    assert not moe_block.parts_fit(good._replace(gate=lc(0, -1, 0, 2, 64, 0, None)))
