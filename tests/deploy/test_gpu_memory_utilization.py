"""`gpu_memory_utilization` (vLLM's knob): the caches get `u * total - in_use` of the device;
tested with the device's free and total bytes monkeypatched, so it runs on the CPU."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache import plan as cache_plan
from specdeploy.cache.handlers import PagedKV, State
from specdeploy.cache.plan import GIB, cache_budget, plan_cache

CPU = torch.device("cpu")


def _memory(monkeypatch, free_gib: float, total_gib: float) -> None:
    monkeypatch.setattr(cache_plan, "available_bytes", lambda device: int(free_gib * GIB))
    monkeypatch.setattr(cache_plan, "total_bytes", lambda device: int(total_gib * GIB))


def _handlers():
    return [PagedKV("kv_cache_0", 2, 16, 16, torch.float32),
            State("ssm_0_state", (8, 16, 16), torch.float32)]


@pytest.mark.parametrize("util", [0.3, 0.5, 0.9, 1.0])
def test_budget_follows_the_fraction(monkeypatch, util):
    _memory(monkeypatch, free_gib=6.0, total_gib=8.0)  # 2 GiB in use (weights, others)
    budget, knob = cache_budget(CPU, gpu_memory_utilization=util)
    assert knob == "gpu_memory_utilization"
    assert budget == int(util * 8 * GIB) - 2 * GIB
    # the plan spends that budget: 64 x 1M tokens want more pages than any of these hold
    plan = plan_cache(_handlers(), 16, 64, 1 << 20, None, CPU, gpu_memory_utilization=util)
    assert plan.budget_bytes == budget
    assert plan.total_bytes <= budget
    page = _handlers()[0].bytes_per_page(16)
    assert budget - plan.total_bytes < page  # filled to within one page


def test_default_is_half_the_free_memory(monkeypatch):
    _memory(monkeypatch, free_gib=6.0, total_gib=8.0)
    assert cache_budget(CPU) == (3 * GIB, "max_cache_gib")
    assert plan_cache(_handlers(), 16, 2, 64, None, CPU).budget_bytes == 3 * GIB


def test_max_cache_gib_is_exact(monkeypatch):
    _memory(monkeypatch, free_gib=6.0, total_gib=8.0)
    assert cache_budget(CPU, max_cache_gib=0.25) == (GIB // 4, "max_cache_gib")


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, 2, float("nan"), True, "0.5"])
def test_out_of_range(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        cache_budget(CPU, gpu_memory_utilization=bad)
    from specdeploy.deploy.build import BuildOptions

    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        BuildOptions(gpu_memory_utilization=bad)


def test_exclusive_with_max_cache_gib():
    from specdeploy.deploy.build import BuildOptions

    with pytest.raises(ValueError, match="gpu_memory_utilization.*max_cache_gib"):
        BuildOptions(gpu_memory_utilization=0.5, max_cache_gib=1.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization.*max_cache_gib"):
        cache_budget(CPU, 1.0, 0.5)


def test_nothing_left(monkeypatch):
    _memory(monkeypatch, free_gib=2.0, total_gib=8.0)  # 6 GiB in use, 0.5 allows 4
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.5 of 8.00 GiB.*6.00 GiB"):
        cache_budget(CPU, gpu_memory_utilization=0.5)


def test_too_small_names_the_knob(monkeypatch):
    _memory(monkeypatch, free_gib=8.0 - 1e-3, total_gib=8.0)
    big = [State("s", (1024, 1024, 8), torch.float32)]  # 32 MiB a slot
    with pytest.raises(ValueError, match="^gpu_memory_utilization: recurrent states"):
        plan_cache(big, 16, 4, 64, None, CPU, gpu_memory_utilization=0.001 / 8 + 1e-4)


def test_cli_flag_reaches_llm(monkeypatch):
    """`--gpu-memory-utilization` parses on generate, bench, deploy and serve."""
    from specdeploy.cli import build_parser
    from specdeploy.serving.cli import add_parser

    ap = build_parser()
    for cmd in (["generate", "--prompt", "x"], ["bench"], ["deploy"]):
        args = ap.parse_args(cmd + ["--gpu-memory-utilization", "0.7"])
        assert args.gpu_memory_utilization == 0.7 and args.max_cache_gib is None
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    p = add_parser(sub)
    assert p.parse_args(["--gpu-memory-utilization", "0.6"]).gpu_memory_utilization == 0.6


def test_llm_plans_from_the_fraction(monkeypatch, tmp_path):
    """End to end: `LLM(gpu_memory_utilization=u)` plans what u leaves of the (patched) device."""
    from specdeploy import LLM, SamplingParams
    from specdeploy.models.registry import family_module

    family_module("llama").make_tiny(tmp_path / "llama", seed=0)
    _memory(monkeypatch, free_gib=7.99, total_gib=8.0)
    util = (0.01 + 0.02) / 8  # 0.03 GiB of 8, 0.01 GiB in use: 0.02 GiB for the cache
    llm = LLM(str(tmp_path / "llama"), max_batch_size=2, max_seq_len=128,
              gpu_memory_utilization=util)
    plan = llm.deployed.plan
    assert plan.budget_bytes == int(util * 8 * GIB) - (int(8 * GIB) - int(7.99 * GIB))
    assert plan.total_bytes <= plan.budget_bytes
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
