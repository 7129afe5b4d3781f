"""Qwen3.5-MoE from GGUF (llama.cpp's "qwen35moe"): the config from its metadata, its tensors
in the HF layout (norms back from 1 + w, value heads back from the converter's tiled order,
gate and up experts joined), logits equal to transformers' on the safetensors checkpoint the
GGUF was converted from, quantized tensors equal to an independent dequantizer, and the MTP
head of its trailing block serving speculation.

The GGUFs are written the way llama.cpp's converter writes them (tests/checkpoint/
gguf_qwen3_5_layout.py); bench/gguf_convert_check.py checks the same reader against llama.cpp's
real converter and runtime.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import qwen3_5_moe as q35

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tests.checkpoint.gguf_qwen3_5_layout import Q, write_gguf  # noqa: E402

TOL = 1e-4  # fp32 logits against transformers (as tests/models/test_qwen3_5_moe.py)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_q35")
    src = q35.make_tiny(d / "st", seed=4, mtp_layers=1)
    return src, write_gguf(src, d / "tiny.gguf")


def test_config_from_metadata(pair):
    src, path = pair
    gg = GGUFReader(path)
    from specdeploy.checkpoint import open_checkpoint

    want = q35.Config.from_hf(open_checkpoint(src).config).__dict__
    got = q35.Config.from_hf(gg.config).__dict__
    assert want["linear_num_key_heads"] < want["linear_num_value_heads"]  # heads reordered
    assert {k: v for k, v in got.items() if k != "rms_norm_eps"} == {
        k: v for k, v in want.items() if k != "rms_norm_eps"}
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"], rel=1e-6)  # float32


def test_a_requantized_file_loads(pair, tmp_path):
    """A GGUF rewritten by llama-quantize (every published Q4_K_M) stores a tensor without its
    trailing size-1 ggml dims: shared_expert_gate [1, H] as [H]. It loads, to the same values
    (it was refused: "has shape (H,), model expects (1, H)")."""
    src, path = pair
    squeezed = write_gguf(src, tmp_path / "requantized.gguf", requantized=True)
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    assert tuple(GGUFReader(squeezed).get(name).shape) == (
        GGUFReader(path).get(name).shape[-1],)  # the file as llama-quantize writes it
    a = load_model(squeezed, dtype="float32", with_mtp=True).state_dict()
    b = load_model(path, dtype="float32", with_mtp=True).state_dict()
    assert a.keys() == b.keys() and a[name].shape == b[name].shape
    for k in b:
        assert torch.equal(a[k], b[k]), k


def test_model_equals_the_safetensors_one(pair):
    """Every parameter loaded from the GGUF, MTP head included, is the safetensors one
    (A_log within float32 rounding)."""
    src, path = pair
    a = load_model(path, dtype="float32", with_mtp=True).state_dict()
    b = load_model(src, dtype="float32", with_mtp=True).state_dict()
    assert a.keys() == b.keys() and any(k.startswith("mtp.") for k in a)
    for k in b:
        if k.endswith("A_log"):  # through -exp and log again
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[k], b[k]), k


@torch.no_grad()
def test_logits_match_transformers(pair):
    src, path = pair
    oracle = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(path, dtype="float32")
    ids = torch.randint(0, 120, (2, 23), generator=torch.Generator().manual_seed(2))
    want = oracle(input_ids=ids).logits
    assert want.std() > 0.1
    assert (ours(ids) - want).abs().max().item() <= TOL


def test_quantized_tensors_equal_independent_dequantizer(tmp_path):
    """Q8_0 matrices and experts: the reader's values equal transformers' GGUF dequantizer on
    the stored bytes, with the converter's changes undone here (value-head order)."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    from tests.checkpoint.gguf_qwen3_5_layout import tiled

    src = q35.make_tiny(tmp_path / "st", seed=8)
    path = write_gguf(src, tmp_path / "q.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q8_0)
    gg = GGUFReader(path)
    t = gg.config["text_config"]
    nk, nv, dv = t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_value_head_dim"]
    checked = 0
    for name, info in gg.tensor_infos.items():
        if info.ggml_type == int(Q.F32):
            continue
        raw = torch.from_numpy(np.asarray(gg._data[info.offset:info.offset + info.nbytes]).copy())
        want = hf_dequantize(raw, info.ggml_type).reshape(info.shape).numpy()
        # tiled -> grouped value heads: `tiled` with the two head counts' roles swapped
        if name.endswith("attn_gate.weight"):
            want = tiled(want, 0, nv // nk, nk, dv)
        elif name.endswith("attn_qkv.weight"):
            qk = 2 * nk * t["linear_key_head_dim"]
            want = np.concatenate([want[:qk], tiled(want[qk:], 0, nv // nk, nk, dv)])
        elif name.endswith(("ssm_alpha.weight", "ssm_beta.weight")):
            want = tiled(want, 0, nv // nk, nk, 1)
        elif name.endswith("ssm_out.weight"):
            want = tiled(want, 1, nv // nk, nk, dv)
        got = gg._hf_array(name)
        np.testing.assert_array_equal(got, want, err_msg=name)
        checked += 1
    assert checked >= 15
    joined = gg.get("model.layers.0.mlp.experts.gate_up_proj")  # [E, 2I, H]: gate rows first
    inter = t["moe_intermediate_size"]
    gate, up = (torch.from_numpy(gg._hf_array(f"blk.0.ffn_{p}_exps.weight"))
                for p in ("gate", "up"))
    assert torch.equal(joined[:, :inter], gate) and torch.equal(joined[:, inter:], up)


def test_llm_serves_gguf_with_its_mtp_head(tmp_path):
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain

    src = q35.make_tiny(tmp_path / "st", seed=9, mtp_layers=1)
    assert_mtp_equals_plain(write_gguf(src, tmp_path / "m.gguf"))


def test_q8_0_ssm_out_reorders_whole_blocks(tmp_path):
    """With Q8_0 blocks of 32 columns and value heads of 64, `ssm_out`'s column reorder moves
    whole blocks: the loader reorders the blocks themselves (no gather left, so the tiled
    kernels take it), and the values are the fp32 tensor the reader dequantizes and reorders
    with numpy, exactly; the fast deployment runs it on a tiled copy."""
    from specdeploy.deploy.build import build
    from specdeploy.ops.ggml_linear import dequantize

    hf = q35.tiny_hf_config(1)
    hf["text_config"]["linear_value_head_dim"] = 64
    src = q35.make_tiny(tmp_path / "st", seed=4, mtp_layers=1, hf_config=hf)
    path = write_gguf(src, tmp_path / "q.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q8_0)
    model = load_model(path)
    params = dict(model.named_parameters())
    outs = [n for n in model.ggml_weights if n.endswith("linear_attn.out_proj.weight")]
    assert len(outs) == 3
    for name in outs:
        gw = model.ggml_weights[name]
        assert gw.kind == "q8_0" and gw.gather is None
        assert torch.equal(dequantize(gw), params[name].detach())
    dep = build(str(path), kernels="fast", max_batch_size=2, max_seq_len=64, page_size=4,
                max_cache_gib=0.02)
    tiled = [n for n in dep.gm.graph.nodes if getattr(n.target, "tiled_call", None) is not None]
    assert len(tiled) >= 3 * 2  # each GDN layer's in_proj and out_proj at least


def test_kquant_ssm_out_keeps_its_blocks_with_reordered_columns(tmp_path):
    """`ssm_out`'s value-head columns are stored reordered (tiled, when key heads < value heads)
    and a K-quant block spans two heads, so the blocks stay as stored and the kernels read x's
    columns in that order: the blocks' values (gather applied) equal the fp32 tensor the
    reader dequantizes and reorders with numpy, and the deployed model on them gives the plain
    model's logits (exact kernel: fp32 order only; fast: the 8-bit activation model)."""
    from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
    from specdeploy.deploy.build import build
    from specdeploy.ops.ggml_linear import dequantize, ggml_linear

    hf = q35.tiny_hf_config(1)
    hf["text_config"]["linear_value_head_dim"] = 64  # 4 heads x 64: one Q4_K block per row
    src = q35.make_tiny(tmp_path / "st", seed=4, mtp_layers=1, hf_config=hf)
    path = write_gguf(src, tmp_path / "k.gguf", qtype=Q.Q4_K, expert_qtype=Q.Q4_K)
    model = load_model(path)
    params = dict(model.named_parameters())
    outs = [n for n in model.ggml_weights if n.endswith("linear_attn.out_proj.weight")]
    assert len(outs) == 3
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for name in outs:
        gw = model.ggml_weights[name]
        assert gw.kind == "q4_k" and gw.gather is not None
        assert not torch.equal(gw.gather, torch.arange(256))  # a real reorder
        assert torch.equal(dequantize(gw), params[name].detach())
        torch.testing.assert_close(ggml_linear(x, gw), x @ params[name].detach().t(),
                                   rtol=1e-5, atol=1e-5)
    ids = torch.randint(3, 120, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids)[0]
    for kernels, tol in (("exact", 1e-5), ("fast", 5e-2)):
        dep = build(str(path), kernels=kernels, kv_cache_dtype="float32", max_batch_size=2,
                    max_seq_len=64, page_size=4, max_cache_gib=0.02)
        left = [n.args[1].target for n in dep.gm.graph.nodes
                if n.target is torch.ops.aten.linear.default]
        assert not [t for t in left if "out_proj" in t], left
        if kernels == "fast":  # x's columns reordered, then the tiled copy (no fused call)
            info = {i.name: i for i in dep.infos}["ggml_linears"]
            assert "tiled: 3 of 3 linears" in info.detail, info.detail  # the 3 out_proj
        pos = 0
        for n in (21, 4, 1):  # a prefill above 16 rows (dequantized on "exact"), then decodes
            seg = Segment(ids[0, pos:pos + n].tolist(), pos, list(range(16)), 0, n, SEG_NORMAL)
            got = dep.forward(build_metadata([seg])).logits
            err = (got - want[pos:pos + n]).abs().max() / want.abs().max()
            assert err < tol, (kernels, n, err.item())
            pos += n
