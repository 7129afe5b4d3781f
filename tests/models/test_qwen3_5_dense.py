"""Dense Qwen3.5 (`Qwen3_5ForConditionalGeneration` / `Qwen3_5ForCausalLM`: the MoE family's
blocks with a SwiGLU MLP): logits equal transformers' own classes; the deployment's greedy
tokens with an image and a video equal transformers' `generate`; MTP drafting is lossless."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import load_model
from specdeploy.models import qwen3_5_moe as q35

transformers = pytest.importorskip("transformers")
# fp32, relative to the largest logit (~4 here): the tiny random net's gated delta rule
# amplifies summation-order differences at an odd position to ~3e-4 absolute (8e-5 relative)
RTOL = 1e-4
IMAGE, VIDEO = 126, 127


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return q35.make_tiny(tmp_path_factory.mktemp("q35_dense"), seed=3, mtp_layers=1,
                         hf_config=q35.tiny_hf_config(1, dense=True))


@pytest.fixture(scope="module")
def ours(dense_dir):
    return load_model(dense_dir, dtype=torch.float32, with_mtp=True)


@pytest.fixture(scope="module")
def hf_vlm(dense_dir):
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        dense_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 124, (b, t), generator=torch.Generator().manual_seed(seed))


def test_config_is_dense(dense_dir):
    hf = json.loads((dense_dir / "config.json").read_text())
    cfg = q35.Config.from_hf(hf)
    assert (cfg.num_experts, cfg.intermediate_size, cfg.mtp_num_hidden_layers) == (0, 96, 1)
    assert cfg == q35.Config.from_hf(hf["text_config"])
    text = {k: v for k, v in hf["text_config"].items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="neither num_experts .* nor intermediate_size"):
        q35.Config.from_hf(text)


@pytest.mark.parametrize("b,t", [(1, 1), (1, 33), (1, 100), (2, 17)])
def test_logits_match_transformers(ours, hf_vlm, b, t):
    ids = _ids(b, t, seed=t + b)
    with torch.no_grad():
        want = hf_vlm(input_ids=ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= RTOL * want.abs().max().item()
    assert want.abs().mean() > 0.1


def test_text_only_layout_matches_causal_lm(ours, dense_dir, tmp_path):
    hf = json.loads((dense_dir / "config.json").read_text())
    config = {**hf["text_config"], "architectures": ["Qwen3_5ForCausalLM"]}
    tensors = {}
    for name, t in ours.state_dict().items():
        if "norm" in name.split(".")[-2] and not name.endswith("linear_attn.norm.weight"):
            t = t - 1.0  # the stored zero-centred form
        tensors[name] = t
    text_dir = write_checkpoint(tmp_path / "text", config, tensors)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        text_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    mine = load_model(text_dir, dtype=torch.float32)
    ids = _ids(2, 40, seed=9)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert (mine(ids) - want).abs().max().item() <= RTOL * want.abs().max().item()


def _media_chat():
    from tests.vision.conftest import rand_image
    from tests.vision.video_util import rand_frames

    return [{"role": "user", "content": [
        {"type": "image", "image": rand_image(30, 40, 1)},
        {"type": "video", "video": (rand_frames(10, 24, 32, 2), {"fps": 4})},
        {"type": "text", "text": "what"}]}], rand_image(30, 40, 1)


def test_greedy_with_an_image_and_a_video_equals_transformers(dense_dir, hf_vlm):
    llm = LLM(dense_dir, max_batch_size=2, max_seq_len=512, max_num_tokens=16)
    msgs, img = _media_chat()
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    (out,) = llm.chat(msgs, sp)
    d = llm.deployed
    clip = d.video_processor.preprocess_one(msgs[0]["content"][1]["video"])
    pix = d.processor.preprocess([img])
    ids = torch.tensor([out.prompt_token_ids])
    hf_vlm.generation_config.eos_token_id = None
    ref = hf_vlm.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == IMAGE).int() + 2 * (ids == VIDEO).int(),
        pixel_values=pix.pixel_values, image_grid_thw=torch.tensor(pix.grid_thw),
        pixel_values_videos=clip.pixel_values, video_grid_thw=torch.tensor([clip.grid_thw]),
        max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.token_ids == ref
    assert d.target.graph_runner.replays > 0


def test_mtp_greedy_equals_plain(dense_dir):
    prompts = ["hello there", "a b c d e f", "the the the"]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(max_batch_size=4, max_seq_len=256)
    want = [o.token_ids for o in LLM(dense_dir, **kw).generate(prompts, sp)]
    spec = LLM(dense_dir, spec={"method": "mtp", "num_draft_tokens": 3, "controller": "off"},
               **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0


def test_make_tiny_cli_writes_the_dense_vlm(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "qwen3_5", "--mtp-layers", "1", "--out",
                 str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert "num_experts" not in hf["text_config"] and hf["text_config"]["intermediate_size"]
