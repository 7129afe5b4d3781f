"""ggml_linears with kernels="fast": a GGUF checkpoint's block linears on the integer-dot kernels.

Oracles: the plain model loaded from the same file (fp32 weights from gguf's dequantization),
the same deployment's own 1-row steps (a K + 1-row verify step must give them bit for bit), and
greedy plain decoding for greedy speculative decoding with every drafter (n-gram lookup, EAGLE-3,
an MTP head) on the fast kernels.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.deploy.deferred import fill_from_blocks
from specdeploy.deploy.passes import ggml_weights
from specdeploy.loading import load_model
from specdeploy.models import llama
from specdeploy.ops import ggml_int, ggml_tiled
from specdeploy.ops.ggml_linear import kernel_unavailable
from tests.checkpoint.test_gguf import Q, _tiny_llama_gguf

pytestmark = pytest.mark.skipif(
    kernel_unavailable() is not None or ggml_int.kernel_unavailable() is not None,
    reason=f"ggml kernels unavailable: {kernel_unavailable() or ggml_int.kernel_unavailable()}")
LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)


@pytest.fixture(scope="module", params=[("q4_1", False), ("q8_0", True), ("q4_0", False)],
                ids=["q4_1-untied", "q8_0-tied", "q4_0-untied"])
def tiny_gguf(request, tmp_path_factory):
    kind, tie = request.param
    d = tmp_path_factory.mktemp(f"ggml_fast_{kind}")
    src = llama.make_tiny(d / "st", seed=7, config_overrides={"tie_word_embeddings": tie})
    qtype = {"q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[kind]
    return src, _tiny_llama_gguf(src, d / "tiny.gguf", qtype)


def _logits(dep, ids, steps):
    pages, pos, out = list(range(16)), 0, []
    for n, kind in steps:
        seg = Segment(ids[pos:pos + n], pos, pages, 0, n, kind)
        out.append(dep.forward(build_metadata([seg])).logits)
        pos += n
    return torch.cat(out)


def test_fast_rows_are_batch_invariant_and_near_the_fp32_model(tiny_gguf):
    """Decode rows one at a time, then the same positions as one 4-row and one 16-row verify
    step: bit-identical logits. Against the fp32 model the logits move by the activation
    rounding only (tests/ops/test_ggml_int.py bounds it per linear; here: within 5% of the
    logits' range, a check that the wiring is right, not a kernel bound)."""
    _, path = tiny_gguf
    dep = build(str(path), kernels="fast", **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_linears"]
    assert f"integer-dot kernel, {ggml_int.default_isa()}" in info.detail
    assert "tiled: 15 of 15 linears" in info.detail  # every kernel call has N % 16 == 0
    ids = torch.randint(3, 128, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = (21, SEG_NORMAL)
    one_by_one = _logits(dep, ids, [prefill] + [(1, SEG_NORMAL)] * 20)
    verify = _logits(dep, ids, [prefill, (4, SEG_EXTEND), (16, SEG_EXTEND)])
    assert torch.equal(one_by_one[21:], verify[21:])
    with torch.no_grad():
        want = load_model(path)(torch.tensor([ids[:41]]))[0]
    span = (want.max() - want.min()).item()
    assert (one_by_one - want).abs().max().item() < 0.05 * span
    exact = _logits(build(str(path), **LIMITS), ids, [prefill] + [(1, SEG_NORMAL)] * 20)
    assert not torch.equal(exact[21:], one_by_one[21:])  # "fast" did change the kernel


def test_fast_prefill_is_the_same_bits_however_it_is_chunked(tiny_gguf):
    """A prompt prefilled whole, in 13-token chunks, and in chunks of 1 (decode rows) gives the
    same last-row logits bit for bit: every attention row is computed on its own
    (cached_attention `_rows`), so the scheduler's cut cannot move a greedy token. Before, one
    SDPA per chunk summed in another order per cut and the 8-bit activation rounding of the
    fast kernels turned that into other tokens at batch 16."""
    _, path = tiny_gguf
    dep = build(str(path), kernels="fast", **LIMITS)
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    cuts = {"whole": [40], "13": [13, 13, 13, 1], "ones": [1] * 40}
    last = {}
    for name, sizes in cuts.items():
        last[name] = _logits(dep, ids, [(n, SEG_NORMAL) for n in sizes])[-1]
    assert torch.equal(last["whole"], last["13"]) and torch.equal(last["whole"], last["ones"])


def test_kernels_option_is_checked_and_falls_back_with_a_warning(tiny_gguf, monkeypatch, caplog):
    _, path = tiny_gguf
    with pytest.raises(ValueError, match="kernels: one of exact, fast, got 'int4'"):
        build(str(path), kernels="int4", **LIMITS)
    monkeypatch.setattr(ggml_int, "default_isa", lambda: "scalar")  # as on a CPU without AVX2
    monkeypatch.delenv("SPECDEPLOY_GGML_ISA", raising=False)
    with caplog.at_level("WARNING", logger="specdeploy"):  # one log line (ops.warn_unbuilt)
        dep = build(str(path), kernels="fast", **LIMITS)
    lines = [r.getMessage() for r in caplog.records if "no SIMD integer path" in r.getMessage()]
    assert len(lines) == 1, lines
    info = {i.name: i for i in dep.infos}["ggml_linears"]
    assert "exact fp32 kernel; fast unavailable" in info.detail
    assert ggml_weights.KERNELS == ("exact", "fast")


def _mtp_head_dir(path, out):
    from specdeploy.models.drafters.mtp_head import make_mtp_head, save_mtp_head

    torch.manual_seed(3)
    head = make_mtp_head(load_model(path))
    save_mtp_head(head, out)
    return str(out)


@pytest.mark.parametrize("method", ["ngram", "eagle3", "mtp"])
def test_greedy_speculative_equals_plain_on_fast_kernels(tiny_gguf, method, tmp_path,
                                                         monkeypatch):
    """Verify steps of up to K + 1 = 5 rows per sequence, two sequences at once, on the fast
    kernels give the tokens of plain decoding on the same kernels."""
    from specdeploy import LLM, SamplingParams
    from specdeploy import tokenizer as tok_mod
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    src, path = tiny_gguf
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))  # tiny GGUF: no vocab
    if method == "ngram":
        # controller="off": drafts are counted below, and the measured controller may cut
        # every lookup on a slow machine
        spec = SpecConfig("ngram", 4, prompt_lookup_num_tokens=6, controller="off")
    elif method == "eagle3":
        spec = SpecConfig("eagle3", 4, draft_model=str(make_tiny_eagle3(src, tmp_path / "e3")))
    else:
        spec = SpecConfig("mtp", 4, draft_model=_mtp_head_dir(path, tmp_path / "mtp"))
    prompts = [[5, 6, 7, 8] * 6, [9, 4] * 3 + [9], list(range(10, 30))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLM(str(path), kernels="fast", **LIMITS)
    fast = LLM(str(path), kernels="fast", spec=spec, **LIMITS)
    info = {i.name: i for i in fast.deployed.target.infos}["ggml_linears"]
    assert "integer-dot" in info.detail and info.num_matches > 0
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in fast.generate(prompts, params)] == want
    stats = fast.stats()
    assert stats.get("draft_tokens", 0) + stats.get("lookup_steps", 0) > 0


def test_tiled_copy_replaces_the_blocks_and_others_keep_the_gguf_order_kernel(tmp_path):
    """A tied Q8_0 head of 136 outputs (not a multiple of 16) keeps ggml_int on its blocks and
    the embedding gathers from them; the other calls run tiled. Either way one copy: the fast
    deployment holds the exact one's bytes, and the named map gives every weight's values."""
    src = llama.make_tiny(tmp_path / "st", seed=2,
                          config_overrides={"tie_word_embeddings": True, "vocab_size": 136})
    path = _tiny_llama_gguf(src, tmp_path / "tiny.gguf", Q.Q8_0)
    fast, exact = (build(str(path), kernels=k, **LIMITS) for k in ("fast", "exact"))
    info = {i.name: i for i in fast.infos}["ggml_linears"]
    assert "tiled: 14 of 15 linears" in info.detail and "1 embeddings" in info.detail
    assert fast.weight_bytes() == exact.weight_bytes()
    model = load_model(path, defer_blocks=True)
    want = {n: p.detach().clone() for n, p in load_model(path).named_parameters()}
    build(str(path), kernels="fast", model=model, **LIMITS)
    named = model.ggml_weights
    assert sum(isinstance(w, ggml_tiled.TiledMember) for w in named.values()) == 14
    for name, w in named.items():
        out = torch.empty(w.shape)
        fill_from_blocks(w, out)
        assert torch.equal(out, want[name]), name
    ids = torch.randint(3, 136, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [(8, SEG_NORMAL), (1, SEG_NORMAL), (3, SEG_EXTEND)]
    one = _logits(fast, ids, [(8, SEG_NORMAL)] + [(1, SEG_NORMAL)] * 4)
    assert torch.equal(one, _logits(fast, ids, steps))


def test_draft_quantize_auto_is_q8_0_on_the_fast_cpu_path(tiny_gguf, tmp_path, monkeypatch):
    """SpecConfig's default draft_quantize="auto": Q8_0 drafter linears where the fast kernels
    run the GGUF target on the CPU (oracle: each weight is its own Q8_0 dequantization, which
    random fp32 weights are not), the target's precision with kernels="exact" or when given
    None, and lossless on both."""
    from specdeploy import LLM, SamplingParams
    from specdeploy import tokenizer as tok_mod
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3
    from specdeploy.ops.ggml_linear import dequantize, quantize_q8_0

    src, path = tiny_gguf
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))  # tiny GGUF: no vocab
    head = str(make_tiny_eagle3(src, tmp_path / "e3"))
    assert SpecConfig("eagle3").draft_quantize == "auto"
    prompts = [[5, 6, 7, 8] * 6, list(range(10, 30))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def q8_exact(llm) -> bool:
        ws = [m.weight for m in llm.deployed.drafter.modules()
              if isinstance(m, torch.nn.Linear) and m.weight.shape[1] % 32 == 0]
        assert ws
        return all(torch.equal(dequantize(quantize_q8_0(w)), w) for w in ws)

    for kernels, quant, want_q in (("fast", "auto", "q8_0"), ("exact", "auto", None),
                                   ("fast", None, None)):
        spec = SpecConfig("eagle3", 2, draft_model=head, draft_quantize=quant, controller="off")
        llm = LLM(str(path), kernels=kernels, spec=spec, **LIMITS)
        assert llm.deployed.spec.draft_quantize == want_q, (kernels, quant)
        assert q8_exact(llm) == (want_q == "q8_0"), (kernels, quant)
        plain = LLM(str(path), kernels=kernels, **LIMITS)
        want = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.stats()["draft_steps"] > 0
