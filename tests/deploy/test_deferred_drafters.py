"""A speculative deployment of a GGUF target keeps one copy of the target's weights: its blocks.

The target loads deferred (placeholders that take no memory) whatever the drafter; the drafter
runs what it reads of the target (embedding, LM head, the checkpoint's MTP layers) on their
blocks, or from values filled for the moment it copies them (a draft vocabulary's LM-head rows).

Oracles: the same deployment built from the fully loaded model (no placeholders: every fp32
value present), which must give the same tokens greedy and sampled (sampled speculation consumes
the drafts' probabilities, so a drafter that read a zero placeholder would differ) and the same
draft counts; gguf-py's dequantization (the plain model's fp32 weights) for copied rows; and the
placeholders themselves (still pending, reading zeros) for what stayed unwritten.
"""
from __future__ import annotations

import gguf
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy import tokenizer as tok_mod
from specdeploy.config import SpecConfig
from specdeploy.deploy import build as build_mod
from specdeploy.deploy.deferred import fill, filled
from specdeploy.loading import load_model
from specdeploy.models import llama
from specdeploy.ops.ggml_linear import kernel_unavailable
from tests.checkpoint.test_gguf import _tiny_llama_gguf

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"ggml kernel unavailable: {kernel_unavailable()}")
Q = gguf.GGMLQuantizationType
LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)
PROMPTS = [[5, 6, 7, 8] * 4, list(range(10, 24))]


@pytest.fixture(scope="module", params=[(Q.Q8_0, True), (Q.Q4_1, False)],
                ids=["q8_0-tied", "q4_1-untied"])
def tiny(request, tmp_path_factory):
    qtype, tie = request.param
    d = tmp_path_factory.mktemp("deferred_drafters")
    src = llama.make_tiny(d / "st", seed=5, config_overrides={"tie_word_embeddings": tie})
    return src, _tiny_llama_gguf(src, d / "tiny.gguf", qtype)


@pytest.fixture
def loaded(monkeypatch):
    """The target models `build` loads, kept for inspection after the build."""
    import specdeploy.loading as loading

    seen, real = [], loading.load_model

    def keep(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(loading, "load_model", keep)
    return seen


def _mtp_head(path, out, vocab_ids=None):
    from specdeploy.models.drafters.mtp_head import make_mtp_head, save_mtp_head

    torch.manual_seed(3)
    head = make_mtp_head(load_model(path))
    if vocab_ids is not None:
        head.set_draft_vocab(torch.tensor(vocab_ids))
    save_mtp_head(head, out)
    return str(out)


def _spec(method, src, path, tmp_path, **kw):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    if method == "eagle3":
        return SpecConfig("eagle3", 3, draft_model=str(make_tiny_eagle3(src, tmp_path / "e3")),
                          controller="off", **kw)
    # "mtp": over a draft vocabulary (its rows of the LM head copied); "mtp-full": the head read
    ids = list(range(0, llama.tiny_hf_config()["vocab_size"], 2)) if method == "mtp" else None
    return SpecConfig("mtp", 3, draft_model=_mtp_head(path, tmp_path / "mtp", ids),
                      controller="off", **kw)


def _run(path, spec):
    llm = LLM(str(path), spec=spec, **LIMITS)
    greedy = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16,
                                                                        ignore_eos=True))]
    sampled = [o.token_ids for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=11))]
    s = llm.stats()
    return greedy, sampled, (s["draft_tokens"], s["accepted_tokens"])


@pytest.mark.parametrize("method,draft_dtype", [("eagle3", None), ("mtp", None),
                                                ("mtp-full", None), ("mtp-full", "bfloat16")])
def test_drafters_leave_the_target_deferred_and_draft_as_over_loaded_weights(
        tiny, method, draft_dtype, tmp_path, monkeypatch, loaded):
    src, path = tiny
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))  # tiny GGUF: no vocab
    kw = {} if draft_dtype is None else {"draft_dtype": draft_dtype, "draft_quantize": None}
    spec = _spec(method, src, path, tmp_path, **kw)
    got = _run(path, spec)
    model = loaded[-1]
    pending = model.ggml_deferred
    layers = [n for n in model.ggml_weights if ".layers." in n]
    # every decoder layer's weights: never written (placeholders, zeros), whatever the drafter
    assert layers and all(n in pending for n in layers)
    assert all(not pending[n].any() for n in layers)
    head = "lm_head.weight" if "lm_head.weight" in model.ggml_weights else \
        "model.embed_tokens.weight"
    # the LM head runs on its blocks in both programs, unless a bf16 drafter cast a copy
    assert (head in pending) == (draft_dtype is None), sorted(pending)[:4]
    monkeypatch.setattr(build_mod, "defer_blocks", lambda opts: False)
    want = _run(path, spec)
    assert not loaded[-1].ggml_deferred  # the oracle: every fp32 value loaded
    assert got == want
    assert got[2][0] > 0  # it drafted


def test_a_draft_vocabularys_rows_are_the_heads_values_and_the_head_stays_blocks(
        tiny, tmp_path, monkeypatch, loaded):
    """The MTP head drafting over a draft vocabulary copies those rows of the (deferred) LM head:
    gguf's values, bit for bit; the head's placeholder is given back (pending, zeros) after."""
    src, path = tiny
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))
    spec = _spec("mtp", src, path, tmp_path, draft_quantize=None)
    llm = LLM(str(path), spec=spec, **LIMITS)
    model = loaded[-1]
    head = "lm_head.weight" if "lm_head.weight" in model.ggml_weights else \
        "model.embed_tokens.weight"
    assert head in model.ggml_deferred and not model.ggml_deferred[head].any()
    ids = (llm.deployed.drafter.d2t + torch.arange(len(llm.deployed.drafter.d2t))).long()
    want = load_model(path).lm_head.weight.detach()[ids]
    assert torch.equal(llm.deployed.drafter.draft_head.weight.detach(), want)


def test_filled_gives_values_then_gives_the_pages_back(tiny):
    """`filled`: inside, the placeholder holds its blocks' values; after, it reads zeros and is
    pending again; `fill` keeps the values and takes it off the pending list."""
    _, path = tiny
    want = load_model(path)
    model = load_model(path, defer_blocks=True)
    name = "model.layers.0.mlp.down_proj.weight"
    t = model.get_parameter(name)
    assert name in model.ggml_deferred and not t.any()
    with filled(model, [t]):
        assert torch.equal(t, want.get_parameter(name)) and name not in model.ggml_deferred
    assert name in model.ggml_deferred and not t.any()
    assert model.ggml_deferred[name].data_ptr() == t.data_ptr()
    other = model.get_parameter("model.layers.0.mlp.up_proj.weight")
    assert list(fill(model, [other, torch.zeros(3)])) == ["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(other, want.get_parameter("model.layers.0.mlp.up_proj.weight"))
    assert "model.layers.0.mlp.up_proj.weight" not in model.ggml_deferred
    assert fill(model, [other]) == {}  # filled once


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5_moe"])
def test_a_ggufs_own_mtp_layers_draft_on_their_blocks(arch, tmp_path, monkeypatch, loaded):
    """A hybrid GGUF's own MTP layers (Q8_0 matrices and experts) stay placeholders: the drafter
    program runs them on their blocks; the same tokens and drafts as over loaded weights."""
    from tests.checkpoint.gguf_nemotron_h_layout import write_gguf as write_nh
    from tests.checkpoint.gguf_qwen3_5_layout import write_gguf as write_q35
    from tests.checkpoint.test_gguf_nemotron_h import MOE

    if arch == "nemotron_h":
        from specdeploy.models import nemotron_h as nh

        src = nh.make_tiny(tmp_path / "st", seed=11, mtp_layers=1, hf_config=MOE)
        path = write_nh(src, tmp_path / "q8.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q8_0)
    else:
        from specdeploy.models import qwen3_5_moe as q35

        src = q35.make_tiny(tmp_path / "st", seed=11, mtp_layers=1)
        path = write_q35(src, tmp_path / "q8.gguf", qtype=Q.Q8_0, expert_qtype=Q.Q8_0)
    spec = SpecConfig("mtp", 2, controller="off")
    llm = LLM(str(path), spec=spec, **LIMITS)
    model = loaded[-1]
    own = [n for n in model.ggml_weights if n.startswith("mtp.")]
    assert own and all(n in model.ggml_deferred and not model.ggml_deferred[n].any()
                       for n in own)
    infos = {i.name: i for i in llm.deployed.draft.infos}
    on_blocks = sum(infos[p].num_matches for p in ("ggml_linears", "ggml_moe_experts")
                    if infos[p].num_matches)
    assert on_blocks > 0, infos["ggml_linears"]
    del llm
    got = _run(path, spec)
    monkeypatch.setattr(build_mod, "defer_blocks", lambda opts: False)
    assert _run(path, spec) == got
    assert got[2][0] > 0
