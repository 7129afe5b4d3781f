"""fuse_recurrent_mixers: each Mamba2 / gated-delta mixer's decode and verify steps run as one
C call (counted: the fused kernel ran, not the fallback) and give the unfused graph's logits
and states (main slots, spec entries) bit for bit over prefill, decode and verify steps (the
oracle: the same deployment without the pass); prefill and mixed steps run the chain."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.ops import ggml_int, state_rows
from specdeploy.ops.ggml_linear import kernel_unavailable

pytestmark = pytest.mark.skipif(
    kernel_unavailable() is not None or ggml_int.kernel_unavailable() is not None,
    reason=f"ggml kernels unavailable: {kernel_unavailable() or ggml_int.kernel_unavailable()}")
pytest.importorskip("gguf")
Q = pytest.importorskip("tests.checkpoint.test_gguf").Q
S = 3


@pytest.fixture(scope="module", params=["nemotron", "qwen3_5"])
def gguf(request, tmp_path_factory):
    from tests.deploy.test_fast_rows_invariant import _nemotron, _qwen

    writer = {"nemotron": _nemotron, "qwen3_5": _qwen}[request.param]
    return request.param, writer(tmp_path_factory.mktemp(request.param), Q.Q8_0, Q.Q8_0)


def _run(dep) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 120, (30,), generator=g).tolist() for _ in range(S)]
    pages = [list(range(16 * s, 16 * s + 16)) for s in range(S)]
    out = []
    for s in range(S):  # prefills (the chain)
        out.append(dep.forward(build_metadata([Segment(ids[s][:20], 0, pages[s], s, 1)])).logits)
    for t in range(20, 24):  # decodes only (the fused call)
        segs = [Segment([ids[s][t]], t, pages[s], s, 1, SEG_NORMAL) for s in range(S)]
        out.append(dep.forward(build_metadata(segs)).logits)
    segs = [Segment(ids[s][24:27], 24, pages[s], s, 3, SEG_EXTEND) for s in range(S)]
    out.append(dep.forward(build_metadata(segs)).logits)  # a verify step (the chain)
    segs = [Segment([ids[0][24]], 24, pages[0], 0, 1, SEG_NORMAL),  # a decode beside a prefill
            Segment(ids[1][24:29], 24, pages[1], 1, 1, SEG_NORMAL)]
    out.append(dep.forward(build_metadata(segs)).logits)
    return out


@pytest.mark.parametrize("kernels", ["fast", "exact"])
def test_fused_mixers_give_the_chains_bits(gguf, kernels, monkeypatch):
    name, path = gguf
    kwargs = dict(kernels=kernels, max_batch_size=S, max_seq_len=64, page_size=4,
                  max_cache_gib=0.05, spec={"method": "ngram", "num_speculative_tokens": 2})
    off = build(str(path), disabled=frozenset({"fuse_recurrent_mixers"}), **kwargs)
    on = build(str(path), **kwargs)
    info = {i.name: i for i in on.target.infos}["fuse_recurrent_mixers"]
    # the gated-delta chain's sigmoid / softplus are the C kernels on "fast" only: "exact"
    # keeps torch's, which the fused call does not reproduce, so it must not match there
    want_match = kernels == "fast" or name == "nemotron"
    assert (info.num_matches > 0) == want_match, info
    kernel = "mamba2_decode" if name == "nemotron" else "gdn_decode"
    calls = []
    real = getattr(state_rows, kernel)

    def counted(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(state_rows, kernel, counted)
    want, got = _run(off), _run(on)
    assert not calls or all(calls)
    if want_match:  # each fused mixer ran the C call at the 4 decode-only steps and the verify
        assert len(calls) == 5 * info.num_matches
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max().item()
    # the states (main slots and the verify step's spec entries) are the chain's, bit for bit
    bufs = dict(off.target.gm.named_buffers())
    states = {n: b for n, b in on.target.gm.named_buffers()
              if n.startswith(("conv_", "ssm_", "gdn_")) and b.numel()}
    assert any("spec" in n for n in states), sorted(states)
    for n, b in states.items():
        assert torch.equal(torch.nan_to_num(b), torch.nan_to_num(bufs[n])), n


def test_skipped_off_the_cpu_and_under_compile():
    from types import SimpleNamespace

    from specdeploy.deploy.passes.fuse_mixers import _skip

    assert _skip(SimpleNamespace(compile=False, device=torch.device("cpu"))) is None
    assert "cuda" in _skip(SimpleNamespace(compile=False, device=torch.device("cuda", 0)))
    assert "compile" in _skip(SimpleNamespace(compile=True, device=torch.device("cpu")))
