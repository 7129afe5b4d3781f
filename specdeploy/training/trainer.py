"""Drafter training loop: frozen target → features → EAGLE-3 or MTP objective → saved head.

Resumable: `OUT/checkpoint.pt` (fp32 weights, optimizer, step, elapsed time, vocab) is written
every `save_every_minutes` and at the end, together with the exported head (bf16 by default) and
`training.json` (command, timing, held-out split, acceptance estimate). Re-running the same
command continues where it stopped; `max_minutes` counts the total over all runs.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdeploy.training import data as data_mod
from specdeploy.training import target_info as info
from specdeploy.training.features import FeatureSource

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class TrainConfig:
    method: str
    out: str
    model: str | None = None
    data: str = "sharegpt"
    max_steps: int | None = None
    max_minutes: float | None = None
    draft_vocab_size: int = 8192
    batch_size: int = 4
    seq_len: int = 256
    num_samples: int | None = None  # training conversations used (cycled); None = all
    ttt_steps: int = 3
    lr: float = 1e-3
    warmup_steps: int = 20
    cache_dir: str | None = None
    save_every_minutes: float = 5.0
    vocab_samples: int = 2000
    fit_batches: int = 12  # closed-form warm start on this many batches (0: none)
    init_from: str | None = None  # start from another run's weights (fine-tuning on new data)
    init_from_checkpoint: bool = False  # MTP: fine-tune the target checkpoint's own mtp.*
    save_dtype: str = "bf16"
    device: str | None = None
    seed: int = 0
    progress: bool = True


def _lr_factor(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warmup, then cosine to 10% over whichever budget (steps or minutes) runs out first."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    prog = 0.0
    if cfg.max_steps:
        prog = max(prog, step / cfg.max_steps)
    if cfg.max_minutes:
        prog = max(prog, elapsed / (60 * cfg.max_minutes))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(prog, 1.0)))


def _export(obj, cfg: TrainConfig, out: Path, meta: dict) -> None:
    dtype = DTYPES[cfg.save_dtype]
    if hasattr(obj, "save"):  # a hybrid family's own MTP module, in the checkpoint's layout
        obj.save(out, dtype)
    elif obj.method == "eagle3":
        from specdeploy.models.drafters.eagle3 import save_eagle3

        save_eagle3(obj.export(dtype).cpu(), out)
    else:
        from specdeploy.models.drafters.mtp_head import save_mtp_head

        save_mtp_head(obj.export(dtype).cpu(), out)
    (out / "training.json").write_text(json.dumps(meta, indent=1))


def _trained_tensor(name: str) -> bool:
    """A head tensor that training produced (not rebuilt from the target: rotary tables, the MTP
    head's copy of the target's LM-head rows)."""
    return not name.endswith("inv_freq") and "draft_head." not in name


def _initial_weights(path: str, method: str, target, aux_layers) -> dict:
    """--init-from: another run's --out dir (its checkpoint.pt), or an exported head without one
    (a config.json + model.safetensors such as the shipped heads): {objective, draft_ids, step,
    source}. The exported weights are bf16; they start the fp32 head at those values."""
    root = Path(path)
    f = root / "checkpoint.pt"
    if f.is_file():
        init = torch.load(f, map_location="cpu")
        if init["method"] != method:
            raise ValueError(f"init_from: {f} is a {init['method']} run, not {method}")
        return {**init, "source": str(f)}
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"init_from: {root} has neither checkpoint.pt nor config.json "
                                "(give a train-drafter --out dir or an exported head)")
    arch = json.loads((root / "config.json").read_text()).get("architectures") or []
    if method == "eagle3":
        from specdeploy.models.drafters.eagle3 import ARCHITECTURES, load_eagle3

        if not set(arch) & set(ARCHITECTURES):
            raise ValueError(f"init_from: {root} holds {arch}, not an eagle3 head")
        head = load_eagle3(root, target_cfg=target.cfg, embed_tokens=info.embedding(target),
                           dtype=torch.float32)
        if tuple(head.cfg.aux_layer_ids) != tuple(aux_layers):
            raise ValueError(f"init_from: {root} fuses target layers {head.cfg.aux_layer_ids}, "
                             f"this run captures {tuple(aux_layers)}")
        draft_ids = head.draft_to_target(torch.arange(head.cfg.draft_vocab_size))
        prefix = "drafter."
    elif info.is_llama(target):
        from specdeploy.models.drafters.mtp_head import ARCHITECTURES, load_mtp_head

        if not set(arch) & set(ARCHITECTURES):
            raise ValueError(f"init_from: {root} holds {arch}, not an mtp head")
        head = load_mtp_head(root, target, dtype=torch.float32)
        if head.d2t is None:
            raise ValueError(f"init_from: {root} has no draft vocab (mtp.d2t)")
        draft_ids = head.d2t + torch.arange(head.d2t.shape[0])
        prefix = "head."
    else:  # a hybrid family's MTP module: the objective takes the loaded module as it is
        from specdeploy.models.drafters.checkpoint_mtp import is_checkpoint_mtp, load_checkpoint_mtp

        if not is_checkpoint_mtp(root):
            raise ValueError(f"init_from: {root} holds {arch} without mtp.* tensors, not an MTP "
                             f"module for this {type(target).__name__} target")
        head = load_checkpoint_mtp(root, target, dtype=torch.float32)
        # NOTE: the checkpoint layout has no training vocab: this run picks one from its data
        return {"module": head, "draft_ids": None, "step": 0, "source": str(root)}
    weights = {prefix + k: v for k, v in head.state_dict().items() if _trained_tensor(k)}
    return {"objective": weights, "draft_ids": draft_ids, "step": 0, "source": str(root),
            "partial": True}


def _saved_module(target, objective: dict):
    """A fresh hybrid MTP module shaped like a saved run's weights (its number of groups), for
    resuming it or starting from it."""
    from specdeploy.models.drafters.checkpoint_mtp import build_mtp

    n = 1 + max(int(k.split(".")[2]) for k in objective if k.startswith("module.layers."))
    per = len(getattr(target.cfg, "mtp_block_types", ())) or 1  # NemotronH: layers per group
    return build_mtp(target, n // per)


def build_objective(method: str, target, draft_ids: torch.Tensor, aux_layers, steps: int,
                    module=None):
    """`module`: an MTP module to train (the checkpoint's own, or a loaded head) instead of a
    fresh one; hybrid targets train their family's MTP module, Llama targets the generic head."""
    if method == "mtp" and not info.is_llama(target):
        from specdeploy.training.hybrid_mtp import HybridMTPObjective

        return HybridMTPObjective(target, draft_ids, steps, module=module)
    if module is not None:
        raise ValueError("init_from_checkpoint: only hybrid targets (NemotronH, Qwen3.5) ship an "
                         "MTP module to start from")
    if method == "eagle3":
        from specdeploy.training.eagle3 import Eagle3Objective

        return Eagle3Objective(target, draft_ids, aux_layers, steps)
    if method == "mtp":
        from specdeploy.training.mtp import MTPObjective

        return MTPObjective(target, draft_ids, steps)
    raise ValueError(f"method: must be eagle3 or mtp, got {method!r}")


def train(cfg: TrainConfig, target=None, tokenizer=None, convs=None, log=print) -> dict:
    """Train a head into `cfg.out`; returns the summary written to training.json. `target`,
    `tokenizer`, `convs` override loading (tests)."""
    import specdeploy
    from specdeploy.training.eagle3 import select_draft_vocab

    if cfg.max_steps is None and cfg.max_minutes is None:
        raise ValueError("give --max-steps and/or --max-minutes")
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        # NOTE: TF32 matmuls (~1e-3 relative) for the frozen target's features and the head:
        # a training signal, not a deployment's numerics; about twice the step rate.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.init_from_checkpoint and (cfg.method != "mtp" or cfg.init_from):
        raise ValueError("init_from_checkpoint: fine-tunes the target's own MTP module; it needs "
                         "--method mtp and no --init-from")
    target = target if target is not None else specdeploy.load_model(
        cfg.model, with_mtp=cfg.init_from_checkpoint)
    target = target.to(device).eval().requires_grad_(False)
    module = None
    if cfg.init_from_checkpoint:
        module = getattr(target, "mtp", None)
        if module is None:
            raise ValueError(f"init_from_checkpoint: the target ({type(target).__name__}) was "
                             "loaded without an MTP module (load it with_mtp=True; its config "
                             "must declare num_nextn_predict_layers / mtp_num_hidden_layers)")
        del target.mtp  # NOTE: trained as the objective's module, never as part of the target
    tokenizer = tokenizer if tokenizer is not None else specdeploy.load_tokenizer(cfg.model)
    if convs is not None:
        train_convs, _, held_meta = data_mod.split_for_training(cfg.data, convs)
    else:
        train_convs, held_meta = data_mod.load_training_data(cfg.data)
    batches = data_mod.TokenBatches(tokenizer, train_convs, cfg.batch_size, cfg.seq_len,
                                    cfg.num_samples, seed=cfg.seed + 1)
    aux_layers = info.aux_layers(target)
    ckpt_file = out / "checkpoint.pt"
    state = torch.load(ckpt_file, map_location="cpu") if ckpt_file.exists() else None
    if state is not None:
        if state["method"] != cfg.method:
            raise ValueError(f"{ckpt_file} is a {state['method']} run; use another --out")
        draft_ids = state["draft_ids"]
        log(f"resuming from {ckpt_file} at step {state['step']}")
    init = None
    if state is None and cfg.init_from:
        init = _initial_weights(cfg.init_from, cfg.method, target, aux_layers)
        draft_ids = init["draft_ids"]  # NOTE: the head's vocab comes with its weights
        module = init.get("module")
        log(f"starting from the weights of {init['source']} (step {init['step']})")
    if state is None and (init is None or draft_ids is None):
        counts = batches.token_counts(target.cfg.vocab_size, cfg.vocab_samples)
        eos = [i for i in [getattr(tokenizer, "eos_token_id", None)] if i is not None]
        draft_ids = select_draft_vocab(counts, cfg.draft_vocab_size, always=eos)
    saved = state if state is not None else init if init and "objective" in init else None
    if module is None and saved is not None and cfg.method == "mtp" and not info.is_llama(target):
        module = _saved_module(target, saved["objective"])
    obj = build_objective(cfg.method, target, draft_ids, aux_layers, cfg.ttt_steps,
                          module=module).to(device)
    params = [p for p in obj.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, elapsed0, history = 0, 0.0, []
    if init is not None and "objective" in init:
        if init.get("partial"):
            want = {k for k in obj.state_dict()
                    if k.startswith(("drafter.", "head.")) and _trained_tensor(k)}
            if set(init["objective"]) != want:
                raise ValueError(f"init_from: {init['source']} does not fit this head: missing "
                                 f"{sorted(want - set(init['objective']))[:4]}, unexpected "
                                 f"{sorted(set(init['objective']) - want)[:4]}")
        obj.load_state_dict(init["objective"], strict=not init.get("partial"))
    if state is not None:
        obj.load_state_dict(state["objective"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed0, history = state["step"], state["elapsed_s"], state.get("history", [])
    source = FeatureSource(target, batches, aux_layers, cfg.cache_dir, device=device,
                           key={"model": str(cfg.model), "data": cfg.data,
                                "split_seed": data_mod.SPLIT_SEED, "seed": cfg.seed})
    fit_s = state.get("fit_seconds", 0.0) if state is not None else 0.0
    if state is None and init is None and module is None and cfg.fit_batches and hasattr(
            obj, "fit_linear"):
        t0 = time.perf_counter()
        obj.fit_linear(source.get(i) for i in range(cfg.fit_batches))
        fit_s = time.perf_counter() - t0
        log(f"closed-form warm start on {cfg.fit_batches} batches: {fit_s:.0f}s")
    meta_base = {"method": cfg.method, "command": " ".join(sys.argv), "config": asdict(cfg),
                 "aux_layer_ids": list(aux_layers),
                 "heldout": held_meta,
                 "draft_vocab_size": int(draft_ids.shape[0]), "device": str(device),
                 "fit_seconds": round(fit_s, 1),
                 "torch_threads": torch.get_num_threads()}

    def save(final: bool) -> dict:
        meta = {**meta_base, "steps": step, "train_seconds": round(elapsed, 1),
                "tokens_seen": tokens_seen, "feature_cache_hits": source.hits,
                "feature_batches_computed": source.misses, "history": history[-50:],
                "final": final}
        torch.save({"method": cfg.method, "objective": obj.state_dict(), "draft_ids": draft_ids,
                    "optimizer": opt.state_dict(), "step": step, "elapsed_s": elapsed,
                    "history": history, "fit_seconds": fit_s}, ckpt_file.with_suffix(".tmp"))
        ckpt_file.with_suffix(".tmp").replace(ckpt_file)
        _export(obj, cfg, out, meta)
        return meta

    from tqdm import tqdm

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not cfg.progress, dynamic_ncols=True,
               desc=f"train {cfg.method}")
    t_start, last_save, tokens_seen = time.perf_counter(), time.perf_counter(), 0
    elapsed, ema = elapsed0, None
    obj.train()
    while True:
        elapsed = elapsed0 + time.perf_counter() - t_start
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        if cfg.max_minutes is not None and elapsed >= 60 * cfg.max_minutes:
            break
        feats = source.get(step)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * _lr_factor(cfg, step, elapsed)
        loss, stats = obj.loss(feats)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens_seen += int(feats.mask.sum())
        ema = stats["est_accept_len"] if ema is None else 0.95 * ema + 0.05 * stats[
            "est_accept_len"]
        history.append({"step": step, "loss": round(loss.item(), 4),
                        "agree": [round(a, 3) for a in stats["agree"]],
                        "est_accept_len": round(stats["est_accept_len"], 3)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{stats['agree'][0]:.2f}",
                        est_len=f"{ema:.2f}", cache=f"{source.hits}/{source.misses}")
        if time.perf_counter() - last_save > 60 * cfg.save_every_minutes:
            save(final=False)
            last_save = time.perf_counter()
    bar.close()
    meta = save(final=True)
    log(f"saved {cfg.method} head to {out} after {step} steps, {elapsed / 60:.1f} min "
        f"(estimated accepted length {ema if ema is not None else float('nan'):.2f})")
    return meta
