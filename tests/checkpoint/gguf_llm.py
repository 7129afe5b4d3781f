"""Test side: `LLM` on a GGUF with an MTP head, greedy speculative against greedy plain."""
from __future__ import annotations

PROMPTS = ["hello there, tiny model", "abc abc abc abc"]


def assert_mtp_equals_plain(path, max_tokens: int = 24):
    """Greedy output with the GGUF's MTP head drafting (K = 2, fixed) equals greedy output
    without speculation, token for token; returns (the plain LLM, the speculative one)."""
    from specdeploy import LLM, SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = LLM(str(path), max_seq_len=128, spec=None)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    spec = LLM(str(path), max_seq_len=128, spec={"method": "mtp", "num_speculative_tokens": 2,
                                                 "controller": "off"})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, sp, use_tqdm=False)] == want
    assert spec.stats()["draft_tokens"] > 0  # the head drafted
    return plain, spec
