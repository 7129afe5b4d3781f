"""The server with speculative decoding (one-model MTP on a tiny Qwen3.5-MoE): greedy answers equal
`LLM.generate`'s, and /metrics exposes the acceptance counters per draft position."""
from __future__ import annotations

import asyncio

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


def test_spec_server_greedy_equals_generate_and_reports_acceptance(spec_llm, serve):
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
    with serve(create_app(spec_llm, model_name="q")) as srv:
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
    assert m["specdeploy_spec_num_draft_tokens"] == K
    steps = m["specdeploy_spec_draft_steps_total"]
    per_pos = [m[f'specdeploy_spec_accepted_tokens_per_position_total{{position="{i}"}}']
               for i in range(K)]
    assert steps > 0 and per_pos[0] > 0 and per_pos[0] >= per_pos[1]
    assert sum(per_pos) == m["specdeploy_spec_accepted_tokens_total"]
    assert m["specdeploy_spec_draft_tokens_total"] >= m["specdeploy_spec_accepted_tokens_total"]
    assert m["specdeploy_spec_mean_accepted_length"] > 1.0
