"""Video inputs on the tiny Qwen3.5-MoE VLM against transformers: the prompt's timestamped
expansion (transformers' own `replace_video_token`), positions (`get_rope_index`), prefill logits
with an image and a video (its forward with `pixel_values_videos`), greedy `generate`; MTP with
videos = plain; the tower in frame groups; videos through the CLI, prompt dicts and
`limit_mm_per_prompt`. The video processor alone: test_video_processor.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.vision.image import ImageError
from tests.vision.conftest import IMAGE_TOKEN, rand_image
from tests.vision.video_util import rand_frames, video_bytes

VIDEO_TOKEN, VS, VE = 127, 124, 125
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _hf_expansion(text: str, clip, indices, fps) -> str:
    """transformers' Qwen3-VL processor's text for one video: its `replace_video_token`, with
    the chat template's wrapper collapsed into the per-step wrappers it writes."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           vision_start_token="<|vision_start|>", video_token="<|video_pad|>",
                           vision_end_token="<|vision_end|>")
    fake._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a)
    inputs = {"video_grid_thw": torch.tensor([clip.grid_thw]),
              "video_metadata": [VideoMetadata(total_num_frames=max(indices) + 1, fps=fps,
                                               frames_indices=list(indices))]}
    body = Qwen3VLProcessor.replace_video_token(fake, inputs, 0)
    return text.replace("<|vision_start|><|video_pad|><|vision_end|>", body)


def _hf_image_expansion(text: str, grid) -> str:
    """transformers' `replace_image_token`: one pad per merged patch."""
    return text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // 4))


def _chat_text(video_first: bool) -> str:
    v, i = "<|vision_start|><|video_pad|><|vision_end|>", "<|vision_start|><|image_pad|>" \
        "<|vision_end|>"
    a, b = (v, i) if video_first else (i, v)
    return f"<|im_start|>user\n{a}look at{b}now<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("video_first", [True, False], ids=["video-image", "image-video"])
def test_prefill_logits_with_a_video_equal_transformers(vlm_llm, hf_vlm, hf_image_processor,
                                                        video_first):
    """Our expansion = transformers' text, our positions = `get_rope_index`, and the logits of
    the whole prompt (image + video features merged) = transformers' forward (fp32, 1e-4)."""
    from specdeploy.vision.chat import build_prompt

    d = vlm_llm.deployed
    tok = vlm_llm.tokenizer
    frames, img = rand_frames(7, 30, 44, seed=1), rand_image(37, 53, 2)
    meta = {"fps": 3.0, "frames_indices": [0, 2, 5, 9, 12, 14, 20]}
    text = _chat_text(video_first)
    mm = build_prompt(d, tok.encode(text, add_special_tokens=False), [img], "p",
                      [(frames, meta)], lambda s: tok.encode(s, add_special_tokens=False))
    clip = d.video_processor.preprocess_one((frames, meta))
    pix = hf_image_processor([img], return_tensors="pt")
    want = _hf_image_expansion(_hf_expansion(text, clip, meta["frames_indices"], meta["fps"]),
                               pix["image_grid_thw"][0])
    assert "<2.3 seconds>" in want  # frames 5 and 9 at 3 fps: (1.667 + 3) / 2 = 2.33
    assert mm.ids == tok.encode(want, add_special_tokens=False)
    ids = torch.tensor([mm.ids])
    kinds = (ids == IMAGE_TOKEN).int() + 2 * (ids == VIDEO_TOKEN).int()
    with torch.no_grad():
        pos, delta = hf_vlm.model.get_rope_index(ids, kinds, pix["image_grid_thw"],
                                                 torch.tensor([clip.grid_thw]))
        ref = hf_vlm(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
                     pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                     pixel_values_videos=clip.pixel_values,
                     video_grid_thw=torch.tensor([clip.grid_thw])).logits
    assert torch.equal(mm.positions(0, mm.num_prompt)[:, None], pos)
    assert mm.delta == int(delta)
    got = _prefill_logits(vlm_llm, mm)
    assert (got - ref[0]).abs().max() <= 1e-4
    assert ref.abs().mean() > 0.1


def _prefill_logits(llm, mm) -> torch.Tensor:
    """Every prompt position's logits: the checkpoint's eager language model on the embedded
    prompt with the deployment's tower's features at the vision tokens."""
    from specdeploy.loading import load_model

    d = llm.deployed
    model = load_model(llm.model_path)
    with torch.no_grad():
        embeds = d.embed_tokens(torch.tensor([mm.ids]))
        feats = d.visual(mm.pixel_values, torch.tensor(mm.grid_thw))
        embeds[0, mm.feature_row >= 0] = feats.to(embeds.dtype)
        return model(None, mm.positions(0, mm.num_prompt)[:, None], embeds)[0]


def _video_chat(frames, meta=None, image=None) -> list[dict]:
    parts = [{"type": "video", "video": frames if meta is None else (frames, meta)},
             {"type": "text", "text": "what happens"}]
    if image is not None:
        parts.insert(1, {"type": "image", "image": image})
    return [{"role": "user", "content": parts}]


def _batch():
    return [_video_chat(rand_frames(6, 30, 40, 0)),
            [{"role": "user", "content": "hello world"}],
            _video_chat(rand_frames(25, 24, 32, 1), {"fps": 10}, rand_image(20, 28, 3))]


def test_greedy_with_a_video_equals_transformers_generate(vlm_llm, hf_vlm, hf_image_processor):
    """A video sampled from 25 frames at 10 fps (frames 0, 6, 12, 18, 24: 3 steps) and an
    image; prefill in
    16-token chunks splits the steps."""
    frames, img = rand_frames(25, 24, 32, 1), rand_image(20, 28, 3)
    (out,) = vlm_llm.chat(_video_chat(frames, {"fps": 10}, img), GREEDY)
    clip = vlm_llm.deployed.video_processor.preprocess_one((frames, {"fps": 10}))
    assert clip.grid_thw[0] == 3 and clip.timestamps == [0.3, 1.5, 2.4]
    ids = torch.tensor([out.prompt_token_ids])
    pix = hf_image_processor([img], return_tensors="pt")
    hf_vlm.generation_config.eos_token_id = None
    ref = hf_vlm.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == IMAGE_TOKEN).int() + 2 * (ids == VIDEO_TOKEN).int(),
        pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
        pixel_values_videos=clip.pixel_values, video_grid_thw=torch.tensor([clip.grid_thw]),
        max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.token_ids == ref


@pytest.fixture(scope="module")
def plain_video_outputs(vlm_llm):
    return [o.token_ids for o in vlm_llm.chat(_batch(), GREEDY)]


def test_mtp_greedy_with_videos_equals_plain(vlm_dir, plain_video_outputs):
    llm = LLM(vlm_dir, max_batch_size=4, max_seq_len=512, max_num_tokens=16,
              spec={"method": "mtp", "num_draft_tokens": 2})
    assert [o.token_ids for o in llm.chat(_batch(), GREEDY)] == plain_video_outputs
    assert llm.stats()["draft_steps"] > 0


def test_a_text_model_refuses_videos():
    from specdeploy.vision.chat import build_prompt

    with pytest.raises(ImageError, match="no vision tower; videos are not accepted"):
        build_prompt(object(), [1, 2], [], "p", [rand_frames(4, 8, 8)])


def test_cli_generate_with_a_video(vlm_dir, vlm_llm, tmp_path, capsys):
    import json

    from specdeploy.cli import main

    path = tmp_path / "c.mkv"
    path.write_bytes(video_bytes(rand_frames(12, 24, 32, 8), 6))
    assert main(["generate", "--model", str(vlm_dir), "--chat", "--video", str(path),
                 "--prompt", "what", "--max-tokens", "6", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    msgs = [{"role": "user", "content": [{"type": "video", "video": str(path)},
                                         {"type": "text", "text": "what"}]}]
    want = vlm_llm.chat(msgs, SamplingParams(max_tokens=6))[0]
    assert got["token_ids"] == want.token_ids
    assert got["prompt_tokens"] == len(want.prompt_token_ids)
    assert main(["generate", "--model", str(vlm_dir), "--chat", "--video", str(tmp_path / "no"),
                 "--prompt", "x"]) == 2
    assert "--video" in capsys.readouterr().err


def test_limit_mm_per_prompt(vlm_dir):
    """vLLM's `limit_mm_per_prompt`: a prompt over a modality's limit is refused by name (the
    engine keeps serving); bad limits are refused when the LLM is built."""
    llm = LLM(vlm_dir, max_batch_size=2, max_seq_len=512,
              limit_mm_per_prompt={"image": 1, "video": 0})
    frames = rand_frames(4, 16, 16)
    with pytest.raises(ImageError, match=r"1 video\(s\), but limit_mm_per_prompt allows 0"):
        llm.chat(_video_chat(frames))
    two = [{"role": "user", "content": [{"type": "image", "image": rand_image(16, 16, i)}
                                        for i in range(2)]}]
    with pytest.raises(ImageError, match=r"2 image\(s\), but limit_mm_per_prompt allows 1"):
        llm.chat(two)
    assert len(llm.chat([{"role": "user", "content": [
        {"type": "image", "image": rand_image(16, 16)}]}], GREEDY)[0].token_ids) == 24
    for bad, msg in (({"audio": 1}, "'audio' is not a modality"),
                     ({"image": -1}, "non-negative integer"), ([1], "must be a dict")):
        with pytest.raises(ValueError, match=msg):
            LLM(vlm_dir, max_batch_size=2, max_seq_len=512, limit_mm_per_prompt=bad)


def test_the_tower_in_frame_groups_gives_the_whole_calls_features(vlm_llm):
    """A long video's frames go through the tower in groups of at most N patches (a frame
    attends only within itself): the features equal one call's (fp32, 1e-5), grouped at every
    size from one frame per group up."""
    from specdeploy.vision.chat import build_prompt

    d = vlm_llm.deployed
    tok = vlm_llm.tokenizer
    text = _chat_text(video_first=True)
    mm = build_prompt(d, tok.encode(text, add_special_tokens=False), [rand_image(30, 44, 1)],
                      "p", [(rand_frames(9, 28, 36, 2), {"fps": 2})],
                      lambda s: tok.encode(s, add_special_tokens=False))
    whole = d.visual(mm.pixel_values, torch.tensor(mm.grid_thw))
    frame = mm.grid_thw[0][1] * mm.grid_thw[0][2]
    assert mm.grid_thw[0][0] == 5 and len(mm.grid_thw) == 2
    for most in (1, frame, 2 * frame + 1, 3 * frame, 10 ** 6):
        got = d.visual.forward_chunked(mm.pixel_values, mm.grid_thw, most)
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    assert d.max_tower_patches >= 16384


def test_a_prompt_dicts_processor_kwargs(vlm_llm):
    """vLLM's prompt dict with its own `mm_processor_kwargs`: that prompt's video is sampled at
    its fps (its tokens = the processor with those kwargs), the next prompt's at the
    deployment's; bad kwargs are refused naming the prompt."""
    from specdeploy.vision.chat import build_prompt

    clip = (rand_frames(40, 24, 32, 5), {"fps": 10})
    prompt = "see <|vision_start|><|video_pad|><|vision_end|> then"
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    slow, base = vlm_llm.generate([
        {"prompt": prompt, "multi_modal_data": {"video": clip},
         "mm_processor_kwargs": {"fps": 0.5, "min_frames": 2}},
        {"prompt": prompt, "multi_modal_data": {"video": clip}}], sp)
    tok = vlm_llm.tokenizer
    ids = tok.encode(prompt)
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    want = build_prompt(vlm_llm.deployed, ids, [], "p", [clip], encode,
                        {"fps": 0.5, "min_frames": 2})
    assert slow.prompt_token_ids == want.ids
    assert base.prompt_token_ids == build_prompt(vlm_llm.deployed, ids, [], "p", [clip],
                                                 encode).ids
    assert len(slow.prompt_token_ids) < len(base.prompt_token_ids)
    with pytest.raises(ValueError, match="prompt 0: mm_processor_kwargs: fps must be"):
        vlm_llm.generate({"prompt": prompt, "multi_modal_data": {"video": clip},
                          "mm_processor_kwargs": {"fps": -1}}, sp)
