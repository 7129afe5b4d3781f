"""Decode steps that end a prefix-cache checkpoint page: replayed (the state slot copied to the
checkpoint after the CPU graph's step, deploy/runner.py `_checkpoints_after`) vs run eagerly
(what every such step did before), on recurrent GGUFs with their defaults (prefix caching on,
a checkpoint every page), batch 1, greedy.

    PYTHONPATH=. .venv/bin/python bench/checkpoint_steps.py GGUF [GGUF ...] [--tokens 256]
        [--prompt-len 32] [--rounds 5] [--json-out FILE]

(bench/vs_llamacpp_moe.py --gguf-dir DIR writes the mid-size NemotronH MoE / Qwen3.5-MoE
GGUFs this was run on.) One deployment per file; rounds alternate which mode goes first; each
round generates --tokens tokens after a --prompt-len prompt on a reset prefix cache, so the
same boundaries are crossed in both modes; decode tokens/s per mode, the per-round ratio's
median, and how many steps each mode replayed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import specdeploy.deploy.runner as runner_mod  # noqa: E402
from specdeploy import LLM, SamplingParams  # noqa: E402
from specdeploy.bench import machine, print_json  # noqa: E402

REAL = runner_mod._checkpoints_after


def _run(llm, prompt, sp, mode) -> tuple[float, int]:
    runner = llm.deployed.graph_runner
    before = runner.replays
    runner_mod._checkpoints_after = REAL if mode == "replayed" else (lambda m: (m, None))
    real_run = runner.run
    if mode == "eager":  # the runner skips any step with checkpoints, as before the change
        runner.run = lambda meta, *a, **k: None if meta.ckpt_tokens.numel() else real_run(
            meta, *a, **k)
    try:
        llm.reset_prefix_cache()
        llm.generate([prompt[:4]], SamplingParams(max_tokens=1))  # (the prefill's Python warm)
        llm.reset_prefix_cache()
        t = time.perf_counter()
        first = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        t_first = time.perf_counter() - t
        llm.reset_prefix_cache()
        t = time.perf_counter()
        out = llm.generate([prompt], sp)[0]
        dt = time.perf_counter() - t - t_first  # less the prefill (one step's worth)
    finally:
        runner.run = real_run
        runner_mod._checkpoints_after = REAL
    assert first[0].token_ids[0] == out.token_ids[0]
    return (len(out.token_ids) - 1) / dt, runner.replays - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ggufs", nargs="+")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    result = {"machine": machine(), "command": " ".join(["bench/checkpoint_steps.py"] +
                                                       sys.argv[1:]), "models": {}}
    prompt = list(range(10, 10 + a.prompt_len))
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    for path in a.ggufs:
        llm = LLM(path, max_batch_size=1, max_seq_len=a.prompt_len + a.tokens + 16)
        plan = llm.deployed.plan
        rows = []
        for r in range(a.rounds):
            modes = ["replayed", "eager"] if r % 2 == 0 else ["eager", "replayed"]
            got = {m: _run(llm, prompt, sp, m) for m in modes}
            rows.append({m: {"decode_tok_s": round(v[0], 1), "replays": v[1]}
                         for m, v in got.items()})
            print(Path(path).name, rows[-1], flush=True)
        result["models"][Path(path).name] = {
            "page_size": plan.page_size, "checkpoint_every": plan.checkpoint_every,
            "threads": torch.get_num_threads(), "rounds": rows,
            "replayed_vs_eager_median": round(statistics.median(
                x["replayed"]["decode_tok_s"] / x["eager"]["decode_tok_s"] for x in rows), 3)}
    print_json(result, a.json_out)


if __name__ == "__main__":
    main()
