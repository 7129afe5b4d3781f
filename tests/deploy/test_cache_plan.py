"""Cache plan: exact bytes per handler, budget errors, spec-state accounting; and the plan of real
tiny deployments against bytes computed by hand from their configs."""
from __future__ import annotations

import math

import pytest
import torch

from specdeploy.cache.handlers import PagedKV, SpecState, State
from specdeploy.cache.plan import GIB, plan_cache

CPU = torch.device("cpu")
F32 = 4


def _handlers(steps: int = 0):
    hs = [PagedKV("kv_cache_0", 2, 16, 16, torch.float32),
          PagedKV("kv_cache_1", 2, 16, 8, torch.bfloat16),
          State("ssm_0_state", (8, 16, 16), torch.float32),
          State("conv_0_state", (192, 3), torch.bfloat16)]
    if steps:
        hs += [SpecState("ssm_0_spec_state", (8, 16, 16), torch.float32, steps, "ssm_0_state"),
               SpecState("conv_0_spec_state", (192, 3), torch.bfloat16, steps,
                         "conv_0_state")]
    return hs


def test_handler_bytes():
    kv, kv16, ssm, conv = _handlers()
    assert kv.bytes_per_page(16) == 16 * 2 * (16 + 16) * F32
    assert kv16.bytes_per_page(5) == 5 * 2 * (16 + 8) * 2
    assert ssm.bytes_per_slot() == 8 * 16 * 16 * F32
    assert conv.bytes_per_slot() == 192 * 3 * 2
    spec = SpecState("s", (8, 16, 16), torch.float32, 4, "t")
    assert spec.bytes_per_slot() == 4 * ssm.bytes_per_slot()
    k, v = kv16.allocate(3, 5, CPU)
    assert k.shape == (3, 5, 2, 16) and v.shape == (3, 5, 2, 8) and k.dtype == torch.bfloat16
    assert k.nbytes + v.nbytes == 3 * kv16.bytes_per_page(5)
    assert spec.allocate(2, CPU).shape == (2, 4, 8, 16, 16)


def test_plan_exact_bytes_capped_by_need():
    """A roomy budget: pages stop at what max_batch_size full sequences could use."""
    hs = _handlers()
    plan = plan_cache(hs, page_size=16, max_batch_size=3, max_seq_len=100, max_cache_gib=1.0,
                      device=CPU)
    pages = 3 * math.ceil(100 / 16) + 1
    assert (plan.num_pages, plan.num_slots, plan.page_size) == (pages, 3, 16)
    assert (plan.scratch_page, plan.scratch_slot) == (pages, 3)  # allocated past the others
    assert plan.bytes_by_handler == {
        "kv_cache_0": (pages + 1) * 16 * 2 * 32 * F32,
        "kv_cache_1": (pages + 1) * 16 * 2 * 24 * 2,
        "ssm_0_state": 4 * 8 * 16 * 16 * F32,
        "conv_0_state": 4 * 192 * 3 * 2,
    }
    assert plan.bytes_by_kind["paged_kv"] == plan.bytes_by_handler["kv_cache_0"] + \
        plan.bytes_by_handler["kv_cache_1"]
    assert plan.total_bytes == sum(plan.bytes_by_handler.values())
    assert plan.budget_bytes == GIB


def test_plan_budget_limits_pages():
    hs = _handlers()
    slot_bytes = 5 * (8 * 16 * 16 * F32 + 192 * 3 * 2)  # 4 slots + the scratch
    page_bytes = hs[0].bytes_per_page(8) + hs[1].bytes_per_page(8)
    budget = slot_bytes + 51 * page_bytes + 17  # room for exactly 50 pages + the scratch
    plan = plan_cache(hs, 8, 4, 256, budget / GIB, CPU)
    assert plan.num_pages == 50
    assert plan.total_bytes <= plan.budget_bytes


@pytest.mark.parametrize("room_pages", (0, 31))
def test_budget_too_small_for_one_sequence(room_pages):
    hs = _handlers()
    slot_bytes = 4 * (8 * 16 * 16 * F32 + 192 * 3 * 2)
    page_bytes = hs[0].bytes_per_page(8) + hs[1].bytes_per_page(8)
    budget = slot_bytes + room_pages * page_bytes  # one 256-token sequence needs 32 pages
    with pytest.raises(ValueError, match="max_cache_gib"):
        plan_cache(hs, 8, 4, 256, budget / GIB, CPU)


def test_budget_too_small_for_states():
    with pytest.raises(ValueError, match="max_cache_gib"):
        plan_cache([State("s", (1024, 1024), torch.float32)], 16, 4, 64, 1e-3, CPU)


@pytest.mark.parametrize("bad", [dict(max_cache_gib=0.0), dict(max_cache_gib=-1.0)])
def test_bad_budget(bad):
    with pytest.raises(ValueError, match="max_cache_gib"):
        plan_cache(_handlers(), 16, 2, 64, device=CPU, **bad)


def test_bad_page_size():
    with pytest.raises(ValueError, match="page_size"):
        plan_cache(_handlers(), 0, 2, 64, 1.0, CPU)


def test_spec_state_counted_in_budget():
    steps = 4  # K + 1
    plain = _handlers()
    spec = _handlers(steps)
    per_slot = 8 * 16 * 16 * F32 + 192 * 3 * 2
    page_bytes = plain[0].bytes_per_page(8) + plain[1].bytes_per_page(8)
    budget = 5 * per_slot * (1 + steps) + 41 * page_bytes  # + the scratch slot and page
    a = plan_cache(plain, 8, 4, 256, budget / GIB, CPU)
    b = plan_cache(spec, 8, 4, 256, budget / GIB, CPU)
    assert b.bytes_by_kind["spec_state"] == 5 * steps * per_slot
    assert b.bytes_by_handler["ssm_0_spec_state"] == 5 * steps * 8 * 16 * 16 * F32
    assert b.num_pages == 40 and a.num_pages > b.num_pages  # spec states took pages' room
    assert b.total_bytes <= b.budget_bytes
    with pytest.raises(ValueError, match="max_cache_gib"):  # the states alone no longer fit
        plan_cache(spec, 8, 4, 256, (4 * per_slot * steps) / GIB, CPU)
    summary = b.summary()
    assert "spec_state" in summary and "ssm_0_spec_state" in summary


def test_summary_lists_handlers():
    hs = [PagedKV(f"kv_cache_{i}", 2, 16, 16, torch.float32) for i in range(30)]
    text = plan_cache(hs, 16, 2, 64, 1.0, CPU).summary()
    assert "paged_kv" in text and "30 × " in text and "kv_cache_0 … kv_cache_29" in text


# ---- the plan of real deployments --------------------------------------------------------------


def test_deployed_plan_bytes_from_config(tiny_dir):
    """nemotron_h "M*M-E*ME": 2 attention layers (Hkv 2, D 16), 3 Mamba layers (SSM state
    [8, 16, 16] fp32, conv window [8·16 + 2·2·16, 3]); the allocated buffers match the plan,
    prefix-cache checkpoints (one per page, the budget allows it) included."""
    from specdeploy.deploy.build import build

    dep = build(tiny_dir("nemotron_h"), dtype="float32", max_batch_size=3,
                         max_seq_len=40, page_size=5, max_cache_gib=0.01, checkpoint_every=1)
    plan = dep.plan
    pages = 3 * 8 + 1
    assert (plan.num_pages, plan.num_slots) == (pages, 3)
    want = {}  # pages and slots: + the scratch one of each
    for i in range(2):
        want[f"kv_cache_{i}"] = (pages + 1) * 5 * 2 * (16 + 16) * F32
    for i in range(3):
        want[f"ssm_{i}_state"] = 4 * 8 * 16 * 16 * F32
        want[f"conv_{i}_state"] = 4 * 192 * 3 * F32
        want[f"ssm_{i}_ckpt"] = pages * 8 * 16 * 16 * F32
        want[f"conv_{i}_ckpt"] = pages * 192 * 3 * F32
    assert plan.num_checkpoints == pages
    assert plan.bytes_by_handler == want
    assert dep.layout.bytes_by_handler == want
    allocated = {name: t.nbytes for name, t in dep.gm.named_buffers()}
    for name, b in want.items():
        got = allocated[name] if name in allocated else (
            allocated[f"{name}_k"] + allocated[f"{name}_v"])
        assert got == b, name


def test_spec_deployment_plan_has_spec_state(tiny_dir, tmp_path):
    """MTP on qwen3_5_moe with K = 2: every GDN / conv state gets a [K+1]-deep spec state, the
    drafter gets its own paged KV; all of it in one plan."""
    from specdeploy.config import SpecConfig
    from specdeploy.deploy.build import build
    from specdeploy.models.registry import family_module

    path = family_module("qwen3_5_moe").make_tiny(tmp_path / "q", seed=0, mtp_layers=1)
    dep = build(path, dtype="float32", max_batch_size=2, max_seq_len=32, page_size=8,
                         max_cache_gib=0.01, spec=SpecConfig("mtp", num_draft_tokens=2))
    plan = dep.target.plan
    gdn, conv = 3 * 4 * 16 * 16 * F32, 3 * 128 * 3 * F32  # 2 slots + the scratch
    for i in range(3):
        assert plan.bytes_by_handler[f"gdn_{i}_state"] == gdn
        assert plan.bytes_by_handler[f"gdn_{i}_spec_state"] == 3 * gdn
        assert plan.bytes_by_handler[f"conv_{i}_spec_state"] == 3 * conv
    assert plan.bytes_by_kind["spec_state"] == 3 * 3 * (gdn + conv)
    assert any(n.startswith("draft_kv_cache") for n in plan.bytes_by_handler)
    assert plan.total_bytes <= plan.budget_bytes


@pytest.mark.parametrize("page_size, every", [(16, 4), (64, 1), (48, 4), (128, 1)])
def test_checkpoints_default_to_whole_scan_chunks(page_size, every):
    """checkpoint_every=None: every page when pages are whole chunks of every scan (64 and 32
    tokens here); an unaligned page size falls back to the fewest pages spanning whole chunks,
    so boundary states still come free with the scans."""
    from specdeploy.cache.handlers import Checkpoint

    f32 = torch.float32
    handlers = [State("s", (4, 4), f32), Checkpoint("c", (4, 4), f32, "s", 64),
                Checkpoint("d", (4, 4), f32, "s", 32), Checkpoint("e", (2,), f32, "s")]
    plan = plan_cache(handlers, page_size, 2, 256, 0.01, torch.device("cpu"))
    assert plan.checkpoint_every == every
    assert ("scan-chunk boundary" if every == 1 else "not a multiple") in plan.checkpoint_why
    assert plan.num_checkpoints == 0  # no KV pages to checkpoint
    explicit = plan_cache(handlers, page_size, 2, 256, 0.01, torch.device("cpu"),
                          checkpoint_every=1)
    assert explicit.checkpoint_every == 1


def test_default_page_size_is_the_scan_chunk_for_hybrids():
    """16 tokens without recurrent states (and with chunk-free ones: conv); with scans, the
    smallest multiple of every chunk that is >= 16."""
    from specdeploy.cache.plan import default_page_size

    f32 = torch.float32
    kv = PagedKV("kv", 2, 16, 16, f32)
    assert default_page_size([kv]) == 16
    assert default_page_size([kv, State("conv", (8, 3), f32)]) == 16
    assert default_page_size([kv, State("ssm", (4, 4), f32, 64)]) == 64
    assert default_page_size([State("a", (4,), f32, 64), State("b", (4,), f32, 128)]) == 128
    assert default_page_size([State("a", (4,), f32, 8)]) == 16


def test_checkpoints_space_out_when_the_budget_is_short():
    """Every page wanted; a budget left for about a third of the pages' checkpoints spaces
    them every 3 pages (covering every cached prefix) and says so in the summary."""
    from specdeploy.cache.handlers import Checkpoint

    f32 = torch.float32
    kv, ck = PagedKV("kv", 1, 64, 64, f32), Checkpoint("c", (64, 64), f32, "s", 16)
    page, ckpt = kv.bytes_per_page(16), ck.bytes_per_slot()  # 8 KiB, 16 KiB
    # 2 sequences of 160 tokens: 21 pages (+ the scratch); room for 7 checkpoints after them
    budget = (22 * page + 7 * ckpt + 100) / 2**30
    plan = plan_cache([kv, ck], 16, 2, 160, budget, torch.device("cpu"))
    assert (plan.num_pages, plan.checkpoint_every, plan.num_checkpoints) == (21, 3, 7)
    assert "spaced out" in plan.checkpoint_why and "one every 3 page(s)" in plan.summary()
    roomy = plan_cache([kv, ck], 16, 2, 160, 1.0, torch.device("cpu"))
    assert (roomy.checkpoint_every, roomy.num_checkpoints) == (1, 21)
    assert "prefix-cache checkpoints: 21 slots (0.328 MiB), one every 1 page(s)" in \
        roomy.summary()
