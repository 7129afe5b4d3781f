"""Prefill chunks that leave one prompt token: the engine drafts after such a chunk (the next
step verifies that token with drafts), so the drafter's chain writes its KV past the chunk. Its
pages must be there (the scheduler reserves the drafts' positions one step early), and a
sequence whose drafting fails mid-prefill finishes with "error" and leaves the engine like any
finished one (it used to wait forever: no token, no output).

Oracles: greedy plain decoding on the same deployment's target (speculation is lossless); the
request's own finish."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.engine.drafting import ModelDrafter
from specdeploy.models import llama
from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

# 6-token chunks: a 37-token prompt is fed as 6 x 6 tokens, then 1 (the chunk before leaves one)
KW = dict(max_batch_size=4, max_seq_len=128, page_size=4, max_num_tokens=6, dtype="float32",
          enable_prefix_caching=False)
PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9] * 10, list(range(60, 75))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_chunks")
    path = llama.make_tiny(root / "t", seed=4)
    return path, make_tiny_eagle3(path, root / "e", seed=0)


@pytest.mark.parametrize("cpu_graphs", [True, False], ids=["chain-on-device", "host-chain"])
def test_eagle3_after_a_chunk_that_leaves_one_token(target, cpu_graphs):
    """The drafts of the chunk before the last prompt token (chain rows at positions past the
    pages the chunk needed): greedy output = plain, every request finishes by length, and the
    drafter did draft. Before the reservation, the replayed chain raised IndexError (a chain
    row past the sequence's pages) and the request failed."""
    path, head = target
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), **KW).generate(PROMPTS, sp)]
    spec = LLM(str(path), cpu_graphs=cpu_graphs, **KW,
               spec={"method": "eagle3", "draft_model": str(head), "num_draft_tokens": 3,
                     "controller": "off"})
    got = spec.generate(PROMPTS, sp)
    assert [o.finish_reason for o in got] == ["length"] * 3
    assert [o.token_ids for o in got] == want
    assert spec.stats()["draft_steps"] > 0 and spec.stats()["num_errors"] == 0


def test_a_drafting_failure_mid_prefill_finishes_the_request(target, monkeypatch):
    """Drafting that raises for every sequence: each fails alone at its first drafting (a
    mid-prefill chunk for the long prompts: no token gained) and its output leaves the
    engine with finish_reason "error", within a bounded number of steps."""
    path, head = target
    llm = LLM(str(path), **KW, spec={"method": "eagle3", "draft_model": str(head),
                                     "num_draft_tokens": 3, "controller": "off"})

    def broken(self, work, hidden):
        raise RuntimeError("drafter down")

    monkeypatch.setattr(ModelDrafter, "propose", broken)
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in PROMPTS]
    done = {}
    for _ in range(200):
        done.update({o.request_id: o for o in eng.step() if o.finished})
        if not eng.has_unfinished():
            break
    assert set(done) == set(ids), "a failed request never left the engine"
    assert {o.finish_reason for o in done.values()} == {"error"}
    assert not eng.has_unfinished() and eng.stats.num_errors == 3
