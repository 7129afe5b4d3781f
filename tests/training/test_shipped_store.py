"""The suffix store shipped for the default model (engine/suffix_store.py): found by
SpecConfig("suffix") with no suffix_store given, drafted from, and lossless under greedy
decoding (oracle: the same deployment code without speculation)."""
from __future__ import annotations

import json

from specdeploy import LLM, SamplingParams, SpecConfig

QUESTIONS = ["Explain in two sentences why the sky is blue.",
             "Write a short product description for a water bottle."]


def test_shipped_store_is_found_and_lossless():
    from specdeploy.default_model import default_model_path
    from specdeploy.drafters_registry import drafters_dir

    default_model_path()  # NOTE: `make test` installs it: a missing model must fail
    cfg = json.loads((drafters_dir() / "smollm2-135m-instruct" / "suffix" / "config.json")
                     .read_text())
    plain = LLM(max_batch_size=2, max_seq_len=512)
    spec = LLM(max_batch_size=2, max_seq_len=512, spec=SpecConfig(
        "suffix", 3, suffix_decoding_max_cached_requests=0, controller="off"))
    assert spec.deployed.suffix_corpus.num_tokens == cfg["num_tokens"] > 1_000_000
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=48)
    want = [o.token_ids for o in plain.chat(msgs, params)]
    assert [o.token_ids for o in spec.chat(msgs, params)] == want
    s = spec.stats()
    # measured here: the store drafted on most steps and its drafts won tokens
    assert s["store_steps"] > 0 and s["store_accepted_tokens"] > 0, s


def test_hybrid_demo_finds_the_store_and_stays_lossless():
    """hybrid-demo (NemotronH, distilled from the default model's replies) is registered for the
    same store: its recurrent states roll back past rejected store drafts exactly."""
    plain = LLM("hybrid-demo", max_batch_size=2, max_seq_len=512)
    spec = LLM("hybrid-demo", max_batch_size=2, max_seq_len=512, spec=SpecConfig(
        "suffix", 3, suffix_decoding_max_cached_requests=0, controller="off"))
    assert spec.deployed.suffix_corpus is not None
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=48)
    assert [o.token_ids for o in spec.chat(msgs, params)] == \
        [o.token_ids for o in plain.chat(msgs, params)]
    s = spec.stats()
    assert s["store_steps"] > 0 and s["store_accepted_tokens"] > 0, s
