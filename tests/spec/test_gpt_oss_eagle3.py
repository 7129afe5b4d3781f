"""EAGLE-3 on gpt-oss (sliding windows with sinks, YaRN, biased MoE experts): the drafter reads its
target's YaRN rope (models/layers.py RopeConfig, as the released gpt-oss EAGLE-3 heads' configs
carry it; refused before), and greedy speculation is the plain deployment's greedy output
token for token, with the random drafter's own drafts and with drafts that are mostly right
(the plain continuation, its last draft wrong) so accepted runs and rejections both occur.
Oracle: the same target without a drafter."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.models import gpt_oss
from specdeploy.models.drafters.eagle3 import load_eagle3, make_tiny_eagle3

LIMITS = dict(max_batch_size=2, max_seq_len=96)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 44))]
SP = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss_eagle3")
    target = gpt_oss.make_tiny(d / "target", seed=3)
    return target, make_tiny_eagle3(target, d / "eagle3", seed=1)


def test_eagle3_greedy_equals_plain_on_gpt_oss(pair):
    target, head = pair
    rope = load_eagle3(head).cfg.rope
    assert rope.rope_type == "yarn" and rope.attention_scaling > 1.0
    want = [o.token_ids for o in LLM(str(target), **LIMITS).generate(PROMPTS, SP)]
    spec = LLM(str(target), **LIMITS, spec=SpecConfig("eagle3", 3, draft_model=str(head),
                                                      controller="off"))
    assert [o.token_ids for o in spec.generate(PROMPTS, SP)] == want
    assert spec.stats()["draft_tokens"] > 0
    by_prompt = {tuple(p): w for p, w in zip(PROMPTS, want)}

    def mostly_right(seq, n):
        cont = by_prompt[tuple(seq.prompt_ids)][len(seq.output_ids):] + [3] * n
        return cont[:n - 1] + [(cont[n - 1] + 1) % 100]

    spec.engine.fix_drafts(mostly_right)
    before = spec.stats()["accepted_tokens"]
    assert [o.token_ids for o in spec.generate(PROMPTS, SP)] == want
    assert spec.stats()["accepted_tokens"] - before >= 10
