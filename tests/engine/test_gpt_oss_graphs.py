"""gpt-oss in full precision (the tiny fp32 checkpoint, `dtype="auto"` on the CPU) on CPU graphs:
its routed experts (biases, clamped SwiGLU) run in linear_rows.c's one C call,
which reads the expert ids in C, so the decode and verify steps record and replay (the
per-pair loop's `tolist` refused every capture before). Oracle: the eager deployment's greedy
tokens; speculative greedy = plain greedy."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.models import gpt_oss
from specdeploy.ops import linear_rows

pytestmark = pytest.mark.skipif(linear_rows.moe_unavailable() is not None,
                                reason=f"no one-call experts: {linear_rows.moe_unavailable()}")
LIMITS = dict(max_batch_size=2, max_seq_len=96)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 44))]
SP = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gpt_oss.make_tiny(tmp_path_factory.mktemp("gpt_oss_graphs"), seed=3)


def _runner(llm):
    return getattr(llm.deployed, "target", llm.deployed).graph_runner


def test_full_precision_gpt_oss_steps_replay_losslessly(tiny):
    eager = LLM(str(tiny), cpu_graphs=False, **LIMITS)
    want = [o.token_ids for o in eager.generate(PROMPTS, SP)]
    graphs = LLM(str(tiny), cpu_graphs=True, **LIMITS)
    assert [o.token_ids for o in graphs.generate(PROMPTS, SP)] == want
    runner = _runner(graphs)
    assert runner.refused == {} and runner.replays >= 15, (runner.replays, runner.refused)
    spec = LLM(str(tiny), cpu_graphs=True, **LIMITS,
               spec={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                     "prompt_lookup_min": 1, "controller": "off"})
    spec.engine.fix_drafts(lambda seq, n: [7] * n)  # drafts every step: verify steps
    assert [o.token_ids for o in spec.generate(PROMPTS, SP)] == want
    runner = _runner(spec)
    verify = sum(v for k, v in runner.replays_by_tokens.items() if k > 1)
    assert runner.refused == {} and verify > 10, (runner.replays_by_tokens, runner.refused)
