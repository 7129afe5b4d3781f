"""Speculation against plain decoding at several concurrencies, in steady state: each level keeps
C requests in flight over a queue of held-out prompts (a finished request's slot is refilled at
once, as a server under load does), greedy, EOS ends a reply. One process, one deployment per
configuration and level, all built before any timing; rounds interleaved, each in its own
shuffled order (seeded by the round).

    .venv/bin/python bench/spec_by_concurrency.py [--concurrency 1 2 4 8]
        [--configs plain,auto] (also plain-b, suffix+ctl, lookup+ctl, plain-noamx, auto-noamx,
        auto-fromN: `auto` with speculation off from N running sequences up, whatever its
        calibration says)
        [--prompts 16] [--skip 6] [--max-tokens 128] [--rounds 3]
        [--threads 2] [--lockstep] [--json-out FILE]

Why not bench/vs_llamacpp_concurrent.py: there N requests start together and all end after
the same number of tokens, so a step's batch only shrinks at the end and the run lasts as long
as its slowest sequence; speculation's gain there is the slowest sequence's, which at 4
requests measured level with plain (bench/results/vs_llamacpp_concurrent_avx512_1205_c4.json).
Here a sequence that speculation moves ahead frees its slot for the next prompt.

--lockstep: the configurations of a concurrency run their closed loops side by side, one engine
step each in turn (the order rotating), and a configuration's rate is its output tokens over the
sum of its own steps' wall times. On a shared machine whose speed drifts by 15-30% within minutes
(docs/benchmarks.md), whole rounds one after another compare a configuration's round with
another machine state; steps ~20 ms apart see the same one. (An A/B of the same decode steps
measured this way differed by 0.2%, where whole rounds of identical deployments differed by up
to 20%.) Without it, rounds run whole, in a shuffled order.

Prompts: held-out ShareGPT first turns (bench/acceptance.py `heldout_prompts`) from index
--skip on (the batch-1 benches use the first 6), chat template, <= 256 tokens. Every
configuration makes the same tokens (greedy, lossless); each row reports output tokens/s (the
median of rounds) and the median of per-round ratios to plain at the same concurrency.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402

from specdeploy import LLM, SamplingParams, SpecConfig  # noqa: E402
from specdeploy.bench import machine, print_json, run_closed_loop  # noqa: E402

CONFIGS = {
    "plain": lambda: None,
    "plain-b": lambda: None,  # a second plain deployment: the spread between identical ones
    "auto": lambda: SpecConfig("auto", suffix_decoding_max_cached_requests=0),
    "suffix+ctl": lambda: SpecConfig("suffix", 3, suffix_decoding_max_cached_requests=0),
    "lookup+ctl": lambda: SpecConfig("ngram", 3, prompt_lookup_num_tokens=16),
    # `auto` with speculation off wherever more than one request runs: its engine's own cost
    "auto-off": lambda: SpecConfig("auto", suffix_decoding_max_cached_requests=0,
                                   disable_by_batch_size=1),
}
# the same deployments with the GGUF kernels' AMX path off (ops/ggml_tiled.py), built (so
# calibrated) and run inside that setting: AMX's effect side by side, where the CPU has it
for _name in ("plain", "auto"):
    CONFIGS[f"{_name}-noamx"] = CONFIGS[_name]


def _from_n(name: str) -> int | None:
    """N of "auto-fromN"."""
    rest = name.removeprefix("auto-from")
    return int(rest) if rest != name and rest.isdigit() else None


def _setting(name: str):
    """The kernel setting a configuration deploys and runs in."""
    if name.endswith("-noamx"):
        from specdeploy.ops import ggml_tiled

        return ggml_tiled.amx(0)
    return contextlib.nullcontext()


def run_lockstep(llms: dict, prompts: list[list[int]], sp: SamplingParams, c: int) -> dict:
    """{key: (output tokens / seconds of its own steps, output tokens)} of the closed loops of
    `llms` (keyed (config, C)), advanced one step each in turn."""
    state = {k: {"pending": list(prompts), "busy": 0.0, "tokens": 0} for k in llms}
    active, turn = list(llms), 0
    while active:
        order = active[turn % len(active):] + active[:turn % len(active)]
        turn += 1
        for k in order:
            eng, st = llms[k].engine, state[k]
            while st["pending"] and len(eng.scheduler.running) + len(eng.scheduler.waiting) < c:
                eng.add_request(st["pending"].pop(0), sp)
            with _setting(k[0]):
                t = time.perf_counter()
                outs = eng.step()
                st["busy"] += time.perf_counter() - t
            st["tokens"] += sum(len(o.token_ids) for o in outs if o.finished)
            if not st["pending"] and not eng.has_unfinished():
                active.remove(k)
    return {k: (st["tokens"] / st["busy"], st["tokens"]) for k, st in state.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--configs", default="plain,auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--skip", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lockstep", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS and not _from_n(n)]
    if unknown or "plain" not in names:
        raise SystemExit(f"--configs: known {sorted(CONFIGS)}, plain included; got {names}")
    llms = {}
    for c in args.concurrency:
        for n in names:
            with _setting(n):
                llms[(n, c)] = LLM(spec=CONFIGS["auto" if _from_n(n) else n](),
                                   max_batch_size=c)
            if _from_n(n):
                llms[(n, c)].engine.controller.off_batches = frozenset(range(_from_n(n), c + 1))
    tok = next(iter(llms.values())).tokenizer
    prompts = heldout_prompts(tok, args.skip + args.prompts, 256)[args.skip:]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for (n, c), llm in llms.items():  # warm-up: a first request of each shape
        with _setting(n):
            run_closed_loop(llm, prompts[:c], SamplingParams(max_tokens=8, temperature=0), c)
    rates: dict[tuple[str, int], list[float]] = {k: [] for k in llms}
    tokens: dict[tuple[str, int], int] = {}
    for r in range(args.rounds):
        if args.lockstep:
            for c in args.concurrency:
                res = run_lockstep({k: v for k, v in llms.items() if k[1] == c}, prompts, sp, c)
                for key, (rate, ntok) in res.items():
                    rates[key].append(rate)
                    tokens[key] = ntok
                    print(f"round {r} {key[0]} @ {c}: {rate:.1f} tok/s (lockstep)",
                          file=sys.stderr, flush=True)
            continue
        order = list(llms)
        random.Random(r).shuffle(order)
        for key in order:
            with _setting(key[0]):
                out = run_closed_loop(llms[key], prompts, sp, key[1])
            rates[key].append(out["output_tokens_per_s"])
            tokens[key] = out["output_tokens"]
            print(f"round {r} {key[0]} @ {key[1]}: {out['output_tokens_per_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    levels = {}
    for c in args.concurrency:
        base = rates[("plain", c)]
        rows = {}
        for n in names:
            rr = rates[(n, c)]
            rows[n] = {"tokens_per_s": round(statistics.median(rr), 2),
                       "per_round": [round(x, 2) for x in rr],
                       "vs_plain": round(statistics.median(x / b for x, b in zip(rr, base)), 3),
                       "vs_plain_per_round": [round(x / b, 3) for x, b in zip(rr, base)],
                       "output_tokens": tokens[(n, c)]}
            stats = llms[(n, c)].stats() if not n.startswith("plain") else {}
            for k in ("mean_accepted_length", "spec_off_batch_sizes"):
                if k in stats:
                    rows[n][k] = stats[k]
        levels[str(c)] = rows
    print_json({"machine": machine(), "command": " ".join(sys.argv),
                "time": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": len(prompts),
                "skip": args.skip, "max_tokens": args.max_tokens, "rounds": args.rounds,
                "lockstep": args.lockstep,
                "by_concurrency": levels}, args.json_out)


if __name__ == "__main__":
    main()
