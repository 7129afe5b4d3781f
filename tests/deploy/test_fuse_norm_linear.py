"""fuse_norm_linears on the CPU: it skips there (a GPU kernel), and where it runs (a CUDA device,
or Triton's interpreter: forced here) the fused graph gives the unfused graph's logits bit for
bit while the kernel is off (each fused op then runs the chain it replaced), for the three
architectures; the ops equal their refs. The kernel itself: tests/cuda/test_gpu_kernels.py."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.models.registry import family_module
from specdeploy.ops import gpu_kernels
from specdeploy.ops.norm_linear import add_norm_linear_ref, norm_linear_ref

LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)
# architecture -> (norm + linear, norm + gate/up + SiLU-gated product) of its tiny checkpoint
MATCHES = {"llama": (2, 2), "nemotron_h": (6, 0), "qwen3_5_moe": (4, 0)}


def _logits(deployed, ids):
    meta = build_metadata([Segment(ids, 0, list(range(16)), 0, num_logits=len(ids))])
    return deployed.forward(meta).logits


def _fused_ops(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
            if n.op == "call_function" and "norm_linear" in getattr(n.target, "__name__", "")]


def test_skips_on_the_cpu(tmp_path):
    family_module("llama").make_tiny(tmp_path, seed=0)
    dep = build(str(tmp_path), **LIMITS)
    info = {i.name: i for i in dep.infos}["fuse_norm_linears"]
    assert info.skipped and "device is cpu" in info.detail
    assert not _fused_ops(dep.gm)


@pytest.mark.parametrize("arch", sorted(MATCHES))
def test_fused_graph_gives_the_unfused_bits_with_the_kernel_off(arch, tmp_path, monkeypatch):
    family_module(arch).make_tiny(tmp_path, seed=0)
    monkeypatch.setattr(gpu_kernels, "INTERPRET", True)  # the pass runs as on a GPU
    opts = dict(vision=False, **LIMITS)
    fused = build(str(tmp_path), **opts)
    base = build(str(tmp_path), disabled=frozenset({"fuse_norm_linears"}), **opts)
    monkeypatch.setattr(gpu_kernels, "INTERPRET", False)
    info = {i.name: i for i in fused.infos}["fuse_norm_linears"]
    plain, glus = MATCHES[arch]
    assert info.num_matches == plain + glus
    assert f"{plain} norm + linear, {glus} norm + gate/up" in info.detail
    assert len(_fused_ops(fused.gm)) == plain + glus and not _fused_ops(base.gm)
    ids = list(range(5, 26))
    assert torch.equal(_logits(fused, ids), _logits(base, ids))


@pytest.mark.parametrize("glu,bias", [(0, False), (24, False), (0, True), (24, True)])
def test_ops_equal_their_refs(glu, bias):
    g = torch.Generator().manual_seed(glu + bias)
    a, b = torch.randn(1, 5, 40, generator=g), torch.randn(1, 5, 40, generator=g)
    nw = torch.randn(40, generator=g)
    w = torch.randn(48, 40, generator=g)
    bb = torch.randn(48, generator=g) if bias else None
    y = torch.ops.specdeploy.norm_linear(a, nw, 1e-6, w, bb, glu)
    torch.testing.assert_close(y, norm_linear_ref(a, nw, 1e-6, w, bb, glu), rtol=1e-5, atol=1e-5)
    total, y = torch.ops.specdeploy.add_norm_linear(a, b, nw, 1e-6, w, bb, glu)
    want_total, want = add_norm_linear_ref(a, b, nw, 1e-6, w, bb, glu)
    assert torch.equal(total, want_total) and y.shape == want.shape == (1, 5, glu or 48)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
