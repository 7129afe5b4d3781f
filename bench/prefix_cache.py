"""Prefix caching: TTFT and throughput of requests sharing a long system prompt, and what caching
costs a cold prefill. Prints one JSON object (and writes it with --json-out).

    python bench/prefix_cache.py [--models default hybrid_demo tiny_hybrid] [--num-requests 32]
        [--system-tokens 1000] [--k 3] [--rounds 2] [--json-out bench/results/prefix_cache.json]

Per model, with and without MTP speculation, `--rounds` rounds of three runs of the same closed
loop (all requests in flight, batch 16, chunked prefill of 512 tokens, greedy, `--max-tokens`
each), their order rotated every round (the machine may be shared): medians over rounds.
- off: `enable_prefix_caching=False`;
- cold: caching on, cache reset (the first request computes the system prompt; requests
  admitted after its first chunks already hit it);
- warm: caching on, the system prompt cached by the round's cold run (new user turns).
Then the cost of caching on prefills that hit nothing: distinct prompts of the same length,
prefill only (`max_tokens=1`), caching on (cache reset first: page keys, registration and, on
the hybrids, a checkpoint of every recurrent state at every page boundary: the default pages
are the scan chunk, so those states come free) against off, runs interleaved: median wall
time and min CPU time of `--reps`.
`tiny_hybrid` is a tiny random Qwen3.5-MoE (gated delta + conv + attention, MTP head);
`hybrid_demo` the shipped 18M NemotronH (Mamba2 + conv + attention, MTP head); `default` is
SmolLM2-135M (attention only: no checkpoints; its shipped MTP head).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json, run_closed_loop

TEXT = ("Rule {i}: when a customer asks about order {i}, check the ledger, confirm the "
        "shipping address, quote the delivery window and thank them by name. ")


def _prompts(llm: LLM, tiny: bool, system_tokens: int, n: int, seed: int) -> list[list[int]]:
    """n prompts: one shared system prompt of exactly `system_tokens` tokens + a user turn."""
    rng = random.Random(seed)
    if tiny:  # NOTE: the system prompt does not depend on `seed`; the user turns do
        system = [random.Random(0).randrange(3, 100) for _ in range(system_tokens)]
        return [system + [rng.randrange(3, 100) for _ in range(24)] for _ in range(n)]
    text = "".join(TEXT.format(i=i) for i in range(system_tokens // 10))
    system = llm.tokenizer.encode(text)[:system_tokens]
    if len(system) < system_tokens:
        raise ValueError(f"system-tokens: the text gives only {len(system)} tokens")
    return [system + llm.tokenizer.encode(f"\nQuestion {seed}-{i}: what does rule "
                                          f"{rng.randrange(99)} say about order {i}?")
            for i in range(n)]


def _run(llm: LLM, prompts, sp) -> dict:
    before = llm.stats()
    r = run_closed_loop(llm, prompts, sp, concurrency=len(prompts))
    after = llm.stats()
    for key in ("prefix_cache_queries", "prefix_cache_hits"):
        if key in after:
            r[key] = after[key] - before[key]
    if "draft_steps" in after:
        r["acceptance_rate"] = ((after["accepted_tokens"] - before["accepted_tokens"])
                                / max(1, after["draft_tokens"] - before["draft_tokens"]))
    r.pop("itl_s", None)
    return r


def _prefill_cost(on: LLM, off: LLM, tiny: bool, args) -> dict:
    """Seconds to prefill distinct prompts (no hits possible), caching on vs off."""
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    t_on, t_off, c_on, c_off = [], [], [], []
    for rep in range(args.reps):
        prompts = [p[:args.system_tokens] for p in _prompts(
            on, tiny, args.system_tokens + 24, 8, seed=1000 + rep)]
        # NOTE: distinct prompts: a shared system prompt would make "on" hit
        prompts = [[(t + i * 7) % 90 + 3 for t in p] if tiny else [i + 1] + p[1:]
                   for i, p in enumerate(prompts)]
        hits = on.stats()["prefix_cache_hits"]
        pairs = [(on, t_on, c_on), (off, t_off, c_off)]
        for llm, wall, cpu in pairs if rep % 2 else pairs[::-1]:  # interleaved
            llm.reset_prefix_cache()
            t0, c0 = time.perf_counter(), time.process_time()
            llm.generate(prompts, sp)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        if on.stats()["prefix_cache_hits"] != hits:
            raise RuntimeError("prefill-cost prompts hit the cache: they must be distinct")
    m_on, m_off = statistics.median(t_on), statistics.median(t_off)
    cpu_on, cpu_off = min(c_on), min(c_off)
    tokens = 8 * args.system_tokens
    # NOTE: CPU seconds (min over reps) are what a shared, loaded machine measures best
    return {"prompts": 8, "prompt_tokens": args.system_tokens, "reps": args.reps,
            "on_wall_s": m_on, "off_wall_s": m_off, "on_prefill_tok_per_s": tokens / m_on,
            "off_prefill_tok_per_s": tokens / m_off, "wall_slowdown": m_on / m_off - 1,
            "on_cpu_s": cpu_on, "off_cpu_s": cpu_off, "cpu_slowdown": cpu_on / cpu_off - 1,
            # NOTE: each rep's on / off pair ran back to back: their ratio cancels slow drifts
            "median_rep_ratio": statistics.median(a / b for a, b in zip(t_on, t_off)),
            "median_rep_cpu_ratio": statistics.median(a / b for a, b in zip(c_on, c_off))}


def _median_runs(runs: list[dict]) -> dict:
    """Per-key medians of a few runs' measurements (nested percentiles too)."""
    out = {}
    for key, v in runs[0].items():
        if isinstance(v, dict):
            out[key] = _median_runs([r[key] for r in runs])
        elif isinstance(v, (int, float)):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def bench_model(name: str, args) -> dict:
    tiny = name == "tiny_hybrid"
    tmp = None
    path = {"default": None, "hybrid_demo": "hybrid-demo"}.get(name)
    if tiny:
        from specdeploy.models.registry import family_module

        tmp = tempfile.TemporaryDirectory()
        path = family_module("qwen3_5_moe").make_tiny(tmp.name, seed=0, mtp_layers=1)
    common = dict(max_batch_size=16, max_seq_len=2048, max_cache_gib=args.max_cache_gib)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    n = args.num_requests if name != "default" else args.num_requests_default
    out = {}
    mtp = SpecConfig("mtp", args.k, controller="off")  # fixed K
    for spec_name, spec in (("plain", None), (f"mtp_k{args.k}", mtp)):
        if spec is not None and (args.no_mtp or args.prefill_cost_only):
            continue
        print(f"[{name} {spec_name}] building", file=sys.stderr, flush=True)
        off = LLM(path, spec=spec, enable_prefix_caching=False, **common)
        on = LLM(path, spec=spec, **common)
        for llm in (off, on):  # NOTE: first calls pay one-time costs; keep them out of "off"
            llm.generate(_prompts(on, tiny, 64, 1, 99), SamplingParams(max_tokens=4))
            llm.reset_prefix_cache()
        rounds = {"off": [], "cold": [], "warm": []}
        for r in range(0 if args.prefill_cost_only else args.rounds):
            # warm always right after its round's cold; off first, then last
            order = ["off", "cold", "warm"] if r % 2 == 0 else ["cold", "warm", "off"]
            for run in order:
                llm = off if run == "off" else on
                if run == "cold":
                    on.reset_prefix_cache()
                seed = 10 * r + (2 if run == "warm" else 1)
                rounds[run].append(_run(llm, _prompts(on, tiny, args.system_tokens, n, seed),
                                        sp))
                print(f"[{name} {spec_name}] round {r} {run}: {rounds[run][-1]['wall_s']:.1f} s",
                      file=sys.stderr, flush=True)
        runs = {run: _median_runs(rs) for run, rs in rounds.items() if rs}
        runs["rounds"] = rounds
        stats = on.stats()
        plan = getattr(on.deployed, "target", on.deployed).plan
        runs["checkpoint_pool"] = {k: stats[k] for k in ("checkpoint_slots", "checkpoint_bytes",
                                                          "checkpoints_used")}
        runs["page_size"] = plan.page_size
        runs["checkpoint_every_pages"] = plan.checkpoint_every
        runs["cache_bytes"] = stats["cache_bytes"]
        if spec is None:
            print(f"[{name}] prefill cost of caching", file=sys.stderr, flush=True)
            runs["cold_prefill_cost"] = _prefill_cost(on, off, tiny, args)
        out[spec_name] = runs
        del off, on
    if tmp is not None:
        tmp.cleanup()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "hybrid_demo", "tiny_hybrid"],
                    choices=("default", "hybrid_demo", "tiny_hybrid"))
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--num-requests-default", type=int, default=32,
                    help="requests for the default model (slower: fewer on a small machine)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-mtp", action="store_true", help="plain decoding only")
    ap.add_argument("--prefill-cost-only", action="store_true",
                    help="only the cold-prefill cost of caching (implies --no-mtp)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-cache-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"machine": machine(), "args": vars(args)}
    for name in args.models:
        result[name] = bench_model(name, args)
    print_json(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
