"""Test side: `LLM` on a GGUF with an MTP head, greedy speculative against greedy plain."""
from __future__ import annotations

PROMPTS = ["hello there, tiny model", "abc abc abc abc"]
# NOTE: a verify step's rows are a decode step's bit for bit on the recurrent layers (they run
# token by token, ops/cached_recurrent.py) and on the block kernels; on a Q8_0 NemotronH MoE
# GGUF one fp32 op still differs (~7e-7 in logprob, not located yet), so a divergence is
# allowed only where the plain run's top two were that close: a near-tie.
NEAR_TIE = 1e-4


def assert_mtp_equals_plain(path, max_tokens: int = 24, kernels: str = "exact"):
    """Greedy output with the GGUF's MTP head drafting (K = 2, fixed) equals greedy output
    without speculation, token for token, but for a proven near-tie (NEAR_TIE); returns (the
    plain LLM, the speculative one)."""
    from specdeploy import LLM, SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = LLM(str(path), max_seq_len=128, spec=None, kernels=kernels)
    want = plain.generate(PROMPTS, sp, use_tqdm=False)
    spec = LLM(str(path), max_seq_len=128, kernels=kernels,
               spec={"method": "mtp", "num_speculative_tokens": 2, "controller": "off"})
    got = spec.generate(PROMPTS, sp, use_tqdm=False)
    for w, g in zip(want, got):
        a, b = w.outputs[0].token_ids, g.outputs[0].token_ids
        if a == b:
            continue
        i = next(i for i, (u, v) in enumerate(zip(a, b)) if u != v)
        top = sorted((getattr(v, "logprob", v) for v in w.outputs[0].logprobs[i].values()),
                     reverse=True)
        assert top[0] - top[1] <= NEAR_TIE, (i, a, b, top)  # not a near-tie: a real mismatch
    assert spec.stats()["draft_tokens"] > 0  # the head drafted
    return plain, spec
