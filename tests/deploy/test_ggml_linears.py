"""ggml_linears: a GGUF checkpoint's Q4_0 / Q4_1 / Q8_0 linears run on their blocks in the deployed
graph.

Oracles: the plain model loaded from the same file (fp32 weights from gguf's dequantization,
F.linear), transformers' logits for the default model (the golden file of
tests/checkpoint/test_gguf.py), and the non-speculative path for greedy speculative decoding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.deploy.passes.ggml_linears import MAX_ROWS
from specdeploy.loading import load_model
from specdeploy.models import llama
from specdeploy.ops.ggml_linear import kernel_unavailable
from tests.checkpoint.test_gguf import GOLDEN, Q, _tiny_llama_gguf
from tests.deploy.conftest import assert_close

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"ggml kernel unavailable: {kernel_unavailable()}")
LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module", params=[("q4_1", False), ("q8_0", True), ("q4_0", False)],
                ids=["q4_1-untied", "q8_0-tied", "q4_0-untied"])
def tiny_gguf(request, tmp_path_factory):
    kind, tie = request.param
    d = tmp_path_factory.mktemp(f"ggml_{kind}")
    src = llama.make_tiny(d / "st", seed=7, config_overrides={"tie_word_embeddings": tie})
    qtype = {"q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[kind]
    return src, _tiny_llama_gguf(src, d / "tiny.gguf", qtype)


def _linears(dep):
    return [n for n in dep.gm.graph.nodes if n.target is torch.ops.aten.linear.default]


def test_every_linear_runs_on_blocks(tiny_gguf):
    _, path = tiny_gguf
    dep = build(str(path), **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_linears"]
    layers = llama.tiny_hf_config()["num_hidden_layers"]
    assert info.num_matches == layers * LINEARS_PER_LAYER + 1, info  # + the LM head
    assert _linears(dep) == []
    # one kernel call per input: fused q/k/v, o, fused gate/up, down
    calls = [n for n in dep.gm.graph.nodes if getattr(n.target, "__name__", "") ==
             "linear_on_blocks"]
    assert len(calls) == layers * 4 + 1


def test_deployed_logits_match_the_plain_model(tiny_gguf):
    """Prefill (> MAX_ROWS rows: the fp32 path), then 1-row decode and 4- and 16-row verify
    steps (the blocks), against the plain model's full-sequence logits at the same positions."""
    _, path = tiny_gguf
    dep = build(str(path), **LIMITS)
    model = load_model(path)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)[0]
    pages, pos = list(range(16)), 0
    steps = ((21, SEG_NORMAL), (1, SEG_NORMAL), (4, SEG_EXTEND), (MAX_ROWS, SEG_EXTEND),
             (1, SEG_NORMAL))
    for n, kind in steps:
        seg = Segment(ids[0, pos:pos + n].tolist(), pos, pages, 0, n, kind)
        got = dep.forward(build_metadata([seg])).logits
        assert_close(got, want[pos:pos + n], rtol=1e-5)  # fp32, other summation order
        pos += n


def test_matches_the_fp32_deployment_and_counts_blocks(tiny_gguf):
    _, path = tiny_gguf
    on = build(str(path), **LIMITS)
    off = build(str(path), disabled=frozenset({"ggml_linears"}), **LIMITS)
    info = {i.name: i for i in off.infos}["ggml_linears"]
    assert info.skipped and info.detail == "disabled"
    for n in (1, 5, 30):
        meta = build_metadata([Segment(list(range(5, 5 + n)), 0, list(range(16)), 0, n)])
        assert_close(on.forward(meta).logits, off.forward(meta).logits, rtol=1e-5)


def test_safetensors_and_bf16_loads_have_no_blocks(tiny_gguf, tmp_path):
    src, path = tiny_gguf
    info = {i.name: i for i in build(str(src), **LIMITS).infos}["ggml_linears"]
    assert info.skipped and "no GGUF" in info.detail
    info = {i.name: i for i in build(str(path), dtype="bfloat16", **LIMITS).infos}
    assert info["ggml_linears"].skipped
    assert load_model(path, dtype="bfloat16").ggml_weights == {}


def test_int8_quantized_linears_are_left_to_int8(tiny_gguf):
    """A weight another transform replaced has no blocks any more: only the LM head (kept fp by
    the default exclusions) still matches."""
    _, path = tiny_gguf
    dep = build(str(path), quantize="int8", **LIMITS)
    assert {i.name: i for i in dep.infos}["ggml_linears"].num_matches == 1


def test_greedy_speculative_equals_non_speculative(tiny_gguf, monkeypatch):
    """ngram drafts verified on the blocks (up to 7 rows a step) give the tokens of plain
    decoding on the blocks."""
    from specdeploy import LLM, SamplingParams
    from specdeploy import tokenizer as tok_mod

    src, path = tiny_gguf
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))  # tiny GGUF: no vocab
    prompts = [[5, 6, 7, 8] * 6, [9, 4] * 3 + [9], list(range(10, 30))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(str(path), **LIMITS)
    spec = LLM(str(path), spec=SpecConfig("ngram", 3, prompt_lookup_num_tokens=6,
                                          controller="off"), **LIMITS)  # counted: fixed K
    for llm in (plain, spec):
        target = getattr(llm.deployed, "target", llm.deployed)
        assert {i.name: i for i in target.infos}["ggml_linears"].num_matches > 0
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.stats()["lookup_steps"] > 0


@pytest.mark.skipif(not GOLDEN.exists(), reason="golden logits file missing")
def test_default_model_decode_on_blocks_matches_transformers():
    """The default model deployed (blocks): prefill most of the golden prompt, then 1-row decode
    steps and one 4-row verify step; every row against transformers' logits."""
    golden = np.load(GOLDEN)
    ids = golden["input_ids"].tolist()
    dep = build(None, max_batch_size=1, max_seq_len=256, max_cache_gib=0.05)
    info = {i.name: i for i in dep.infos}["ggml_linears"]
    assert info.num_matches == 30 * LINEARS_PER_LAYER + 1, info
    cols = torch.from_numpy(golden["columns"])
    want_cols = torch.from_numpy(golden["logits_columns"])
    pages, start = list(range(16)), len(ids) - 8
    dep.forward(build_metadata([Segment(ids[:start], 0, pages, 0, 0)]))
    rows = []
    for pos in range(start, start + 4):
        rows.append(dep.forward(build_metadata([Segment([ids[pos]], pos, pages, 0, 1)])).logits)
    rows.append(dep.forward(build_metadata([Segment(ids[start + 4:], start + 4, pages, 0, 4,
                                                    SEG_EXTEND)])).logits)
    logits = torch.cat(rows)
    # transformers' own oracle tolerance for this model (tests/checkpoint/test_gguf.py)
    torch.testing.assert_close(logits[:, cols], want_cols[start:], rtol=0, atol=1e-3)
    torch.testing.assert_close(logits[-1], torch.from_numpy(golden["logits_last"]),
                               rtol=0, atol=1e-3)
    assert logits.argmax(-1).tolist() == golden["argmax"][start:].tolist()


def test_a_weight_edited_after_loading_keeps_the_fp32_path(tiny_gguf):
    """Blocks are used only while they still hold the parameter's values: one edited in place
    (same tensor, other numbers) goes the fp32 way, and the logits follow the edit."""
    from specdeploy.deploy.build import build

    _, path = tiny_gguf
    model = load_model(path)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    dep = build(model=model, **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_linears"]
    layers = llama.tiny_hf_config()["num_hidden_layers"]
    assert info.num_matches == layers * LINEARS_PER_LAYER and "1 weights changed" in info.detail
    ids = list(range(5, 12))
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0]
    got = dep.forward(build_metadata([Segment(ids, 0, list(range(16)), 0, len(ids))])).logits
    assert_close(got, want, rtol=1e-5)
