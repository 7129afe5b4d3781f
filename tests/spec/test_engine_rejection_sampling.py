"""Engine-level rejection sampling on a hybrid target: under MTP speculation the first two
generated tokens follow the exact target distribution (chi-square, fixed seeds).

Token 1 is sampled from the prefill's logits; token 2 is the first verified position of the
next step (the MTP draft accepted, or the residual resampled), so it exercises the engine's
whole verify path: drafts, q, the per-request generators, acceptance and the residual. Oracle:
the eager NemotronH module's logits, processed with exact math (temperature, then top-k)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h

N = 2000
PROMPT = [5, 17, 42, 9, 33, 61, 8]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = nemotron_h.make_tiny(tmp_path_factory.mktemp("rs") / "nh", seed=3, mtp_layers=1)
    # fixed K: token 2 is always a verified draft position (the controller may draft none)
    llm = LLM(str(path), spec=SpecConfig("mtp", 3, controller="off"), max_batch_size=64,
              max_seq_len=64, max_cache_gib=0.05, page_size=8, dtype="float32",
              enable_prefix_caching=False)
    return path, llm


def _processed(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    z = logits.double() / temperature
    if top_k:
        kth = z.topk(top_k, -1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.softmax(z, -1)


def _exact(path, temperature: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 1) [V] and the marginal P(token 2) [V] = sum_x P(x) P(token 2 | x)."""
    model = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        p1 = _processed(model(torch.tensor([PROMPT]))[0, -1], temperature, top_k)
        v = p1.numel()
        ids = torch.tensor(PROMPT)[None].expand(v, -1)
        nxt = torch.arange(v)[:, None]
        p2 = _processed(model(torch.cat([ids, nxt], 1))[:, -1], temperature, top_k)
    return p1, (p1[:, None] * p2).sum(0)


def _binned_test(samples: torch.Tensor, p: torch.Tensor, top: int = 12) -> float:
    """Chi-square p-value over the `top` likeliest tokens + one bin for the rest (every
    expected count >= 5)."""
    order = p.argsort(descending=True)
    keep = [int(t) for t in order[:top] if p[t] * len(samples) >= 5]
    counts = [int((samples == t).sum()) for t in keep]
    expected = [float(p[t]) * len(samples) for t in keep]
    rest = len(samples) - sum(counts)
    rest_e = len(samples) - sum(expected)
    if rest_e >= 5:
        counts.append(rest)
        expected.append(rest_e)
    else:  # fold the sliver into the last bin so the totals agree
        counts[-1] += rest
        expected[-1] += rest_e
    return chisquare(counts, expected).pvalue


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 8)], ids=["T1", "T0.7_top8"])
def test_first_two_tokens_follow_target(hybrid, temperature, top_k):
    path, llm = hybrid
    p1, p2 = _exact(path, temperature, top_k)
    params = [SamplingParams(max_tokens=2, temperature=temperature, top_k=top_k, seed=s,
                             ignore_eos=True) for s in range(N)]
    before = llm.stats()
    outs = llm.generate([PROMPT] * N, params)
    after = llm.stats()
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (N, 2)
    # the verify path ran, and both of its branches were taken (some drafts accepted, some not)
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert drafted >= 3 * N and 0 < accepted < drafted, (drafted, accepted)
    assert _binned_test(toks[:, 0], p1) > 1e-3
    assert _binned_test(toks[:, 1], p2) > 1e-3
