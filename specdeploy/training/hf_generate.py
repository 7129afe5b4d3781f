"""`gen-drafter-data --engine transformers`: the target's replies through transformers' `generate`.

Our engine serves from the CPU; on a GPU, a drafter's training data (thousands of greedy replies)
is made faster by transformers' batched `generate` over *our loaded weights* (the same tensors
the deployment runs, copied into the HF class of the family, whose parameter names ours follow).
transformers is only needed for this path. Greedy replies equal our engine's up to floating-point
near-ties (a padded batch sums in another order); tests check token equality on a tiny target.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Reply:
    """What `generate_file` reads from an engine's output."""

    token_ids: list[int]
    text: str
    finish_reason: str


def hf_model_from(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """The HF causal-LM class of `model`'s family (from its raw `hf_config`) holding its weights."""
    try:
        import transformers
    except ImportError as e:  # an optional path: say what to install
        raise RuntimeError("--engine transformers needs `pip install transformers`") from e
    raw = dict(getattr(model, "hf_config", None) or {})
    if "model_type" not in raw:
        raise ValueError("--engine transformers: the loaded model has no HF config (model_type)")
    cfg = transformers.AutoConfig.for_model(**raw)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ours = model.state_dict()
    theirs = hf.state_dict()
    missing = sorted(set(theirs) - set(ours) - {"lm_head.weight"})
    extra = sorted(k for k in set(ours) - set(theirs) if not k.endswith("inv_freq"))
    if missing or extra:
        raise ValueError(f"--engine transformers: {type(hf).__name__} and {type(model).__name__} "
                         f"name their weights differently (missing {missing[:4]}, "
                         f"unexpected {extra[:4]}); use --engine specdeploy")
    sd = {k: ours[k].float() for k in theirs if k in ours}
    hf.load_state_dict(sd, strict=False)
    if "lm_head.weight" not in ours:
        hf.tie_weights()
    return hf.to(device).eval()


class HFGenerator:
    """`generate(list of prompt ids, list of SamplingParams)` → replies, in batches of
    `batch_size` (prompts sorted by length, left-padded, so a batch wastes little)."""

    def __init__(self, model: nn.Module, tokenizer, eos_token_ids, batch_size: int = 256,
                 device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.eos = sorted(int(t) for t in eos_token_ids)
        if not self.eos:
            raise ValueError("--engine transformers: the target names no EOS token")
        self.hf = hf_model_from(model, self.device)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params) -> list[Reply]:
        out: list[Reply | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            for i, r in zip(idx, self._batch([prompts[i] for i in idx], [params[i] for i in idx])):
                out[i] = r
        return out  # type: ignore[return-value]

    def _batch(self, prompts: list[list[int]], params) -> list[Reply]:
        p0 = params[0]
        if any((p.max_tokens, p.temperature) != (p0.max_tokens, p0.temperature) for p in params):
            raise ValueError("--engine transformers: one max_tokens / temperature per batch")
        n = max(len(p) for p in prompts)
        pad = self.eos[0]
        ids = torch.full((len(prompts), n), pad, dtype=torch.long)
        att = torch.zeros((len(prompts), n), dtype=torch.long)
        for j, p in enumerate(prompts):  # left padding: every prompt ends at column n - 1
            ids[j, n - len(p):] = torch.tensor(p)
            att[j, n - len(p):] = 1
        kw = {"do_sample": False} if p0.temperature == 0 else {
            "do_sample": True, "temperature": p0.temperature, "top_k": 0, "top_p": 1.0}
        if p0.temperature:
            torch.manual_seed(p0.seed or 0)
        gen = self.hf.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                               max_new_tokens=p0.max_tokens, min_new_tokens=0,
                               eos_token_id=self.eos, pad_token_id=pad, **kw)
        replies = []
        for row in gen[:, n:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in self.eos), None)
            toks = row[:cut] if cut is not None else row[:p0.max_tokens]
            text_ids = toks[:-1] if cut is not None else toks  # the stop token is not text
            replies.append(Reply(toks, self.tokenizer.decode(text_ids),
                                 "stop" if cut is not None else "length"))
        return replies
