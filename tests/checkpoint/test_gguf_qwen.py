"""Qwen2 / Qwen3 / Qwen3-MoE GGUFs (llama.cpp's "qwen2" / "qwen3" / "qwen3moe": the Llama layout
without the q/k row permutation, plus q/k/v biases or per-head q/k norms, stacked experts),
written here as llama.cpp's converter
writes them (names from gguf-py's own map), against the safetensors checkpoints they came from
and transformers on those; the real converter and runtime: bench/gguf_convert_check.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import llama

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType
ARCHS = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
             "shared_expert_intermediate_size": 48, "qkv_bias": True, "norm_topk_prob": False,
             "mlp_only_layers": []}


def write_qwen_gguf(src: Path, out: Path, qtype=Q.F32) -> Path:
    from collections import defaultdict

    from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer, quantized_or_f32

    reader = open_checkpoint(src)
    c = reader.config
    kind = c["model_type"]
    names = gguf.get_tensor_name_map(ARCHS[kind], c["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[ARCHS[kind]])
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if kind in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    add_tokenizer(w, src, c["vocab_size"])
    experts = defaultdict(dict)  # the converter stacks each layer's experts, gate and up apart
    for key in reader.keys():
        a = reader.get(key).numpy().astype(np.float32)
        if ".mlp.experts." in key:
            layer, e, proj = key.split(".")[2], int(key.split(".")[5]), key.split(".")[6]
            experts[layer, proj][e] = a
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        quantized_or_f32(w, name, a, qtype, qtype)
    for (layer, proj), by_e in sorted(experts.items()):
        name = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight",
                              try_suffixes=(".weight",))
        quantized_or_f32(w, name, np.stack([by_e[e] for e in range(len(by_e))]), qtype, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param in ("qwen3_moe", "qwen2_moe"):
        from specdeploy.models import qwen3_moe

        # (every layer MoE: gguf-py and llama.cpp name no dense MLP in a qwen3moe file)
        over = QWEN2_MOE if request.param == "qwen2_moe" else {"mlp_only_layers": []}
        src = qwen3_moe.make_tiny(d / "st", seed=2, config_overrides=over)
    else:
        src = llama.make_tiny(d / "st", seed=2, config_overrides=llama.tiny_qwen_config(
            request.param))
    return request.param, src, write_qwen_gguf(src, d / "tiny.gguf")


def test_gguf_equals_the_checkpoint_and_transformers(pair):
    kind, src, path = pair
    gg = GGUFReader(path)
    assert gg.config["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                           "qwen3_moe": "Qwen3MoeForCausalLM",
                                           "qwen2_moe": "Qwen2MoeForCausalLM"}[kind]]
    qwen2 = kind in ("qwen2", "qwen2_moe")
    assert ("model.layers.0.self_attn.q_norm.weight" in gg) == (not qwen2)
    if kind == "qwen2_moe":
        assert gg.config["shared_expert_intermediate_size"] == 48
        assert "model.layers.0.mlp.shared_expert_gate.weight" in gg
    if kind == "qwen3_moe":
        assert gg.config["mlp_only_layers"] == [] and gg.config["num_experts"] == 8
        assert "model.layers.2.mlp.experts.gate_up_proj" in gg
    assert ("model.layers.0.self_attn.q_proj.bias" in gg) == qwen2
    a, b = load_model(path).state_dict(), load_model(src).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in b)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = oracle(input_ids=ids).logits
        assert (load_model(path)(ids) - want).abs().max().item() <= 1e-4 * want.abs().max()


def test_q8_0_file_on_the_fast_kernels(pair, tmp_path):
    """A Q8_0 file deploys on the block kernels (the default fast path; Qwen3-MoE's routed
    experts too): greedy plain = with n-gram drafts."""
    kind, src, _ = pair
    path = write_qwen_gguf(src, tmp_path / "q8.gguf", Q.Q8_0)
    gg = GGUFReader(path)
    assert gg.get_blocks("model.layers.0.self_attn.q_proj.weight") is not None
    if kind in ("qwen3_moe", "qwen2_moe"):
        assert gg.get_blocks("model.layers.0.mlp.experts.gate_up_proj") is not None
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42, 43]]
    plain = [o.token_ids for o in LLM(str(path), max_batch_size=2, max_seq_len=128)
             .generate(prompts, sp)]
    spec = LLM(str(path), max_batch_size=2, max_seq_len=128,
               spec={"method": "ngram", "num_draft_tokens": 3, "controller": "off"})
    assert [o.token_ids for o in spec.generate(prompts, sp)] == plain
