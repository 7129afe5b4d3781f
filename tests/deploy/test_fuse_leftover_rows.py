"""fuse_leftover_rows: NemotronH's ReLU² and a MoE layer's routed + shared + residual add before
the next norm, one row kernel call each where the block fusions left them.

Oracles: torch's own ops (relu then square; two adds in the graph's order) for the kernels, bit
for bit at every ISA the CPU has; for the pass, the same deployment with the pass disabled (the
torch chain it replaces), whose logits must be equal bit for bit, and greedy MTP speculation
against plain decoding.
"""
from __future__ import annotations

import pytest
import torch
from torch import fx

from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.deploy.passes import fuse_rows_late as late
from specdeploy.models import nemotron_h as nh
from specdeploy.ops import row_kernels as rk
from tests.checkpoint.test_gguf_nemotron_h import DENSE, MOE

pytestmark = pytest.mark.skipif(rk._library() is None, reason="row kernels unavailable")
LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)
SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -1e-40, 1e-20, 3e19,
           -3e19, 1.0, -1.0, 2.5, -7.0]


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 1003, 40_000])
def test_relu2_is_torchs_relu_then_square_bit_for_bit(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 10
    x[:min(n, len(SPECIAL))] = torch.tensor(SPECIAL[:min(n, len(SPECIAL))])
    want = torch.square(torch.relu(x))
    for level in (0, 1, 2):
        with rk.max_isa(level):
            got = rk.elementwise("relu2", x)
        # NaN in, NaN out (torch's relu keeps it); every other value the same bits
        assert torch.equal(torch.isnan(got), torch.isnan(want)), level
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), level
    strided = x.view(-1, 1).expand(-1, 2)[:, 1] if n > 1 else x  # a view: copied, same bits
    assert torch.equal(late.relu2_rows(strided).nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("rows,n", [(1, 7), (2, 256), (3, 1003), (70, 96)])
def test_add3_rms_norm_is_the_two_adds_then_the_norm(rows, n):
    g = torch.Generator().manual_seed(rows * n)
    a, b, c = (torch.randn(1, rows, n, generator=g) * s for s in (1.0, 3.0, 1e-3))
    w = torch.randn(n, generator=g)
    want_sum = a + (b + c)  # the graph's order: routed + shared, then the residual
    want_sum2, want_norm = rk.add_rms_norm(a, b + c, w, 1e-5)
    assert torch.equal(want_sum2, want_sum)
    for level in (0, 1, 2):
        with rk.max_isa(level):
            s, y = rk.add3_rms_norm(a, b, c, w, 1e-5)
        assert torch.equal(s, want_sum), level
        assert torch.equal(y, want_norm), level  # the norm of the same sum, the same code


def test_add3_falls_back_to_the_chain_where_the_kernel_does_not_take_it():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 3, 8, generator=g)
    b = torch.randn(3, 8, generator=g)  # broadcasts against a: torch's add, then the norm
    c = torch.randn(1, 3, 8, generator=g)
    w = torch.randn(8, generator=g)
    assert rk.add3_rms_norm(a, b, c, w, 1e-5) is None
    s, y = late.add3_rms_norm_rows(a, b, c, w, 1e-5)
    ws, wy = torch.ops.specdeploy.add_rms_norm(a, b + c, w, 1e-5)
    assert torch.equal(s, ws) and torch.equal(y, wy)


def test_a_relu_read_elsewhere_and_an_add_read_twice_are_left_alone():
    aten = torch.ops.aten
    g = fx.Graph()
    x, a, w = g.placeholder("x"), g.placeholder("a"), g.placeholder("w")
    relu = g.call_function(aten.relu.default, (x,))
    sq = g.call_function(aten.square.default, (relu,))
    add = g.call_function(aten.add.Tensor, (sq, relu))  # relu has two readers
    norm = g.call_function(torch.ops.specdeploy.add_rms_norm.default, (a, add, w, 1e-5))
    g.output((norm, add))  # the add is read outside the norm too
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert late._fuse_relu2(gm) == 0 and late._fuse_add3(gm) == 0


def _logits(dep, ids):
    pages, pos, out = list(range(16)), 0, []
    for n in (9, 3, 1, 1):
        seg = Segment(ids[pos:pos + n], pos, pages, 0, n, SEG_NORMAL)
        out.append(dep.forward(build_metadata([seg])).logits)
        pos += n
    return torch.cat(out)


@pytest.mark.parametrize("layout", ["moe", "dense"])
def test_nemotron_h_deployment_fuses_and_keeps_every_bit(tmp_path, layout):
    src = nh.make_tiny(tmp_path / "st", seed=7, mtp_layers=int(layout == "moe"),
                       hf_config=MOE if layout == "moe" else DENSE)
    dep = build(str(src), kernels="exact", **LIMITS)
    info = {i.name: i for i in dep.infos}["fuse_leftover_rows"]
    moe = MOE["hybrid_override_pattern"].count("E")
    mlp = DENSE["hybrid_override_pattern"].count("-")
    if layout == "moe":  # every MoE layer's shared expert, and its sums before the next norm
        assert info.num_matches == 2 * moe and f"{moe} relu^2, {moe} add" in info.detail, info
    else:  # dense MLP layers: ReLU² only
        assert f"{mlp} relu^2, 0 add" in info.detail, info
    left = [n for n in dep.gm.graph.nodes if n.op == "call_function"
            and any(k in str(n.target) for k in ("relu", "square"))
            and n.target is not late.relu2_rows]
    assert not left, left
    base = build(str(src), kernels="exact", disabled=frozenset({"fuse_leftover_rows"}),
                 **LIMITS)
    assert {i.name: i for i in base.infos}["fuse_leftover_rows"].skipped
    ids = torch.randint(3, 100, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(_logits(dep, ids), _logits(base, ids))


def test_greedy_mtp_on_the_fused_hybrid_equals_plain(tmp_path):
    from specdeploy import LLM, SamplingParams, SpecConfig

    src = nh.make_tiny(tmp_path / "st", seed=9, mtp_layers=1, hf_config=MOE)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 22], [40, 41, 42, 43, 40, 41]]
    plain = LLM(str(src), max_batch_size=2, max_seq_len=64)
    spec = LLM(str(src), max_batch_size=2, max_seq_len=64,
               spec=SpecConfig("mtp", 2, controller="off"))
    infos = {i.name: i for i in spec.deployed.target.infos}
    assert infos["fuse_leftover_rows"].num_matches > 0
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp)]
    assert got == want
    assert spec.stats()["draft_tokens"] > 0
