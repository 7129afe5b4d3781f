"""What `LLM` shows while it works: a progress bar over requests that also reports output
tokens per second, and its loading messages on stderr."""
from __future__ import annotations

import sys


def progress_bar(total: int):
    from tqdm import tqdm

    bar = tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)
    bar.tokens = 0
    return bar


def token_rate(bar, new_tokens: int) -> str:
    """Output tokens per second since the bar started (tqdm's own rate counts requests)."""
    bar.tokens += new_tokens
    elapsed = bar.format_dict.get("elapsed") or 0.0
    return f"{bar.tokens / elapsed:.1f}" if elapsed > 0 else "-"


def stderr_log(msg: str) -> None:
    print(f"[specdeploy] {msg}", file=sys.stderr, flush=True)
