"""Checkpoints with several MTP groups (NemotronH `num_nextn_predict_layers`, Qwen3.5
`mtp_num_hidden_layers`): the deployed drafter runs group g(j) at draft step j, each group with
its own paged KV, and drafts what the module computes.

Oracle: the plain MTP module of the checkpoint, run eagerly as one causal forward over [committed
rows fed the target's final-normed hidden states, then one row per draft so far fed the previous
step's output hidden], with `step=j` (no cache, no graph, no engine). The expected group of
each step is spelled out here (NemotronH: min(j, G-1); Qwen3.5: j mod G, as vLLM), not read from
the code under test. Lossless: greedy output with G = 2 equals the same target's greedy output
without speculation.
"""
from __future__ import annotations

import pytest
import torch

import specdeploy
from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.models.registry import family_module

K = 3  # past G = 2: step 2 shows the policy beyond the last group
# NOTE: checkpoint_every=1: recurrent checkpoints at every page, so a 21-token prompt can hit
LIMITS = dict(dtype="float32", max_batch_size=4, max_seq_len=96, max_cache_gib=0.05,
              page_size=8, checkpoint_every=1)
EXPECTED_GROUPS = {  # draft step j -> group, for G = 1, 2
    ("nemotron_h", 1): [0, 0, 0], ("nemotron_h", 2): [0, 1, 1],
    ("qwen3_5_moe", 1): [0, 0, 0], ("qwen3_5_moe", 2): [0, 1, 0],
}


class Case:
    def __init__(self, arch: str, groups: int, root):
        self.arch, self.groups = arch, groups
        self.path = family_module(arch).make_tiny(root / f"{arch}_{groups}", seed=3,
                                                  mtp_layers=groups)
        # fixed K: every step runs the K draft steps whose groups are checked; the drafter in
        # the target's precision (its drafts are compared with the module's)
        self.llm = LLM(str(self.path), spec=SpecConfig("mtp", K, controller="off",
                                                       draft_quantize=None), **LIMITS)
        self.model = specdeploy.load_model(str(self.path), dtype="float32", with_mtp=True)


@pytest.fixture(scope="module", params=sorted(EXPECTED_GROUPS), ids=lambda p: f"{p[0]}-G{p[1]}")
def case(request, tmp_path_factory):
    return Case(*request.param, tmp_path_factory.mktemp("mtp_groups"))


def _module_drafts(model, ids: list[int], k: int):
    """Drafts after `ids` by the plain module (see the module docstring)."""
    n = len(ids) - 1
    with torch.no_grad():
        hidden = model.forward_hidden(torch.tensor([ids[:n]]), torch.arange(n)[None])
        toks, drafts, logits = list(ids[1:]), [], []
        for j in range(k):
            out = model.mtp(hidden, model.mtp.embed(torch.tensor([toks])),
                            torch.arange(len(toks))[None], step=j)
            drafts.append(int(out.logits[0, -1].argmax()))
            logits.append(out.logits[0, -1])
            hidden, toks = torch.cat([hidden, out.hidden[:, -1:]], 1), toks + [drafts[-1]]
    return drafts, torch.stack(logits)


def test_groups_deployed(case):
    d = case.llm.deployed
    assert d.num_groups == case.groups == case.model.mtp.num_groups
    assert [d.group_of(j) for j in range(K)] == EXPECTED_GROUPS[(case.arch, case.groups)]
    # each group its own KV (the same shapes: one attention layer per group), all in the one
    # cache plan, which sizes its pages for all of them
    plan = d.target.plan
    kv = {n: b for n, b in plan.bytes_by_handler.items() if plan.kind_by_handler[n] == "paged_kv"}
    per_group = [sorted(b for n, b in kv.items() if n.startswith(_prefix(g)))
                 for g in range(case.groups)]
    assert per_group[0] and all(p == per_group[0] for p in per_group), kv
    assert not any(n.startswith(_prefix(case.groups)) for n in kv)
    assert plan.bytes_by_kind["paged_kv"] == sum(kv.values())
    handlers = [h for gd in (d.target, *d.drafts) for h in gd.resources
                if hasattr(h, "num_kv_heads")]
    pages = plan.num_pages + 1  # + the scratch page (cache/plan.py)
    assert sum(h.bytes_per_page(plan.page_size) for h in handlers) * pages == sum(kv.values())


def _prefix(group: int) -> str:
    return "draft_" if group == 0 else f"draft{group}_"


def test_deployed_drafts_equal_module_drafts(case, monkeypatch):
    """Draft step by draft step, after a prefill and after verify/commit rounds: the deployed
    drafter's logits equal the module's (fp32, 1e-5) and its drafts are the module's."""
    eng, d = case.llm.engine, case.llm.deployed
    calls = []
    draft_forward = d.draft_forward

    def recording(meta, hidden, group=0, **kw):  # kw: a replayed chain's on-device ids
        out = draft_forward(meta, hidden, group=group, **kw)
        calls.append((group, out.logits.clone()))
        return out

    monkeypatch.setattr(d, "draft_forward", recording)
    g = torch.Generator().manual_seed(0)
    long = torch.randint(3, 100, (21,), generator=g).tolist()
    hits = case.llm.stats()["prefix_cache_hits"]
    # the last prompt again: a prefix-cache hit serves every group's KV from the shared pages
    for prompt, steps in ((long[:9], 1), (long, 3), (long, 2)):
        eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        for _ in range(steps):
            calls.clear()
            eng.step()
        (seq,) = list(eng.scheduler.running)
        want_drafts, want_logits = _module_drafts(case.model, seq.all_ids, K)
        # calls: the catch-up through every group (group 0's output drafts step 0), then
        # one forward per further draft step through that step's group
        groups = [grp for grp, _ in calls]
        expect = EXPECTED_GROUPS[(case.arch, case.groups)]
        assert groups == list(range(case.groups)) + expect[1:], groups
        got = torch.cat([calls[0][1]] + [lg for _, lg in calls[case.groups:]])
        assert seq.spec.drafts == want_drafts, prompt
        torch.testing.assert_close(got, want_logits, atol=1e-5, rtol=1e-5)
        while eng.has_unfinished():
            eng.step()
    assert case.llm.stats()["prefix_cache_hits"] > hits


def test_greedy_spec_equals_non_spec(case):
    if case.groups == 1:
        pytest.skip("G = 1 greedy equality: tests/spec/test_spec_greedy.py")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (1, 6, 30)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(str(case.path), **LIMITS)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = [o.token_ids for o in case.llm.generate(prompts, params)]
    assert got == want
    assert case.llm.stats()["draft_steps"] > 0
