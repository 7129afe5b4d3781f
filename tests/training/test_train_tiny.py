"""Drafter training on a tiny random Llama target: loss goes down, saved heads reload exactly."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import specdeploy
from specdeploy.models import llama
from specdeploy.training.data import Conversation
from specdeploy.training.trainer import TrainConfig, train

WORDS = "the cat sat on a mat and then it ran to see the dog who was very happy".split()


class CharTokenizer:
    """Bytes mod 128 (the tiny vocab); the 'chat template' is role: content lines."""

    eos_token_id = 2

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [b % 128 for b in text.encode()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = specdeploy.load_model(llama.make_tiny(root / "target", seed=0))
    rng = random.Random(0)
    convs = [Conversation(str(i), [
        {"role": "user", "content": " ".join(rng.choices(WORDS, k=6))},
        {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=12))}])
        for i in range(40)]
    return root, target, convs


def _train(setup, method, **kw):
    root, target, convs = setup
    cfg = TrainConfig(method=method, out=str(root / method), max_steps=12, batch_size=2,
                      seq_len=48, num_samples=2, lr=3e-3, warmup_steps=1, draft_vocab_size=64,
                      save_dtype="fp32", vocab_samples=20, progress=False,
                      cache_dir=str(root / "features"), fit_batches=0, **kw)
    meta = train(cfg, target=target, tokenizer=CharTokenizer(), convs=convs, log=lambda m: None)
    return cfg, meta


@pytest.fixture(scope="module")
def trained(setup):
    return {m: _train(setup, m) for m in ("eagle3", "mtp")}


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_few_steps_lower_the_loss(trained, method):
    _, meta = trained[method]
    losses = [h["loss"] for h in meta["history"]]
    assert len(losses) == 12
    # NOTE: a random tiny target is nearly uniform, so the soft CE floor (its entropy) is close
    # to the start; a steady drop is what a working objective shows here.
    assert losses[-1] < losses[0] - 0.05 and losses[-1] < min(losses[:3]), losses
    assert meta["heldout"]["num_heldout"] == 4 and len(meta["heldout"]["heldout_ids"]) == 4


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_closed_form_warm_start_lowers_the_loss(setup, method):
    from specdeploy.training.trainer import build_objective

    _, target, _ = setup
    f = _features(setup)
    obj = build_objective(method, target, torch.arange(0, 128, 2), (0, 1, 1), steps=2)
    with torch.no_grad():
        before = float(obj.loss(f)[0])
        obj.fit_linear([f])
        after = float(obj.loss(f)[0])
    assert after < before, (before, after)


def _features(setup):
    from specdeploy.models.drafters.eagle3 import default_aux_layers
    from specdeploy.training.features import extract

    _, target, _ = setup
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    return extract(target, ids, torch.ones_like(ids, dtype=torch.bool),
                   default_aux_layers(target.cfg.num_hidden_layers))


def _chain(drafter, first_hidden, ids, steps=3):
    """Greedy drafts of `steps` chained steps from every position (full-sequence recompute)."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = drafter(first_hidden, drafter.embed(ids), pos)
    drafts = [out.logits.argmax(-1)]
    for j in range(1, steps):
        out = drafter(out.hidden, drafter.embed(drafts[-1]), pos + j)
        drafts.append(out.logits.argmax(-1))
    return torch.stack(drafts), out.logits


def test_saved_eagle3_reloads_and_drafts_identically(setup, trained):
    from specdeploy.models.drafters.eagle3 import load_eagle3
    from specdeploy.training.eagle3 import Eagle3Objective

    _, target, _ = setup
    cfg, _ = trained["eagle3"]
    state = torch.load(f"{cfg.out}/checkpoint.pt")
    obj = Eagle3Objective(target, state["draft_ids"], (0, 1, 1))
    obj.load_state_dict(state["objective"])
    loaded = load_eagle3(cfg.out, target_cfg=target.cfg, embed_tokens=target.model.embed_tokens)
    f = _features(setup)
    with torch.no_grad():
        a, la = _chain(obj.drafter, f.aux, f.ids)
        b, lb = _chain(loaded, f.aux, f.ids)
    assert torch.equal(a, b) and torch.allclose(la, lb, atol=1e-5)


def test_saved_mtp_head_reloads_and_drafts_identically(setup, trained):
    """The saved head drafts over its training vocab (`mtp.d2t`): the same drafts (target ids)
    and logits as the trained head's full-vocab logits restricted to those ids."""
    from specdeploy.models.drafters.mtp_head import load_mtp_head
    from specdeploy.training.mtp import MTPObjective

    _, target, _ = setup
    cfg, _ = trained["mtp"]
    state = torch.load(f"{cfg.out}/checkpoint.pt")
    obj = MTPObjective(target, state["draft_ids"])
    obj.load_state_dict(state["objective"])
    loaded = load_mtp_head(cfg.out, target)
    keys = safe_open(f"{cfg.out}/model.safetensors", "pt").keys()
    assert keys and all(k.startswith("mtp.") for k in keys) and "mtp.fc.weight" in keys
    ids = state["draft_ids"]
    assert torch.equal(loaded.d2t + torch.arange(len(ids)), ids)
    f = _features(setup)

    def chain(head, restrict: bool, steps=3):
        pos = torch.arange(f.ids.shape[1]).expand_as(f.ids)
        hidden, tok, drafts = f.final, f.ids, []
        for j in range(steps):
            out = head(hidden, head.embed(tok), pos + j)
            logits = out.logits[..., ids] if restrict else out.logits
            tok = ids[logits.argmax(-1)]
            hidden = out.hidden
            drafts.append(tok)
        return torch.stack(drafts), logits

    with torch.no_grad():
        a, la = chain(obj.head, True)
        b, lb = chain(loaded, False)
    assert torch.equal(a, b) and torch.allclose(la, lb, atol=1e-5)


def test_eagle3_checkpoint_round_trips_with_d2t(setup, trained):
    from specdeploy.models.drafters.eagle3 import load_eagle3

    _, target, _ = setup
    cfg, _ = trained["eagle3"]
    hf = json.loads(open(f"{cfg.out}/config.json").read())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["draft_vocab_size"] == 64 and hf["vocab_size"] == 128
    with safe_open(f"{cfg.out}/model.safetensors", "pt") as f:
        keys = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
    assert any(k.startswith("midlayer.self_attn.") for k in keys)
    draft_ids = torch.load(f"{cfg.out}/checkpoint.pt")["draft_ids"]
    assert torch.equal(torch.arange(64) + d2t, draft_ids)
    assert t2d.dtype == torch.bool and int(t2d.sum()) == 64 and bool(t2d[draft_ids].all())
    loaded = load_eagle3(cfg.out, target_cfg=target.cfg, embed_tokens=target.model.embed_tokens)
    assert torch.equal(loaded.draft_to_target(torch.arange(64)), draft_ids)
    assert loaded.cfg.to_hf() == hf


def test_resume_continues_the_run(setup, trained):
    cfg, _ = trained["mtp"]
    _, target, convs = setup
    more = TrainConfig(**{**cfg.__dict__, "max_steps": 14})
    meta = train(more, target=target, tokenizer=CharTokenizer(), convs=convs, log=lambda m: None)
    assert meta["steps"] == 14 and meta["history"][-1]["step"] == 14
    assert meta["feature_cache_hits"] == 2  # both steps read the cache written before


@pytest.mark.parametrize("exported", [False, True], ids=["run_dir", "exported_head"])
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_init_from_starts_at_another_runs_weights(setup, trained, method, exported, tmp_path):
    """From a run's --out dir (checkpoint.pt) or from the exported head alone (config.json +
    model.safetensors, as the shipped heads are): 0 steps later the saved head is that head."""
    cfg, _ = trained[method]
    root, target, convs = setup
    src = cfg.out
    if exported:
        src = tmp_path / "exported"
        src.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(f"{cfg.out}/{name}", src / name)
    new = TrainConfig(method=method, out=str(tmp_path / "ft"), max_steps=0, batch_size=2,
                      seq_len=48, num_samples=2, save_dtype="fp32", progress=False,
                      init_from=str(src), fit_batches=4)  # NOTE: no warm start over the weights
    train(new, target=target, tokenizer=CharTokenizer(), convs=convs, log=lambda m: None)
    with safe_open(f"{cfg.out}/model.safetensors", "pt") as a, \
            safe_open(f"{new.out}/model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    other = "mtp" if method == "eagle3" else "eagle3"
    bad = TrainConfig(method=other, out=str(tmp_path / "bad"), max_steps=0, init_from=str(src),
                      progress=False)
    with pytest.raises(ValueError, match="init_from"):
        train(bad, target=target, tokenizer=CharTokenizer(), convs=convs, log=lambda m: None)
    with pytest.raises(FileNotFoundError, match="neither checkpoint.pt nor config.json"):
        train(TrainConfig(method=method, out=str(tmp_path / "none"), max_steps=0,
                          init_from=str(tmp_path / "empty"), progress=False),
              target=target, tokenizer=CharTokenizer(), convs=convs, log=lambda m: None)


def test_several_data_sources_with_caps(tmp_path):
    from specdeploy.training.data import load_conversations, load_training_data, split

    files = []
    for name, n in (("a", 50), ("b", 30)):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"id": f"{name}{i}", "messages": [
            {"role": "user", "content": f"q {name} {i}"},
            {"role": "assistant", "content": f"r {name} {i}"}]}) + "\n" for i in range(n)))
        files.append(str(f))
    a, b = files
    train_a, held_a = split(load_conversations(a))
    train_b, held_b = split(load_conversations(b))
    convs, meta = load_training_data(f"{a},{b}:7,{b}:7")
    assert [c.id for c in convs] == [c.id for c in train_a + train_b[:7] + train_b[:7]]
    assert meta["sources"] == [a, f"{b}:7", f"{b}:7"]
    assert [m["heldout_ids"] for m in meta["splits"]] == [[c.id for c in held] for held in
                                                          (held_a, held_b, held_b)]
    single, meta1 = load_training_data(a)
    assert [c.id for c in single] == [c.id for c in train_a] and meta1["num_heldout"] == 5
    with pytest.raises(ValueError, match="data"):
        load_training_data(",")


def test_mtp_head_with_a_bad_draft_vocab_is_named(setup, trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from specdeploy.checkpoint import CheckpointError
    from specdeploy.models.drafters.mtp_head import load_mtp_head

    _, target, _ = setup
    cfg, _ = trained["mtp"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((Path(cfg.out) / "config.json").read_text())
    tensors = load_file(f"{cfg.out}/model.safetensors")
    tensors["mtp.d2t"] = tensors["mtp.d2t"] + 10_000  # ids past the target's vocab
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mtp.d2t"):
        load_mtp_head(bad, target)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen3_targets_train_heads_that_deploy(tmp_path, family):
    """Qwen3 and Qwen3-MoE targets (the Llama module's attention with q/k norms; routed
    experts) train an EAGLE-3 head and a generic MTP head; the saved EAGLE-3 head drafts on
    the deployed target without changing its greedy tokens."""
    from specdeploy.models import qwen3_moe

    path = (llama.make_tiny(tmp_path / "t", seed=0, config_overrides=llama.tiny_qwen_config(
        "qwen3")) if family == "qwen3" else qwen3_moe.make_tiny(tmp_path / "t", seed=0))
    target = specdeploy.load_model(path)
    rng = random.Random(0)
    convs = [Conversation(str(i), [
        {"role": "user", "content": " ".join(rng.choices(WORDS, k=6))},
        {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=12))}])
        for i in range(40)]
    for method in ("eagle3", "mtp"):
        cfg = TrainConfig(method=method, out=str(tmp_path / method), max_steps=10,
                          batch_size=2, seq_len=48, num_samples=2, lr=3e-3, warmup_steps=1,
                          draft_vocab_size=64, save_dtype="fp32", vocab_samples=20,
                          progress=False, fit_batches=0)
        meta = train(cfg, target=target, tokenizer=CharTokenizer(), convs=convs,
                     log=lambda m: None)
        losses = [h["loss"] for h in meta["history"]]
        assert losses[-1] < losses[0] - 0.05, (method, losses)
    sp = specdeploy.SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = ["the cat sat", "a dog"]
    want = [o.token_ids for o in specdeploy.LLM(str(path), max_batch_size=2,
                                                max_seq_len=128).generate(prompts, sp)]
    spec = specdeploy.LLM(str(path), max_batch_size=2, max_seq_len=128, spec={
        "method": "eagle3", "draft_model": str(tmp_path / "eagle3"), "num_draft_tokens": 2,
        "controller": "off"})
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
