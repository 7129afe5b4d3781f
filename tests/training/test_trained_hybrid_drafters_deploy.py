"""Drafters trained on tiny hybrid targets deploy and speculate losslessly: greedy output with
`SpecConfig(method, draft_model=DIR)` equals greedy output without a drafter (oracle: the plain
path of the same deployment code). The VLM checkpoint deploys with its vision tower, and gets
image prompts too."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams, SpecConfig
from tests.training.hybrid_setup import Hybrid
from tests.vision.conftest import rand_image

LIMITS = dict(max_batch_size=4, max_seq_len=256, max_cache_gib=0.05, page_size=8,
              max_num_tokens=16)
PROMPTS = [[5, 6, 7, 8, 9], [20, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13, 14, 15, 16, 17, 18, 19],
           [33]]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
DRAFTERS = {"eagle3": "Eagle3Drafter", "mtp": "MTP", "mtp_ft": "MTP"}


def _chats():
    """Text only, and an image between two texts (chunked prefill splits its tokens)."""
    return [[{"role": "user", "content": "hello world"}],
            [{"role": "user", "content": [{"type": "text", "text": "look"},
                                          {"type": "image", "image": rand_image(37, 53, 0)},
                                          {"type": "text", "text": "ok"}]}]]


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5_moe", "qwen3_5_moe_text"])
def hybrid(request, tmp_path_factory):
    h = Hybrid(request.param, tmp_path_factory.mktemp(request.param))
    plain = LLM(str(h.path), **LIMITS)
    h.plain = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    h.vlm = request.param == "qwen3_5_moe"
    if h.vlm:
        h.plain_chat = [o.token_ids for o in plain.chat(_chats(), GREEDY)]
    return h


@pytest.mark.parametrize("run", ["eagle3", "mtp", "mtp_ft"])
def test_trained_drafter_speculates_losslessly(hybrid, run):
    cfg, _ = hybrid.run(run)
    llm = LLM(str(hybrid.path), spec=SpecConfig(cfg.method, 3, draft_model=cfg.out), **LIMITS)
    assert type(llm.deployed.drafter).__name__ == DRAFTERS[run]
    assert (type(llm.deployed).__name__ == "VisionLanguageDeployed") == hybrid.vlm
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hybrid.plain
    if hybrid.vlm:
        assert [o.token_ids for o in llm.chat(_chats(), GREEDY)] == hybrid.plain_chat
    stats = llm.stats()
    assert stats["draft_steps"] > 0 and stats["draft_tokens"] == 3 * stats["draft_steps"]
