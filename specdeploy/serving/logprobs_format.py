"""Logprobs in OpenAI's response shapes, from `RequestOutput.logprobs` (engine: the target's raw
logprobs, vLLM's default `logprobs_mode`: before penalties and temperature, after the grammar
mask).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`; completions:
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, and with
`echo` the prompt's tokens first (the first one's logprob null, as OpenAI's legacy endpoint).
`prompt_logprobs` (vLLM's): a list over the prompt, null first, then {"<id>": {"logprob",
"rank", "decoded_token"}} of the top N and the prompt token. `as_ids` (vLLM's
`return_tokens_as_token_ids`): each token of `logprobs` is named "token_id:<id>" instead of by
its text (its `bytes` and `text_offset` still those of its text). A logprob of
-inf (a token the grammar forbids, among the top N) is reported as -9999.0, as vLLM does: JSON
has no infinity.
"""
from __future__ import annotations

FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, FLOOR)


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def _name(text: str, t: int, as_ids: bool) -> str:
    return f"token_id:{t}" if as_ids else text


def _tops(tokenizer, entry: dict[int, float], n: int, as_ids: bool) -> dict[str, float]:
    # NOTE: keyed by text, as OpenAI's shape is: two ids spelling alike keep the better
    top: dict[str, float] = {}
    for i, lp in _top(entry, n):
        top.setdefault(f"token_id:{i}" if as_ids else tokenizer.decode([i]), _lp(lp))
    return top


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_n: int, as_ids: bool = False) -> dict:
    def item(t: int, lp: float) -> dict:
        text = tokenizer.decode([t])
        return {"token": _name(text, t, as_ids), "logprob": _lp(lp),
                "bytes": list(text.encode())}

    content = []
    for t, entry in zip(token_ids, logprobs):
        content.append({**item(t, entry[t]),
                        "top_logprobs": [item(i, lp) for i, lp in _top(entry, top_n)]})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                        top_n: int, offset: int = 0, as_ids: bool = False) -> dict:
    """`offset`: characters of the choice's text before these tokens (streaming chunks)."""
    tokens, lps, tops, offsets = [], [], [], []
    for t, entry in zip(token_ids, logprobs):
        text = tokenizer.decode([t])
        tokens.append(_name(text, t, as_ids))
        lps.append(_lp(entry[t]))
        tops.append(_tops(tokenizer, entry, top_n, as_ids))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def format_logprobs(chat: bool, tokenizer, token_ids: list[int],
                    logprobs: list[dict[int, float]] | None, top_n: int | None,
                    offset: int = 0, as_ids: bool = False) -> dict | None:
    if logprobs is None or top_n is None:
        return None
    n = len(logprobs)
    if chat:
        return chat_logprobs(tokenizer, token_ids[:n], logprobs, top_n, as_ids)
    return completion_logprobs(tokenizer, token_ids[:n], logprobs, top_n, offset, as_ids)


def prompt_logprobs_json(tokenizer, entries: list | None, ranks: list | None,
                         prompt_ids: list[int], top_n: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {"<id>": {"logprob",
    "rank", "decoded_token"}}; ranks of the top N are their places, the prompt token's its own."""
    if entries is None:
        return None
    out: list = []
    for i, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        item = {}
        for place, (t, lp) in enumerate(entry.items()):
            rank = place + 1 if place < top_n else ranks[i]
            item[str(t)] = {"logprob": _lp(lp), "rank": rank,
                            "decoded_token": tokenizer.decode([t])}
        tok = prompt_ids[i]
        if str(tok) in item and list(entry).index(tok) < top_n:
            item[str(tok)]["rank"] = ranks[i]  # NOTE: its own rank (equal, barring exact ties)
        out.append(item)
    return out


def echo_logprobs(tokenizer, prompt_ids: list[int], entries: list, top_n: int,
                  output: dict | None, echo_chars: int, as_ids: bool = False) -> dict:
    """Completions' logprobs with `echo`: the prompt's tokens (the first with null logprob and
    null top_logprobs, OpenAI's legacy shape) before the reply's (`output`, whose text_offset
    counts from the echoed text's end, `echo_chars`)."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for t, entry in zip(prompt_ids, entries):
        text = tokenizer.decode([t])
        tokens.append(_name(text, t, as_ids))
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(_lp(entry[t]))
        tops.append(_tops(tokenizer, entry, top_n, as_ids))
    if output is not None:
        tokens += output["tokens"]
        lps += output["token_logprobs"]
        tops += output["top_logprobs"]
        offsets += [echo_chars + o for o in output["text_offset"]]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}
