"""The engine's own work per step, outside the forwards, at C requests in flight: plain decoding
next to speculative deployments, one process.

    .venv/bin/python bench/step_overhead.py [--concurrency 8 16] [--configs plain,auto,auto-off]
        [--prompts 32] [--skip 6] [--max-tokens 96] [--rounds 2] [--threads 2]
        [--json-out FILE]

Why: where speculation is off (a large batch) a speculative deployment should cost what plain
decoding does, and where it is on, the time outside the forwards is what the cost controller
cannot see in its model of the step. Wall time on a shared machine moves by 15-30% between runs
(docs/benchmarks.md), the time outside the forwards, a few hundred microseconds of Python, far
less: each step's wall time is split into the target's forward, the drafter's forwards and the
rest ("host_ms"), and the rest is reported per step and per output token, medians over steps.

Steady state as bench/spec_by_concurrency.py: C requests in flight over a queue of held-out
ShareGPT prompts, greedy, EOS ends a reply. Prefill steps (a segment of more than one token
that is not a verify) are left out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402
from spec_by_concurrency import CONFIGS  # noqa: E402

from specdeploy import LLM, SamplingParams  # noqa: E402
from specdeploy.bench import machine, print_json  # noqa: E402


class StepClock:
    """Wraps the deployment's forwards and the engine's step: per step, seconds in the target
    forward, in the drafter's and in all; whether the step was a prefill."""

    def __init__(self, llm):
        self.engine, self.d = llm.engine, llm.deployed
        self.steps: list[tuple[float, float, float, bool]] = []
        self._fwd = self._draft = 0.0
        self._prefill = False
        self._wrap("forward", "_fwd", True)
        if getattr(self.d, "draft_forward", None) is not None and \
                getattr(self.d, "draft", None) is not None:
            self._wrap("draft_forward", "_draft", False)
        step = self.engine.step

        def timed_step():
            self._fwd = self._draft = 0.0
            self._prefill = False
            t = time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - t, self._fwd, self._draft, self._prefill))
            return out

        self.engine.step = timed_step

    def _wrap(self, attr: str, slot: str, target: bool) -> None:
        fn = getattr(self.d, attr)

        def run(meta, *a, **kw):
            t = time.perf_counter()
            out = fn(meta, *a, **kw)
            setattr(self, slot, getattr(self, slot) + time.perf_counter() - t)
            if target and meta.num_tokens > meta.num_seqs and _has_prefill(meta):
                self._prefill = True
            return out

        setattr(self.d, attr, run)


def _has_prefill(meta) -> bool:
    """A plain (not verify) segment of more than one token (a CPU deployment's tensors)."""
    lens = (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).tolist()
    return any(n > 1 and k == 0 for n, k in zip(lens, meta.seg_kind.tolist()))


def run(llm, prompts, sp, c: int) -> dict:
    from specdeploy.bench import run_closed_loop

    clock = StepClock(llm)
    res = run_closed_loop(llm, prompts, sp, c)
    steps = [s for s in clock.steps if not s[3] and s[1] > 0]
    host = [w - f - d for w, f, d, _ in steps]
    tokens = res["output_tokens"]
    return {"tokens_per_s": round(res["output_tokens_per_s"], 1), "steps": len(steps),
            "step_ms": round(1e3 * statistics.median(w for w, *_ in steps), 3),
            "forward_ms": round(1e3 * statistics.median(f for _, f, *_ in steps), 3),
            "draft_ms": round(1e3 * statistics.median(d for _, _, d, _ in steps), 3),
            "host_ms": round(1e3 * statistics.median(host), 3),
            "host_ms_mean": round(1e3 * statistics.fmean(host), 3),
            "host_us_per_token": round(1e6 * sum(host) / max(tokens, 1), 1),
            "output_tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--configs", default="plain,auto,auto-off")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--skip", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: known {sorted(CONFIGS)}; got {unknown}")
    llms = {(n, c): LLM(spec=CONFIGS[n](), max_batch_size=c) for n in names
            for c in args.concurrency}
    tok = next(iter(llms.values())).tokenizer
    prompts = heldout_prompts(tok, args.skip + args.prompts, 256)[args.skip:]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rows: dict = {}
    for _ in range(args.rounds):
        for c in args.concurrency:
            for n in names:
                rows.setdefault(str(c), {}).setdefault(n, []).append(
                    run(llms[n, c], prompts, sp, c))
    summary = {c: {n: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
                   for n, runs in by.items()} for c, by in rows.items()}
    print_json({"bench": "step_overhead", "machine": machine(), "command": " ".join(sys.argv),
                "summary": summary, "rounds": rows}, args.json_out)


if __name__ == "__main__":
    main()
