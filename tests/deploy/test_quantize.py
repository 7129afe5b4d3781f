"""Weight-only int8: the op against its ref, and the QUANTIZE pass on tiny llama / nemotron_h /
qwen3_5_moe graphs.

Two references for the quantized graph:
- the plain model with every quantized weight replaced by its dequantized value: the pass must
  reproduce it up to fp32 reassociation (≤ 1e-4 of the logits' scale) — this checks the rewrite;
- the fp graph: logits differ by quantization noise only. Per-channel symmetric int8 rounds each
  weight by at most scale/2 = max|row|/254 (0.4% of the row's largest weight); with independent
  signs that is ~0.5% per matmul, ~1% after the tiny Llama's 2 layers. We allow 3% of the logits'
  scale. (MoE models are not held to this bound: a perturbed router input can flip a top-k
  expert choice, a discrete jump; they are held to the first reference instead.)
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.passes.quantize import is_excluded
from specdeploy.deploy.pipeline import run_transform
from specdeploy.loading import load_model
from specdeploy.ops.quant_linear import dequantize_int8, int8_linear_ref, quantize_int8

int8_linear = torch.ops.specdeploy.int8_linear
FAMILIES = ("llama", "nemotron_h", "qwen3_5_moe")
# linears whose weight is a parameter, minus lm_head and MoE routers (see each tiny config):
# llama 2 layers × (q, k, v, o, gate, up, down); nemotron_h "M*M-E*ME": 3 × (in, out) mamba,
# 2 × (q, k, v, o) attention, 1 MLP (up, down), 2 MoE × (fc1/fc2 latent, shared up/down), its
# router reads a cast weight; qwen3_5_moe: 3 GDN × (qkv, z, a, b, out) + 1 attention × 4 +
# 4 shared experts × 3.
EXPECTED_MATCHES = {"llama": 14, "nemotron_h": 24, "qwen3_5_moe": 31}


def _excluded_by_default(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith((".gate.weight",
                                                       ".shared_expert_gate.weight"))


# ---- the op --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 64, 96), (1, 7, 63, 7), (2, 33, 160, 64), (5, 0, 16, 8)])
@pytest.mark.parametrize("with_bias", (True, False))
def test_int8_linear_matches_ref(shape, with_bias, close):
    b, t, k, n = shape
    torch.manual_seed(0)
    x = torch.randn(b, t, k)
    q = quantize_int8(torch.randn(n, k))
    bias = torch.randn(n) if with_bias else None
    y = int8_linear(x, q.weight, q.scale, bias)
    assert y.shape == (b, t, n) and y.dtype == x.dtype
    close(y, int8_linear_ref(x, q.weight, q.scale, bias), rtol=1e-5)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("rows", (0, 1, 9))
def test_int8_linear_half_inputs(dtype, rows, close):
    """bf16 runs the int8 GEMM kernel with bf16 scales; allow bf16 / fp16 output rounding."""
    torch.manual_seed(0)
    x = torch.randn(rows, 64).to(dtype)
    q = quantize_int8(torch.randn(32, 64))
    bias = torch.randn(32)
    y = int8_linear(x, q.weight, q.scale, bias)
    assert y.dtype == dtype and y.shape == (rows, 32)
    close(y.float(), int8_linear_ref(x, q.weight, q.scale, bias).float(), rtol=1e-2)


def test_quantize_int8_rounding_bound():
    torch.manual_seed(0)
    w = torch.randn(16, 40)
    w[3] = 0.0  # an all-zero row must not divide by zero
    q = quantize_int8(w)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (16,)
    assert q.weight.abs().max() <= 127
    err = (dequantize_int8(q.weight, q.scale) - w).abs()
    assert (err <= q.scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(dequantize_int8(q.weight, q.scale)[3], torch.zeros(40))


def test_int8_linear_op_registration():
    torch.manual_seed(0)
    q = quantize_int8(torch.randn(7, 64))
    args = (torch.randn(3, 5, 64), q.weight, q.scale, torch.randn(7))
    torch.library.opcheck(int8_linear.default, args)  # schema, fake kernel, dynamic shapes


# ---- exclusions: names, and the drafter namespace ----------------------------------------------


def test_exclusion_patterns():
    default = DeployContext(model=None).quant_exclude
    assert is_excluded("lm_head.weight", default)
    assert is_excluded("model.layers.0.mlp.gate.weight", default)  # MoE routers
    assert is_excluded("model.layers.4.mixer.gate.weight", default)
    assert not is_excluded("model.layers.0.mlp.gate_proj.weight", default)
    assert is_excluded("eagle_drafter.fc.weight", default)
    assert is_excluded("eagle_drafter.lm_head.weight", default)
    assert is_excluded("shared_lm_head.weight", default)  # the target's head lent to a drafter
    assert not is_excluded("model.layers.0.self_attn.q_proj.weight", default)
    # target patterns never reach into the drafter namespace, drafter patterns never out of it
    assert not is_excluded("eagle_drafter.layers.0.self_attn.q_proj.weight", ("*q_proj*",))
    assert not is_excluded("eagle_drafter.midlayer.q_proj.weight", ("*",))
    assert is_excluded("eagle_drafter.midlayer.q_proj.weight", ("eagle_drafter.*q_proj",))
    assert not is_excluded("model.q_proj.weight", ("eagle_drafter*",))


class _TargetAndDrafter(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(16, 16)
        self.eagle_drafter = nn.Module()
        self.eagle_drafter.q_proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.q_proj(x), self.eagle_drafter.q_proj(x)


@pytest.mark.parametrize("exclude,want", [
    (("*q_proj",), {"eagle_drafter.q_proj.weight"}),
    (("eagle_drafter.*",), {"q_proj.weight"}),
    (("eagle_drafter.*", "q_proj"), set()),
])
def test_drafter_namespace_in_graph(exclude, want):
    torch.manual_seed(0)
    gm = torch.export.export(_TargetAndDrafter(), (torch.randn(3, 16),), strict=False).module()
    ctx = DeployContext(model=None, quantize="int8", quant_exclude=exclude)
    info, _ = run_transform("quantize_int8_weights", gm, ctx)
    kept = {n for n, _ in gm.named_parameters() if n.endswith("weight")}
    assert {"q_proj.weight", "eagle_drafter.q_proj.weight"} - kept == want
    assert info.num_matches == len(want)


def test_unknown_method_fails():
    gm = torch.export.export(_TargetAndDrafter(), (torch.randn(3, 16),), strict=False).module()
    with pytest.raises(ValueError, match="quantize"):
        run_transform("quantize_int8_weights", gm, DeployContext(model=None, quantize="int4"))


# ---- the pass on the tiny families ---------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def quantized(request, tiny_dir):
    family = request.param
    model = load_model(tiny_dir(family), dtype="float32")
    gm = export_model(model, max_tokens=512)
    torch.manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (1, 13))
    pos = torch.arange(13)[None]
    with torch.inference_mode():
        fp_logits = gm(ids, pos)[0]
    fp_gm = copy.deepcopy(gm)
    info, _ = run_transform("quantize_int8_weights", gm,
                            DeployContext(model=model, quantize="int8"))
    with torch.inference_mode():
        q_logits = gm(ids, pos)[0]
    return dict(family=family, model=model, fp_gm=fp_gm, gm=gm, info=info, ids=ids, pos=pos,
                fp_logits=fp_logits, q_logits=q_logits)


def _linear_weight_names(gm) -> list[str]:
    return [n.args[1].target for n in gm.graph.nodes
            if n.target is torch.ops.aten.linear.default and n.args[1].op == "get_attr"]


def test_match_count_and_names(quantized):
    want = [n for n in _linear_weight_names(quantized["fp_gm"]) if not _excluded_by_default(n)]
    assert quantized["info"].num_matches == len(want) == EXPECTED_MATCHES[quantized["family"]]
    gm = quantized["gm"]
    params = dict(gm.named_parameters())
    buffers = dict(gm.named_buffers())
    for name in want:
        assert name not in params, f"{name}: fp weight still in the graph module"
        assert buffers[f"{name}_int8"].dtype == torch.int8
        assert buffers[f"{name}_scale"].dtype == torch.float32
    assert sum(1 for n in gm.graph.nodes if n.target is torch.ops.specdeploy.int8_linear.default
               ) == len(want)


def test_excluded_untouched(quantized):
    model_params = dict(quantized["model"].named_parameters())
    left = _linear_weight_names(quantized["gm"])
    excluded = [n for n in _linear_weight_names(quantized["fp_gm"]) if _excluded_by_default(n)]
    assert "lm_head.weight" in excluded
    assert sorted(left) == sorted(excluded)
    params = dict(quantized["gm"].named_parameters())
    for name in excluded:
        assert params[name].dtype == torch.float32
        assert torch.equal(params[name], model_params[name])


def test_memory_drops(quantized):
    def nbytes(gm):
        return sum(t.numel() * t.element_size()
                   for t in [*gm.parameters(), *gm.buffers()])

    fp_params = dict(quantized["fp_gm"].named_parameters())
    names = [n for n in _linear_weight_names(quantized["fp_gm"]) if not _excluded_by_default(n)]
    saved = sum(3 * fp_params[n].numel() - 4 * fp_params[n].shape[0] for n in names)
    assert nbytes(quantized["fp_gm"]) - nbytes(quantized["gm"]) == saved


def test_logits_equal_dequantized_model(quantized, close):
    deq = copy.deepcopy(quantized["model"])
    qbuf = dict(quantized["gm"].named_buffers())
    with torch.no_grad():
        for name, p in deq.named_parameters():
            if f"{name}_int8" in qbuf:
                p.copy_(dequantize_int8(qbuf[f"{name}_int8"], qbuf[f"{name}_scale"]))
        want = deq(quantized["ids"], quantized["pos"])
    close(quantized["q_logits"], want, rtol=1e-4)


def test_logits_close_to_fp(quantized, close):
    if quantized["family"] != "llama":
        pytest.skip("MoE routing may flip under any perturbation; see the module docstring")
    close(quantized["q_logits"], quantized["fp_logits"], rtol=3e-2)
    err = (quantized["q_logits"] - quantized["fp_logits"]).abs().max()
    assert err > 0  # something was actually quantized


def test_build_deployed_int8_frees_fp_weights(tiny_dir, close):
    """`build(quantize="int8")`: the report counts the matches, the step's logits are
    within the quantization bound, and the plain model's fp weights are freed once dropped."""
    from specdeploy.cache.metadata import Segment, build_metadata
    from specdeploy.deploy.build import build

    model = load_model(tiny_dir("llama"), dtype="float32")
    q_proj = weakref.ref(model.model.layers[0].self_attn.q_proj.weight)
    head = weakref.ref(model.lm_head.weight)
    ids = list(range(3, 20))
    with torch.inference_mode():
        fp = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
    dep = build(model=model, quantize="int8", max_batch_size=2, max_seq_len=64,
                         page_size=4, max_cache_gib=0.01)
    del model
    gc.collect()
    assert q_proj() is None, "the quantized layer's fp weight is still alive"
    assert head() is not None  # excluded: the graph still uses it
    assert "quantize_int8_weights" in dep.report() and "14 matches" in dep.report()
    out = dep.forward(build_metadata([Segment(ids, 0, [0, 1, 2, 3, 4], slot=0)]))
    close(out.logits[0], fp, rtol=3e-2)
