"""fuse_decoder_layers: one C call per Llama-type layer on the tiled GGUF kernels, giving the
unfused chain's bits (oracle: the same deployment built without the pass; greedy plain decoding
for greedy speculative decoding)."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.deploy.passes import fuse_layers
from specdeploy.models import llama
from specdeploy.ops import layer_rows
from specdeploy.ops.fused_rows import _add_rms_norm_kernel, _silu_mul_kernel
from specdeploy.ops.qkv_attention import _qkv_attention_kernel
from tests.checkpoint.test_gguf import Q, _tiny_llama_gguf

pytestmark = pytest.mark.skipif(layer_rows.unavailable() is not None,
                                reason=f"fused layer unavailable: {layer_rows.unavailable()}")
LIMITS = dict(max_batch_size=3, max_seq_len=64, page_size=4, max_cache_gib=0.01, kernels="fast")
OFF = frozenset({"fuse_decoder_layers"})


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuse_layer")
    # NOTE: 4 layers, so that consecutive layers hand results over in reused buffers
    src = llama.make_tiny(d / "st", seed=11, config_overrides={"num_hidden_layers": 4})
    return src, _tiny_llama_gguf(src, d / "tiny.gguf", Q.Q4_1)


def _fused(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "__name__", "") == "decoder_layer"]


def _steps():
    """A prefill of 21 rows beside one of 7, one of 3, three decode steps of 3 sequences, then a
    verify step of 1 + 3 rows beside a decode and a 2-row extend (a mixed batch)."""
    a, b, c = list(range(5, 26)), list(range(30, 37)), list(range(40, 43))
    pages = {0: list(range(0, 8)), 1: list(range(8, 16)), 2: list(range(16, 24))}
    yield [Segment(a, 0, pages[0], 0, num_logits=len(a)), Segment(b, 0, pages[1], 1)]
    yield [Segment(c, 0, pages[2], 2, num_logits=3)]
    lens = {0: len(a), 1: len(b), 2: len(c)}
    for step in range(3):
        yield [Segment([50 + step + s], lens[s] + step, pages[s], s) for s in range(3)]
    for s in range(3):
        lens[s] += 3
    yield [Segment([60, 61, 62, 63], lens[0], pages[0], 0, num_logits=4, kind=SEG_EXTEND),
           Segment([64], lens[1], pages[1], 1),
           Segment([65, 66], lens[2], pages[2], 2, num_logits=2, kind=SEG_EXTEND)]


def _caches(dep):
    return {n: b for n, b in dep.gm.named_buffers() if "kv_cache" in n}


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8", "fp8_e5m2"])
def test_fused_graph_gives_the_unfused_bits(tiny_gguf, kv_dtype, monkeypatch):
    """Prefill, decode, verify and mixed steps: logits and every KV cache bit-equal to the graph
    built without the pass, with the C path taking every step (the chain is never run)."""
    _, path = tiny_gguf
    fused = build(str(path), kv_cache_dtype=kv_dtype, **LIMITS)
    base = build(str(path), kv_cache_dtype=kv_dtype, disabled=OFF, **LIMITS)
    assert not _fused(base.gm)

    def no_chain(*a):
        raise AssertionError("the fused layer ran its fallback chain")

    monkeypatch.setattr(layer_rows, "run_chain", no_chain)
    for segs in _steps():
        meta = build_metadata(segs)
        got, want = fused.forward(meta).logits, base.forward(meta).logits
        assert torch.equal(got, want), (segs, (got - want).abs().max())
    want_kv = _caches(base)
    for name, kv in _caches(fused).items():
        want = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(
            kv_dtype) or getattr(torch, kv_dtype)
        # (bytes: torch.equal has no float8 kernel)
        assert kv.dtype == want and torch.equal(kv.view(torch.uint8),
                                                want_kv[name].view(torch.uint8)), name


def test_fallback_runs_the_chain_and_gives_its_bits(tiny_gguf, monkeypatch):
    """Where the C path does not take a step (here: a step check refused by hand, as for a
    sliding window or metadata the attention kernel rejects), the fused op runs the chain's own
    callables, in order: the same logits."""
    _, path = tiny_gguf
    fused = build(str(path), **LIMITS)
    base = build(str(path), disabled=OFF, **LIMITS)
    monkeypatch.setattr(layer_rows.Shared, "_check", lambda self, *a: 0)
    ran = []
    real = layer_rows.run_chain
    monkeypatch.setattr(layer_rows, "run_chain", lambda *a: ran.append(1) or real(*a))
    for segs in _steps():
        meta = build_metadata(segs)
        assert torch.equal(fused.forward(meta).logits, base.forward(meta).logits)
    assert len(ran) == 6 * 4  # six steps, four layers


def test_the_pass_fuses_every_layer_and_leaves_no_chain(tiny_gguf):
    _, path = tiny_gguf
    dep = build(str(path), **LIMITS)
    info = {i.name: i for i in dep.infos}["fuse_decoder_layers"]
    layers = dep.hf_config["num_hidden_layers"]
    assert info.num_matches == layers == len(_fused(dep.gm)) == 4
    chain = (_qkv_attention_kernel, _add_rms_norm_kernel, _silu_mul_kernel)
    left = [n for n in dep.gm.graph.nodes if n.op == "call_function" and n.target in chain]
    assert not left, left
    tiled = [n for n in dep.gm.graph.nodes if n.op == "call_function"
             and hasattr(n.target, "tiled_call")]
    assert len(tiled) == 1  # the LM head; every layer's four linears are inside the fused op
    assert not [m for m in map(fuse_layers._match, dep.gm.graph.nodes) if m is not None]


def test_the_kv_cache_a_fused_layer_holds_is_not_counted_as_weights(tiny_gguf):
    """After its first call a fused layer keeps its KV cache (its closure's `seen`): the
    deployment's weight bytes are those before any step (the cache is the plan's)."""
    _, path = tiny_gguf
    dep = build(str(path), **LIMITS)
    before = dep.weight_bytes()
    for segs in _steps():
        dep.forward(build_metadata(segs))
    cache = sum(b.untyped_storage().nbytes() for b in _caches(dep).values())
    assert cache > 0 and dep.weight_bytes() == before


def _parities(gm):
    return [n.target.out_parity for n in _fused(gm)]


def test_results_reuse_a_buffer_only_where_the_next_layer_alone_reads_them(tiny_gguf, tmp_path):
    """Layer i's results are read by layer i + 1 only: held pair i % 2; the last layer's feed
    the LM head: fresh. An EAGLE-3 target's captured residuals are fresh too."""
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    src, path = tiny_gguf
    dep = build(str(path), **LIMITS)
    assert _parities(dep.gm) == [0, 1, 0, None]
    assert "3 writing reused buffers" in {i.name: i for i in dep.infos}[
        "fuse_decoder_layers"].detail
    spec = SpecConfig("eagle3", 2, draft_model=str(make_tiny_eagle3(src, tmp_path / "e3")),
                      capture_layers=(0, 2))
    target = build(str(path), spec=spec, **LIMITS).target
    assert {i.name: i for i in target.infos}["capture_hidden_states"].num_matches == 2
    assert _parities(target.gm) == [None, 1, None, None]


def test_switched_off_the_pass_says_why(tiny_gguf, monkeypatch):
    _, path = tiny_gguf
    monkeypatch.setenv("SPECDEPLOY_LAYER_KERNEL", "0")
    layer_rows._library.cache_clear()
    try:
        dep = build(str(path), **LIMITS)
    finally:
        layer_rows._library.cache_clear()
    info = {i.name: i for i in dep.infos}["fuse_decoder_layers"]
    assert info.skipped and "SPECDEPLOY_LAYER_KERNEL=0" in info.detail and not _fused(dep.gm)


def test_exact_kernels_keep_their_chain(tiny_gguf):
    _, path = tiny_gguf
    dep = build(str(path), **{**LIMITS, "kernels": "exact"})
    info = {i.name: i for i in dep.infos}["fuse_decoder_layers"]
    assert info.num_matches == 0 and not info.skipped and not _fused(dep.gm)
    assert "no layer on tiled linears" in info.detail


def test_greedy_speculative_equals_plain_with_the_fused_layer(tiny_gguf, monkeypatch):
    """n-gram lookup drafts of up to K = 4 (verify steps of up to 5 rows per sequence, three
    sequences at once) give the tokens of plain decoding, both deployments fused."""
    from specdeploy import LLM, SamplingParams
    from specdeploy import tokenizer as tok_mod

    src, path = tiny_gguf
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))  # tiny GGUF: no vocab
    limits = {k: v for k, v in LIMITS.items() if k != "page_size"}
    spec = SpecConfig("ngram", 4, prompt_lookup_num_tokens=6, controller="off")
    plain = LLM(str(path), **limits)
    fast = LLM(str(path), spec=spec, **limits)
    for llm in (plain, fast):
        target = getattr(llm.deployed, "target", llm.deployed)
        assert len(_fused(target.gm)) == 4
    prompts = [[5, 6, 7, 8] * 6, [9, 4] * 3 + [9], list(range(10, 30))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in fast.generate(prompts, params)] == want
    assert fast.stats().get("lookup_steps", 0) > 0


def _set_windows(gm, name: str, index: int, windows: list[int]):
    """The sliding window argument of each layer's attention node, in layer order."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "") == name]
    assert len(nodes) == len(windows)
    for n, w in zip(nodes, windows):
        assert n.args[index] == 0
        n.args = n.args[:index] + (w,) + n.args[index + 1:]
    gm.recompile()


def test_windowed_layers_take_the_fused_path_with_the_unfused_bits(tiny_gguf, monkeypatch):
    """Sliding windows of 5 on layers 0 and 2 (the GGUF has none: set on the graphs' attention
    nodes): the fused layers take the C path on every step (no chain) and give the unfused
    graph's logits bit for bit; a guard: the windows change the logits."""
    _, path = tiny_gguf
    fused = build(str(path), **LIMITS)
    base = build(str(path), disabled=OFF, **LIMITS)
    plain = build(str(path), disabled=OFF, **LIMITS)
    windows = [5, 0, 5, 0]
    _set_windows(fused.gm, "decoder_layer", 12, windows)
    _set_windows(base.gm, "_qkv_attention_kernel", 11, windows)

    def no_chain(*a):
        raise AssertionError("the fused layer ran its fallback chain")

    monkeypatch.setattr(layer_rows, "run_chain", no_chain)
    moved = 0.0
    for segs in _steps():
        meta = build_metadata(segs)
        got, want = fused.forward(meta).logits, base.forward(meta).logits
        assert torch.equal(got, want), (segs, (got - want).abs().max())
        moved = max(moved, (plain.forward(meta).logits - want).abs().max().item())
    assert moved > 1e-3
