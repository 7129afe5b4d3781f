"""SpecConfig("auto"): the choice per target, fields given explicitly kept, lossless."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.models.registry import family_module
from specdeploy.spec_auto import DEFAULT_MODEL, choice_for, resolve_auto

LIMITS = dict(max_batch_size=2, max_seq_len=96, max_cache_gib=0.02, dtype="float32")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    return {"llama": family_module("llama").make_tiny(root / "llama", seed=0),
            "nemotron_h": family_module("nemotron_h").make_tiny(root / "nh", seed=0,
                                                                  mtp_layers=1)}


def test_choice_per_target(ckpts):
    assert choice_for(None) == DEFAULT_MODEL  # the embedded default model: the bench's pick
    assert choice_for(None, device="cuda")["method"] == DEFAULT_MODEL["method"]
    assert choice_for(ckpts["nemotron_h"])["method"] == "mtp"  # its own MTP layers
    assert choice_for(ckpts["llama"])["method"] == "ngram"  # nothing to draft with
    for path in (None, ckpts["llama"], ckpts["nemotron_h"]):
        assert choice_for(path)["controller"] == "cost"
    # the shipped hybrid: the store it was distilled from beat its MTP head (spec_auto.py)
    from specdeploy.checkpoint.shipped import shipped_model_path

    assert choice_for("hybrid-demo")["method"] == "suffix"
    assert choice_for(str(shipped_model_path("hybrid-demo")))["method"] == "suffix"


def test_given_fields_win_and_bad_combinations_are_refused(ckpts):
    spec = resolve_auto(SpecConfig("auto", num_draft_tokens=2, draft_min_prob=0.25),
                        ckpts["llama"])
    assert (spec.method, spec.num_draft_tokens, spec.draft_min_prob) == ("ngram", 2, 0.25)
    assert resolve_auto(SpecConfig("auto"), ckpts["llama"]).num_draft_tokens == 3
    assert resolve_auto(SpecConfig("eagle3", draft_model="x"), None).method == "eagle3"
    with pytest.raises(ValueError, match="draft_model: method='auto'"):
        SpecConfig("auto", draft_model="somewhere")


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_auto_is_lossless(ckpts, arch):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 4, 11, 12, 13, 9, 3, 4]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(ckpts[arch], **LIMITS).generate(prompts, sp)]
    llm = LLM(ckpts[arch], spec=SpecConfig("auto"), **LIMITS)
    assert llm.spec.method == ("mtp" if arch == "nemotron_h" else "ngram")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == plain
