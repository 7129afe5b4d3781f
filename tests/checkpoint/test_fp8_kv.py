"""FP8 KV cache (ModelOpt `kv_cache_quant_algo: FP8`, per-layer k/v scales).

1. Exactness: the deployed prefill equals the independently dequantized model whose attention
   reads fp8-rounded keys and values (k -> fp8(k / s_k) * s_k, written in the test), ≤ 1e-4.
2. Against the fp32 cache of the same checkpoint: e4m3 keeps 3 mantissa bits, so each cached
   key / value is off by at most 2^-4 relative (2^-10 * s below the normal range), and the
   checkpoint's FP8 activation quantization downstream can turn a perturbed activation into
   the neighbouring e4m3 value (another step of up to 2^-4). Through the tiny NemotronH's two
   attention layers the logits stay within 8% of their scale (measured 4.8%).
3. The cache plan counts float8 pages: 1/4 of the fp32 cache's bytes per page.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdeploy.cache.handlers import PagedKV
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.deploy.build import build
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h_blocks, qwen3_5_blocks
from specdeploy.quantize_cli import make_tiny_quantized
from tests.checkpoint.quant_oracle import dequantize_dir, fake_quant_hooks

LIMITS = dict(max_batch_size=2, max_seq_len=64, max_cache_gib=0.01, page_size=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_quantized("nemotron_h", tmp_path_factory.mktemp("kv") / "q", "fp8",
                               kv_cache="fp8")


def _prefill_logits(path, ids):
    d = build(str(path), **LIMITS)
    meta = build_metadata([Segment(ids, 0, list(range(d.layout.num_pages))[:8], 0,
                                   num_logits=len(ids))])
    return d, d.forward(meta).logits


def _ids():
    return torch.randint(3, 120, (37,), generator=torch.Generator().manual_seed(4)).tolist()


def _kv_scales(path) -> list[tuple[float, float]]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        ks = sorted(k for k in h.keys() if k.endswith(".k_scale"))
        return [(h.get_tensor(k).item(),
                 h.get_tensor(k.replace("k_proj.k_scale", "v_proj.v_scale")).item()) for k in ks]


def test_fp8_kv_prefill_matches_fake_quantized_oracle(ckpt, tmp_path):
    scales = _kv_scales(ckpt)
    assert len(scales) == 2  # the tiny NemotronH's two attention layers
    in_scales = dequantize_dir(ckpt, tmp_path / "oracle")
    oracle = load_model(tmp_path / "oracle")
    calls = iter(scales * 2)
    real_attention = torch.ops.specdeploy.attention

    def fq(x, s):
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s

    def attention(q, k, v, scale, window=0):
        ks, vs = next(calls)
        return real_attention(q, fq(k, ks), fq(v, vs), scale, window)

    ids = _ids()
    with torch.no_grad(), fake_quant_hooks(oracle, in_scales, (nemotron_h_blocks,
                                                               qwen3_5_blocks)):
        proxy = nemotron_h_blocks._ops
        proxy.attention = attention  # the hooks' op proxy: attention reads rounded K/V
        want = oracle(torch.tensor([ids]))[0]
    d, got = _prefill_logits(ckpt, ids)
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), err
    info = next(i for i in d.infos if i.name == "fp8_kv_scales")
    assert "2 with the checkpoint's k/v scales" in info.detail


def test_fp8_kv_close_to_fp32_cache_and_smaller(ckpt, tmp_path):
    plain = tmp_path / "fp32kv"
    shutil.copytree(ckpt, plain)
    hqc = json.loads((plain / "hf_quant_config.json").read_text())
    hqc["quantization"]["kv_cache_quant_algo"] = None
    (plain / "hf_quant_config.json").write_text(json.dumps(hqc))
    ids = _ids()
    d8, l8 = _prefill_logits(ckpt, ids)
    d32, l32 = _prefill_logits(plain, ids)
    rel = (l8 - l32).abs().max().item() / l32.abs().max().item()
    assert 0 < rel <= 0.08, rel
    kv8 = [h for h in d8.resources if isinstance(h, PagedKV)]
    kv32 = [h for h in d32.resources if isinstance(h, PagedKV)]
    assert {h.dtype for h in kv8} == {torch.float8_e4m3fn} and kv32[0].dtype == torch.float32
    assert kv8[0].bytes_per_page(8) * 4 == kv32[0].bytes_per_page(8)
    assert "kv_cache" in "".join(d8.plan.summary())
    assert d8.gm.get_buffer(f"{kv8[0].name}_k").dtype == torch.float8_e4m3fn
