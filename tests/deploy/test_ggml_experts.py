"""ggml_moe_experts: routed experts of a GGUF checkpoint (stacked Q4_0 / Q4_1 / Q8_0 blocks) run
on their blocks in the deployed graph.

Oracles: `moe_experts_ref` over the weights dequantized by gguf-py (op level), the plain model
loaded from the same file (fp32 weights, its own `moe_experts`), and the non-speculative path
for greedy speculative decoding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.deploy.passes.ggml_calls import MAX_ROWS
from specdeploy.deploy.passes.ggml_experts import experts_fn
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h as nh
from specdeploy.models import qwen3_5_moe as q35
from specdeploy.ops import ggml_int, ggml_moe_int
from specdeploy.ops.ggml_linear import expert, kernel_unavailable, make_weight
from specdeploy.ops.moe import moe_experts_ref
from specdeploy.ops.moe_grouped import expert_activation
from tests.deploy.conftest import assert_close

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import Q  # noqa: E402
from tests.checkpoint.gguf_nemotron_h_layout import write_gguf as write_nh  # noqa: E402
from tests.checkpoint.gguf_qwen3_5_layout import write_gguf as write_q35  # noqa: E402
from tests.checkpoint.test_gguf_nemotron_h import MOE  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"ggml kernel unavailable: {kernel_unavailable()}")
LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)
KINDS = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}


def _stacked(kind: str, e: int, n: int, k: int, seed: int):
    """Random stacked experts as blocks, and gguf-py's dequantization of them (the oracle's)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((e, n, k)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w, KINDS[kind])
    values = torch.from_numpy(gguf.quants.dequantize(raw, KINDS[kind]).reshape(e, n, k).copy())
    return make_weight(kind, torch.from_numpy(raw.copy()), (e, n, k)), values


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("tokens", [1, 5, 2 * MAX_ROWS + 3])  # the last: > MAX_ROWS an expert
def test_op_matches_the_reference_on_dequantized_weights(kind, activation, tokens):
    e, h, inter, k = 4, 64, 32, 2
    up, up_v = _stacked(kind, e, inter * (2 if activation == "swiglu" else 1), h, 1)
    down, down_v = _stacked(kind, e, h, inter, 2)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    wts = torch.rand(tokens, k, generator=g)
    got = experts_fn(up, down, activation, None)(x, ids, wts)
    want = moe_experts_ref(x, ids, wts, up_v, down_v, activation)
    assert_close(got, want, rtol=1e-5)  # fp32 values; the sums in another order
    if ggml_int.kernel_unavailable() is None:  # 8-bit activations (llama.cpp's model)
        isa = ggml_int.default_isa()
        fast = experts_fn(up, down, activation, isa)(x, ids, wts)
        # the oracle: token by token, each expert's matrices through ggml_linear_int (checked
        # against its own error bound in tests/ops/test_ggml_int.py); the same bits a row,
        # summed over the k experts in another order
        want_fast = torch.zeros_like(x)
        for t_ in range(tokens):
            for j in range(k):
                ex = int(ids[t_, j])
                hid = ggml_int.ggml_linear_int(x[t_:t_ + 1], expert(up, ex), None, isa)
                hid = expert_activation(hid, activation)
                y = ggml_int.ggml_linear_int(hid, expert(down, ex), None, isa)
                want_fast[t_] += wts[t_, j] * y[0]
        # (Q4_0 / Q4_1 / Q8_0 experts run on tiled copies: another fp32 summation of the same
        # integer products, bits checked against a tiled composition in tests/ops)
        assert_close(fast, want_fast, rtol=1e-5)


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5_moe"])
def q8_gguf(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"ggml_experts_{request.param}")
    if request.param == "nemotron_h":
        src = nh.make_tiny(d / "st", seed=11, mtp_layers=1, hf_config=MOE)
        return write_nh(src, d / "q8.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q8_0), 2
    src = q35.make_tiny(d / "st", seed=11, mtp_layers=1)
    return write_q35(src, d / "q8.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q8_0), 4


def test_experts_run_on_blocks_and_match_the_plain_model(q8_gguf):
    """Every MoE layer's experts on blocks, no fp32 expert weight left in the graph; prefill
    (> MAX_ROWS rows), a 4-row chunk and decode steps against the plain model's logits."""
    path, n_moe = q8_gguf
    dep = build(str(path), **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_moe_experts"]
    assert info.num_matches == n_moe, info
    assert not [n for n in dep.gm.graph.nodes if n.target is torch.ops.specdeploy.moe_experts
                .default]
    assert not [n for n, p in dep.gm.named_parameters() if p.dim() == 3 and "expert" in n]
    model = load_model(path)
    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)[0]
    pages, pos = list(range(16)), 0
    # (a hybrid's multi-row steps are prefill chunks here: verify steps need the speculative
    # engine's state resources; the last test covers them)
    for n in (21, 1, 4, 1):
        seg = Segment(ids[0, pos:pos + n].tolist(), pos, pages, 0, n, SEG_NORMAL)
        got = dep.forward(build_metadata([seg])).logits
        assert_close(got, want[pos:pos + n], rtol=1e-5)  # fp32, other summation order
        pos += n


def test_experts_load_deferred(q8_gguf):
    """Where the pass runs, the experts' fp32 values are never written (placeholders)."""
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.loading import load_model_from_reader

    path, _ = q8_gguf
    model = load_model_from_reader(open_checkpoint(path), "float32", defer_blocks=True)
    deferred = [n for n in model.ggml_deferred if "experts" in n]
    assert deferred and all(model.get_parameter(n).abs().sum() == 0 for n in deferred)


def test_greedy_speculation_equals_plain_on_quantized_experts(q8_gguf):
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain

    assert_mtp_equals_plain(q8_gguf[0], max_tokens=20)


def test_fast_kernels_run_each_moe_layer_in_one_call(q8_gguf):
    """With kernels="fast" each MoE layer's experts are one C call (ops/ggml_moe_int.py; its
    bits checked in tests/ops/test_ggml_moe_int.py), logits within the 8-bit activations'
    error of the plain model's."""
    if ggml_moe_int.unavailable():
        pytest.skip(f"one-call MoE kernel unavailable: {ggml_moe_int.unavailable()}")
    path, n_moe = q8_gguf
    dep = build(str(path), kernels="fast", **LIMITS)
    # (each in a fused MoE block where the block matches: tests/deploy/test_fuse_moe_blocks.py)
    calls = [n for n in dep.gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "") in ("experts_one_call", "moe_block")]
    assert len(calls) == n_moe
    model = load_model(path)
    ids = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)[0]
    seg = Segment(ids[0].tolist(), 0, list(range(16)), 0, 12, SEG_NORMAL)
    got = dep.forward(build_metadata([seg])).logits
    # 8-bit activations (llama.cpp's model) through every linear: on average a few percent of
    # the logits' spread (its largest: 0.58 of 1.02 on the tiny Qwen3.5, the same with the
    # per-expert calls: SPECDEPLOY_GGML_MOE=0)
    assert (got - want).abs().mean() <= 0.05 * want.std()


def test_the_report_counts_the_blocks_a_fused_moe_block_holds(q8_gguf):
    """`weight_bytes` (the report's "weights resident") finds every block a deployment holds:
    with "fast" the experts sit in a fused MoE block's parts and the linears it replaced in its
    fallback chain, with "exact" in the per-expert loop's closure. Either way the same bytes
    (Q8_0's tiled copies are its blocks' bytes), and at least the file's blocks (besides them:
    the few fp32 vectors fused ops took out of the parameters). Before the walk entered the
    fused block, "fast" reported the NemotronH IQ3_M file's 117 MB as 5.6 MB."""
    path, _ = q8_gguf
    blocks = sum(g.blocks.nbytes for g in load_model(path).ggml_weights.values())
    fast, exact = (build(str(path), kernels=k, **LIMITS) for k in ("fast", "exact"))
    assert any(n.op == "call_function" and getattr(n.target, "__name__", "") == "moe_block"
               for n in fast.gm.graph.nodes) or ggml_moe_int.unavailable()
    held = fast.weight_bytes().closures
    assert held == exact.weight_bytes().closures and held >= blocks

