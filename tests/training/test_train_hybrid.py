"""Drafter training on tiny hybrid targets (NemotronH; Qwen3.5-MoE in the VLM layout and in the
text-only one): EAGLE-3 heads, fresh family MTP modules, and the checkpoint's own MTP module
fine-tuned and written back in its `mtp.*` layout."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdeploy.models.drafters.checkpoint_mtp import load_checkpoint_mtp
from specdeploy.models.drafters.eagle3 import load_eagle3
from specdeploy.training.features import extract
from specdeploy.training.hybrid_mtp import HybridMTPObjective
from specdeploy.training.target_info import aux_layers, embedding
from specdeploy.training.trainer import TrainConfig, build_objective, train
from specdeploy.training.ttt import KVSteps, shift
from tests.training.hybrid_setup import MTP_GROUPS, Hybrid, chain_drafts
from tests.training.test_train_tiny import CharTokenizer

ARCHS = ["nemotron_h", "qwen3_5_moe", "qwen3_5_moe_text"]


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request, tmp_path_factory):
    return Hybrid(request.param, tmp_path_factory.mktemp(request.param))


def _objective(hybrid, cfg, target, draft_ids):
    module = None
    if cfg.init_from_checkpoint:
        module = target.mtp
        del target.mtp
    return build_objective(cfg.method, target, draft_ids, aux_layers(target), cfg.ttt_steps,
                           module=module)


@pytest.mark.parametrize("run", ["eagle3", "mtp", "mtp_ft"])
def test_few_steps_lower_the_loss(hybrid, run):
    """The loss on the training batch: the objective as it starts (fresh init, or the
    checkpoint's module) vs the same objective with the trained weights of checkpoint.pt."""
    cfg, meta = hybrid.run(run)
    state = torch.load(f"{cfg.out}/checkpoint.pt")
    target = hybrid.target(with_mtp=cfg.init_from_checkpoint)
    feats = hybrid.batch(target, cfg)
    obj = _objective(hybrid, cfg, target, state["draft_ids"])
    with torch.no_grad():
        before = float(obj.loss(feats)[0])
        obj.load_state_dict(state["objective"])
        after = float(obj.loss(feats)[0])
    assert meta["steps"] == 10 and meta["aux_layer_ids"] == list(aux_layers(target))
    # NOTE: a random tiny target is nearly uniform: the soft-CE floor is close to the start
    assert after < before - 0.05, (before, after)
    assert abs(before - meta["history"][0]["loss"]) < 0.05  # the trainer saw that same batch


def test_hybrid_capture_layers(hybrid):
    """Inputs of existing layers past the embedding; on NemotronH the layers after an MLP /
    MoE layer first (its pattern M*M-E*ME has those at 4 and 5; a third comes from the rest)."""
    target = hybrid.target()
    ids = aux_layers(target)
    assert len(ids) == 3 and len(set(ids)) == 3 and all(1 <= i < len(target.model.layers)
                                                        for i in ids)
    assert ids == ((4, 5, 6) if hybrid.arch == "nemotron_h" else (1, 2, 3))


def test_eagle3_head_reloads_and_drafts_identically(hybrid):
    cfg, _ = hybrid.run("eagle3")
    state = torch.load(f"{cfg.out}/checkpoint.pt")
    target = hybrid.target()
    obj = _objective(hybrid, cfg, target, state["draft_ids"])
    obj.load_state_dict(state["objective"])
    loaded = load_eagle3(cfg.out, target_cfg=target.cfg, embed_tokens=embedding(target))
    assert loaded.cfg.aux_layer_ids == aux_layers(target)
    feats = hybrid.batch(target, cfg)
    with torch.no_grad():
        a, la = chain_drafts(obj.drafter, feats.aux, feats.ids, 3, 1)
        b, lb = chain_drafts(loaded, feats.aux, feats.ids, 3, 1)
    assert torch.equal(a, b) and torch.allclose(la, lb, atol=1e-5)


@pytest.mark.parametrize("run", ["mtp", "mtp_ft"])
def test_mtp_module_reloads_in_the_checkpoint_layout(hybrid, run):
    """The written `mtp.*` keys are the checkpoint's own (same names and shapes); the reloaded
    module drafts exactly as the trained one in memory, every group included; fine-tuning
    changed the checkpoint's weights."""
    cfg, _ = hybrid.run(run)
    with safe_open(f"{cfg.out}/model.safetensors", "pt") as f, \
            safe_open(f"{hybrid.path}/model.safetensors", "pt") as ref:
        written = {k: f.get_slice(k).get_shape() for k in f.keys()}
        mtp_keys = {k: ref.get_slice(k).get_shape() for k in ref.keys() if k.startswith("mtp.")}
    groups = MTP_GROUPS if cfg.init_from_checkpoint else 1
    if groups == MTP_GROUPS:
        assert written == mtp_keys
    else:  # a fresh module has one group: the checkpoint's group-0 keys
        assert written and set(written) <= set(mtp_keys)
        assert all(written[k] == mtp_keys[k] for k in written)
    hf = json.loads(open(f"{cfg.out}/config.json").read())
    key = "num_nextn_predict_layers" if hybrid.arch == "nemotron_h" else "mtp_num_hidden_layers"
    assert hf.get("text_config", hf)[key] == groups

    state = torch.load(f"{cfg.out}/checkpoint.pt")
    target = hybrid.target(with_mtp=cfg.init_from_checkpoint)
    original = getattr(target, "mtp", None)
    original = None if original is None else {k: v.clone() for k, v in
                                              original.state_dict().items()}
    obj = _objective(hybrid, cfg, target, state["draft_ids"])
    obj.load_state_dict(state["objective"])
    loaded = load_checkpoint_mtp(cfg.out, target)
    assert type(loaded) is type(obj.module)
    feats = hybrid.batch(target, cfg)
    with torch.no_grad():
        a, la = chain_drafts(obj.module, feats.final, feats.ids, 3, groups)
        b, lb = chain_drafts(loaded, feats.final, feats.ids, 3, groups)
    assert torch.equal(a, b) and torch.allclose(la, lb, atol=1e-5)
    if original is not None:
        now = obj.module.state_dict()
        assert any(not torch.equal(v, now[k]) for k, v in original.items())


def test_checkpoint_dir_loads_as_its_own_mtp_module(hybrid):
    """Oracle: the family loader's `Model(with_mtp=True).mtp`; the checkpoint-layout reader must
    give the same tensors from the full target checkpoint."""
    target = hybrid.target(with_mtp=True)
    want = target.mtp.state_dict()
    got = load_checkpoint_mtp(hybrid.path, target).state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("steps,trained", [(1, {0}), (3, {0, 1})])
def test_group_j_is_trained_at_step_j(hybrid, steps, trained):
    """Unrolled step j runs group min(j, G-1): one step leaves group 1 without a gradient."""
    target = hybrid.target(with_mtp=True)
    cfg = hybrid.config("mtp_ft", ttt_steps=steps)
    module = target.mtp
    del target.mtp
    obj = HybridMTPObjective(target, torch.arange(target.cfg.vocab_size), steps, module=module)
    obj.loss(hybrid.batch(target, cfg))[0].backward()
    per_group = len(module.layers) // MTP_GROUPS
    for g in range(MTP_GROUPS):
        grads = [p.grad for layer in module.layers[g * per_group:(g + 1) * per_group]
                 for p in layer.parameters()]
        assert any(x is not None and bool(x.abs().sum() > 0) for x in grads) == (g in trained)


def _module_draft(mod, feats, emb, p, j, groups):
    """Oracle: logits of draft step j after position p from the MTP module's own causal forward
    over what that step's group holds in deployment (its rows at the committed positions 0..p,
    fed from the target's features, then its own earlier draft rows for p), not the unrolled
    code under test."""
    h_in = [feats.final[0, p]]  # the hidden input of each step
    for k in range(j + 1):
        g = min(k, groups - 1)
        hid = [feats.final[0, q] for q in range(p + 1)]
        embs = [emb[0, q + 1] for q in range(p + 1)]
        pos = list(range(p + 1))
        for s in range(1, k + 1):
            if min(s, groups - 1) == g:
                hid.append(h_in[s])
                embs.append(emb[0, p + s + 1])
                pos.append(p + s)
        out = mod(torch.stack(hid)[None], torch.stack(embs)[None], torch.tensor([pos]), step=g)
        if k == j:
            return out.logits[0, -1]
        h_in.append(out.hidden[0, -1])


@pytest.mark.parametrize("groups", [1, MTP_GROUPS])
def test_unrolled_mtp_steps_equal_module_drafting(hybrid, groups):
    target = hybrid.target(with_mtp=groups > 1)
    module = getattr(target, "mtp", None)
    if module is not None:
        del target.mtp
    obj = HybridMTPObjective(target, torch.arange(target.cfg.vocab_size), 3, module=module)
    with torch.no_grad():
        for prm in obj.module.parameters():  # off the target copy: every weight matters
            prm.add_(0.05 * torch.randn(prm.shape, generator=torch.Generator().manual_seed(2)))
    n = 12
    ids = torch.randint(3, target.cfg.vocab_size, (1, n),
                        generator=torch.Generator().manual_seed(1))
    feats = extract(target, ids, torch.ones_like(ids, dtype=torch.bool), aux_layers(target))
    emb = embedding(target)(ids).detach()
    obj.__dict__["_head_rows"] = obj.module.borrowed["lm_head"].weight
    kv, hidden, unrolled = KVSteps(1.0), feats.final, []
    with torch.no_grad():
        for j in range(3):
            kv.step = j
            hidden, logits = obj.step(hidden, shift(emb, j + 1), (torch.arange(n) + j)[None], kv)
            unrolled.append(logits)
        for p in (0, 4, n - 4):
            for j in range(3):
                want = _module_draft(obj.module, feats, emb, p, j, groups)
                torch.testing.assert_close(unrolled[j][0, p], want, rtol=1e-4, atol=1e-4)


def test_init_from_checkpoint_is_refused_where_it_cannot_apply(hybrid, tmp_path):
    target = hybrid.target()
    kw = dict(tokenizer=CharTokenizer(), convs=hybrid.convs, log=lambda m: None)
    with pytest.raises(ValueError, match="needs --method mtp"):
        train(hybrid.config("eagle3", init_from_checkpoint=True, out=str(tmp_path / "a")),
              target=target, **kw)
    with pytest.raises(ValueError, match="without an MTP module"):
        train(hybrid.config("mtp_ft", out=str(tmp_path / "b")), target=target, **kw)


def test_resume_continues_a_fine_tuning_run(hybrid):
    cfg, _ = hybrid.run("mtp_ft")
    more = TrainConfig(**{**cfg.__dict__, "max_steps": 12})
    meta = train(more, target=hybrid.target(with_mtp=True), tokenizer=CharTokenizer(),
                 convs=hybrid.convs, log=lambda m: None)
    assert meta["steps"] == 12 and meta["history"][-1]["step"] == 12
    assert len(meta["history"]) == 12  # the first ten came from checkpoint.pt


@pytest.mark.parametrize("exported", [False, True], ids=["run_dir", "exported_module"])
def test_init_from_a_fine_tuned_module(hybrid, exported, tmp_path):
    """From a two-group run's --out dir or from its exported mtp.* directory alone: 0 steps
    later the written module is that module."""
    cfg, _ = hybrid.run("mtp_ft")
    src = Path(cfg.out)
    if exported:
        src = tmp_path / "exported"
        src.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(Path(cfg.out) / name, src / name)
    new = hybrid.config("mtp", out=str(tmp_path / "ft"), max_steps=0, init_from=str(src))
    train(new, target=hybrid.target(), tokenizer=CharTokenizer(), convs=hybrid.convs,
          log=lambda m: None)
    with safe_open(f"{cfg.out}/model.safetensors", "pt") as a, \
            safe_open(f"{new.out}/model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


@pytest.mark.parametrize("run", ["eagle3", "mtp"])
def test_dense_qwen3_5_trains_its_heads(tmp_path, run):
    """Dense Qwen3.5: an EAGLE-3 head as wide as its MLP, and a fresh MTP module, lower the
    loss in 10 steps."""
    from specdeploy.training.target_info import eagle3_geometry

    h = Hybrid("qwen3_5", tmp_path)
    target = h.target()
    assert eagle3_geometry(target)["intermediate_size"] == target.cfg.intermediate_size == 96
    cfg, meta = h.run(run)
    state = torch.load(f"{cfg.out}/checkpoint.pt")
    feats = h.batch(target, cfg)
    obj = _objective(h, cfg, target, state["draft_ids"])
    with torch.no_grad():
        before = float(obj.loss(feats)[0])
        obj.load_state_dict(state["objective"])
        after = float(obj.loss(feats)[0])
    assert meta["steps"] == 10 and after < before - 0.05, (before, after)
