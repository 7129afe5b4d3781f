"""The server with speculative decoding (one-model MTP on a tiny Qwen3.5-MoE): greedy answers equal
`LLM.generate`'s, and /metrics exposes the acceptance counters per draft position."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from specdeploy import LLM, SamplingParams, SpecConfig

K = 2
MAX_TOKENS = 10
PROMPTS = ["Speculation is", "Drafts are verified", "Hi"]


@pytest.fixture(scope="module")
def spec_llm(tmp_path_factory):
    from specdeploy.models.registry import family_module

    path = family_module("qwen3_5_moe").make_tiny(tmp_path_factory.mktemp("serve_q") / "q",
                                                  seed=0, mtp_layers=1)
    return LLM(path, dtype="float32", max_batch_size=4, max_seq_len=96,
               spec=SpecConfig("mtp", K))


def test_spec_server_greedy_equals_generate_and_reports_acceptance(spec_llm, serve, caplog):
    from specdeploy.serving.app import create_app

    refs = spec_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    by_prompt = {tuple(o.prompt_token_ids): o.token_ids for o in refs}

    def oracle_drafts(seq, k):  # the target's own future tokens: every draft gets accepted
        ref = by_prompt[tuple(seq.prompt_ids)]
        n = len(seq.output_ids)
        return (ref[n:n + k] + [0] * k)[:k]

    # NOTE: a random tiny drafter accepts nothing; oracle drafts exercise the per-position
    # counters, and the answers must stay the target's (lossless verification).
    spec_llm.engine.fix_drafts(oracle_drafts)
    caplog.set_level("INFO", logger="specdeploy.serving")
    with serve(create_app(spec_llm, model_name="q", stats_log_interval=0.2)) as srv:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                    timeout=60)

        async def one(prompt: str, stream: bool) -> str:
            r = await client.completions.create(model="q", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=stream)
            if not stream:
                return r.choices[0].text
            return "".join([ch.choices[0].text async for ch in r])

        async def main():
            try:
                jobs = [one(p, s) for s in (False, True) for p in PROMPTS]
                return await asyncio.wait_for(asyncio.gather(*jobs), 120)
            finally:
                await client.close()

        texts = asyncio.run(main())
        assert texts == [o.text for o in refs] * 2
        m = srv.wait_idle()
        time.sleep(0.5)  # a log interval after the last drafts
    assert m["specdeploy_spec_num_draft_tokens"] == K
    steps = m["specdeploy_spec_draft_steps_total"]
    per_pos = [m[f'specdeploy_spec_accepted_tokens_per_position_total{{position="{i}"}}']
               for i in range(K)]
    assert steps > 0 and per_pos[0] > 0 and per_pos[0] >= per_pos[1]
    assert sum(per_pos) == m["specdeploy_spec_accepted_tokens_total"]
    assert m["specdeploy_spec_draft_tokens_total"] >= m["specdeploy_spec_accepted_tokens_total"]
    assert m["specdeploy_spec_mean_accepted_length"] > 1.0
    # vLLM's names (model_name / engine labels) carry the same counts
    lab = 'engine="0",model_name="q"'
    assert m[f"vllm:spec_decode_num_drafts_total{{{lab}}}"] == steps
    assert m[f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}}"] == sum(per_pos)
    assert m[f"vllm:spec_decode_num_draft_tokens_total{{{lab}}}"] == \
        m["specdeploy_spec_draft_tokens_total"]
    assert [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}}']
            for i in range(K)] == per_pos
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("SpecDecoding metrics:")]
    assert lines, "no periodic SpecDecoding log line"
    assert "Mean acceptance length" in lines[0] and "Per-position acceptance rate" in lines[0]


def test_spec_decoding_log_line_counts_the_interval():
    from specdeploy.serving.stats_log import SpecDecodingLogger

    log = SpecDecodingLogger()
    snap = {"draft_steps": 10, "draft_tokens": 20, "accepted_tokens": 12,
            "accepted_per_position": [8, 4]}
    first = log.line(snap, 10.0)  # everything since start
    assert "Mean acceptance length: 2.20" in first and "0.800, 0.400" in first
    assert log.line(snap, 12.0) is None  # no drafts since: nothing to say
    later = {"draft_steps": 14, "draft_tokens": 28, "accepted_tokens": 16,
             "accepted_per_position": [10, 6]}
    line = log.line(later, 14.0)  # 4 drafts, 8 drafted, 4 accepted over 2 s
    assert "Mean acceptance length: 2.00" in line and "Accepted: 4 tokens" in line
    assert "Drafted throughput: 4.00 tokens/s" in line and "0.500, 0.500" in line
    assert "Avg Draft acceptance rate: 50.0%" in line
    assert SpecDecodingLogger().line({"num_running": 0}, 1.0) is None  # not speculating
