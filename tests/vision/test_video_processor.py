"""The video processor (vision/video.py) on the tiny Qwen3.5-MoE VLM's config, against
transformers: its pieces (resize sizes, frame sampling, timestamps, patch layout; its resize
against PIL); video files decoded with PyAV = their frames; processor kwargs; bad videos refused
by name. Videos through the model: test_video.py."""
from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.vision.image import ImageError
from specdeploy.vision.video import VideoError, VideoProcessor, smart_resize, step_timestamps
from tests.vision.video_util import rand_frames, video_bytes


def _ours(vlm_dir) -> VideoProcessor:
    from specdeploy.vision.image import ImageProcessor

    return VideoProcessor.from_dir(vlm_dir, ImageProcessor.from_dir(vlm_dir))


@pytest.mark.parametrize("t,h,w", [(2, 30, 40), (5, 7, 100), (16, 200, 90), (9, 64, 64),
                                   (4, 3, 3), (33, 480, 640), (3, 500, 9)])
def test_smart_resize_equals_transformers(t, h, w):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as ref

    for lo, hi in ((256, 16384), (4096, 25165824), (128 * 32 * 32, 32 * 32 * 768)):
        for factor in (8, 32):
            assert smart_resize(t, h, w, 2, factor, lo, hi) == ref(t, h, w, 2, factor, lo, hi)


def test_sampling_and_timestamps_equal_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    for fps, lo, hi in ((2.0, 4, 16), (1.0, 4, 768), (0.5, 2, 8)):
        ours = VideoProcessor(fps=fps, min_frames=lo, max_frames=hi)
        hf = SimpleNamespace(fps=fps, min_frames=lo, max_frames=hi)
        for total, src_fps in ((25, 10.0), (3, 30.0), (300, 29.97), (7, 2.0), (1000, 24.0)):
            want = Qwen3VLVideoProcessor.sample_frames(
                hf, VideoMetadata(total_num_frames=total, fps=src_fps)).tolist()
            assert ours.sample(total, src_fps) == want, (fps, total, src_fps)
            stamps = Qwen3VLProcessor._calculate_timestamps(None, list(want), src_fps, 2)
            assert step_timestamps(want, src_fps, 2) == stamps


def test_resize_is_pils_bicubic_within_one_level(vlm_dir):
    """torchvision's uint8 resize (what transformers' video processor runs) against an
    independent resampler: Pillow's bicubic, frame by frame."""
    from PIL import Image

    vp = _ours(vlm_dir)
    frames = rand_frames(6, 45, 61, seed=3)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    got = vp.resize(x).permute(0, 2, 3, 1).numpy()
    h, w = got.shape[1:3]
    assert (h, w) != (45, 61) and h % 8 == 0 and w % 8 == 0
    for f, g in zip(frames, got):
        ref = np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC))
        assert np.abs(ref.astype(int) - g.astype(int)).max() <= 1


@pytest.mark.parametrize("t", [4, 5])
def test_patches_equal_transformers_patchify(vlm_dir, t):
    """Normalization (naive: (x / 255 - mean) / std) and transformers' `patchify` (the last
    frame repeated to fill the last temporal patch)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    vp = _ours(vlm_dir)
    x = torch.from_numpy(rand_frames(t, 24, 40, seed=t)).permute(0, 3, 1, 2).contiguous()
    got = vp.patchify(x, list(range(t)), 2.0)
    norm = (x.double() / 255 - 0.5) / 0.5
    ref, gt, gh, gw = Qwen3VLVideoProcessor.patchify(None, norm[None].float(), 4, 2, 2)
    assert got.grid_thw == (gt, gh, gw) == ((t + 1) // 2, 6, 10)
    torch.testing.assert_close(got.pixel_values, ref[0], rtol=0, atol=1e-6)


def test_video_files_decode_to_their_frames(vlm_llm, tmp_path):
    """A lossless file (its header does not count frames), as a path, file:// URL, data URL and
    bytes, = its frames with the file's rate (sampled the same way); vLLM's prompt dict and
    generate(videos=) = chat."""
    frames = rand_frames(25, 24, 32, 1)
    data = video_bytes(frames, fps=10)
    path = tmp_path / "clip.mkv"
    path.write_bytes(data)
    vp = vlm_llm.deployed.video_processor
    want = vp.preprocess_one((frames, {"fps": 10}))
    url = "data:video/x-matroska;base64," + base64.b64encode(data).decode()
    for src in (str(path), f"file://{path}", url, data):
        got = vp.preprocess_one(src)
        assert got.grid_thw == want.grid_thw and got.timestamps == want.timestamps
        assert torch.equal(got.pixel_values, want.pixel_values)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    chat = vlm_llm.chat([{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "hm"}]}],
        sp)[0]
    prompt = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>hm<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert vlm_llm.generate(prompt, sp, videos=[path])[0].token_ids == chat.token_ids
    (o,) = vlm_llm.generate({"prompt": prompt, "multi_modal_data": {"video": (frames,
                                                                              {"fps": 10})}}, sp)
    assert o.token_ids == chat.token_ids and o.prompt_token_ids == chat.prompt_token_ids


def test_mp4_with_a_frame_count(vlm_llm):
    """A lossy MP4 whose header counts its 40 frames at 20 fps: 4 frames sampled (2 a second)
    at the file's frame indices."""
    frames = rand_frames(40, 32, 48, 4)
    got = vlm_llm.deployed.video_processor.preprocess_one(video_bytes(frames, 20, False))
    assert got.grid_thw[0] == 2
    assert got.timestamps == step_timestamps([0, 13, 26, 39], 20.0, 2)


def test_processor_kwargs_set_the_sampling(vlm_dir, vlm_llm):
    frames = (rand_frames(40, 24, 32, 5), {"fps": 10})
    base = vlm_llm.deployed.video_processor
    assert base.preprocess_one(frames).grid_thw[0] == 4  # 8 frames at 2 fps
    fewer = base.with_kwargs({"fps": 0.5, "min_frames": 2})
    assert fewer.preprocess_one(frames).grid_thw[0] == 1  # 2 frames at 0.5 fps
    whole = base.with_kwargs({"do_sample_frames": False})
    assert whole.preprocess_one(frames).grid_thw[0] == 20  # decoded frames are taken as given
    llm = LLM(vlm_dir, max_batch_size=2, max_seq_len=512,
              mm_processor_kwargs={"fps": 1.0, "max_pixels": 4096})
    assert llm.deployed.video_processor.fps == 1.0
    assert llm.deployed.processor.max_pixels == 4096
    for bad, msg in (({"fps": 0}, "fps must be a positive number"),
                     ({"do_sample_frames": 1}, "must be a boolean"),
                     ({"max_frames": 2.5}, "positive integer"),
                     ({"min_frames": 9, "max_frames": 4}, "above max_frames")):
        with pytest.raises(ValueError, match=msg):
            LLM(vlm_dir, max_batch_size=2, max_seq_len=512, mm_processor_kwargs=bad)


def test_bad_videos_are_refused_by_name(vlm_llm, tmp_path, monkeypatch):
    vp = vlm_llm.deployed.video_processor
    one = rand_frames(1, 16, 16)
    cases = [
        (one, "1 frame\\(s\\); a video needs at least 2"),
        (one.astype(np.float32), "frames must be uint8"),
        (one[..., :2], "frames must be uint8 \\[frames, height, width, 3\\]"),
        ([one[0], rand_frames(1, 8, 8)[0]], "frames of different sizes"),
        ((rand_frames(4, 8, 8), {"fps": -1}), "fps must be a positive number"),
        ((rand_frames(4, 8, 8), {"frames_indices": [0, 1]}), "2 frames_indices for 4 frames"),
        (b"not a video at all", "not a video"),
        ("https://example.com/v.mp4", "remote URLs are not fetched"),
        ("data:image/png;base64,AAAA", "must look like data:video/"),
        (str(tmp_path / "missing.mp4"), "no such file"),
        (3.5, "expected a video file"),
        (rand_frames(4, 1, 900), "aspect ratio"),
    ]
    for src, msg in cases:
        with pytest.raises(VideoError, match=msg):
            vp.preprocess_one(src, "video 0")
    with pytest.raises(VideoError, match="at most max_frames"):
        vp.with_kwargs({"do_sample_frames": False}).preprocess_one(
            video_bytes(rand_frames(20, 16, 16), 10))
    monkeypatch.setitem(__import__("sys").modules, "av", None)
    with pytest.raises(VideoError, match="needs PyAV"):
        vp.preprocess_one(b"\x00" * 16)
    monkeypatch.undo()
    with pytest.raises(ImageError, match=r"1 video\(s\) but 0 video placeholder"):
        vlm_llm.generate("just text", videos=[rand_frames(4, 16, 16)])
    with pytest.raises(ValueError, match="videos: give one list of videos per prompt"):
        vlm_llm.generate(["a", "b"], videos=[rand_frames(4, 16, 16), None])
    with pytest.raises(ValueError, match="multi_modal_data takes"):
        vlm_llm.generate({"prompt": "a", "multi_modal_data": {"audio": 1}})
    with pytest.raises(ValueError, match="cannot be combined with prompt dicts"):
        vlm_llm.generate({"prompt": "a"}, videos=[rand_frames(4, 16, 16)])
    with pytest.raises(ValueError, match="one of `prompt` / `prompt_token_ids`"):
        vlm_llm.generate([{"prompt": "a", "prompt_token_ids": [1]}])
    with pytest.raises(ValueError, match="longer than max_seq_len=512 .* fps, max_frames"):
        vlm_llm.generate("<|video_pad|>", videos=[(rand_frames(120, 16, 16),
                                                   {"frames_indices": list(range(120))})])
    assert vlm_llm.engine.has_unfinished() is False
