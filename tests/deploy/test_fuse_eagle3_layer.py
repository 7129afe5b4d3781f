"""fuse_decoder_layers on the EAGLE-3 drafter's layer (q/k/v over cat(embeds, hidden), 2H wide):
with its linears on tiled blocks (`draft_quantize="q8_0"`) the drafter graph's layer is one C
call, bit-equal to the drafter built without the pass; greedy EAGLE-3 speculation still gives
the plain tokens. The default fp32 drafter (oneDNN linears) keeps its chain."""
from __future__ import annotations

import pytest
import torch

from specdeploy.cache.metadata import build_metadata
from specdeploy.config import SpecConfig
from specdeploy.deploy.build import build
from specdeploy.ops import layer_rows
from tests.deploy.test_fuse_layer import LIMITS, OFF, _fused, _steps, tiny_gguf  # noqa: F401

pytestmark = pytest.mark.skipif(layer_rows.unavailable() is not None,
                                reason=f"fused layer unavailable: {layer_rows.unavailable()}")


@pytest.fixture(scope="module")
def eagle3_dir(tiny_gguf, tmp_path_factory):  # noqa: F811
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    src, _ = tiny_gguf
    return str(make_tiny_eagle3(src, tmp_path_factory.mktemp("e3") / "e3"))


def _spec(eagle3_dir, quant="q8_0"):
    return SpecConfig("eagle3", 2, draft_model=eagle3_dir, draft_quantize=quant,
                      controller="off")


def test_fused_drafter_gives_the_unfused_bits(tiny_gguf, eagle3_dir, monkeypatch):  # noqa: F811
    _, path = tiny_gguf
    fused = build(str(path), spec=_spec(eagle3_dir), **LIMITS)
    base = build(str(path), spec=_spec(eagle3_dir), disabled=OFF, **LIMITS)
    assert len(_fused(fused.draft.gm)) == 1 and not _fused(base.draft.gm)
    assert len(_fused(fused.target.gm)) == 4

    def no_chain(*a):
        raise AssertionError("the fused layer ran its fallback chain")

    monkeypatch.setattr(layer_rows, "run_chain", no_chain)
    g = torch.Generator().manual_seed(0)
    h = fused.drafter.cfg.hidden_size
    for segs in _steps():
        meta = build_metadata(segs)
        hidden = torch.randn(meta.num_tokens, h, generator=g)
        got, want = fused.draft.forward(meta, hidden), base.draft.forward(meta, hidden)
        assert torch.equal(got.logits, want.logits), (got.logits - want.logits).abs().max()
        assert torch.equal(got.hidden, want.hidden)
    want_kv = {n: b for n, b in base.draft.gm.named_buffers() if "kv_cache" in n}
    for name, kv in fused.draft.gm.named_buffers():
        if "kv_cache" in name:
            assert torch.equal(kv, want_kv[name]), name


def test_fp32_drafter_keeps_its_chain(tiny_gguf, eagle3_dir):  # noqa: F811
    _, path = tiny_gguf
    dep = build(str(path), spec=_spec(eagle3_dir, None), **LIMITS)
    assert not _fused(dep.draft.gm)


def test_greedy_eagle3_equals_plain_with_the_fused_drafter(tiny_gguf, eagle3_dir,  # noqa: F811
                                                           monkeypatch):
    from specdeploy import LLM, SamplingParams
    from specdeploy import tokenizer as tok_mod

    src, path = tiny_gguf
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))  # tiny GGUF: no vocab
    limits = {k: v for k, v in LIMITS.items() if k != "page_size"}
    plain = LLM(str(path), **limits)
    spec = LLM(str(path), spec=_spec(eagle3_dir), **limits)
    assert len(_fused(spec.deployed.draft.gm)) == 1
    prompts = [[5, 6, 7, 8] * 6, [9, 4] * 3 + [9], list(range(10, 30))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
