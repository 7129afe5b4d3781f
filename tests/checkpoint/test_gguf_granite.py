"""Granite 4.0-H GGUFs (llama.cpp's "granitehybrid"), written here as llama.cpp's converter
writes them (conversion/granite.py `GraniteHybridModel`: gguf-py's names, q/k rows permuted as
for llama's RoPE, the Mamba2 tensors as Mamba2Model writes them, the fused gate | up projections
split, the multipliers as metadata; the real converter and runtime:
bench/gguf_convert_check.py --only granite_hybrid), against the safetensors checkpoint."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import granite_hybrid as granite

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import (  # noqa: E402
    Q,
    add_tokenizer,
    permute,
    quantized_or_f32,
)


def write_granite_gguf(src: Path, out: Path, qtype=Q.F32) -> Path:
    reader = open_checkpoint(src)
    c = reader.config
    cfg = granite.Config.from_hf(c)
    n = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, n)
    w = gguf.GGUFWriter(str(out), "granitehybrid")
    w.add_block_count(n)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([c["num_key_value_heads"] if t == "attention" else 0
                         for t in cfg.block_types])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_attention_scale(c["attention_multiplier"])
    w.add_embedding_scale(c["embedding_multiplier"])
    w.add_residual_scale(c["residual_multiplier"])
    w.add_logit_scale(c["logits_scaling"])
    w.add_expert_shared_feed_forward_length(c["shared_intermediate_size"])
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_group_count(c["mamba_n_groups"])
    w.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    w.add_ssm_time_step_rank(c["mamba_n_heads"])
    w.add_rope_scaling_finetuned(False)  # (a hybrid: no RoPE)
    add_tokenizer(w, src, c["vocab_size"])
    groups = c["mamba_n_groups"]
    for key in reader.keys():
        a = reader.get(key).numpy().astype(np.float32)
        base = key.rsplit(".", 1)[0]
        if key.endswith("input_linear.weight"):  # gate | up, split
            i = a.shape[-2] // 2
            stem = "ffn_{}_exps" if a.ndim == 3 else "ffn_{}_shexp"
            bid = key.split(".")[2]
            for part, rows in (("gate", a[..., :i, :]), ("up", a[..., i:, :])):
                quantized_or_f32(w, f"blk.{bid}.{stem.format(part)}.weight",
                                 np.ascontiguousarray(rows), qtype, qtype)
            continue
        if key.endswith("output_linear.weight") and a.ndim == 3:
            quantized_or_f32(w, f"blk.{key.split('.')[2]}.ffn_down_exps.weight", a, qtype, qtype)
            continue
        if key.endswith("self_attn.q_proj.weight"):
            a = permute(a, c["num_attention_heads"])
        elif key.endswith("self_attn.k_proj.weight"):
            a = permute(a, c["num_key_value_heads"])
        elif key.endswith("A_log"):
            a = -np.exp(a)[:, None]
        elif key.endswith("mamba.D"):
            a = a[:, None]
        elif key.endswith("mamba.norm.weight"):
            a = a.reshape(groups, -1)
        elif key.endswith("conv1d.weight"):
            a = a[:, 0]
        if key.endswith("dt_bias"):
            name = f"blk.{key.split('.')[2]}.ssm_dt.bias"
        elif key.endswith(("A_log", "mamba.D")):
            name = names.get_name(key)
        else:
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, (key, base)
        quantized_or_f32(w, name, a, qtype, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_granite")
    src = granite.make_tiny(d / "st", seed=3)
    return src, write_granite_gguf(src, d / "f32.gguf")


def test_gguf_equals_the_checkpoint(pair):
    """Every parameter equals the checkpoint's (A_log within float32 rounding: through -exp
    and log again); the config's multipliers, layer kinds and NoPE too."""
    src, path = pair
    gg = GGUFReader(path)
    got, want = granite.Config.from_hf(gg.config), granite.Config.from_hf(
        open_checkpoint(src).config)
    assert all(getattr(got, f) == getattr(want, f)
               for f in ("block_types", "rope", "mamba_head_dim", "n_groups"))
    for f in ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
              "logits_scaling"):  # (GGUF stores them as float32)
        assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-7)
    a = load_model(path, dtype=torch.float32).state_dict()
    b = load_model(src, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    for k in b:
        if k.endswith("A_log"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a[k], b[k]), k


def test_q8_0_file_with_ngram_drafts(pair, tmp_path):
    """A Q8_0 file (its experts on the block kernels): n-gram drafting = plain greedy."""
    src, _ = pair
    path = write_granite_gguf(src, tmp_path / "q8.gguf", Q.Q8_0)
    assert GGUFReader(path).get_blocks("model.layers.1.block_sparse_moe.input_linear.weight") \
        is not None
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42, 43]]
    kw = dict(max_batch_size=2, max_seq_len=128)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)]
    spec = LLM(str(path), spec={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 2, "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0
