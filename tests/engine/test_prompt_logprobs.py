"""`SamplingParams.prompt_logprobs` (engine/prompt_logprobs.py) against transformers: tiny Llama,
NemotronH and Qwen3.5-MoE checkpoints, prompts prefilled in several chunks; every prompt token's
logprob (after the first) is transformers' log-softmax of the position before it (fp32, 2e-4
absolute: the deployed ops' fp32 round-off over log-softmax's ~50 terms), the top N are its
top N, and the rank is where the token falls in transformers' distribution. Also: speculation,
prefix caching and a batch mate change nothing; validation names the field."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from tests.spec.tiny_targets import LIMITS, Target

TOL = 2e-4


@pytest.fixture(scope="module", params=["llama", "nemotron_h", "qwen3_5_moe"])
def target(request, tmp_path_factory):
    return Target(request.param, tmp_path_factory.mktemp(f"plp_{request.param}"))


@pytest.fixture(scope="module")
def hf_logprobs(target):
    """prompt -> transformers' log-softmax at every position [L, V] (fp32)."""
    import transformers

    # eager attention; without mamba_ssm / causal_conv1d transformers runs its torch fallbacks
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        target.path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    hf.eval()
    cache = {}

    def of(prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in cache:
            with torch.inference_mode():
                x = torch.tensor([prompt])
                logits = hf(x, attention_mask=torch.ones_like(x)).logits[0].float()
            cache[key] = logits.log_softmax(-1)
        return cache[key]
    return of


def _check(entries, ranks, prompt, ref: torch.Tensor, n: int) -> None:
    assert len(entries) == len(prompt) == len(ranks)
    assert entries[0] is None and ranks[0] is None
    for i in range(1, len(prompt)):
        row, tok, got = ref[i - 1], prompt[i], entries[i]
        assert abs(got[tok] - row[tok].item()) <= TOL, (i, got[tok], row[tok].item())
        top = row.topk(n + 1) if n else None
        listed = [t for t in got if t != tok or list(got).index(t) < n]
        assert len(listed) == n or (tok in listed and len(got) == n)
        for t in list(got)[:n]:  # the top N: transformers' values, in its order
            assert abs(got[t] - row[t].item()) <= TOL
        if n:
            vals = [got[t] for t in list(got)[:n]]
            assert vals == sorted(vals, reverse=True)
            # NOTE: ids may differ from transformers' only between values within TOL
            assert all(row[t] >= top.values[n - 1] - TOL for t in list(got)[:n])
        rank_lo = int((row > row[tok] + TOL).sum()) + 1
        rank_hi = int((row > row[tok] - TOL).sum()) + 1
        assert rank_lo <= ranks[i] <= rank_hi, (i, ranks[i], rank_lo, rank_hi)


def test_prompt_logprobs_equal_transformers_across_chunks(target, hf_logprobs):
    """Prompts of 33 and 100 tokens prefilled in chunks of 24 (with a short one in the batch),
    top 3 and top 0."""
    llm = LLM(str(target.path), **{**LIMITS, "max_num_tokens": 24})
    prompts = [target.prompts[2], target.prompts[3], target.prompts[1]]
    for n in (3, 0):
        sp = SamplingParams(max_tokens=4, prompt_logprobs=n)
        for p, out in zip(prompts, llm.generate(prompts, sp)):
            _check(out.prompt_logprobs, out.prompt_logprob_ranks, p, hf_logprobs(p), n)


def test_speculation_prefix_cache_and_batch_mates_change_nothing(target):
    """The same prompt logprobs and tokens through the speculative engine; a repeated prompt
    (its pages prefix-cached) still gets every position; a request without prompt_logprobs
    beside one with them decodes as it does alone."""
    plain = target.llm(None)
    p = target.prompts[3]
    sp = SamplingParams(max_tokens=12, prompt_logprobs=2)
    first = plain.generate([p], sp)[0]
    again = plain.generate([p], sp)[0]
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.prompt_logprob_ranks == first.prompt_logprob_ranks
    spec = target.llm(3)
    got = spec.generate([p], sp)[0]
    assert got.token_ids == first.token_ids
    for a, b in zip(got.prompt_logprobs[1:], first.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)
    mate = target.prompts[2]
    alone = spec.generate([mate], SamplingParams(max_tokens=12))[0]
    both = spec.generate([mate, p], [SamplingParams(max_tokens=12), sp])
    assert both[0].token_ids == alone.token_ids and both[0].prompt_logprobs is None
    assert both[1].token_ids == first.token_ids


def test_validation_names_the_field():
    for bad in (-1, 21, 1.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_preempted_requests_keep_their_prompt_logprobs(target):
    """A cache too small for the batch: sequences are preempted and recompute prompt + output
    as a prefill; their prompt logprobs are recorded once (not again, not cut) and equal an
    unpreempted run's, and the tokens stay lossless."""
    from tests.spec.test_spec_everything import _budget_for_tokens

    prompts = target.prompts * 3
    sp = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    want = target.llm(None).generate(prompts, sp)
    tight = dict(LIMITS, max_seq_len=160, page_size=8)
    tight["max_cache_gib"] = _budget_for_tokens(target, 24 * 8 + 4)
    llm = LLM(str(target.path), spec=target.spec(3), **tight)
    got = llm.generate(prompts, sp)
    assert llm.stats()["num_preemptions"] > 0
    for a, b, p in zip(got, want, prompts):
        assert a.token_ids == b.token_ids
        assert len(a.prompt_logprobs) == len(p) == len(a.prompt_logprob_ranks)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-5 for t in x)
