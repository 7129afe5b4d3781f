"""Where a decode step's time goes, for bench/gpu_bench.py's phases: a tiny hybrid's
verify-step / decode-step time ratio (`hybrid_verify_ratio`), a batch-1 step with CUDA graphs
against its replay and its eager kernels (`step_profile`), and the host's share of a step under
cProfile (`host_profile`). Each returns the JSON its phase records.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from specdeploy import LLM, SamplingParams, SpecConfig


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hybrid_verify_ratio(args) -> dict:
    """verify (1 + K tokens) / decode step time of a tiny NemotronH at batch size 1, eager and
    (on CUDA) replayed as CUDA graphs (the runner's steps, as the engine runs them)."""
    from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
    from specdeploy.deploy.build import build
    from specdeploy.engine.cuda_graphs import install
    from specdeploy.models.registry import family_module

    path = family_module("nemotron_h").make_tiny(Path(tempfile.mkdtemp()) / "h", mtp_layers=1)
    dep = build(str(path), dtype=args.dtype, device=args.device, max_batch_size=1,
                max_seq_len=256, spec=SpecConfig("mtp", 3)).target
    dep.forward(build_metadata([Segment(list(range(3, 35)), 0, [0, 1], 0, 1)]))

    def timed(seg, reps=50) -> float:
        meta = build_metadata([seg])
        dep.forward(meta)
        _sync(args.device)
        t = time.perf_counter()
        for _ in range(reps):
            dep.forward(meta)
        _sync(args.device)
        return (time.perf_counter() - t) / reps

    decode = timed(Segment([5], 32, [0, 1, 2], 0, 1))
    verify = timed(Segment([5, 6, 7, 8], 32, [0, 1, 2], 0, 4, SEG_EXTEND))
    out = {"decode_ms": 1e3 * decode, "verify_ms": 1e3 * verify, "ratio": verify / decode}
    if torch.device(args.device).type == "cuda":
        install(dep, 1)  # dep.forward now replays the uniform steps
        decode = timed(Segment([5], 32, [0, 1, 2], 0, 1))
        verify = timed(Segment([5, 6, 7, 8], 32, [0, 1, 2], 0, 4, SEG_EXTEND))
        out["cuda_graphs"] = {"decode_ms": 1e3 * decode, "verify_ms": 1e3 * verify,
                              "ratio": verify / decode,
                              "replays": dep.graph_runner.replays}
    return out


@torch.inference_mode()
def step_profile(args, prompt: list[int], triton: bool = False, gemv: bool = False) -> dict:
    """Where a batch-1 decode step's time goes with CUDA graphs: the engine's step, the graph's
    replay alone (GPU time), and the kernels of one eager run of the same step (torch.profiler:
    how many launches, which kernels take the time). `gemv`: with the fused norm + linear."""
    from torch.profiler import ProfilerActivity, profile

    from specdeploy.cache.metadata import Segment, build_metadata
    from specdeploy.engine.cuda_graphs import install
    from specdeploy.ops import gpu_kernels

    cuda = torch.device(args.device).type == "cuda"
    gpu_kernels.set_enabled(triton)  # the phase runner turns them off again (`Phases`)
    gpu_kernels.set_gemv(gemv)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=1,
              max_seq_len=1024, cuda_graphs=cuda)
    eng, dev = llm.engine, args.device
    target = getattr(eng.deployed, "target", eng.deployed)
    runner = target.graph_runner or install(eng.deployed, 1, capture=False)  # CPU: a smoke run
    eng.add_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(40):  # prefill, then decode steps (captures the widths they reach)
        eng.step()
    _sync(dev)
    steps = []
    for _ in range(60):
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    key, replay = max((k for k in runner._graphs if k[1] == 1), default=None), None
    if key is not None:
        cap = runner._graphs[key]
        _sync(dev)
        t = time.perf_counter()
        for _ in range(100):
            cap.graph.replay()
        _sync(dev)
        replay = 1e3 * (time.perf_counter() - t) / 100
    n = len(prompt) + 40
    pages = list(range(-(-(n + 1) // target.plan.page_size)))
    meta = build_metadata([Segment([5], n, pages, 0)])
    static = runner._static(meta, 1)
    feed = target._feed(static)
    target._fn(*feed)
    _sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        target._fn(*feed)
    _sync(dev)
    eager = (time.perf_counter() - t) / 10
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        target._fn(*feed)
        _sync(dev)
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    launches = sum(e.count for e in kernels)
    gpu_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    cpu_top = sorted((e for e in prof.key_averages() if e.device_type.name == "CPU"),
                     key=lambda e: -e.self_cpu_time_total)[:12]
    return {"engine_step_ms": 1e3 * sorted(steps)[len(steps) // 2],
            "graph_replay_ms": replay, "graph_key": key,
            "eager_forward_ms": 1e3 * eager, "kernel_launches": launches,
            "kernel_gpu_ms": gpu_us / 1e3,
            "top_kernels": [[e.key[:90], e.count, round(e.self_device_time_total, 1)]
                            for e in top],
            "top_cpu_ops": [[e.key[:60], e.count, round(e.self_cpu_time_total, 1)]
                            for e in cpu_top], "triton": triton, "gemv": gemv}


@torch.inference_mode()
def host_profile(args, prompt: list[int], top: int = 18) -> dict:
    """Where the host's time goes in a batch-1 step (cProfile over 64 engine steps): plain,
    EAGLE-3 at K = 3 and under the cost controller, with the defaults (CUDA graphs, Triton
    kernels, drafter graphs). A step of a small model on a GPU waits on the host as much as on
    the device."""
    import cProfile
    import pstats

    out = {}
    for name, spec in (("plain", None), ("eagle3", SpecConfig("eagle3", 3, controller="off")),
                       ("eagle3_ctl", SpecConfig("eagle3", 3))):
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=1,
                  max_seq_len=1024, spec=spec)
        # the steps profiled below, once first: their graph captures and compiles out of it
        llm.generate([prompt], SamplingParams(max_tokens=80, ignore_eos=True))
        eng = llm.engine
        eng.add_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(4):
            eng.step()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(64):
            eng.step()
        prof.disable()
        wall = time.perf_counter() - t
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
        out[name] = {"step_ms": 1e3 * wall / 64, "top_own_ms_per_step": [
            [f"{Path(f).name}:{line}({fn})", calls, round(1e3 * tt / 64, 4),
             round(1e3 * ct / 64, 4)] for (f, line, fn), (_, calls, tt, ct, _) in rows]}
    return out
