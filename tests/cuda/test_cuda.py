"""The same deployments on a CUDA device (`cuda` marker: skipped where none is, run by
bench/gpu_check.sh): logits equal the CPU deployment's, speculation stays lossless, seeded
sampling draws on the device."""
from __future__ import annotations

import pytest
import torch

from specdeploy import SamplingParams
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.deploy.build import build
from tests.spec.tiny_targets import LIMITS, METHODS, Target

pytestmark = pytest.mark.cuda
ARCHS = sorted(METHODS)


@pytest.fixture(scope="module", params=ARCHS)
def target(request, tmp_path_factory) -> Target:
    return Target(request.param, tmp_path_factory.mktemp("cuda"))


def _prefill_logits(dep, ids: list[int]) -> torch.Tensor:
    pages = list(range(-(-len(ids) // dep.layout.page_size)))
    # a windowed model's layers have pages of their own (cache/window.py, 0 the null page)
    win = [p + 1 for p in pages] if getattr(dep.layout, "num_win_pages", 0) else []
    seg = Segment(ids, 0, pages, 0, len(ids), win_pages=win)
    return dep.forward(build_metadata([seg])).logits.cpu()


def test_logits_cuda_equal_cpu(target):
    """fp32 both sides; 1e-3 (TF32 and different reduction orders on the GPU)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    opts = dict(dtype="float32", max_batch_size=2, max_seq_len=128, max_cache_gib=0.05)
    cpu = build(str(target.path), **opts)
    gpu = build(str(target.path), device="cuda", **opts)
    for ids in target.prompts[1:4]:
        torch.testing.assert_close(_prefill_logits(gpu, ids), _prefill_logits(cpu, ids),
                                   atol=1e-3, rtol=1e-3)


def _llm(target, spec=None):
    from specdeploy import LLM

    return LLM(str(target.path), spec=spec, device="cuda", dtype="float32", **LIMITS)


def test_greedy_spec_equals_plain_on_cuda(target):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain_llm = _llm(target)
    plain = [o.token_ids for o in plain_llm.generate(target.prompts, params)]
    spec = _llm(target, target.spec(3))
    assert [o.token_ids for o in spec.generate(target.prompts, params)] == plain
    assert spec.stats()["draft_steps"] > 0
    # the prompt's logprobs (every prefill row, cut back on the device) through both engines
    lp = SamplingParams(max_tokens=4, prompt_logprobs=2)
    a = plain_llm.generate([target.prompts[3]], lp)[0].prompt_logprobs
    b = spec.generate([target.prompts[3]], lp)[0].prompt_logprobs
    assert len(a) == len(b) == len(target.prompts[3]) and a[0] is None and b[0] is None
    for i, (x, y) in enumerate(zip(a[1:], b[1:])):
        tok = target.prompts[3][i + 1]
        assert abs(x[tok] - y[tok]) < 1e-4, (i, x, y)


def test_seeded_sampling_on_cuda(target):
    llm = _llm(target, target.spec(2))
    p = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    a = llm.generate(target.prompts[:3], p)
    b = llm.generate(target.prompts[:3], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_cuda_graphs_by_default(target):
    """LLM on CUDA replays decode steps without being asked (vLLM's default), a
    vision-language target's too (the tiny Qwen3.5 has a vision tower: its graph reads the
    input embeddings from a static buffer), and eager output equals the replayed output."""
    from specdeploy import LLM

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = _llm(target)
    dep = llm.engine.deployed
    runner = getattr(dep, "target", dep).graph_runner
    got = [o.token_ids for o in llm.generate(target.prompts[:3], params)]
    assert runner is not None and runner.replays >= 10
    assert runner.takes_hidden == hasattr(dep, "image_features")
    eager = LLM(str(target.path), device="cuda", dtype="float32", cuda_graphs=False, **LIMITS)
    assert getattr(eager.engine.deployed, "target", eager.engine.deployed).graph_runner is None
    assert [o.token_ids for o in eager.generate(target.prompts[:3], params)] == got


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_vl_moe"])
def test_vision_language_requests_on_cuda(tmp_path_factory, family):
    """The tiny Qwen3.5 VLM and Qwen3-VL-MoE (DeepStack: the wider embeddings through the CUDA
    graphs' static inputs) on CUDA: an image and a video in one prompt, and a text request;
    the tower's features equal the CPU tower's (fp32, 1e-3) and greedy tokens with CUDA graphs
    equal the eager CUDA deployment's."""
    from specdeploy import LLM
    from specdeploy.models import qwen3_5_moe, qwen3_vl
    from tests.vision.conftest import rand_image
    from tests.vision.video_util import rand_frames

    torch.backends.cuda.matmul.allow_tf32 = False
    d = tmp_path_factory.mktemp(f"cuda_{family}")
    path = str(qwen3_5_moe.make_tiny(d, seed=0, mtp_layers=1) if family == "qwen3_5_moe"
               else qwen3_vl.make_tiny(d, seed=0, moe=True))
    msgs = [[{"role": "user", "content": [
        {"type": "video", "video": (rand_frames(12, 24, 32, 1), {"fps": 6})},
        {"type": "image", "image": rand_image(30, 40, 2)}, {"type": "text", "text": "and"}]}],
        [{"role": "user", "content": "hello there"}]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    opts = dict(dtype="float32", max_batch_size=2, max_seq_len=512, max_num_tokens=16)
    gpu = LLM(path, device="cuda", **opts)
    got = [o.token_ids for o in gpu.chat(msgs, params)]
    runner = gpu.engine.deployed.target.graph_runner
    assert runner.replays > 0
    eager = LLM(path, device="cuda", cuda_graphs=False, **opts)
    assert [o.token_ids for o in eager.chat(msgs, params)] == got
    cpu = LLM(path, **opts)
    from specdeploy.vision.chat import build_prompt

    tok = cpu.tokenizer
    ids = cpu.chat_ids([{"role": "user", "content": [
        {"type": "video"}, {"type": "image"}, {"type": "text", "text": "and"}]}])
    mm = build_prompt(cpu.deployed, ids, [rand_image(30, 40, 2)], "p",
                      [(rand_frames(12, 24, 32, 1), {"fps": 6})],
                      lambda s: tok.encode(s, add_special_tokens=False))
    want = cpu.deployed.visual(mm.pixel_values, torch.tensor(mm.grid_thw))
    feats = gpu.deployed.visual(mm.pixel_values.cuda(), torch.tensor(mm.grid_thw)).cpu()
    torch.testing.assert_close(feats, want, atol=1e-3, rtol=1e-3)


def _new_family(kind: str, path):
    from specdeploy.models import llama, qwen3_moe
    from specdeploy.models import qwen3_5_moe as q35

    if kind == "qwen3_moe":
        return qwen3_moe.make_tiny(path, seed=0)
    if kind == "granite_hybrid":
        from specdeploy.models import granite_hybrid

        return granite_hybrid.make_tiny(path, seed=0)
    if kind == "glm4_moe":
        from specdeploy.models import glm4_moe

        return glm4_moe.make_tiny(path, seed=0, mtp_layers=1)
    if kind == "qwen3_next":
        from specdeploy.models import qwen3_next

        return qwen3_next.make_tiny(path, seed=0, mtp_layers=1)
    if kind == "phi3":  # partial RoPE, LongRoPE, a window on every layer
        from specdeploy.models import phi3
        from tests.models.test_phi3 import MINI

        return phi3.make_tiny(path, seed=0, config_overrides=MINI)
    if kind == "gpt_oss":  # attention sinks, sliding windows, biased MoE experts
        from specdeploy.models import gpt_oss

        return gpt_oss.make_tiny(path, seed=0)
    if kind == "deepseek_v3":  # MLA (value heads narrower than keys), MTP layer
        from specdeploy.models import deepseek_v3

        return deepseek_v3.make_tiny(path, seed=0, mtp_layers=1)
    if kind in ("gemma3", "lfm2"):  # softcapped logits, local / global RoPE; short convs
        from specdeploy.models.registry import family_module

        return family_module(kind).make_tiny(path, seed=0)
    if kind == "qwen3_5_dense":
        return q35.make_tiny(path, seed=0, mtp_layers=1, hf_config=q35.tiny_hf_config(
            1, dense=True))
    return llama.make_tiny(path, seed=0, config_overrides=llama.tiny_qwen_config(kind))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe", "qwen3_5_dense", "qwen3_next",
                                  "glm4_moe", "granite_hybrid", "gpt_oss", "phi3",
                                  "deepseek_v3", "gemma3", "lfm2"])
def test_more_families_on_cuda(tmp_path, kind):
    """Qwen2 / Qwen3 / Qwen3-MoE / dense Qwen3.5 / Qwen3-Next / GLM-4.5 / Granite 4.0-H / gpt-oss
    (sinks and windows on the torch paths off the CPU) / Phi-4-mini's shape / DeepSeek-V3
    (MLA) / Gemma 3 / LFM2: prefill
    logits on CUDA = on the CPU (fp32, 1e-3), and greedy tokens with CUDA graphs = the eager
    CUDA deployment's."""
    from specdeploy import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(_new_family(kind, tmp_path / kind))
    opts = dict(dtype="float32", max_batch_size=2, max_seq_len=128, max_cache_gib=0.05)
    cpu, gpu = build(path, **opts), build(path, device="cuda", **opts)
    ids = list(range(3, 40))
    torch.testing.assert_close(_prefill_logits(gpu, ids), _prefill_logits(cpu, ids),
                               atol=1e-3, rtol=1e-3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(20, 50))]
    kw = dict(device="cuda", dtype="float32", max_batch_size=2, max_seq_len=128)
    graphs = LLM(path, **kw)
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    eager = LLM(path, cuda_graphs=False, **kw)
    assert [o.token_ids for o in eager.generate(prompts, params)] == got
