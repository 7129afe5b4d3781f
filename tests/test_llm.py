"""`LLM` end to end on a tiny Llama: greedy tokens equal transformers' `generate`."""
from __future__ import annotations

import random

import pytest
import torch

from specdeploy import LLM, SamplingParams

LENGTHS = (1, 7, 33, 100)
MAX_TOKENS = 24
BACKENDS = ("eager", "graph")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # NOTE: tiny matmuls on a busy 2-core machine spin OpenMP threads for ~50 ms each.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from specdeploy.models.registry import family_module

    return family_module("llama").make_tiny(tmp_path_factory.mktemp("llama") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    # ids 3.. are plain characters / fillers: no special token inside a prompt.
    return [[rng.randrange(3, 128) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_tokens(tiny_llama, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request, tiny_llama):
    return LLM(tiny_llama, dtype="float32", max_batch_size=4, max_seq_len=256,
               backend=request.param)


def test_greedy_alone_and_batched_equal_transformers(llm, prompts, hf_tokens):
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert alone == hf_tokens
    batch = llm.generate(prompts, sp)
    assert [o.token_ids for o in batch] == hf_tokens
    for o, p in zip(batch, prompts):
        assert o.prompt_token_ids == p
        assert o.finish_reason in ("stop", "length")
        assert o.text == llm.tokenizer.decode(
            o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids)
        assert o.metrics.ttft is not None and o.metrics.ttft > 0


def test_chunked_prefill_identical(llm, prompts, hf_tokens):
    sched = llm.engine.scheduler
    old = sched.max_num_tokens
    sched.max_num_tokens = 8
    try:
        out = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    finally:
        sched.max_num_tokens = old
    assert [o.token_ids for o in out] == hf_tokens


def test_64_requests_tiny_cache(tiny_llama, llm):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 30))] for _ in range(64)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    backend = "graph" if "Graph" in type(llm.deployed).__name__ else "eager"
    # 48 KiB = 6 pages of 16 tokens (2 layers x K,V x 2 heads x 16 dims x fp32 = 8 KiB a page).
    small = LLM(tiny_llama, dtype="float32", max_batch_size=8, max_seq_len=64,
                max_cache_gib=48 / 2**20, max_num_tokens=32, backend=backend)
    assert small.deployed.layout.num_pages <= 6
    out = small.generate(prompts, sp)
    want = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert [o.token_ids for o in out] == want
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["num_finished"] == 64
    assert stats["free_pages"] == small.deployed.layout.num_pages


def test_sampling_seeded(llm, prompts):
    sp = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True)
          for s in (7, 7, 8)]
    a, b, c = llm.generate([prompts[1]] * 3, sp)
    assert a.token_ids == b.token_ids != c.token_ids


def test_stream_matches_generate(llm, prompts):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    (want,) = llm.generate([prompts[2]], sp)
    chunks = list(llm.generate_stream(prompts[2], sp))
    assert chunks[-1].finished and chunks[-1].token_ids == want.token_ids
    assert "".join(c.delta_text for c in chunks) == want.text
    assert sum(len(c.delta_token_ids) for c in chunks) == len(want.token_ids)


def test_chat_and_text_prompt(llm):
    msgs = [{"role": "user", "content": "hi there"}]
    (out,) = llm.chat(msgs, SamplingParams(max_tokens=4))
    assert out.prompt_token_ids == llm.chat_ids(msgs)
    (out2,) = llm.generate("hello", SamplingParams(max_tokens=4))
    assert out2.prompt_token_ids == list(llm.tokenizer.encode("hello"))


@pytest.mark.parametrize("prompt,kwargs,name", [
    ("", {}, "prompt"), ([], {}, "prompt"), ([5] * 300, {}, "prompt"),
    ([5] * 250, {"max_tokens": 10}, "max_tokens"),
])
def test_bad_input(llm, prompt, kwargs, name):
    with pytest.raises(ValueError, match=name):
        llm.generate([prompt], SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs,name", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_llm_args(tiny_llama):
    with pytest.raises(ValueError, match="backend"):
        LLM(tiny_llama, backend="nope")
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(tiny_llama, max_batch_size=0)


def test_spec_config_validation():
    from specdeploy import SpecConfig

    assert SpecConfig("mtp").num_draft_tokens == 3
    with pytest.raises(ValueError, match="method"):
        SpecConfig("medusa")
    for k in (0, 17):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            SpecConfig("eagle3", num_draft_tokens=k)
