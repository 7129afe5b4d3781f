"""Lossless speculation: greedy output with a drafter equals greedy output without it, token for
token (oracle: the non-speculative path of the same deployment code)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdeploy import SamplingParams

MAX_TOKENS = 20


def _ids(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(target):
    """Greedy continuations without speculation (long enough for forced drafts past the end)."""
    llm = target.llm()
    params = SamplingParams(max_tokens=MAX_TOKENS + 8, ignore_eos=True)
    return _ids(llm.generate(target.prompts, params))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_spec_equals_non_spec(target, baseline, k):
    llm = target.llm(k)
    before = llm.stats()["draft_steps"]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [b[:MAX_TOKENS] for b in baseline]
    assert _ids(llm.generate(target.prompts, params)) == want  # mixed batch 1..100 tokens
    assert _ids(llm.generate([target.prompts[2]], params)) == [want[2]]  # batch 1
    stats = llm.stats()
    assert stats["draft_steps"] > before and stats["draft_tokens"] == k * stats["draft_steps"]


def _oracle(baseline, prompts, noise: float, seed: int):
    """A drafter proposing the target's own greedy tokens, each wrong with prob `noise`."""
    rng = random.Random(seed)
    by_prompt = {tuple(p): b for p, b in zip(prompts, baseline)}

    def propose(seq, k):
        cont = by_prompt[tuple(seq.prompt_ids)]
        start = len(seq.output_ids)
        drafts = (cont[start:start + k] + [3] * k)[:k]
        return [d if rng.random() >= noise else (d + 1) % 100 for d in drafts]

    return propose


@pytest.mark.parametrize("k", [1, 3, 5])
def test_forced_target_drafts_are_all_accepted(target, baseline, k):
    llm = target.llm(k)
    llm.engine.reset_spec_stats()  # NOTE: count this test's steps only
    llm.engine.fix_drafts(_oracle(baseline, target.prompts, 0.0, 0))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _ids(llm.generate(target.prompts, params)) == [b[:MAX_TOKENS] for b in baseline]
    stats = llm.stats()
    assert stats["mean_accepted_length"] == k + 1
    assert stats["accepted_per_position"] == [stats["draft_steps"]] * k


def test_partial_acceptance_stays_lossless(target, baseline):
    """Drafts right at random positions: sequences sit at different accepted lengths each step,
    and stop at max_tokens inside an accepted run."""
    k = 5
    llm = target.llm(k)
    llm.engine.reset_spec_stats()
    llm.engine.fix_drafts(_oracle(baseline, target.prompts, 0.3, 1))
    lengths = [5, 11, 17, 20, 9]  # max_tokens landing mid-run
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    got = _ids(llm.generate(target.prompts, params))
    assert got == [b[:n] for b, n in zip(baseline, lengths)]
    stats = llm.stats()
    assert 1 < stats["mean_accepted_length"] < k + 1


@pytest.mark.parametrize("k", [1, 3, 5])
def test_lookup_drafts_stay_lossless(target, k):
    """N-gram lookup drafts on prompts that repeat themselves (so lookup fires from the first
    step) mixed with ones that do not: output equals the non-speculative path's."""
    prompts = [[5, 6, 7, 8] * 6, target.prompts[1], [9, 4] * 3 + [9], target.prompts[3]]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = _ids(target.llm().generate(prompts, params))
    llm = target.llm(k)
    llm.engine.set_lookup((4, 2))  # resets the counters
    try:
        assert _ids(llm.generate(prompts, params)) == want
        assert _ids(llm.generate([prompts[0]], params)) == [want[0]]  # batch 1
        stats = llm.stats()
    finally:
        llm.engine.set_lookup(None)
    assert stats["lookup_steps"] > 0 and stats["draft_tokens"] == k * stats["draft_steps"]
    assert stats["lookup_steps"] < stats["draft_steps"]  # the drafter drafted the others


def test_longer_lookup_drafts_stay_lossless(target, baseline):
    """prompt_lookup_num_tokens > K: lookup runs grow from K=2 up to 6 drafts while accepted
    whole, the drafter drafts 2. Greedy output equals the non-speculative path's. Then 6
    forced right drafts per step: all accepted, so a hybrid target's spec state (sized for
    6 + 1 tokens) rolls forward from entry 6."""
    from specdeploy import LLM
    from tests.spec.tiny_targets import LIMITS

    prompts = [[5, 6, 7, 8] * 6, target.prompts[1], [9, 4] * 3 + [9], target.prompts[3]]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = _ids(target.llm().generate(prompts, params))
    spec = dataclasses.replace(target.spec(2), prompt_lookup_max=4, prompt_lookup_num_tokens=6)
    llm = LLM(str(target.path), spec=spec, **LIMITS)
    assert _ids(llm.generate(prompts, params)) == want
    assert _ids(llm.generate([prompts[0]], params)) == [want[0]]  # batch 1
    s = llm.stats()
    assert s["num_draft_tokens"] == 2 and len(s["accepted_per_position"]) == 6
    assert s["lookup_steps"] > 0
    assert s["draft_tokens"] <= 2 * s["draft_steps"] + 4 * s["lookup_steps"]
    if target.arch == "llama":
        # NOTE: this random Llama follows the looping prompt, so lookup runs pass whole and
        # grow (the random hybrids do not: their lookup runs stay at K, checked above)
        assert s["draft_tokens"] > 2 * s["draft_steps"] and s["accepted_per_position"][5] > 0

    llm.engine.set_lookup((4, 2), 6)  # resets the counters
    llm.engine.fix_drafts(_oracle(baseline, target.prompts, 0.0, 0))
    assert _ids(llm.generate(target.prompts, params)) == [b[:MAX_TOKENS] for b in baseline]
    s = llm.stats()
    assert s["mean_accepted_length"] == 7
    assert s["accepted_per_position"] == [s["draft_steps"]] * 6


def test_low_precision_drafter_stays_lossless(target, baseline):
    """A bf16, int8-weight drafter next to an fp32 target (the CPU setting where a draft step
    is bound by reading the drafter's weights): output equals the non-speculative path's, the
    target keeps its precision, and native MTP heads get their own copy of the target's head."""
    from specdeploy import LLM, SpecConfig
    from tests.spec.tiny_targets import LIMITS

    spec = SpecConfig(target.method, 3, draft_model=target.spec(3).draft_model,
                      draft_dtype="bfloat16", draft_quantize="int8")
    llm = LLM(str(target.path), spec=spec, **LIMITS)
    d = llm.deployed
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [b[:MAX_TOKENS] for b in baseline]
    assert _ids(llm.generate(target.prompts, params)) == want
    assert _ids(llm.generate([target.prompts[2]], params)) == [want[2]]
    assert llm.stats()["draft_steps"] > 0
    assert d.drafter.dtype == torch.bfloat16
    quant = {i.name: i for i in d.draft.infos}["quantize_int8_weights"]
    assert quant.num_matches > 0 and not quant.skipped
    assert {p.dtype for p in d.target.gm.parameters()} == {torch.float32}
    borrowed = d.drafter.borrowed
    if "lm_head" in borrowed:  # a head drafting over the target's vocabulary reads its LM head
        assert borrowed["lm_head"].weight.dtype == torch.bfloat16
    assert borrowed["embed_tokens"].weight.dtype == torch.float32  # the target's embedding


def test_q8_0_drafter_stays_lossless(target, baseline):
    """draft_quantize="q8_0": the drafter's own linears quantized to Q8_0 at load and run on the
    block kernels (the CPU drafter setting): output equals the non-speculative path's, the
    drafter's fp32 weights are exactly their Q8_0 values (oracle: dequantizing them again is
    the identity), and its graph computes on blocks."""
    from specdeploy import LLM, SpecConfig
    from specdeploy.ops.ggml_linear import dequantize, quantize_q8_0
    from tests.spec.tiny_targets import LIMITS

    spec = SpecConfig(target.method, 3, draft_model=target.spec(3).draft_model,
                      draft_quantize="q8_0")
    llm = LLM(str(target.path), spec=spec, **LIMITS)
    d = llm.deployed
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _ids(llm.generate(target.prompts, params)) == [b[:MAX_TOKENS] for b in baseline]
    assert llm.stats()["draft_steps"] > 0
    info = {i.name: i for i in d.draft.infos}["ggml_linears"]
    assert info.num_matches > 0 and not info.skipped, info
    linears = [m.weight for m in d.drafter.modules() if isinstance(m, torch.nn.Linear)
               and m.weight.shape[1] % 32 == 0]
    assert linears
    for w in linears:
        assert torch.equal(dequantize(quantize_q8_0(w)), w)
    assert {p.dtype for p in d.target.gm.parameters()} == {torch.float32}
    if target.method == "eagle3":  # its eager fc projection runs on the tiled Q8_0 kernel too
        from specdeploy.ops import ggml_tiled

        if ggml_tiled.kernel_unavailable() is None:
            fc = d.drafter.fc
            assert "fc_kernel" in d.drafter.__dict__
            x = torch.randn(5, fc.in_features, generator=torch.Generator().manual_seed(0))
            want = torch.nn.functional.linear(x.double(), fc.weight.double(),
                                              None if fc.bias is None else fc.bias.double())
            # x is rounded to 8 bits per block of 32 (step max|x_block| / 127): each output
            # moves by at most half a step per input times |w|, plus fp32 sums
            step = x.abs().reshape(5, -1, 32).amax(-1).repeat_interleave(32, -1) / 127
            bound = 0.5 * step.double() @ fc.weight.abs().double().T
            err = (d.drafter.project(x).double() - want).abs()
            assert (err <= bound * 1.001 + 1e-5).all(), (err - bound).max()


def test_draft_quantize_auto_is_q8_0_on_a_safetensors_fp32_cpu_target(tmp_path):
    """SpecConfig's default draft_quantize="auto" on an fp32 safetensors target: Q8_0 drafter
    linears with the fast kernels (what makes hybrid-demo's MTP head pay; its lossless run is
    test_q8_0_drafter_stays_lossless), the target's precision with kernels="exact"."""
    from specdeploy import LLM, SpecConfig
    from specdeploy.models.registry import family_module
    from tests.spec.tiny_targets import LIMITS

    path = family_module("nemotron_h").make_tiny(tmp_path / "nh", seed=1, mtp_layers=1)
    for kernels, want in (("fast", "q8_0"), ("exact", None)):
        llm = LLM(str(path), kernels=kernels, spec=SpecConfig("mtp", 2), **LIMITS)
        assert llm.deployed.spec.draft_quantize == want, kernels


def test_draft_precision_is_validated():
    from specdeploy import SpecConfig

    with pytest.raises(ValueError, match="draft_dtype"):
        SpecConfig("eagle3", draft_dtype="int4")
    with pytest.raises(ValueError, match="draft_quantize"):
        SpecConfig("eagle3", draft_quantize="fp8")


def test_draft_confidence_stop_stays_lossless(target, baseline):
    """draft_min_prob: chains stop at different lengths per sequence and step (some steps with
    no drafts at all, decoded plainly); output equals the non-speculative path's and the counters
    add up. Thresholds span the tiny drafters' top probabilities, so every regime occurs."""
    k = 3
    llm = target.llm(k)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [b[:MAX_TOKENS] for b in baseline]
    seen = {"short": False, "none": False, "full": False}
    try:
        for p in (1e-9, 1e-6, 1e-4, 1e-3, 0.02, 0.1, 0.9):
            llm.engine.draft_min_prob = p
            llm.engine.reset_spec_stats()
            assert _ids(llm.generate(target.prompts, params)) == want, p
            s = llm.stats()
            seen["none"] |= s["undrafted_steps"] > 0
            seen["short"] |= s["draft_steps"] > 0 and s["draft_tokens"] < k * s["draft_steps"]
            seen["full"] |= s["draft_steps"] > 0 and s["draft_tokens"] == k * s["draft_steps"]
            out_tokens = sum(len(w) for w in want)
            # every token is one target step's bonus or an accepted draft (prefill's counts too)
            steps = s["draft_steps"] + s["undrafted_steps"]
            assert steps + s["accepted_tokens"] <= out_tokens
    finally:
        llm.engine.draft_min_prob = 0.0
    assert all(seen.values()), seen


def test_draft_confidence_stop_with_lookup(target):
    """Lookup drafts ignore the drafter's confidence (they run the whole K) while the drafter's
    chains stop early: lossless on repeating prompts."""
    k = 3
    prompts = [[5, 6, 7, 8] * 6, target.prompts[1], [9, 4] * 3 + [9], target.prompts[3]]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = _ids(target.llm().generate(prompts, params))
    llm = target.llm(k)
    llm.engine.set_lookup((4, 2))
    llm.engine.draft_min_prob = 0.9
    try:
        assert _ids(llm.generate(prompts, params)) == want
        s = llm.stats()
    finally:
        llm.engine.set_lookup(None)
        llm.engine.draft_min_prob = 0.0
    assert s["lookup_steps"] > 0 and s["undrafted_steps"] > 0


def test_draft_min_prob_is_validated():
    from specdeploy import SpecConfig

    for bad in (-0.1, 1.0, "0.5", True):
        with pytest.raises(ValueError, match="draft_min_prob"):
            SpecConfig("eagle3", draft_min_prob=bad)
