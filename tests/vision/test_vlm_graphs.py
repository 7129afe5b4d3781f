"""Replayed steps of a vision-language target (engine/cuda_graphs.py's runner; CPU graphs on the
CPU): the graph takes input embeddings and multimodal positions, so the runner copies the
step's embedding rows into a static buffer and feeds the image requests' positions. Oracles:
the eager deployment (`cpu_graphs=False`) and the tensor path of the feed."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.engine.cuda_graphs import CudaGraphRunner, install
from tests.vision.conftest import rand_image

GREEDY24 = SamplingParams(max_tokens=24, ignore_eos=True)
OPTS = dict(max_batch_size=4, max_seq_len=512, max_num_tokens=16)
BUILD = dict(max_batch_size=4, max_seq_len=512)


def _chats():
    a, b = rand_image(40, 56, 3), rand_image(64, 32, 4)
    return [[{"role": "user", "content": [{"type": "image", "image": a},
                                          {"type": "text", "text": "what is it"}]}],
            [{"role": "user", "content": "hello world"}],
            [{"role": "user", "content": [{"type": "text", "text": "look"},
                                          {"type": "image", "image": b}]}]]


def _count_image_replays(monkeypatch) -> list[int]:
    """[steps with multimodal positions the runner replayed]."""
    seen = [0]
    run = CudaGraphRunner.run

    def counted(self, meta, *a, **k):
        out = run(self, meta, *a, **k)
        if out is not None and meta.mrope_positions is not None:
            seen[0] += 1
        return out

    monkeypatch.setattr(CudaGraphRunner, "run", counted)
    return seen


@pytest.fixture(scope="module")
def eager_outputs(vlm_dir):
    llm = LLM(vlm_dir, cpu_graphs=False, **OPTS)
    assert llm.deployed.target.graph_runner is None
    return [o.token_ids for o in llm.chat(_chats(), GREEDY24)]


def test_image_requests_replay_and_decode_as_eager(vlm_dir, eager_outputs, monkeypatch):
    """Image requests and a text one in a batch: their decode steps replay (the multimodal
    positions fed), greedy tokens those of the eager deployment."""
    seen = _count_image_replays(monkeypatch)
    llm = LLM(vlm_dir, **OPTS)
    runner = llm.deployed.target.graph_runner
    assert runner is not None and runner.takes_hidden and not runner.refused
    got = [o.token_ids for o in llm.chat(_chats(), GREEDY24)]
    assert got == eager_outputs
    assert seen[0] >= 10, seen  # ~20 decode steps of the three together, then fewer


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_verify_steps_replay_with_images(vlm_dir, eager_outputs, monkeypatch, k):
    """MTP: verify steps (EXTEND, multimodal positions) and the drafter's steps replay; the
    drafter chain of image requests stays on the host (its positions come with its segments);
    greedy output equals plain eager decoding."""
    seen = _count_image_replays(monkeypatch)
    llm = LLM(vlm_dir, spec={"method": "mtp", "num_draft_tokens": k}, **OPTS)
    got = [o.token_ids for o in llm.chat(_chats(), GREEDY24)]
    assert got == eager_outputs
    assert llm.stats()["draft_steps"] > 0
    runner = llm.deployed.target.graph_runner
    assert runner.replays_by_tokens[k + 1] > 0 and seen[0] > 0
    assert not runner.refused


def test_decode_bursts_step_alone_on_embeddings(vlm_dir, eager_outputs):
    """A burst feeds each step's tokens by id on the device; the VLM graph reads embeddings,
    so its steps run one at a time (same tokens)."""
    llm = LLM(vlm_dir, num_scheduler_steps=4, **OPTS)
    got = [o.token_ids for o in llm.chat(_chats(), GREEDY24)]
    assert got == eager_outputs


@pytest.mark.parametrize("verify", [False, True])
def test_multimodal_feed_equals_the_tensor_path(vlm_dir, verify):
    """The host-list feed with multimodal positions (three axes apart, as after an image)
    gives the buffer of padding, widening and concatenating the step's tensors."""
    from specdeploy.deploy.build import build
    from specdeploy.engine.graph_feed import static_width

    dep = build(vlm_dir, **BUILD)
    runner = install(dep, OPTS["max_batch_size"], capture=False)
    ps = runner.page_size
    if verify:
        segs = [Segment([5, 6, 7], 9, [3], 0, 3, SEG_EXTEND),
                Segment([1, 2, 3], ps + 5, [6, 2], 1, 3, SEG_EXTEND),
                Segment([4, 4, 4], 20, [1], 2, 3, SEG_EXTEND)]
    else:
        segs = [Segment([7], ps + 3, [4, 9], 2), Segment([5], 3, [1], 0),
                Segment([8], ps, [5, 7], 3)]
    meta = build_metadata(segs)
    t = meta.num_tokens
    pos = torch.stack([meta.position_ids - 4, meta.position_ids - 9, meta.position_ids + 2])
    meta = replace(meta, mrope_positions=pos)
    bare = replace(meta, lists=None)
    b = runner.bucket(meta)
    assert b == 4 and runner.bucket(bare) == 4
    static = runner._static(bare, b)
    want = torch.cat([x.reshape(-1) for x in dep.target.device_inputs(static).values()])
    width = static_width(meta.lists, t // meta.num_seqs, b, runner.page_size, runner.widths)
    got = runner.feed(meta, b, width)
    assert got == want.tolist()
    assert got[4 * (t // 3):4 * (t // 3) + t] == pos[0].tolist()  # axis 0 after the ids


def test_image_prefill_steps_do_not_replay(vlm_dir):
    """A step whose rows take image features (the wrapper merges them) runs eagerly."""
    from specdeploy.deploy.build import build

    dep = build(vlm_dir, **BUILD)
    runner = install(dep, OPTS["max_batch_size"], capture=False)
    meta = build_metadata([Segment([7], 40, [4], 2)])
    assert runner.bucket(meta) == 1
    meta.mm_rows = [(0, object(), 40, 1)]
    assert runner.bucket(meta) is None
