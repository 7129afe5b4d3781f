"""TP=1 vs TP=2 on this machine: per-rank memory (weights held while loading, with per-rank
loading; RSS peak and steady), decode tokens/s at batch 1 and 16, and time per step in
collectives (rank 0's all-reduce / all-gather inside the graph) and in rank 0's per-step messages
to the workers.

    .venv/bin/python bench/tp_scaling.py [--models default,hybrid] [--tokens 32] [--blocks]
        [--json-out bench/results/tp_scaling.json]

Two ranks on two cores are not faster: this measures the overhead a multi-device run pays. Every
rank runs 1 torch thread (TP=1: one core, TP=2: two): with other processes on the two cores, 2
OpenMP threads in one process collapse into spin-waits (tests/conftest.py), which would make TP=1
look 20x slower than it is. RSS is read after `malloc_trim`. Both build with the `ggml_linears`
transform disabled (fp32 linears everywhere) unless `--blocks`: then the GGUF's linears run on its
blocks, each rank on its cut of them (deploy/shard_slice.py `slice_blocks`). The default model
(SmolLM2: 9 query heads) cannot split its heads over 2 ranks; it shards `mlp` and `lm_head` and
replicates attention (`shard_layers`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from specdeploy.bench import machine, print_json
from specdeploy.deploy.build import BuildOptions, build
from specdeploy.deploy.passes.shard import param_bytes
from specdeploy.distributed import DistConfig
from specdeploy.distributed.groups import MESSAGES
from specdeploy.engine import Engine, SamplingParams
from specdeploy.ops.collectives import COLLECTIVE_TIME
from specdeploy.tokenizer import load_tokenizer


def hybrid_checkpoint(root: str) -> str:
    """A mid-size NemotronH (16 blocks of every kind, H=512, ~60M parameters)."""
    from specdeploy.models import nemotron_h

    hf = nemotron_h.tiny_hf_config()
    hf.update(hidden_size=512, hybrid_override_pattern="M*M-E*ME" * 2, num_hidden_layers=16,
              mamba_num_heads=16, mamba_head_dim=32, ssm_state_size=64, n_groups=2,
              chunk_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              intermediate_size=1536, n_routed_experts=8, moe_intermediate_size=384,
              moe_shared_expert_intermediate_size=512, moe_latent_size=None, vocab_size=8192)
    return str(nemotron_h.make_tiny(os.path.join(root, "hybrid"), seed=0, hf_config=hf))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def decode_rate(engine: Engine, batch: int, tokens: int, vocab: int) -> dict:
    """Prefill `batch` 16-token prompts (untimed), then time the decode steps."""
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(torch.randint(3, min(vocab, 1000), (16,), generator=g).tolist(),
                           SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.step()  # prefill (+ the first token)
    c0, m0 = dict(COLLECTIVE_TIME), dict(MESSAGES)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    coll = COLLECTIVE_TIME["seconds"] - c0["seconds"]
    return {"batch": batch, "decode_tok_s": round(batch * (tokens - 1) / dt, 2),
            "steps": steps, "ms_per_step": round(1e3 * dt / steps, 2),
            "collective_ms_per_step": round(1e3 * coll / steps, 3),
            "collective_calls_per_step": round(
                (COLLECTIVE_TIME["calls"] - c0["calls"]) / steps, 1),
            "message_ms_per_step": round(1e3 * (MESSAGES["seconds"] - m0["seconds"]) / steps, 3)}


def _memory_one(deployed, rss_before: int) -> dict:
    """TP=1's row of what `rank_memory` gathers from every rank under TP."""
    import resource

    from specdeploy.deploy.graph import weight_bytes
    from specdeploy.distributed.runtime import _rss

    rss, anon = _rss()
    return {"rank": 0, "weight_bytes": weight_bytes([deployed.gm]), "rss_bytes": rss,
            "rss_anon_bytes": anon, "rss_before_build_bytes": rss_before,
            "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **deployed.load_stats}


def _mib(m: dict) -> dict:
    """Bytes as MiB; `load_peak`: weights held at once while loading (per-rank loading: the
    rank's share plus one whole tensor), `kept`: the graphs' weights after the pipeline
    (packed copies included), RSS right after the build and its peak (export's transients
    too), `rss_peak_growth`: the peak over the RSS before the build started."""
    f = {k[:-len("_bytes")] + "_mib": round(v / 2**20, 1) for k, v in m.items()
         if k.endswith("_bytes")}
    f["rss_peak_growth_mib"] = round(f["rss_peak_mib"] - f["rss_before_build_mib"], 1)
    return {"rank": m["rank"], **f}


def run(path: str, tp: int, shard_layers, tokens: int, blocks: bool = False) -> dict:
    opts = BuildOptions(dtype="float32", max_batch_size=16, max_seq_len=256, page_size=16,
                        max_cache_gib=0.25, kernels="fast" if blocks else "exact",
                        disabled=frozenset() if blocks else frozenset({"ggml_linears"}))
    torch.set_num_threads(1)
    if tp == 1:
        from specdeploy.distributed.runtime import _rss

        rss_before = _rss()[0]
        deployed, workers = build(path, opts), []
        memory = [_memory_one(deployed, rss_before)]
    else:
        from specdeploy.distributed.runtime import build_ranked

        os.environ["SPECDEPLOY_WORKER_THREADS"] = "1"
        opts = BuildOptions(**{**opts.__dict__, "dist": DistConfig(tp, 1, 0, shard_layers)})
        deployed = build_ranked(path, opts, timeout=120)
        workers = deployed._workers
        memory = deployed.rank_memory
    gm = deployed.gm
    tok = load_tokenizer(path)
    out = {"tp": tp, "shard_layers": list(shard_layers), "rank0_weight_mib": round(
        param_bytes(gm) / 2**20, 2), "memory_per_rank": [_mib(m) for m in memory]}
    rates = []
    for batch in (1, 16):
        engine = Engine(deployed, tok, max_batch_size=16, max_num_tokens=512, seed=0,
                        eos_token_ids=())
        decode_rate(engine, batch, 4, deployed.vocab_size)  # warm-up
        rates.append(decode_rate(engine, batch, tokens, deployed.vocab_size))
    out["decode"] = rates
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # rank 0; the workers' RSS is as they left it
    out["steady_rss_mib_per_rank"] = [round(rss_mib(os.getpid()), 1)] + [
        round(rss_mib(p.pid), 1) for p in workers]
    if tp > 1:
        deployed.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="default,hybrid")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--tp", type=int, default=None, help="run one TP size (internal)")
    p.add_argument("--blocks", action="store_true",
                   help="GGUF linears on their blocks (fast kernels), cut per rank")
    p.add_argument("--json-out", default=None)
    p.add_argument("--note", default="", help="recorded with the result (e.g. a shared machine)")
    args = p.parse_args(argv)
    result = {"machine": machine(), "load_avg_at_start": os.getloadavg(), "note": args.note,
              "tokens": args.tokens, "blocks": args.blocks, "command": " ".join(sys.argv),
              "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            from specdeploy.default_model import default_model_path

            path = str(default_model_path()) if name == "default" else hybrid_checkpoint(tmp)
            layers = ("mlp", "lm_head") if name == "default" else DistConfig().shard_layers
            for tp in (1, 2):
                # NOTE: one fresh process per run, so each RSS is that run's alone
                import json
                import subprocess

                cmd = [sys.executable, "-c", "import json,sys; from bench.tp_scaling import run;"
                       f"print('RESULT', json.dumps(run({path!r}, {tp}, {tuple(layers)!r}, "
                       f"{args.tokens}, {args.blocks})))"]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                      cwd=os.path.dirname(os.path.dirname(__file__)))
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not line:
                    raise RuntimeError(f"{name} tp={tp} failed:\n{proc.stderr[-3000:]}")
                result["runs"].append({"model": name, **json.loads(line[0][7:])})
                print(result["runs"][-1], file=sys.stderr, flush=True)
    print_json(result, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
