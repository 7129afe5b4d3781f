"""The deployed drafter drafts what the drafter module computes (oracle: the module's plain causal
forward on the target's features, no cache, no graph): at the first step after a prefill and
after several verify/accept/commit rounds. Lossless tests cannot see a drafting bug (it only
costs acceptance); this one does. The training objective is tied to the same module forward by
tests/training/test_ttt_matches_drafting.py."""
from __future__ import annotations

import pytest
import torch

import specdeploy
from specdeploy import SamplingParams
from specdeploy.training.features import extract
from tests.spec.tiny_targets import Target


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Target("llama", tmp_path_factory.mktemp("fidelity"))


def _module_drafts(model, drafter, ids: list[int], k: int):
    """Drafts after `ids` by the module: step-0 rows from target features at 0..n-1 (n + 1 =
    len(ids)), then one row per draft step fed with the previous step's output hidden, each
    step a full causal forward over all rows so far."""
    n_layers = len(model.model.layers)
    capture = [min(max(i - 1, 0), n_layers - 1) for i in drafter.cfg.aux_layer_ids]
    n = len(ids) - 1
    f = extract(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool),
                tuple(c + 1 for c in capture))  # input of layer c + 1 = output of layer c
    hidden, toks, drafts, logits = drafter.fc(f.aux[:, :n]), list(ids[1:]), [], []
    for _ in range(k):
        out = drafter(hidden, drafter.embed(torch.tensor([toks])),
                      torch.arange(len(toks))[None])
        d = int(drafter.draft_to_target(out.logits[0, -1].argmax()))
        drafts.append(d)
        logits.append(out.logits[0, -1])
        hidden, toks = torch.cat([hidden, out.hidden[:, -1:]], 1), toks + [d]
    return drafts, torch.stack(logits)


@pytest.mark.parametrize("steps", [1, 4])
def test_engine_drafts_equal_module_drafts(llama, steps, monkeypatch):
    """Drafts equal, and the draft logits of every step agree to fp32 rounding (1e-4 abs on
    logits of size ~1; argmaxes alone would miss e.g. a wrong RoPE position)."""
    k = 3
    llm = llama.llm(k)
    eng = llm.engine
    model = specdeploy.load_model(str(llama.path))
    drafter = llm.deployed.drafter
    seen = []
    draft_forward = llm.deployed.draft_forward

    def recording(meta, hidden, **kw):  # one sequence: each draft forward gives a draft's logits
        out = draft_forward(meta, hidden, **kw)
        seen.append(out.logits.clone())
        return out

    monkeypatch.setattr(llm.deployed, "draft_forward", recording)
    with torch.no_grad():
        for prompt in llama.prompts[1:4]:
            eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
            for _ in range(steps):
                seen.clear()
                eng.step()
            (seq,) = list(eng.scheduler.running)
            drafts, logits = _module_drafts(model, drafter, seq.all_ids, k)
            assert seq.spec.drafts == drafts, prompt
            torch.testing.assert_close(torch.cat(seen), logits, atol=1e-4, rtol=1e-4)
            while eng.has_unfinished():
                eng.step()
