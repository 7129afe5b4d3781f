"""`kv_cache_dtype="fp8"` (vLLM's `--kv-cache-dtype fp8`): a float8_e4m3fn paged KV cache at
scale 1.0 for any checkpoint, on the CPU's C attention (tests/ops/test_fp8_kv_rows.py: the
kernel's bits). Oracles: the same deployment's torch attention path over the same FP8 cache
(`.float()` of what it holds), the fp32-cache deployment (the rounding's size), greedy plain
decoding for greedy speculative decoding."""
from __future__ import annotations

import re

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.cache.handlers import PagedKV
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.cli import main
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.ops import attention_rows as ar

LIMITS = dict(max_batch_size=3, max_seq_len=96, page_size=4, max_cache_gib=0.01,
              dtype="float32")


def _steps():
    """Prefill chunks of 13 and 6 rows, then decode and 3-row verify-like extend steps."""
    pages = {0: list(range(0, 12)), 1: list(range(12, 24))}
    a, b = list(range(5, 18)), list(range(30, 36))
    yield [Segment(a, 0, pages[0], 0, num_logits=len(a)), Segment(b, 0, pages[1], 1,
                                                                   num_logits=len(b))]
    lens = {0: len(a), 1: len(b)}
    for step in range(3):
        yield [Segment([40 + step + s], lens[s] + step, pages[s], s) for s in range(2)]
    yield [Segment([50, 51, 52], lens[0] + 3, pages[0], 0, num_logits=3),
           Segment([53], lens[1] + 3, pages[1], 1)]


def _logits(dep):
    return [dep.forward(build_metadata(segs)).logits.clone() for segs in _steps()]


@pytest.mark.parametrize("name,alias,dtype,bound", [
    ("fp8", "fp8_e4m3", torch.float8_e4m3fn, 0.15), ("fp8_e5m2", "fp8_e5m2", torch.float8_e5m2,
                                                      0.3)], ids=["e4m3", "e5m2"])
def test_fp8_cache_is_one_byte_a_value_and_reads_what_it_holds(tiny_dir, monkeypatch, name,
                                                                alias, dtype, bound):
    """The caches are float8, a quarter of the fp32 cache's bytes a page; the logits of the C
    kernel's path = the torch attention path's over the same FP8 cache (1e-4 of the largest
    logit: sums in other orders), and differ from the fp32 cache's by the storage rounding
    only (E4M3 keeps 4 significant bits, each value within 2^-4 of itself, E5M2 3 bits, 2^-3:
    within 15% / 30% of the largest logit here (E4M3 measured 5.1% on this random model), and
    not equal: the cast happened)."""
    if ar.unavailable() is not None:
        pytest.skip(f"attention kernel unavailable: {ar.unavailable()}")
    path = str(tiny_dir("llama"))
    fp8 = build(path, kv_cache_dtype=name, **LIMITS)
    full = build(path, kv_cache_dtype="float32", **LIMITS)
    kv8 = [h for h in fp8.resources if isinstance(h, PagedKV)]
    kv32 = [h for h in full.resources if isinstance(h, PagedKV)]
    assert kv8 and {h.dtype for h in kv8} == {dtype}
    assert [4 * h.bytes_per_page(4) for h in kv8] == [h.bytes_per_page(4) for h in kv32]
    assert {b.dtype for n, b in fp8.gm.named_buffers() if "kv_cache" in n} == {dtype}
    got, ref32 = _logits(fp8), _logits(full)
    calls = []
    real = ar.attention_rows
    monkeypatch.setattr(ar, "attention_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ar, "fits", lambda *a: False)  # the torch paths
    torch_path = _logits(build(path, kv_cache_dtype=alias, **LIMITS))
    assert not calls
    for g, t, f in zip(got, torch_path, ref32):
        scale = f.abs().max()
        assert (g - t).abs().max() <= 1e-4 * scale
        assert 0 < (g - f).abs().max() <= bound * scale


def test_greedy_speculation_on_fp8_equals_plain(tiny_dir):
    """n-gram drafts verified on an FP8 cache: the tokens of plain greedy decoding on it."""
    path = str(tiny_dir("llama"))
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [3, 4, 5, 6, 3, 4, 5, 6, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    limits = dict(LIMITS, max_seq_len=64)
    plain = LLM(path, kv_cache_dtype="fp8", **limits).generate(prompts, params)
    spec = LLM(path, kv_cache_dtype="fp8", spec=SpecConfig("ngram", num_draft_tokens=3),
               **limits)
    drafted = spec.generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert spec.stats()["num_draft_tokens"] > 0


def test_unknown_kv_dtype_is_refused_by_name(tiny_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype: one of .*fp8_e5m2.*'fp8_e8m0'"):
        build(str(tiny_dir("llama")), kv_cache_dtype="fp8_e8m0", **LIMITS)


def test_cli_flag_reaches_the_plan(tiny_dir, capsys):
    """`--kv-cache-dtype fp8` on `deploy`: a budget that limits the fp32 plan holds ~4x its
    pages as FP8; generate / bench / serve parse the flag."""
    def kv_mib(flag):
        rc = main(["deploy", "--model", str(tiny_dir("llama")), "--list-transforms",
                   "--max-seq-len", "64", "--max-cache-gib", "0.0001", "--dtype", "float32",
                   "--kv-cache-dtype", flag])
        out = capsys.readouterr().out
        assert rc == 0
        return out[out.index("cache plan:"):]

    fp8, fp32 = kv_mib("fp8"), kv_mib("float32")
    pages = [int(re.search(r"num_pages=(\d+)", p).group(1)) for p in (fp8, fp32)]
    # one small budget: ~4x the pages fit (a page costs a quarter; measured 51 vs 12)
    assert pages[0] >= 3.5 * pages[1] > 0
    from specdeploy.cli import build_parser
    from specdeploy.serving.cli import add_parser

    ap = build_parser()
    for cmd in (["generate", "--prompt", "x"], ["bench"], ["deploy"]):
        assert ap.parse_args(cmd + ["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    import argparse

    p = add_parser(argparse.ArgumentParser().add_subparsers())
    assert p.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
