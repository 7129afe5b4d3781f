"""LLM options that reach the deploy pipeline: quantize (and its validation)."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.models.registry import family_module

LIMITS = dict(max_batch_size=2, max_seq_len=128, max_cache_gib=0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("opts") / "llama"
    family_module("llama").make_tiny(path, seed=0)
    return str(path)


def test_int8_quantized_llm_generates_and_reports(tiny):
    llm = LLM(tiny, quantize="int8", **LIMITS)
    info = {i.name: i for i in llm.deployed.infos}["quantize_int8_weights"]
    assert info.num_matches > 0 and not info.skipped
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_unknown_quantization_is_rejected(tiny):
    with pytest.raises(ValueError, match="quantize"):
        LLM(tiny, quantize="int4", **LIMITS)
