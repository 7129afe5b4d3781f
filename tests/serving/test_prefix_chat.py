"""Prefix caching through the OpenAI server: a multi-turn chat's second turn re-sends the first
turn (system prompt, question, answer); most of its prompt tokens are hits, counted under vLLM's
metric names, and its answer is the offline API's on a cold cache."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams

MODEL = "tiny"
KEY = "test-key"
SYSTEM = ("You are a careful assistant. Answer in one short sentence, never more, and always "
          "stay on the topic of the question you were asked.")
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_batch_size=4, max_seq_len=512, page_size=4)


def _turn2(answer: str) -> list[dict]:
    return TURN1 + [{"role": "assistant", "content": answer},
                    {"role": "user", "content": "And another one?"}]


def test_second_turn_prompt_is_mostly_hits(llm, serve):
    from specdeploy.serving.app import create_app

    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    llm.reset_prefix_cache()
    ref1 = llm.chat(TURN1, greedy)[0]
    llm.reset_prefix_cache()
    ref2 = llm.chat(_turn2(ref1.text), greedy)[0]
    llm.reset_prefix_cache()
    app = create_app(llm, model_name=MODEL, api_key=KEY)
    with serve(app) as srv:
        c = srv.client()
        r1 = c.chat.completions.create(model=MODEL, messages=TURN1, max_tokens=MAX_TOKENS,
                                       temperature=0)
        assert r1.choices[0].message.content == ref1.text
        m1 = srv.wait_idle()
        r2 = c.chat.completions.create(model=MODEL, messages=_turn2(ref1.text),
                                       max_tokens=MAX_TOKENS, temperature=0)
        assert r2.choices[0].message.content == ref2.text
        m2 = srv.wait_idle()
    queries = m2["vllm:prefix_cache_queries_total"] - m1["vllm:prefix_cache_queries_total"]
    hits = m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"]
    assert queries == r2.usage.prompt_tokens == len(ref2.prompt_token_ids)
    # all of turn 1's prompt (full pages of 4) is hit; the rest is the re-tokenized answer and
    # the new question
    assert hits >= len(ref1.prompt_token_ids) // 4 * 4
    assert hits > 0.5 * queries, (hits, queries)
    # turn 1 hit nothing (the cache was reset)
    assert m1["vllm:prefix_cache_hits_total"] == 0
    assert m2["specdeploy_prefix_cache_hits_total"] == hits


def test_stats_report_prefix_cache_and_turning_it_off(llm, tiny_llama_dir):
    stats = llm.stats()
    for key in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_pages",
                "checkpoint_slots", "checkpoints_used", "checkpoint_bytes"):
        assert key in stats, key
    assert stats["checkpoint_slots"] == 0  # llama: no recurrent state, no checkpoint pool
    off = LLM(tiny_llama_dir, dtype="float32", max_batch_size=2, max_seq_len=64,
              enable_prefix_caching=False)
    prompt = list(range(3, 40))
    a = off.generate([prompt, prompt], SamplingParams(max_tokens=4))
    assert a[0].token_ids == a[1].token_ids
    assert "prefix_cache_queries" not in off.stats()
    assert off.reset_prefix_cache() is False


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "deploy"])
def test_no_enable_prefix_caching_flag(command):
    from specdeploy.cli import build_parser

    extra = ["--prompt", "x"] if command == "generate" else []
    ap = build_parser()
    assert ap.parse_args([command, *extra]).enable_prefix_caching is True
    args = ap.parse_args([command, *extra, "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False
