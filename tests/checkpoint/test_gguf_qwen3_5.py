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
