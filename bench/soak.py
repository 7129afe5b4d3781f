"""Soak: a `specdeploy serve` process under `concurrency` closed-loop streaming chat requests for
`duration` seconds, with a share of hostile requests mixed in. Prints one JSON object.

    .venv/bin/python bench/soak.py --duration 600 --concurrency 16 --hostile 0.05
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running server

Reports good requests completed and failed (by status), hostile requests by status (any 5xx
is a bug), p50/p99 TTFT of the good ones, the server's RSS at start (after a warm-up), at the
end and at its peak, and the KV pages still in use when the load stops (should be 0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import launch, percentiles  # noqa: E402  (bench/serve.py)

from specdeploy.bench import print_json  # noqa: E402
from specdeploy.serving.metrics import parse_text  # noqa: E402

NAN = float("nan")


def hostile_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(path, content-type, raw body): the kinds of tests/serving/hostile_cases.py, in small."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    comp = {"model": model, "prompt": "hi", "max_tokens": 4}
    c, ch = "/v1/completions", "/v1/chat/completions"
    js = [
        (c, {**comp, "top_k": 1e30, "temperature": 0.7}), (c, {**comp, "temperature": 1e-45}),
        (ch, {**chat, "temperature": NAN}), (ch, {**chat, "top_p": 0}),
        (c, {**comp, "max_tokens": True}), (c, {**comp, "seed": "x"}),
        (ch, {**chat, "messages": [{"role": "user", "content": "\ud800"}]}),
        (ch, {**chat, "messages": [{"role": "wizard", "content": "x"}]}),
        (ch, {**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (c, {**comp, "prompt": "w" * 400_000}), (c, {**comp, "stop": ["s"] * 100}),
        (c, {**comp, "model": "\ud800"}), (ch, {**chat, "max_tokens": 10**9}),
    ]
    out = [(p, "application/json", json.dumps(b).encode()) for p, b in js]
    out += [(c, "application/json", b"[" * 50_000), (ch, "application/json", b"{not json"),
            (c, "application/json", b'{"prompt": "\xff"}'), (ch, "text/plain", b"hello")]
    return out


async def good(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"status": r.status_code}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    return {"status": "stream_error"}
                delta = ev["choices"][0]["delta"] if ev["choices"] else {}
                if ttft is None and delta.get("content"):
                    ttft = time.perf_counter() - t0
        return {"status": 200, "ttft": ttft}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__}


async def bad(http: httpx.AsyncClient, case: tuple[str, str, bytes]) -> int | str:
    path, ctype, raw = case
    try:
        r = await http.post(path, content=raw, headers={"Content-Type": ctype})
        return r.status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def soak(args, url: str, pid: int, prompts: list[str]) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        cases = hostile_bodies(model)
        # warm-up at full load, so the RSS baseline has the allocator's working set in it
        await asyncio.gather(*(good(http, model, p, args.max_tokens)
                               for p in prompts[:args.concurrency]))
        rss = [rss_mib(pid)]
        good_res: list[dict] = []
        bad_status: Counter = Counter()
        end = time.monotonic() + args.duration

        async def worker(w: int):
            i = w
            while time.monotonic() < end:
                if rng.random() < args.hostile:
                    bad_status[str(await bad(http, rng.choice(cases)))] += 1
                else:
                    good_res.append(await good(http, model, prompts[i % len(prompts)],
                                               args.max_tokens))
                i += args.concurrency

        async def sample_rss():
            while time.monotonic() < end:
                await asyncio.sleep(5)
                rss.append(rss_mib(pid))

        await asyncio.gather(sample_rss(), *(worker(w) for w in range(args.concurrency)))
        await asyncio.sleep(1.0)
        m = parse_text((await http.get("/metrics")).text)
        rss.append(rss_mib(pid))
    ok = [r for r in good_res if r["status"] == 200]
    return {
        "duration_s": args.duration, "concurrency": args.concurrency,
        "hostile_share": args.hostile, "max_tokens": args.max_tokens,
        "good_completed": len(ok),
        "good_failed_by_status": dict(Counter(str(r["status"]) for r in good_res
                                              if r["status"] != 200)),
        "hostile_by_status": dict(sorted(bad_status.items())),
        "hostile_5xx": sum(v for k, v in bad_status.items() if k.startswith("5")),
        "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "rss_mib": {"start": rss[0], "end": rss[-1], "max": max(rss),
                    "every_5s": [round(x) for x in rss]},
        "pages_in_use_after": m.get("specdeploy_cache_pages_in_use"),
        "requests_running_after": m.get("specdeploy_num_requests_running"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (else one is started)")
    ap.add_argument("--pid", type=int, default=None, help="its pid, for RSS (with --url)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hostile", type=float, default=0.05, help="share of hostile requests")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--max-prompt-chars", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--threads", type=int, default=None, help="server torch threads")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from specdeploy.bench import load_prompts

    prompts = [p[: args.max_prompt_chars] for p in load_prompts("sharegpt", 256)]
    proc = None
    if args.url is None:
        launch_args = argparse.Namespace(
            concurrency=[args.concurrency], max_seq_len=args.max_seq_len, model=args.model,
            num_draft_tokens=0, draft_model=None, startup_timeout=args.startup_timeout,
            serve_arg=["--threads", str(args.threads)] if args.threads else [])
        proc, url = launch(launch_args, "none")
        pid = proc.pid
    else:
        url, pid = args.url, args.pid
        if pid is None:
            raise SystemExit("--pid is needed with --url (the server's RSS)")
    try:
        result = asyncio.run(soak(args, url, pid, prompts))
        result["model"] = args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"
    finally:
        if proc is not None:
            proc.terminate()
            t0 = time.monotonic()
            proc.wait(60)
            print(f"[soak] server exited {time.monotonic() - t0:.1f} s after SIGTERM",
                  file=sys.stderr)
    print_json(result, args.json_out)


if __name__ == "__main__":
    main()
