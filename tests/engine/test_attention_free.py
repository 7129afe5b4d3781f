"""A model without attention (NemotronH of Mamba2 and MLP layers only) has no KV pages: the
engine serves it (it used to refuse every request for "the whole KV cache (0 tokens)", and
with that check lifted the scheduler waited for ever for pages). Oracles: the plain model's
greedy argmax, step by step, and greedy plain decoding for n-gram speculation."""
from __future__ import annotations

import torch

from specdeploy import LLM, SamplingParams
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h as nh


def test_mamba_and_mlp_only_model_serves(tmp_path):
    hf = nh.tiny_hf_config()
    hf.update(hybrid_override_pattern="M-M-", num_hidden_layers=4)
    path = nh.make_tiny(tmp_path / "m", seed=3, hf_config=hf)
    prompt = [5, 17, 40, 41, 42, 5, 17, 40]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), max_seq_len=64, spec=None)
    assert llm.deployed.layout.num_pages == 0
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    model, ids = load_model(path), list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt):]
    spec = LLM(str(path), max_seq_len=64, spec={"method": "ngram", "num_speculative_tokens": 3,
                                                "controller": "off", "prompt_lookup_min": 1})
    assert spec.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == got
