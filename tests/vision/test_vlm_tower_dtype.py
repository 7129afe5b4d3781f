"""The vision tower's dtype (`mm_encoder_dtype`, deploy/vlm.py `tower_dtype`): "auto" keeps the
model's dtype but runs a tower shipped in bfloat16 in bfloat16 on a CPU with native bf16 matmuls;
explicit values win. The bf16 tower's features against transformers' tower in bf16 (the oracle)."""
from __future__ import annotations

import shutil

import gguf
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.deploy import vlm
from tests.vision.conftest import rand_image
from tests.vision.mmproj_layout import write_mmproj

OPTS = dict(max_batch_size=2, max_seq_len=512)


@pytest.fixture(scope="module")
def bf16_dir(vlm_dir, tmp_path_factory):
    """The tiny VLM with its tower stored in bfloat16 (as released checkpoints ship it)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("bf16_tower") / "vlm"
    shutil.copytree(vlm_dir, out)
    for f in out.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: v.bfloat16() if k.startswith("model.visual.") and v.is_floating_point()
                   else v for k, v in t.items()}, f, metadata={"format": "pt"})
    return str(out)


def test_auto_runs_a_bf16_tower_in_bf16_on_a_bf16_cpu(vlm_dir, bf16_dir, tmp_path, monkeypatch):
    f32, bf = torch.float32, torch.bfloat16
    mm_bf16 = write_mmproj(vlm_dir, tmp_path / "bf16.gguf", ftype=gguf.GGMLQuantizationType.BF16)
    mm_f16 = write_mmproj(vlm_dir, tmp_path / "f16.gguf", ftype=gguf.GGMLQuantizationType.F16)
    # llama.cpp's F16 mmproj of a bf16 tower (what released towers are): bf16 values in F16
    mm_f16_of_bf16 = write_mmproj(bf16_dir, tmp_path / "f16b.gguf",
                                  ftype=gguf.GGMLQuantizationType.F16)
    shipped = {p: open_checkpoint(p) for p in (vlm_dir, bf16_dir, mm_bf16, mm_f16,
                                               mm_f16_of_bf16)}
    assert not vlm.f16_holds_bf16(shipped[mm_f16]) and vlm.f16_holds_bf16(shipped[mm_f16_of_bf16])
    for capable in (True, False):
        monkeypatch.setattr(vlm, "cpu_bf16_matmul", lambda c=capable: c)
        for path, reader in shipped.items():
            want = bf if capable and path in (bf16_dir, mm_bf16, mm_f16_of_bf16) else f32
            assert vlm.tower_dtype(reader, "auto", f32, "cpu") == want, (path, capable)
            assert vlm.tower_dtype(reader, "float32", f32, "cpu") == f32
            assert vlm.tower_dtype(reader, "bfloat16", f32, "cpu") == bf
            assert vlm.tower_dtype(reader, "auto", f32, "cuda") == f32  # (the model's there)
    with pytest.raises(ValueError, match="mm_encoder_dtype: unsupported 'int8'"):
        LLM(bf16_dir, mm_encoder_dtype="int8", **OPTS)


def test_an_f16_mmproj_of_a_bf16_tower_loads_its_values(bf16_dir, tmp_path):
    """The F16 file's tower in bf16 holds the bf16 checkpoint's weights: equal wherever f16
    stores them as normal numbers, within f16's subnormal step (2^-24) below that."""
    from specdeploy.deploy.vlm import load_vision

    mm = write_mmproj(bf16_dir, tmp_path / "f16b.gguf", ftype=gguf.GGMLQuantizationType.F16)
    got = load_vision(open_checkpoint(mm), torch.bfloat16).state_dict()
    want = load_vision(open_checkpoint(bf16_dir), torch.bfloat16).state_dict()
    assert got.keys() == want.keys()
    for k in got:
        g, w = got[k].float(), want[k].float()
        normal = w.abs() >= 2 ** -14
        assert torch.equal(g[normal], w[normal]), k
        assert (g - w).abs().max() <= 2 ** -24, k


def test_bf16_tower_matches_transformers_bf16_tower(bf16_dir, hf_vlm):
    """Deployed with `mm_encoder_dtype="bfloat16"` (the fp32 language model unchanged): its
    features are transformers' tower's in bf16 on the same pixels to bf16's precision, and the
    deployment answers image requests."""
    import copy

    llm = LLM(bf16_dir, mm_encoder_dtype="bfloat16", **OPTS)
    d = llm.deployed
    assert next(d.visual.parameters()).dtype == torch.bfloat16
    assert d.embed_tokens.weight.dtype == torch.float32
    img = rand_image(56, 40, 7)
    pix = d.processor.preprocess([img])
    grid = torch.tensor(pix.grid_thw)
    ours = d.visual(pix.pixel_values, grid).float()
    tower = copy.deepcopy(hf_vlm.model.visual).to(torch.bfloat16)
    with torch.no_grad():
        out = tower(pix.pixel_values.to(torch.bfloat16), grid_thw=grid)
    theirs = (out.pooler_output if hasattr(out, "pooler_output") else out).float()
    assert theirs.shape == ours.shape
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 2e-2, rel  # bf16 rounding of the same sums (8 bits of mantissa)
    f32 = LLM(bf16_dir, mm_encoder_dtype="float32", **OPTS).deployed.visual(
        pix.pixel_values, grid)
    assert (ours - f32).abs().max() / f32.abs().max() < 2e-2  # ... and of the fp32 tower
    (o,) = llm.generate("look <|vision_start|><|image_pad|><|vision_end|>",
                        SamplingParams(max_tokens=4, ignore_eos=True), images=[img])
    assert len(o.token_ids) == 4 and d.vision_seconds > 0


def test_a_tower_narrower_than_the_text_model_is_refused(tmp_path):
    """A checkpoint whose tower's out_hidden_size is not the text hidden size (a hand-edited
    config) is told so at build, not with a negative tensor size at its first request."""
    from specdeploy.checkpoint import CheckpointError
    from specdeploy.models.qwen3_5_moe import make_tiny, tiny_hf_config

    hf = tiny_hf_config()
    hf["text_config"] = dict(hf["text_config"], hidden_size=128, head_dim=32)
    path = make_tiny(tmp_path / "vlm", seed=0, hf_config=hf)
    with pytest.raises(CheckpointError, match="out_hidden_size must equal"):
        LLM(str(path), **OPTS)
