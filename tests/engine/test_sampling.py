"""Sampler and stop conditions."""
from __future__ import annotations

import pytest
import torch
from toy_engine import CharTokenizer, make_engine, run_all

from specdeploy.engine import SamplingParams
from specdeploy.engine.sampler import sample

PROMPTS = [[1, 2, 3], [7], [5, 9, 11, 13, 2, 4]]


def test_top_k_1_equals_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    p = [SamplingParams(temperature=1.5, top_k=1)] * 5
    assert torch.equal(sample(logits, p, [None] * 5), logits.argmax(-1))
    p = [SamplingParams(temperature=1.5, top_p=1e-6)] * 5  # only the top token survives
    assert torch.equal(sample(logits, p, [None] * 5, torch.Generator().manual_seed(1)),
                       logits.argmax(-1))


def test_distribution_matches_softmax_with_filters():
    g = torch.Generator().manual_seed(0)
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 4000
    logits = row.expand(n, 5).clone()
    for params, keep in ((SamplingParams(temperature=1.0), 5),
                         (SamplingParams(temperature=1.0, top_k=3), 3),
                         (SamplingParams(temperature=1.0, top_p=0.8), 3)):
        ids = sample(logits, [params] * n, [None] * n, g)
        freq = torch.bincount(ids, minlength=5).float() / n
        want = torch.zeros(5)
        want[:keep] = row[:keep].softmax(-1)
        assert (freq - want).abs().max() < 0.04, (params, freq, want)


def test_seeded_reproducible_and_seeds_differ():
    eng = make_engine()
    sp = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True)
          for s in (1, 1, 2)]
    a, b, c = run_all(eng, [PROMPTS[0]] * 3, sp)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    greedy = run_all(eng, [PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert a.token_ids != greedy.token_ids  # temperature > 0 really samples
    top1 = run_all(eng, [PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.9, top_k=1,
                                                      seed=3, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_max_tokens_and_stop_token_ids():
    eng = make_engine(tokenizer=CharTokenizer())
    full = run_all(eng, PROMPTS, SamplingParams(max_tokens=15, ignore_eos=True))
    assert all(len(o.token_ids) == 15 and o.finish_reason == "length" for o in full)
    for o, p in zip(full, PROMPTS):
        assert o.text == CharTokenizer().decode(o.token_ids)
        stop_tok = o.token_ids[6]
        cut = o.token_ids.index(stop_tok)
        (s,) = run_all(eng, [p], SamplingParams(max_tokens=15, stop_token_ids=[stop_tok],
                                                ignore_eos=True))
        assert s.finish_reason == "stop" and s.token_ids == o.token_ids[:cut + 1]
        assert s.text == CharTokenizer().decode(o.token_ids[:cut])  # stop token not in text


def test_stop_strings():
    eng = make_engine(tokenizer=CharTokenizer())
    full = run_all(eng, PROMPTS, SamplingParams(max_tokens=15, ignore_eos=True))
    for o, p in zip(full, PROMPTS):
        stop = o.text[5:8]
        at = o.text.index(stop)
        (s,) = run_all(eng, [p], SamplingParams(max_tokens=15, stop=["zzzzzz", stop],
                                                ignore_eos=True))
        assert s.finish_reason == "stop"
        assert s.text == o.text[:at]
        assert s.token_ids == o.token_ids[:at + len(stop)]
        (k,) = run_all(eng, [p], SamplingParams(max_tokens=15, stop=["zzzzzz", stop],
                                                ignore_eos=True, include_stop_str_in_output=True))
        assert k.text == o.text[:at + len(stop)] and k.token_ids == s.token_ids  # vLLM's field


def test_eos_stops_unless_ignored():
    base = run_all(make_engine(), [PROMPTS[1]], SamplingParams(max_tokens=10, ignore_eos=True))
    eos = base[0].token_ids[3]
    eng = make_engine(eos_token_ids=[eos])
    (o,) = run_all(eng, [PROMPTS[1]], SamplingParams(max_tokens=10))
    assert o.finish_reason == "stop" and o.token_ids[-1] == eos
    assert len(o.token_ids) == base[0].token_ids.index(eos) + 1
    (o,) = run_all(eng, [PROMPTS[1]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert o.token_ids == base[0].token_ids


@pytest.mark.parametrize("kwargs,name", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_argmax_rows_is_torch_argmax():
    """The numpy argmax of the CPU greedy paths gives torch's ids: ties go to the first, a row
    with NaN to its first NaN, any leading shape; other dtypes take torch's own path."""
    from specdeploy.engine.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (5, 7, 49), generator=g).float()  # many ties
    x[1, 2, 5] = x[1, 2, 9] = float("nan")
    x[3, 0, :] = float("-inf")
    for t in (x, x[0], x[:, 3], x.transpose(0, 1)):  # views, non-contiguous
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1))
    b = x.bfloat16()
    assert torch.equal(argmax_rows(b), b.argmax(-1))
    with torch.inference_mode():
        y = torch.randn(2, 100, generator=g)
        assert argmax_rows(y).tolist() == y.argmax(-1).tolist()
