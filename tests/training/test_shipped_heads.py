"""The EAGLE-3 and MTP heads shipped for the default model: found with no draft_model, lossless
under greedy decoding, and accepted often on fixed chat prompts."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams, SpecConfig

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why they are prime."]
MAX_TOKENS = 24
K = 2


def _default_or_skip():
    from specdeploy.checkpoint import CheckpointError
    from specdeploy.default_model import default_model_path
    from specdeploy.drafters_registry import drafters_dir

    try:
        default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    if not (drafters_dir() / "smollm2-135m-instruct" / "eagle3" / "config.json").is_file():
        pytest.skip("shipped heads are not installed")


@pytest.fixture(scope="module")
def reference():
    """Prompts, and plain greedy continuations (full recompute, no cache, no drafter)."""
    _default_or_skip()
    import specdeploy

    tok = specdeploy.load_tokenizer(None)
    model = specdeploy.load_model(None)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                          add_special_tokens=False) for q in QUESTIONS]
    cache: dict = {}

    def greedy(eos: frozenset) -> list[list[int]]:
        if eos not in cache:
            outs = []
            for p in prompts:
                ids, out = list(p), []
                with torch.inference_mode():
                    while len(out) < MAX_TOKENS and (not out or out[-1] not in eos):
                        out.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
                        ids.append(out[-1])
                outs.append(out)
            cache[eos] = outs
        return cache[eos]

    return prompts, greedy


@pytest.fixture(scope="module", params=["eagle3", "mtp"])
def spec_run(request, reference):
    prompts, _ = reference
    llm = LLM(max_batch_size=3, max_seq_len=192, spec=SpecConfig(request.param, K))
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return request.param, llm, [o.token_ids for o in outs]


def test_shipped_head_is_the_default_drafter(spec_run):
    from specdeploy.drafters_registry import drafters_dir

    method, llm, _ = spec_run
    d = llm.deployed.drafter
    assert type(d).__name__ == ("Eagle3Drafter" if method == "eagle3" else "MTPHead")
    path = drafters_dir() / "smollm2-135m-instruct" / method
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert 0 < size <= 25 * 2**20


def test_greedy_output_equals_plain_greedy(spec_run, reference):
    _, llm, outs = spec_run
    assert outs == reference[1](frozenset(llm.engine.eos_token_ids))


def test_acceptance_rate_on_fixed_prompts(spec_run):
    method, llm, _ = spec_run
    s = llm.stats()
    assert s["draft_steps"] > 0
    assert s["acceptance_rate"] > 0.3, (method, s["acceptance_rate"], s["mean_accepted_length"])
