"""Gemma 3 vision-language from GGUF: a `gemma3` text GGUF with llama.cpp's `gemma3` mmproj, both
written as its converter writes them (tests/vision/gemma3_mmproj_layout.py), against the
safetensors checkpoint and transformers (fp32; the projection as the converter's F16)."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.models import gemma3
from tests.vision.conftest import rand_image
from tests.vision.test_gemma3_vl import (
    BOI,
    EOI,
    IMAGE,
    LIMITS,
    _err,
    _hf_inputs,
    _logprobs,
    _ours,
    make_tiny_vlm,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A 6-layer tiny VLM (no layer pattern: llama.cpp's default of 6, as test_gguf_gemma3.py),
    its text GGUF and mmproj, and transformers' model with the projection rounded to F16 as the
    converter stores it. Softcap 0 (none): transformers' Gemma3ForConditionalGeneration applies
    no final softcap (its Gemma3ForCausalLM does; the releases set none)."""
    pytest.importorskip("gguf")
    from tests.checkpoint.test_gguf_gemma3 import CONFIG
    from tests.vision.gemma3_mmproj_layout import write_mmproj, write_text_gguf

    d = tmp_path_factory.mktemp("gemma3_gguf")
    text_config = {**CONFIG, "final_logit_softcapping": 0.0}
    vlm = make_tiny_vlm(d / "vlm", seed=4, text_config=text_config)
    text = write_text_gguf(vlm, text_config, d / "text.gguf")
    mmproj = write_mmproj(vlm, d / "mmproj.gguf")
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        vlm, dtype=torch.float32, attn_implementation="eager").eval()
    w = hf.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        w.copy_(w.half().float())
    return vlm, text, mmproj, hf


def test_gguf_mmproj_reads_the_tower(gguf_pair):
    """Every tower and projector tensor as the checkpoint's: bit for bit (F32), the projection
    as its F16 rounding, the soft-emb norm's `1 + w` (what the norm multiplies by) too."""
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.models.gemma3_vision import load_vision

    vlm, _, mmproj, _ = gguf_pair
    a = load_vision(open_checkpoint(mmproj), torch.float32).state_dict()
    b = load_vision(open_checkpoint(vlm), torch.float32).state_dict()
    assert a.keys() == b.keys()
    proj = "multi_modal_projector.mm_input_projection_weight"
    b[proj] = b[proj].half().float()
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    a[norm], b[norm] = 1.0 + a[norm], 1.0 + b[norm]
    assert not torch.equal(b[norm], torch.ones_like(b[norm]))
    assert [k for k in b if not torch.equal(a[k], b[k])] == []


def test_gguf_with_mmproj_equals_transformers(gguf_pair):
    """`LLM(text.gguf, mmproj=...)`: prompt logprobs with an image = transformers' (F16
    projection), greedy tokens = its generate."""
    vlm, text, mmproj, hf = gguf_pair
    _hf_inputs.path = vlm
    llm = LLM(str(text), mmproj=str(mmproj), **LIMITS)
    img = rand_image(40, 50, 3)
    ids = [30, 31, 32, BOI, 40, 41, 42]
    (out,) = llm.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                          images=[img])
    got = out.prompt_token_ids
    assert got[3:13] == [98, 98, BOI, *[IMAGE] * 4, EOI, 98, 98]
    assert _err(_ours(out), _logprobs(hf, got, [img])) <= 1e-4
    hf.generation_config.eos_token_id = None
    ref = hf.generate(**_hf_inputs(got, [img]), max_new_tokens=8, do_sample=False)[0, len(got):]
    assert out.token_ids == ref.tolist()


def test_gguf_mmproj_without_image_tokens_is_refused(gguf_pair, tmp_path):
    """A Gemma 3 text GGUF whose vocabulary lacks the image tokens (a text-only model's) with
    the mmproj: refused, naming them."""
    from specdeploy.checkpoint import CheckpointError
    from tests.checkpoint.test_gguf_gemma3 import CONFIG, write_gemma3_gguf

    src = gemma3.make_tiny(tmp_path / "st", seed=1, hf_config=CONFIG)
    text = write_gemma3_gguf(src, tmp_path / "t.gguf")
    with pytest.raises(CheckpointError, match="no <start_of_image>, <end_of_image>"):
        LLM(str(text), mmproj=str(gguf_pair[2]), **LIMITS)
