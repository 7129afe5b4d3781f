"""Serving benchmark: ShareGPT prompts against the OpenAI-compatible server at several
concurrencies, with and without speculative decoding. Prints one JSON object.

    # against a server you started (`specdeploy serve ...`)
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000
    # or let the bench start one server per configuration (a `specdeploy serve` subprocess)
    .venv/bin/python bench/serve.py --model DIR --configs none,mtp --num-draft-tokens 3

Each level keeps `concurrency` streaming chat requests in flight (closed loop) until
`num_prompts` are done. Per request: TTFT (send → first content chunk), inter-token latency (gap
between content chunks; with speculation one chunk may carry several tokens) and TPOT
((latency - TTFT) / (tokens - 1)). Output tokens come from the server's `usage`. Speculative
acceptance is the /metrics delta over the level.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from specdeploy.serving.metrics import parse_text

SPEC_KEYS = ("draft_steps_total", "draft_tokens_total", "accepted_tokens_total")


@dataclass
class Result:
    ok: bool = False
    ttft: float | None = None
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
                      ) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    res = Result()
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices", []):
                    if ch.get("delta", {}).get("content"):
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        res.chunk_times.append(now)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    res.ok = True
    return res


async def run_level(url: str, headers: dict, model: str, prompts: list[str], concurrency: int,
                    max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=limits) as http:
        before = await scrape(http)
        queue = list(prompts)
        results: list[Result] = []

        async def worker():
            while queue:
                results.append(await one_request(http, model, queue.pop(0), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = await scrape(http)
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.output_tokens > 1]
    level = {"concurrency": concurrency, "num_requests": len(results), "errors": len(results)
             - len(ok), "wall_s": wall, "output_tokens": out_tokens,
             "output_tokens_per_s": out_tokens / wall, "requests_per_s": len(ok) / wall,
             "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
             "itl_s": percentiles(itl), "tpot_s": percentiles(tpot)}
    if any(r.error for r in results):
        level["first_error"] = next(r.error for r in results if r.error)
    spec = {k: after.get(f"specdeploy_spec_{k}", 0) - before.get(f"specdeploy_spec_{k}", 0)
            for k in SPEC_KEYS if f"specdeploy_spec_{k}" in after}
    if spec:
        steps = max(spec["draft_steps_total"], 1)
        spec["mean_accepted_length"] = 1 + spec["accepted_tokens_total"] / steps
        spec["acceptance_rate"] = spec["accepted_tokens_total"] / max(
            spec["draft_tokens_total"], 1)
        level["spec"] = spec
    return level


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    return parse_text((await http.get("/metrics")).text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, spec: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specdeploy.cli", "serve", "--port", str(port), "--spec", spec,
           "--max-batch-size", str(max(args.concurrency)), "--max-seq-len", str(args.max_seq_len),
           "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    if spec != "none":
        cmd += ["--num-draft-tokens", str(args.num_draft_tokens)]
        if args.draft_model:
            cmd += ["--draft-model", args.draft_model]
    cmd += args.serve_arg
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("server did not start in time")
        time.sleep(0.2)


def bench_server(args, url: str, prompts: list[str], label: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
    levels = []
    for c in args.concurrency:
        n = args.num_prompts or max(4, 2 * c)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        levels.append(asyncio.run(run_level(url, headers, model, batch, c, args.max_tokens)))
        print(f"[bench] {label} c={c}: {levels[-1]['output_tokens_per_s']:.1f} tok/s",
              file=sys.stderr)
    return {"config": label, "model": model, "levels": levels}


def table(runs: list[dict]) -> str:
    rows = ["| config | conc | req | tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
            "TPOT p50 (ms) | accepted len |", "|---|---|---|---|---|---|---|---|"]
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    for run in runs:
        for lv in run["levels"]:
            acc = lv.get("spec", {}).get("mean_accepted_length")
            rows.append(f"| {run['config']} | {lv['concurrency']} | {lv['num_requests']} | "
                        f"{lv['output_tokens_per_s']:.1f} | {ms(lv['ttft_s']['p50'])} / "
                        f"{ms(lv['ttft_s']['p99'])} | {ms(lv['itl_s']['p50'])} / "
                        f"{ms(lv['itl_s']['p99'])} | {ms(lv['tpot_s']['p50'])} | "
                        f"{'-' if acc is None else f'{acc:.2f}'} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (else launch one per config)")
    ap.add_argument("--api-key", default=os.environ.get("SPECDEPLOY_API_KEY"))
    ap.add_argument("--model", default=None, help="checkpoint for launched servers")
    ap.add_argument("--configs", default="none,mtp", help="spec methods to launch: none,mtp,eagle3")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `serve` argument")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-prompts", type=int, default=0, help="per level (0: 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-chars", type=int, default=1000, help="longer prompts are cut")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    from specdeploy.bench import load_prompts

    need = args.num_prompts or 2 * max(args.concurrency)
    prompts = [p[: args.max_prompt_chars] for p in load_prompts("sharegpt", max(need, 4))]
    runs = []
    if args.url:
        runs.append(bench_server(args, args.url, prompts, "server"))
    else:
        for spec in args.configs.split(","):
            proc, url = launch(args, spec)
            try:
                runs.append(bench_server(args, url, prompts, spec))
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(table(runs), file=sys.stderr)
    print(json.dumps({"runs": runs, "max_tokens": args.max_tokens, "dataset": "sharegpt",
                      "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                                  "python": platform.python_version()},
                      "command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
