"""NemotronH from GGUF (llama.cpp's "nemotron_h" / "nemotron_h_moe"): the config from its
metadata, its tensors in the HF layout, logits equal to transformers' on the safetensors
checkpoint the GGUF was converted from, quantized tensors equal to an independent dequantizer,
and the MTP head folded into the GGUF's last block serving speculation.

The GGUFs are written the way llama.cpp's converter writes them (tests/checkpoint/
gguf_nemotron_h_layout.py: names from gguf-py's map, values changed as the converter does).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h as nh

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tests.checkpoint.gguf_nemotron_h_layout import Q, write_gguf  # noqa: E402

TOL = 1e-4  # fp32 logits against transformers (as tests/models/test_nemotron_h.py)


def _hf(pattern: str, mtp: int = 0) -> dict:
    hf = nh.tiny_hf_config(mtp)
    # NOTE: llama.cpp routes without expert groups (gguf_nemotron_h.py), so the checkpoint has
    # one group; a GGUF cannot hold MLP layers beside MoE ones, and llama.cpp's converter takes
    # any config with `num_experts_per_tok` as MoE (so the dense one has no MoE keys)
    hf.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern), n_group=1,
              topk_group=1)
    if "E" not in pattern:
        for k in [k for k in hf if "expert" in k or k.startswith("moe_")
                  or k in ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")]:
            del hf[k]
    return hf


DENSE = _hf("M*M-*M")
_MOE_ONLY = {"moe_intermediate_size", "moe_latent_size", "n_group", "topk_group",
             "norm_topk_prob", "routed_scaling_factor", "moe_shared_expert_intermediate_size"}
MOE = _hf("M*EM*E", mtp=1)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"gguf_nh_{request.param}")
    src = nh.make_tiny(d / "st", seed=5, mtp_layers=0 if request.param == "dense" else 1,
                       hf_config=DENSE if request.param == "dense" else MOE)
    return src, write_gguf(src, d / "tiny.gguf")


def test_config_from_metadata(pair):
    src, path = pair
    want = nh.Config.from_hf(open_checkpoint(src).config).__dict__
    got = nh.Config.from_hf(GGUFReader(path).config).__dict__
    # chunk_size is the SSD kernel's block (not stored; any value computes the same scan); a
    # dense model's MoE fields, a MoE one's MLP width, are unused (not stored); eps is stored
    # as float32
    skip = {"chunk_size", "eps"} | ({k for k in want if "expert" in k or k in _MOE_ONLY}
                                    if "moe" not in want["block_types"] else set())
    skip |= {"intermediate_size"} if "mlp" not in want["block_types"] else set()
    assert {k: v for k, v in got.items() if k not in skip} == {
        k: v for k, v in want.items() if k not in skip}
    assert got["eps"] == pytest.approx(want["eps"], rel=1e-6)


def test_tensors_equal_safetensors(pair):
    src, path = pair
    st, gg = open_checkpoint(src), GGUFReader(path)
    cfg = st.config
    for key in st.keys():
        ours = key.replace("backbone.", "model.", 1)  # transformers' names (the model's own)
        if ".mixer.experts." in key:  # stacked in the GGUF
            head, e, proj = ours.rsplit(".", 3)[0], int(key.split(".")[5]), key.rsplit(".", 2)[1]
            got = gg.get(f"{head}.{proj}")[e]
        else:
            got = gg.get(ours)
        want = st.get(key)
        assert got.shape == want.shape, key
        if key.endswith("A_log"):  # through -exp and log again
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        else:
            assert torch.equal(got, want), key
    assert cfg["num_hidden_layers"] == gg.config["num_hidden_layers"]


@torch.no_grad()
def test_logits_match_transformers(pair):
    src, path = pair
    oracle = transformers.NemotronHForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(path, dtype="float32")
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(1))
    want = oracle(ids, use_cache=False).logits
    got = ours(ids)
    assert want.std() > 0.1
    assert (got - want).abs().max().item() <= TOL


def test_quantized_tensors_equal_independent_dequantizer(tmp_path):
    """Q8_0 2-D weights and Q8_0 stacked experts: every tensor the reader returns equals
    transformers' GGUF dequantizer on the stored bytes (then the converter's layout undone)."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    src = nh.make_tiny(tmp_path / "st", seed=6, mtp_layers=1, hf_config=MOE)
    path = write_gguf(src, tmp_path / "q.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q8_0)
    gg = GGUFReader(path)
    cfg = gg.config
    quantized = 0
    for hf in gg.keys():
        info = gg.tensor_infos[gg._where[hf]]
        if info.ggml_type == int(Q.F32):
            continue
        quantized += 1
        raw = torch.from_numpy(np.asarray(gg._data[info.offset:info.offset + info.nbytes]).copy())
        want = hf_dequantize(raw, info.ggml_type).reshape(info.shape).numpy()
        if info.name.endswith("attn_q.weight"):
            want = _unpermute(want, cfg["num_attention_heads"])
        elif info.name.endswith("attn_k.weight"):
            want = _unpermute(want, cfg["num_key_value_heads"])
        np.testing.assert_array_equal(gg.get(hf).numpy(), want, err_msg=hf)
        if len(info.shape) == 2:  # the block kernels' raw blocks, rows in the same order
            assert gg.get_blocks(hf) is not None
    assert quantized >= 20
    assert any(n.endswith("_exps.weight") and i.ggml_type == int(Q.Q8_0)
               for n, i in gg.tensor_infos.items())


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`: rows [heads, half, 2] back to [heads, 2, half]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llm_serves_gguf_with_its_mtp_head(tmp_path):
    """LLM on the GGUF: its tokenizer from the metadata, and the MTP head of the GGUF's last
    block drafting; greedy speculative output equals greedy plain output."""
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain

    src = nh.make_tiny(tmp_path / "st", seed=7, mtp_layers=1, hf_config=MOE)
    plain, _ = assert_mtp_equals_plain(write_gguf(src, tmp_path / "m.gguf"))
    tok = plain.tokenizer
    assert tok.decode(tok.encode("abc d", add_special_tokens=False)) == "abc d"
