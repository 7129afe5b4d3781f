"""Where a decode step and a verify step of the deployed graph spend their time, by op kind.

    .venv/bin/python bench/step_profile.py [--model PATH] [--kernels exact,fast] [--k 3]
        [--threads 1] [--reps 30] [--json-out FILE]

One greedy request on the default model feeds the graph; the feeds of one decode step (1 row)
and of one verify step (1 + K rows, the drafts faked from the plain continuation) are captured
and replayed. Each replay runs the graph node by node (`torch.fx.Interpreter`), timing every
node; node times are summed per kind (linears, attention, recurrent, norm, rope, embedding, the
rest: views, adds, muls, casts). A fused decoder layer (`fuse_decoder_layers`: its linears,
attention and norms in one C call) is its own kind, "layer", which "non_linear_share" counts
as not linear (the linears left are the LM head's). The plain graph call is timed too: its
wall time minus the sum of node times of an interpreted run estimates what the interpreter
adds, not the deployment.
"non_linear_share" is everything but the linears over the graph call's wall time.
"engine_decode": a plain (no drafter) deployment's decode steps, the engine step's time, its
graph call's, and "outside_graph_ms", their difference: the engine's own work around the graph
(metadata, feeds, sampling, bookkeeping); bench/spec_phases.py splits a speculative step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import fx

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.bench import machine, print_json
from specdeploy.engine.cpu_graphs import CpuGraph

KINDS = (("layer", ("decoder_layer",)),
         ("linear", ("linear", "ggml", "int8", "mm", "packed", "matmul", "addmm", "q4", "q8")),
         ("attention", ("attention", "sdpa")), ("recurrent", ("ssm", "conv", "delta", "gdn")),
         ("norm", ("norm",)), ("rope", ("rope", "rotary")), ("embedding", ("embedding",)),
         ("moe", ("moe",)))


def kind_of(node: fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target)).lower()
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


class TimedInterpreter(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.times: dict[str, float] = {}

    def run_node(self, n):
        if n.op != "call_function":
            return super().run_node(n)
        t = time.perf_counter()
        out = super().run_node(n)
        k = kind_of(n)
        self.times[k] = self.times.get(k, 0.0) + time.perf_counter() - t
        return out


def capture_feeds(llm: LLM, k: int) -> tuple[dict[str, list], object]:
    """The feeds of one decode step (1 row) and one verify step (1 + k rows: k fixed drafts
    of a lookup-only deployment, so the target sees a real extend segment)."""
    target = llm.engine.deployed.target
    feeds: list[tuple[int, list]] = []
    orig = target._feed

    def feed(meta, hidden=None):
        f = orig(meta, hidden)
        feeds.append((int(meta.input_ids.numel()), f))
        return f

    target._feed = feed
    prompt = [3 + i % min(1000, llm.engine.deployed.vocab_size - 3) for i in range(1000, 1040)]
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))  # no match: decodes
    llm.engine.fix_drafts(lambda seq, n: [7] * n)
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.fix_drafts(None)
    target._feed = orig
    decode = next(f for n, f in feeds if n == 1)
    verify = next(f for n, f in feeds if n == 1 + k)
    return {"decode": decode, "verify": verify}, target


def profile(target, feed, reps: int) -> dict:
    gm = target.gm
    walls, node_runs = [], []
    with torch.inference_mode():
        for _ in range(3):
            target._fn(*feed)
        for _ in range(reps):
            t = time.perf_counter()
            target._fn(*feed)
            walls.append(time.perf_counter() - t)
        for _ in range(max(3, reps // 3)):
            it = TimedInterpreter(gm)
            it.run(*feed)
            node_runs.append(it.times)
    kinds = sorted({k for r in node_runs for k in r})
    med = {k: statistics.median(r.get(k, 0.0) for r in node_runs) * 1e3 for k in kinds}
    wall = statistics.median(walls) * 1e3
    nodes = sum(med.values())
    linear = med.get("linear", 0.0)
    return {"graph_call_ms": round(wall, 3), "sum_node_ms": round(nodes, 3),
            "ms_by_kind": {k: round(v, 3) for k, v in med.items()},
            "share_by_kind": {k: round(v / nodes, 4) for k, v in med.items()},
            "non_linear_share": round(1 - linear / wall, 4) if wall else None,
            "non_linear_share_of_nodes": round(1 - linear / nodes, 4) if nodes else None,
            "num_call_nodes": sum(1 for n in gm.graph.nodes if n.op == "call_function")}


def outside_graph(llm: LLM, target, tokens: int = 48) -> dict:
    """Median over the plain decode steps of one greedy request: the engine step, its graph
    call, and the difference (metadata, feeds, sampling, bookkeeping: the engine's own work)."""
    calls, rows = [], []
    fn, step, replay = target._fn, llm.engine.step, CpuGraph.replay

    def timed_fn(*a):
        t = time.perf_counter()
        out = fn(*a)
        calls.append(time.perf_counter() - t)
        return out

    def timed_replay(self):  # a replayed step (engine/cpu_graphs.py) is its graph call
        t = time.perf_counter()
        replay(self)
        calls.append(time.perf_counter() - t)

    def timed_step():
        n, t = len(calls), time.perf_counter()
        out = step()
        rows.append((time.perf_counter() - t, calls[n:]))
        return out

    target._fn, llm.engine.step, CpuGraph.replay = timed_fn, timed_step, timed_replay
    try:
        vocab = llm.engine.deployed.vocab_size
        llm.generate([[3 + i % (vocab - 3) for i in range(2000, 2040)]],
                     SamplingParams(max_tokens=tokens, ignore_eos=True))
    finally:
        target._fn, llm.engine.step, CpuGraph.replay = fn, step, replay
    plain = [(s, c[0]) for s, c in rows[1:] if len(c) == 1]  # step 0: the prefill
    return {"step_ms": round(statistics.median(s for s, _ in plain) * 1e3, 3),
            "graph_call_ms": round(statistics.median(g for _, g in plain) * 1e3, 3),
            "outside_graph_ms": round(statistics.median(s - g for s, g in plain) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--kernels", default="exact,fast")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--note", default="")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = {}
    for kern in a.kernels.split(","):
        llm = LLM(a.model, max_batch_size=1, max_seq_len=512, kernels=kern,
                  spec=SpecConfig("ngram", a.k, controller="off"), enable_prefix_caching=False,
                  cpu_graphs=False)  # NOTE: replays skip `_feed`: the feeds come from eager steps
        feeds, target = capture_feeds(llm, a.k)
        rows[kern] = {name: profile(target, f, a.reps) for name, f in feeds.items()}
        plain = LLM(a.model, max_batch_size=1, max_seq_len=512, kernels=kern,
                    enable_prefix_caching=False)
        rows[kern]["engine_decode"] = outside_graph(plain, plain.engine.deployed)
        del llm, feeds, target, plain
    print_json({"bench": "step_profile", "machine": machine(), "threads": a.threads,
                "k": a.k, "note": a.note, "results": rows}, a.json_out)


if __name__ == "__main__":
    main()
