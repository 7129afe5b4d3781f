"""Qwen3-VL(-MoE) as llama.cpp ships it: the text GGUF ("qwen3vl" / "qwen3vlmoe": Qwen3 /
Qwen3-MoE files with multimodal RoPE sections and `n_deepstack_layers`) and the mmproj with the
DeepStack mergers, written here in the converter's layouts (conversion/qwen3vl.py), against the
safetensors checkpoint they came from (the oracle: the same weights in the released layout,
itself checked against transformers in test_qwen3_vl.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError, open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import qwen3_vl
from tests.vision.conftest import rand_image
from tests.vision.mmproj_layout import write_mmproj

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
ARCHS = {"dense": gguf.MODEL_ARCH.QWEN3VL, "moe": gguf.MODEL_ARCH.QWEN3VLMOE}
TINY_PIXELS = {"min_pixels": 16 * 16, "max_pixels": 224 * 224}  # the tiny processor's limits
OPTS = dict(max_batch_size=4, max_seq_len=512, max_num_tokens=16)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = ["describe <|vision_start|><|image_pad|><|vision_end|> now", "hello there",
           "two <|vision_start|><|image_pad|><|vision_end|> and "
           "<|vision_start|><|image_pad|><|vision_end|>"]


def _images():
    a, b = rand_image(40, 56, 5), rand_image(64, 30, 6)
    return [[a], [], [b, a]]


def write_text_gguf(src: Path, out: Path, kind: str, qtype=Q.F32) -> Path:
    """The language model as the converter writes it (Qwen3VLTextModel / Qwen3VLMoeTextModel):
    `model.language_model.` names through gguf-py's map, the released fused experts
    ([E, H, 2I] / [E, I, H]) split into gate / up and transposed, the RoPE sections and the
    number of DeepStack levels."""
    from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer, quantized_or_f32

    reader = open_checkpoint(src)
    hf = reader.config
    c = hf["text_config"]
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
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_sections([*rope["mrope_section"], 0])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_num_deepstack_layers(len(hf["vision_config"]["deepstack_visual_indexes"]))
    if kind == "moe":
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    add_tokenizer(w, src, c["vocab_size"])
    for key in reader.keys():
        if key.startswith("model.visual."):
            continue
        a = reader.get(key).numpy().astype(np.float32)
        key = key.replace("model.language_model.", "model.", 1)
        if key.endswith("mlp.experts.gate_up_proj"):
            i = a.shape[2] // 2
            for proj, part in (("gate_proj", a[..., :i]), ("up_proj", a[..., i:])):
                name = names.get_name(key.replace("gate_up_proj", f"{proj}.weight"),
                                      try_suffixes=(".weight",))
                quantized_or_f32(w, name, np.ascontiguousarray(part.transpose(0, 2, 1)), qtype,
                                 qtype)
            continue
        if key.endswith("mlp.experts.down_proj"):
            name = names.get_name(key + ".weight", try_suffixes=(".weight",))
            quantized_or_f32(w, name, np.ascontiguousarray(a.transpose(0, 2, 1)), qtype, qtype)
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        quantized_or_f32(w, name, a, qtype, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def files(request, tmp_path_factory):
    kind = request.param
    d = tmp_path_factory.mktemp(f"gguf_qwen3_vl_{kind}")
    # (every layer MoE: gguf-py and llama.cpp name no dense MLP in a qwen3vlmoe file)
    src = qwen3_vl.make_tiny(d / "st", seed=4, moe=kind == "moe",
                             text_overrides={"mlp_only_layers": []} if kind == "moe" else None)
    return kind, src, write_text_gguf(src, d / "text.gguf", kind), write_mmproj(src,
                                                                                 d / "mm.gguf")


def test_the_files_hold_the_checkpoints_tensors(files):
    kind, src, text, mm = files
    gg = GGUFReader(text)
    assert gg.config["architectures"] == [{"dense": "Qwen3VLForConditionalGeneration",
                                           "moe": "Qwen3VLMoeForConditionalGeneration"}[kind]]
    cfg = qwen3_vl.Config.from_hf(gg.config)
    assert (cfg.deepstack_layers, cfg.mrope_section, cfg.mrope_interleaved) == (
        2, (4, 2, 2), True)
    a, b = load_model(text).state_dict(), load_model(src).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in b)
    tower, want = open_checkpoint(mm), open_checkpoint(src)
    assert tower.config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    keys = [k for k in want.keys() if k.startswith("model.visual.")]
    assert any("deepstack_merger_list.1.norm" in k for k in keys)
    assert set(keys) <= set(tower.keys())  # (and the patch embedding's two GGUF halves)
    assert all(torch.equal(tower.get(k), want.get(k)) for k in keys)


def test_greedy_with_images_equals_the_safetensors_vlm(files):
    """Image requests and a text one, prefill chunks splitting the images: the GGUF pair's
    greedy tokens are the safetensors checkpoint's."""
    _, src, text, mm = files
    want = [o.token_ids for o in LLM(src, **OPTS).generate(PROMPTS, GREEDY, images=_images())]
    llm = LLM(str(text), mmproj=str(mm), mm_processor_kwargs=TINY_PIXELS, **OPTS)
    assert llm.deployed.deepstack_width == 2 * 64
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, images=_images())] == want


def test_q8_0_text_file_with_ngram_drafts(files, tmp_path):
    """A Q8_0 text file (its matrices and experts on the block kernels) with the mmproj:
    n-gram drafting with images = plain greedy."""
    kind, src, _, mm = files
    text = write_text_gguf(src, tmp_path / "q8.gguf", kind, Q.Q8_0)
    gg = GGUFReader(text)
    assert gg.get_blocks("model.layers.0.self_attn.q_proj.weight") is not None
    if kind == "moe":
        assert gg.get_blocks("model.layers.0.mlp.experts.gate_up_proj") is not None
    kw = dict(mmproj=str(mm), mm_processor_kwargs=TINY_PIXELS, **OPTS)
    want = [o.token_ids for o in LLM(str(text), **kw).generate(PROMPTS, GREEDY,
                                                               images=_images())]
    spec = LLM(str(text), spec={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 3, "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY, images=_images())] == want
    assert spec.stats()["draft_steps"] > 0


def test_a_tower_of_another_depth_of_deepstack_is_refused(files, tmp_path):
    """A Qwen3.5 mmproj (no DeepStack) beside a Qwen3-VL text GGUF names the mismatch."""
    from specdeploy.models import qwen3_5_moe

    _, _, text, _ = files
    other = qwen3_5_moe.make_tiny(tmp_path / "q35", seed=1)
    mm = write_mmproj(other, tmp_path / "q35_mm.gguf")
    with pytest.raises(CheckpointError, match="0 DeepStack levels, text.gguf takes 2"):
        LLM(str(text), mmproj=str(mm), **OPTS)
