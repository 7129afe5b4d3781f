"""The embedded default model (SmolLM2-135M-Instruct): greedy tokens equal transformers'."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams

# NOTE: two prompts keep this test short; the bench checks a longer greedy run.
QUESTIONS = ["Write a haiku about the sea.",
             "List three prime numbers and explain why they are prime."]


@pytest.fixture(scope="module")
def llm():
    from specdeploy.default_model import default_model_path

    default_model_path()  # NOTE: `make test` installs it; a missing model must fail, not skip
    # the exact kernels: the fp32 model, whose greedy tokens transformers' must equal
    return LLM(dtype="float32", max_batch_size=2, max_seq_len=256, kernels="exact")


def test_default_model_greedy_equals_transformers(llm):
    from specdeploy.bench import hf_model_from_checkpoint

    prompts = [llm.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert all(len(p) >= 32 for p in prompts)
    sp = SamplingParams(max_tokens=16)  # both stop at EOS (and keep it)
    ours = llm.generate(prompts, sp)
    hf = hf_model_from_checkpoint(llm.model_path)
    with torch.inference_mode():
        for p, o in zip(prompts, ours):
            x = torch.tensor([p])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                            do_sample=False, pad_token_id=0,
                            eos_token_id=sorted(llm.engine.eos_token_ids))
            assert o.token_ids == y[0, len(p):].tolist()
    assert ours[0].text.strip() and sum(len(o.token_ids) for o in ours) >= 16
