"""A GGUF vision-language deployment: the text GGUF and llama.cpp's mmproj GGUF of the tiny Qwen3.5
VLM (written in the converters' layouts: tests/checkpoint/gguf_qwen3_5_layout.py,
tests/vision/mmproj_layout.py) against the safetensors checkpoint they came from (the oracle: the
same weights, deployed from the released layout), and what a bad pair is told."""
from __future__ import annotations

import gguf
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError, open_checkpoint
from specdeploy.checkpoint.gguf_mmproj import PIXEL_LIMITS
from tests.vision.conftest import rand_image
from tests.vision.mmproj_layout import write_mmproj

pytest.importorskip("tests.checkpoint.test_gguf")
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
TINY_PIXELS = {"min_pixels": 16 * 16, "max_pixels": 224 * 224}  # the tiny processor's limits
OPTS = dict(max_batch_size=4, max_seq_len=512, max_num_tokens=16)
PROMPTS = ["describe <|vision_start|><|image_pad|><|vision_end|> now", "hello there",
           "two <|vision_start|><|image_pad|><|vision_end|> and "
           "<|vision_start|><|image_pad|><|vision_end|>"]


def _images():
    a, b = rand_image(40, 56, 5), rand_image(64, 30, 6)
    return [[a], [], [b, a]]


@pytest.fixture(scope="module")
def pair(vlm_dir, tmp_path_factory):
    from tests.checkpoint.gguf_qwen3_5_layout import write_gguf

    d = tmp_path_factory.mktemp("gguf_vlm")
    return write_gguf(vlm_dir, d / "text.gguf"), write_mmproj(vlm_dir, d / "mmproj.gguf")


def test_tower_tensors_and_config_are_the_checkpoints(vlm_dir, pair, tmp_path):
    """Every `model.visual.*` tensor, the patch embedding joined from its two temporal halves:
    exactly (F32), as fp16 rounds it (F16), as gguf-py's own Q8_0 round trip gives it (Q8_0
    matrices, the common `mmproj-Q8_0.gguf`); the vision config the checkpoint's."""
    from gguf.quants import dequantize, quantize

    from specdeploy.models.qwen3_5_vision import VisionConfig

    Q = gguf.GGMLQuantizationType
    st = open_checkpoint(vlm_dir)
    names = sorted(k for k in st.keys() if k.startswith("model.visual."))
    rounded = {
        Q.F32: lambda a: a,
        Q.F16: lambda a: a.half().float() if a.dim() > 1 else a,
        Q.Q8_0: lambda a: torch.from_numpy(dequantize(quantize(a.numpy(), Q.Q8_0), Q.Q8_0))
        if a.dim() == 2 and a.shape[-1] % 32 == 0 else a,
    }
    for ftype, rnd in rounded.items():
        path = pair[1] if ftype == Q.F32 else write_mmproj(vlm_dir, tmp_path / f"{ftype.name}.gguf",
                                                           ftype=ftype)
        mm = open_checkpoint(path)
        assert sorted(k for k in mm.keys() if k.startswith("model.visual.")) == names
        quantized = 0
        for k in names:
            want = rnd(st.get(k).float())
            quantized += not torch.equal(want, st.get(k).float())
            assert torch.equal(mm.get(k), want), (ftype.name, k)
        assert quantized > 0 or ftype == Q.F32  # (the test's rounding did something)
        assert VisionConfig.from_hf(mm.config) == VisionConfig.from_hf(st.config)


def test_greedy_with_images_equals_the_safetensors_vlm(vlm_dir, pair):
    """Image requests and a text one in a batch, prefill chunks splitting the images: the GGUF
    pair's greedy tokens are the safetensors checkpoint's, as are its image features."""
    want_llm = LLM(vlm_dir, **OPTS)
    want = [o.token_ids for o in want_llm.generate(PROMPTS, GREEDY, images=_images())]
    llm = LLM(str(pair[0]), mmproj=str(pair[1]), mm_processor_kwargs=TINY_PIXELS, **OPTS)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, images=_images())]
    assert got == want
    assert llm.deployed.target.graph_runner.replays > 0  # its decode steps replay too
    img = _images()[0]
    pix = llm.deployed.processor.preprocess(img)
    assert pix.grid_thw == want_llm.deployed.processor.preprocess(img).grid_thw
    grid = torch.tensor(pix.grid_thw)
    assert torch.equal(llm.deployed.visual(pix.pixel_values, grid),
                       want_llm.deployed.visual(pix.pixel_values, grid))


def test_videos_on_the_gguf_pair(vlm_dir, pair):
    """An mmproj says nothing of videos: the released Qwen3.5 video preprocessor's limits and
    sampling around the file's patching; a video request's greedy tokens are the safetensors
    checkpoint's under that processor."""
    from specdeploy.vision.video import RELEASED
    from tests.vision.video_util import rand_frames

    llm = LLM(str(pair[0]), mmproj=str(pair[1]), **OPTS)
    vp = llm.deployed.video_processor
    assert {k: getattr(vp, k) for k in RELEASED} == RELEASED
    assert (vp.patch_size, vp.merge_size, vp.temporal_patch_size) == (4, 2, 2)
    assert vp.image_mean == vp.image_std == (0.5, 0.5, 0.5)
    want_llm = LLM(vlm_dir, **OPTS)
    want_llm.deployed.video_processor = vp
    prompt = "see <|vision_start|><|video_pad|><|vision_end|> then"
    clip = [(rand_frames(30, 24, 32, 2), {"fps": 6})]
    want = want_llm.generate(prompt, GREEDY, videos=clip)[0]
    got = llm.generate(prompt, GREEDY, videos=clip)[0]
    assert got.prompt_token_ids == want.prompt_token_ids
    assert sum(t == 127 for t in got.prompt_token_ids) == 5 * 12  # 10 frames: 5 steps
    assert got.token_ids == want.token_ids


def test_mtp_with_images_on_the_gguf_pair(vlm_dir, pair):
    """The text GGUF's MTP layer drafts for image requests; greedy output is plain's."""
    plain = LLM(str(pair[0]), mmproj=str(pair[1]), mm_processor_kwargs=TINY_PIXELS, **OPTS)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY, images=_images())]
    spec = LLM(str(pair[0]), mmproj=str(pair[1]), mm_processor_kwargs=TINY_PIXELS,
               spec={"method": "mtp", "num_draft_tokens": 2}, **OPTS)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY, images=_images())] == want
    assert spec.stats()["draft_steps"] > 0


def test_pixel_limits(vlm_dir, pair, tmp_path):
    """An mmproj says no resize limits: the released Qwen3.5 preprocessor's; limits the file
    writes win over those; `mm_processor_kwargs` over both. Mean, std, patch and merge sizes
    are the file's."""
    from specdeploy.vision.image import ImageProcessor

    cfg = open_checkpoint(pair[1]).config["preprocessor"]
    p = ImageProcessor.from_config(cfg)
    assert (p.min_pixels, p.max_pixels) == (PIXEL_LIMITS["min_pixels"],
                                            PIXEL_LIMITS["max_pixels"])
    assert (p.patch_size, p.merge_size, p.temporal_patch_size) == (4, 2, 2)
    assert p.image_mean == p.image_std == (0.5, 0.5, 0.5)
    written = write_mmproj(vlm_dir, tmp_path / "px.gguf", pixels=(1024, 4096))
    p = ImageProcessor.from_config(open_checkpoint(written).config["preprocessor"])
    assert (p.min_pixels, p.max_pixels) == (1024, 4096)
    p = p.with_kwargs({"max_pixels": 8192})
    assert (p.min_pixels, p.max_pixels) == (1024, 8192)
    with pytest.raises(ValueError, match="min_pixels 9000 is above max_pixels 8192"):
        p.with_kwargs({"min_pixels": 9000})


def test_bad_pairs_are_refused_by_name(vlm_dir, pair, tmp_path):
    text, mm = map(str, pair)
    with pytest.raises(CheckpointError, match="an mmproj file .* mmproj="):
        LLM(mm, **OPTS)
    with pytest.raises(CheckpointError, match="not an mmproj GGUF"):
        LLM(text, mmproj=text, **OPTS)
    with pytest.raises(ValueError, match="goes with a text GGUF"):
        LLM(vlm_dir, mmproj=mm, **OPTS)
    other = write_mmproj(vlm_dir, tmp_path / "p.gguf", projector="qwen2vl_merger")
    with pytest.raises(CheckpointError, match="projector 'qwen2vl_merger' is not supported"):
        LLM(text, mmproj=str(other), **OPTS)
    halves = write_mmproj(vlm_dir, tmp_path / "h.gguf", skip=("v.patch_embd.weight.1",))
    with pytest.raises(CheckpointError, match="v.patch_embd.weight.1"):
        LLM(text, mmproj=str(halves), **OPTS)
    with pytest.raises(ValueError, match="mm_processor_kwargs: 'size' is not supported"):
        LLM(text, mmproj=mm, mm_processor_kwargs={"size": 3}, **OPTS)
    with pytest.raises(ValueError, match="max_pixels must be a positive integer"):
        LLM(text, mmproj=mm, mm_processor_kwargs={"max_pixels": -1}, **OPTS)
    with pytest.raises(ValueError, match="mmproj: given with vision=False"):
        from specdeploy.deploy.build import BuildOptions

        BuildOptions(mmproj=mm, vision=False)


def test_cli_flags_reach_the_llm(monkeypatch):
    """`--mmproj` / `--mm-processor-kwargs` / `--mm-encoder-dtype` / `--limit-mm-per-prompt`
    on generate and serve
    become LLM's arguments."""
    from specdeploy.cli import build_parser

    class Built(Exception):
        pass

    def fake_llm(*args, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr("specdeploy.llm.LLM", fake_llm)
    for argv in (["generate", "--model", "t.gguf", "--prompt", "x"], ["serve", "t.gguf"]):
        args = build_parser().parse_args([*argv, "--mmproj", "m.gguf", "--mm-processor-kwargs",
                                          '{"max_pixels": 4096}', "--mm-encoder-dtype",
                                          "bfloat16", "--limit-mm-per-prompt", '{"video": 1}'])
        with pytest.raises(Built) as e:
            args.func(args)
        kw = e.value.args[0]
        assert kw["mmproj"] == "m.gguf" and kw["mm_processor_kwargs"] == {"max_pixels": 4096}
        assert kw["mm_encoder_dtype"] == "bfloat16"
        assert kw["limit_mm_per_prompt"] == {"video": 1}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--mm-processor-kwargs", "[1]"])
