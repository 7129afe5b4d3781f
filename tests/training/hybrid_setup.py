"""Tiny hybrid targets (NemotronH, Qwen3.5-MoE in the VLM layout and text-only) and drafter
training runs on them, shared by the hybrid training tests."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import specdeploy
from specdeploy.models.registry import family_module
from specdeploy.training import data as data_mod
from specdeploy.training.data import Conversation
from specdeploy.training.features import extract
from specdeploy.training.target_info import aux_layers
from specdeploy.training.trainer import TrainConfig, train
from tests.training.test_train_tiny import WORDS, CharTokenizer

# run name → what it trains: a fresh EAGLE-3 head, a fresh family MTP module, or the
# checkpoint's own MTP module (two groups in these tiny checkpoints) fine-tuned
RUNS = {"eagle3": dict(method="eagle3"), "mtp": dict(method="mtp"),
        "mtp_ft": dict(method="mtp", init_from_checkpoint=True)}
MTP_GROUPS = 2


def text_only_qwen(src: Path, out: Path) -> Path:
    """The tiny Qwen3.5 VLM checkpoint in transformers' text-only layout (`model.*` keys, a flat
    `Qwen3_5MoeForCausalLM` config, no vision tower)."""
    hf = json.loads((src / "config.json").read_text())
    flat = {**hf["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text", "tie_word_embeddings": False}
    tensors = {k.replace("model.language_model.", "model."): v
               for k, v in load_file(str(src / "model.safetensors")).items()
               if not k.startswith("model.visual.")}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(flat))
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.glob("tokenizer*"):  # the tokenizer stays; the image processor does not
        shutil.copy(f, out / f.name)
    return out


class Hybrid:
    """A tiny hybrid checkpoint with two MTP groups, and its training runs (trained once)."""

    def __init__(self, arch: str, root: Path):
        self.arch, self.root = arch, root
        module = family_module("qwen3_5_moe" if arch == "qwen3_5" else arch.removesuffix("_text"))
        extra = {"hf_config": module.tiny_hf_config(MTP_GROUPS, dense=True)} \
            if arch == "qwen3_5" else {}  # dense Qwen3.5: the MoE family's module
        self.path = module.make_tiny(root / arch, seed=0, mtp_layers=MTP_GROUPS, **extra)
        if arch.endswith("_text"):
            self.path = text_only_qwen(self.path, root / "text_only")
        rng = random.Random(0)
        self.convs = [Conversation(str(i), [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=6))},
            {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=12))}])
            for i in range(40)]
        self._runs: dict = {}

    def target(self, with_mtp: bool = False):
        return specdeploy.load_model(self.path, with_mtp=with_mtp)

    def config(self, run: str, **kw) -> TrainConfig:
        args = dict(out=str(self.root / f"{self.arch}_{run}"), max_steps=10, batch_size=2,
                    seq_len=48, num_samples=2, lr=3e-3, warmup_steps=1, draft_vocab_size=64,
                    save_dtype="fp32", vocab_samples=20, progress=False, fit_batches=0)
        return TrainConfig(**{**args, **RUNS[run], **kw})

    def run(self, run: str) -> tuple[TrainConfig, dict]:
        """(config, training.json summary) of a finished 10-step run."""
        if run not in self._runs:
            cfg = self.config(run)
            target = self.target(with_mtp=cfg.init_from_checkpoint)
            meta = train(cfg, target=target, tokenizer=CharTokenizer(), convs=self.convs,
                         log=lambda m: None)
            self._runs[run] = cfg, meta
        return self._runs[run]

    def batch(self, target, cfg: TrainConfig):
        """The features of the run's training batch (batch 0: the only one, 2 samples of 2)."""
        train_convs, _, _ = data_mod.split_for_training(cfg.data, self.convs)
        batches = data_mod.TokenBatches(CharTokenizer(), train_convs, cfg.batch_size,
                                        cfg.seq_len, cfg.num_samples, seed=cfg.seed + 1)
        ids, mask = batches.batch(0)
        return extract(target, ids, mask, aux_layers(target))


def chain_drafts(module, hidden, ids, steps: int, groups: int):
    """Greedy drafts of `steps` chained steps from every position (full-sequence recompute);
    step j runs group min(j, groups - 1)."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    tok, drafts, logits = ids, [], None
    for j in range(steps):
        out = module(hidden, module.embed(tok), pos + j, step=min(j, groups - 1))
        tok, hidden, logits = out.logits.argmax(-1), out.hidden, out.logits
        drafts.append(tok)
    return torch.stack(drafts), logits
