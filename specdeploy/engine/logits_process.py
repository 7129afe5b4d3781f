"""What a request's parameters do to the target's logits before sampling, for plain decoding
and for the verification of drafts alike (vLLM's order and semantics):

1. grammar mask (structured output): tokens the request's grammar forbids get -inf. As in vLLM
   (the bitmask is applied to the logits before its sampler), this is part of the logits whose
   logprobs are reported: the "raw" logprobs are those of the masked logits.
2. allowed_token_ids: every other token gets -inf; bad_words: a word's last token gets -inf
   where the generated tokens end with the word's other tokens; logit_bias: added to its
   tokens' logits (vLLM applies these before its penalties, after computing raw logprobs).
3. penalties: repetition_penalty over prompt + generated tokens (a positive logit is divided
   by it, a negative one multiplied), then frequency (times the count) and presence (once per
   token seen) over the generated tokens only.
4. min_tokens: EOS (unless ignore_eos) and stop_token_ids get -inf while fewer tokens exist.
Temperature, min_p, top-k and top-p follow in the sampler (engine/sampler.py, verify.py).

Under speculation the K+1 rows of a verify segment are the target after the committed tokens
plus drafts[:j] (row j): the grammar state, the token counts and the length of row j all include
those drafts, so each row is the distribution plain decoding would have had there, and
verification stays lossless against the processed target. All rows of the batch are processed
at once; the host builds index tensors (copies to the device, no synchronisation).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from specdeploy.engine.grammar import unpack_bitmask
from specdeploy.engine.request import Sequence


class Processed(NamedTuple):
    raw: torch.Tensor  # [S, R, V] the target's logits, grammar-masked: what logprobs report
    logits: torch.Tensor  # [S, R, V] after min_tokens and penalties: what sampling reads


def process(logits: torch.Tensor, seqs: Seq[Sequence], drafts: Seq[list[int]],
            eos_token_ids: frozenset[int] = frozenset()) -> Processed:
    """logits [S, R, V] (row j: after the sequence's committed tokens + drafts[s][:j]; rows
    past len(drafts[s]) + 1 are padding, processed like the last one)."""
    logits = logits.float()
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if rows:
        logits = _on_rows(logits, rows, lambda x, sub: x.masked_fill(
            ~_grammar_allowed(x, sub, [drafts[i] for i in rows]), float("-inf")), seqs)
    raw = logits
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if rows:
        logits = _on_rows(logits, rows, lambda x, sub: _penalize(
            x, sub, [drafts[i] for i in rows], eos_token_ids), seqs)
        # NOTE: a row where nothing is left (a grammar that can only end (EOS) before
        # min_tokens, one that allows none of allowed_token_ids, allowed_token_ids that are all
        # stop tokens before min_tokens) keeps the grammar's mask alone: else nothing could be
        # sampled and the request would fail
        dead = (logits == float("-inf")).all(-1, keepdim=True)
        logits = torch.where(dead, raw, logits)
    return Processed(raw, logits)


def _on_rows(logits: torch.Tensor, rows: list[int], fn, seqs: Seq[Sequence]) -> torch.Tensor:
    """`fn(logits[rows], seqs[rows])` written back: the [S, R, V]-sized temporaries of a step
    (counts, masks) are only as large as the requests that need them."""
    sub = [seqs[i] for i in rows]
    if len(rows) == len(seqs):
        return fn(logits, sub)
    idx = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, idx, fn(logits[idx], sub))


def _grammar_allowed(logits: torch.Tensor, seqs: Seq[Sequence], drafts: Seq[list[int]]
                     ) -> torch.Tensor:
    s, r, v = logits.shape
    words = (v + 31) // 32
    rows = []
    for seq, d in zip(seqs, drafts):
        if seq.matcher is None:
            rows.append(torch.full((r, words), -1, dtype=torch.int32))
            continue
        rows.append(seq.matcher.row_masks(d[:r - 1], r))
    return unpack_bitmask(torch.stack(rows).to(logits.device), v)


def _penalize(logits: torch.Tensor, seqs: Seq[Sequence], drafts: Seq[list[int]],
              eos_token_ids: frozenset[int]) -> torch.Tensor:
    s, r, v = logits.shape
    dev = logits.device
    p = [q.params for q in seqs]
    if any(x.allowed_token_ids is not None or x.logit_bias for x in p):
        logits = logits + _bias_rows(p, v, dev)[:, None]
    if any(q.bad_words_ids for q in seqs):
        logits = logits.masked_fill(_bad_words_mask(seqs, drafts, r, v, dev), float("-inf"))
    counts = generated_counts(seqs, drafts, r, v, dev)  # [S, R, V]
    rep = torch.tensor([x.repetition_penalty for x in p], device=dev)[:, None, None]
    freq = torch.tensor([x.frequency_penalty for x in p], device=dev)[:, None, None]
    pres = torch.tensor([x.presence_penalty for x in p], device=dev)[:, None, None]
    if any(x.repetition_penalty != 1.0 for x in p):
        seen = (counts > 0) | torch.stack([_prompt_seen(q, v, dev) for q in seqs])[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - freq * counts - pres * (counts > 0).float()
    if any(x.min_tokens for x in p):
        logits = logits.masked_fill(_min_tokens_mask(seqs, r, v, dev, eos_token_ids),
                                    float("-inf"))
    return logits


def _bias_rows(params, v: int, dev) -> torch.Tensor:
    """[S, V]: -inf outside allowed_token_ids, + logit_bias on its ids, 0 elsewhere."""
    bias = torch.zeros(len(params), v)
    for i, x in enumerate(params):
        if x.allowed_token_ids is not None:
            bias[i] = float("-inf")
            bias[i, torch.tensor(x.allowed_token_ids, dtype=torch.long)] = 0.0
        if x.logit_bias:
            ids = torch.tensor([t for t, _ in x.logit_bias], dtype=torch.long)
            bias[i, ids] += torch.tensor([b for _, b in x.logit_bias])
    return bias.to(dev)


def bad_word_ids(tokenizer, words) -> list[tuple[int, ...]]:
    """Each bad word's token ids as written (leading blanks stripped), and after a space where
    that spelling starts with another token and has as many tokens (vLLM's rule)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [plain] if plain else []
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _bad_words_mask(seqs: Seq[Sequence], drafts: Seq[list[int]], r: int, v: int,
                    dev) -> torch.Tensor:
    """[S, R, V] True at a bad word's last token where row j's generated tokens (the output,
    then drafts[:j]) end with the word's other tokens."""
    mask = torch.zeros(len(seqs), r, v, dtype=torch.bool)
    for i, (q, d) in enumerate(zip(seqs, drafts)):
        if not q.bad_words_ids:
            continue
        longest = max(len(w) for w in q.bad_words_ids) - 1
        gen = q.output_ids[-longest:] if longest else []
        for j in range(r):
            tail = (gen + d[:j])[-longest:] if longest else []
            for w in q.bad_words_ids:
                n = len(w) - 1
                if w[-1] < v and (n == 0 or (len(tail) >= n and tuple(tail[-n:]) == w[:-1])):
                    mask[i, j, w[-1]] = True
    return mask.to(dev)


def generated_counts(seqs: Seq[Sequence], drafts: Seq[list[int]], r: int, v: int,
                     dev) -> torch.Tensor:
    """[S, R, V] occurrences of each token among the generated tokens before row j (the
    output so far, then drafts[:j])."""
    s = len(seqs)
    width = max((len(q.output_ids) for q in seqs), default=0)
    ids = torch.full((s, max(width, 1)), v, dtype=torch.long)  # pad: the extra column v
    for i, q in enumerate(seqs):
        if q.output_ids:
            ids[i, :len(q.output_ids)] = torch.tensor(q.output_ids)
    base = torch.zeros(s, v + 1, device=dev).scatter_add_(
        1, ids.to(dev), torch.ones(ids.shape, device=dev))
    counts = base[:, None].expand(s, r, v + 1)
    if r > 1:
        d = torch.full((s, r - 1), v, dtype=torch.long)
        for i, x in enumerate(drafts):
            x = x[:r - 1]
            if x:
                d[i, :len(x)] = torch.tensor(x)
        onehot = torch.zeros(s, r - 1, v + 1, device=dev).scatter_(2, d.to(dev)[..., None], 1.0)
        before = torch.cat((onehot.new_zeros(s, 1, v + 1), onehot.cumsum(1)), 1)
        counts = counts + before
    return counts[..., :v]


def _prompt_seen(seq: Sequence, v: int, dev) -> torch.Tensor:
    """[V] bool: tokens of the prompt (kept on the sequence: the prompt never changes)."""
    if seq.prompt_seen is None or seq.prompt_seen.shape[0] != v:
        seen = torch.zeros(v, dtype=torch.bool)
        seen[torch.tensor(seq.prompt_ids, dtype=torch.long)] = True
        seq.prompt_seen = seen.to(dev)
    return seq.prompt_seen


def _min_tokens_mask(seqs: Seq[Sequence], r: int, v: int, dev,
                     eos_token_ids: frozenset[int]) -> torch.Tensor:
    """[S, R, V] True where a stop token is banned: row j has len(output) + j tokens."""
    mask = torch.zeros(len(seqs), r, v, dtype=torch.bool)
    for i, q in enumerate(seqs):
        short = q.params.min_tokens - len(q.output_ids)  # rows 0..short-1 are below it
        if short <= 0:
            continue
        stops = set(q.params.stop_token_ids)
        if not q.params.ignore_eos:
            stops |= eos_token_ids
        stops = [t for t in stops if t < v]
        if stops:
            mask[i, :short, torch.tensor(stops, dtype=torch.long)] = True
    return mask.to(dev)


def logprob_pack(raw: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """raw [S, R, V], tokens [S, R] → float64 [S, R, 1 + 2n]: each token's logprob, then the
    top n logprobs and their ids (descending), to be copied to the host with the step's other
    results in one transfer."""
    lp = raw.float().log_softmax(-1)
    tok = lp.gather(-1, tokens.clamp_min(0)[..., None])
    if n == 0:
        return tok.double()
    top = lp.topk(min(n, lp.shape[-1]), dim=-1)
    return torch.cat((tok.double(), top.values.double(), top.indices.double()), -1)


def unpack_logprobs(row: list[float], n: int, keep: int, token: int) -> dict[int, float]:
    """One packed row (see `logprob_pack`, top n) → {id: logprob}: the top `keep` <= n first,
    then the token if it is not among them."""
    out = {int(i): lp for lp, i in zip(row[1:1 + keep], row[1 + n:1 + n + keep])}
    out.setdefault(token, row[0])
    return out
