"""The training-time test sees what deployment sees: step j of the unrolled objective (row p)
gives the logits the drafter module computes when drafting the j-th token after p, with its
attention over the real-feature rows 0..p plus its own earlier draft steps.

Oracle: the drafter's own full causal forward (the code that gets exported), run on the
sequence deployment builds — step-0 rows from target features, then one row per draft step fed
with the previous step's output hidden — not the unrolled code under test.
"""
from __future__ import annotations

import pytest
import torch

import specdeploy
from specdeploy.models import llama
from specdeploy.models.drafters.eagle3 import default_aux_layers
from specdeploy.training.features import extract
from specdeploy.training.ttt import KVSteps, shift

STEPS, T = 3, 12


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return specdeploy.load_model(llama.make_tiny(tmp_path_factory.mktemp("t") / "t", seed=0))


def _objective(method, target):
    torch.manual_seed(0)
    ids = torch.arange(target.cfg.vocab_size)  # the whole vocab: logits comparable 1:1
    if method == "eagle3":
        from specdeploy.training.eagle3 import Eagle3Objective

        obj = Eagle3Objective(target, ids, default_aux_layers(target.cfg.num_hidden_layers),
                              STEPS)
        with torch.no_grad():  # off the target init: every weight matters
            for p in obj.drafter.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return obj
    from specdeploy.training.mtp import MTPObjective

    obj = MTPObjective(target, ids, STEPS)
    with torch.no_grad():
        for p in obj.head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    obj.__dict__["_head_rows"] = target.lm_head.weight
    return obj


def _unrolled(obj, method, feats, emb, head_dim):
    first = obj.drafter.fc(feats.aux) if method == "eagle3" else feats.final
    kv, hidden, out = KVSteps(head_dim**-0.5), first, []
    for j in range(STEPS):
        pos = (torch.arange(T) + j)[None]
        hidden, logits = obj.step(hidden, shift(emb, j + 1), pos, kv)
        out.append(logits)
    return out


def _module_draft(obj, method, feats, emb, p, j):
    """Logits of draft step j after position p, from the drafter module's causal forward."""
    mod = obj.drafter if method == "eagle3" else obj.head
    first = feats.aux if method == "eagle3" else feats.final
    hid = [first[0, q] for q in range(p + 1)]
    embs = [emb[0, q + 1] for q in range(p + 1)]
    pos = list(range(p + 1))
    for k in range(j + 1):
        out = mod(torch.stack(hid)[None] if k == 0 else _mixed(obj, method, hid)[None],
                  torch.stack(embs)[None], torch.tensor([pos]))
        if k == j:
            return out.logits[0, -1]
        hid.append(out.hidden[0, -1])
        embs.append(emb[0, p + k + 2])
        pos.append(p + k + 1)


def _mixed(obj, method, hid):
    """Step-0 rows are target features (EAGLE-3: projected by fc, as deployment's `project`
    does); later rows are the drafter's own hidden."""
    if method != "eagle3":
        return torch.stack(hid)
    h = obj.drafter.cfg.hidden_size
    return torch.stack([obj.drafter.fc(x) if x.shape[-1] != h else x for x in hid])


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_unrolled_steps_equal_module_drafting(target, method):
    obj = _objective(method, target)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.cfg.vocab_size, (1, T), generator=g)
    feats = extract(target, ids, torch.ones_like(ids, dtype=torch.bool),
                    default_aux_layers(target.cfg.num_hidden_layers))
    emb = target.model.embed_tokens(ids)
    head_dim = target.cfg.head_dim
    with torch.no_grad():
        unrolled = _unrolled(obj, method, feats, emb, head_dim)
        for p in (0, 3, T - STEPS - 1):
            for j in range(STEPS):
                want = _module_draft(obj, method, feats, emb, p, j)
                # fp32, same math in another order: 1e-4 relative
                torch.testing.assert_close(unrolled[j][0, p], want, rtol=1e-4, atol=1e-4)
