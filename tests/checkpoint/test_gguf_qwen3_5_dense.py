"""Dense Qwen3.5 from GGUF (llama.cpp's "qwen35", written as its converter writes it:
tests/checkpoint/gguf_qwen3_5_layout.py): the config from its metadata, every tensor equal to
the safetensors checkpoint's, logits equal to transformers' on that checkpoint, the MTP head
lossless, Q8_0 matrices on the block kernels, and the mmproj pair taking images and videos."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import qwen3_5_moe as q35

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tests.checkpoint.gguf_qwen3_5_layout import Q, write_gguf  # noqa: E402

RTOL = 1e-4  # relative to the largest logit (tests/models/test_qwen3_5_dense.py says why)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_q35_dense")
    src = q35.make_tiny(d / "st", seed=4, mtp_layers=1,
                        hf_config=q35.tiny_hf_config(1, dense=True))
    return src, write_gguf(src, d / "tiny.gguf")


def test_config_and_tensors_are_the_checkpoints(pair):
    src, path = pair
    gg = GGUFReader(path)
    assert gg.metadata["general.architecture"] == "qwen35"
    assert gg.config["architectures"] == ["Qwen3_5ForCausalLM"]
    want = q35.Config.from_hf(open_checkpoint(src).config).__dict__
    got = q35.Config.from_hf(gg.config).__dict__
    assert got["intermediate_size"] == 96 and got["num_experts"] == 0
    assert {k: v for k, v in got.items() if k != "rms_norm_eps"} == {
        k: v for k, v in want.items() if k != "rms_norm_eps"}
    a = load_model(path, dtype="float32", with_mtp=True).state_dict()
    b = load_model(src, dtype="float32", with_mtp=True).state_dict()
    assert a.keys() == b.keys() and "model.layers.0.mlp.gate_proj.weight" in a
    for k in b:
        if k.endswith("A_log"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[k], b[k]), k


@torch.no_grad()
def test_logits_match_transformers(pair):
    src, path = pair
    oracle = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 120, (2, 23), generator=torch.Generator().manual_seed(2))
    want = oracle(input_ids=ids).logits
    got = load_model(path, dtype="float32")(ids)
    assert (got - want).abs().max().item() <= RTOL * want.abs().max().item()


def test_mtp_head_and_q8_0_blocks(tmp_path):
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain

    src = q35.make_tiny(tmp_path / "st", seed=9, mtp_layers=1,
                        hf_config=q35.tiny_hf_config(1, dense=True))
    assert_mtp_equals_plain(write_gguf(src, tmp_path / "m.gguf"))
    q8 = write_gguf(src, tmp_path / "q8.gguf", qtype=Q.Q8_0)
    assert GGUFReader(q8).get_blocks("model.layers.0.mlp.gate_proj.weight") is not None
    assert_mtp_equals_plain(q8)


def test_the_mmproj_pair_takes_images_and_videos(pair, tmp_path):
    """The dense text GGUF with its mmproj deploys the VLM: an image and a video request's
    greedy tokens equal the safetensors checkpoint's (its video processor: the pair's)."""
    from tests.vision.conftest import rand_image
    from tests.vision.mmproj_layout import write_mmproj
    from tests.vision.video_util import rand_frames

    src, path = pair
    mm = write_mmproj(src, tmp_path / "mmproj.gguf")
    opts = dict(max_batch_size=2, max_seq_len=512, max_num_tokens=16)
    llm = LLM(str(path), mmproj=str(mm), mm_processor_kwargs={"min_pixels": 256,
                                                               "max_pixels": 224 * 224}, **opts)
    assert llm.deployed.hf_config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    want_llm = LLM(src, **opts)
    want_llm.deployed.video_processor = llm.deployed.video_processor
    msgs = [{"role": "user", "content": [
        {"type": "image", "image": rand_image(30, 40, 1)},
        {"type": "video", "video": (rand_frames(10, 24, 32, 2), {"fps": 4})},
        {"type": "text", "text": "what"}]}]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    assert llm.chat(msgs, sp)[0].token_ids == want_llm.chat(msgs, sp)[0].token_ids
