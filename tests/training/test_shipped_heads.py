"""The EAGLE-3 and MTP heads shipped for the default model: found with no draft_model, lossless
under greedy decoding, and accepted on fixed chat prompts.

The heads were trained on one GPU in about 8 minutes on the target's own replies (README,
bench/train_default_heads_gpu.sh). Measured on these three prompts, greedy: at K=1 (one draft
per step) both heads' acceptance rate is 0.56; at K=3 EAGLE-3 accepts the first draft 51% of the
time (acceptance rate over all three positions 0.27, mean accepted length 1.80), MTP 53% (0.28,
1.84). The thresholds below keep a margin for other CPUs' rounding; a random head scores ~0.
"""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams, SpecConfig

QUESTIONS = ["Count from 1 to 30, separated by commas.", "List the days of the week.",
             "List the months of the year."]
MAX_TOKENS = 24
K = 3
MIN_FIRST_ACCEPT = {"eagle3": 0.4, "mtp": 0.4}  # measured 0.51 / 0.53
MIN_MEAN_ACCEPTED = {"eagle3": 1.6, "mtp": 1.6}  # measured 1.80 / 1.84
MIN_RATE_K1 = {"eagle3": 0.45, "mtp": 0.45}  # measured 0.56 / 0.56


def _default_or_skip():
    from specdeploy.default_model import default_model_path
    from specdeploy.drafters_registry import drafters_dir

    # NOTE: `make test` installs the default model and ships the heads: missing ones must fail
    default_model_path()  # raises CheckpointError naming the package to install
    assert (drafters_dir() / "smollm2-135m-instruct" / "eagle3" / "config.json").is_file()


def _plain_greedy(model, prompt: list[int], eos: frozenset, guess: list[int]) -> list[int]:
    """The fp32 model's greedy continuation, by full recompute (no cache). `guess` only saves
    forwards: one forward over prompt + out + guess gives the argmax after each of its
    prefixes; the longest matching run is kept, plus the model's own next token, and a wrong
    guess is corrected there. A right guess costs one forward instead of one per token."""
    out: list[int] = []
    while len(out) < MAX_TOKENS and (not out or out[-1] not in eos):
        draft = guess[len(out):MAX_TOKENS] if guess[:len(out)] == out else []
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out + draft]))[0, len(prompt) + len(out) - 1:]
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            out.append(tok)
            if len(out) == MAX_TOKENS or tok in eos or i == len(draft) or draft[i] != tok:
                break
    return out


@pytest.fixture(scope="module")
def reference():
    """Prompts, and plain greedy continuations (full recompute, no cache, no drafter)."""
    _default_or_skip()
    import specdeploy

    tok = specdeploy.load_tokenizer(None)
    model = specdeploy.load_model(None)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                          add_special_tokens=False) for q in QUESTIONS]
    cache: dict = {}

    def greedy(eos: frozenset, guess: list[list[int]]) -> list[list[int]]:
        """`guess`: the outputs under test, as a head start (the result does not depend on it)."""
        if eos not in cache:
            cache[eos] = [_plain_greedy(model, p, eos, g) for p, g in zip(prompts, guess)]
        return cache[eos]

    return prompts, greedy


def _run(method: str, prompts, k: int, **spec_kw):
    from specdeploy.drafters_registry import drafters_dir

    # NOTE: the MTP head is named explicitly: deploy/runner.py asks the loader for the target's
    # own mtp.* weights when draft_model is None, which a Llama rejects (reported upstream);
    # test_default_mtp_head_resolves covers the no-draft_model lookup itself.
    draft = (str(drafters_dir() / "smollm2-135m-instruct" / "mtp") if method == "mtp" else None)
    # NOTE: the exact kernels: the oracle is the fp32 model's full recompute; fixed K: the
    # thresholds are the acceptance of K drafts every step
    llm = LLM(max_batch_size=3, max_seq_len=192, kernels="exact",
              spec=SpecConfig(method, k, draft_model=draft, controller="off", **spec_kw))
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return llm, [o.token_ids for o in outs]


@pytest.fixture(scope="module", params=["eagle3", "mtp"])
def spec_run(request, reference):
    llm, outs = _run(request.param, reference[0], K)
    return request.param, llm, outs


def test_shipped_head_is_the_default_drafter(spec_run):
    from specdeploy.drafters_registry import drafters_dir

    method, llm, _ = spec_run
    d = llm.deployed.drafter
    assert type(d).__name__ == ("Eagle3Drafter" if method == "eagle3" else "MTPHead")
    path = drafters_dir() / "smollm2-135m-instruct" / method
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert 0 < size <= 25 * 2**20


def test_greedy_output_equals_plain_greedy(spec_run, reference):
    _, llm, outs = spec_run
    assert outs == reference[1](frozenset(llm.engine.eos_token_ids), outs)


def test_acceptance_on_fixed_prompts(spec_run):
    method, llm, _ = spec_run
    s = llm.stats()
    assert s["draft_steps"] > 0
    first = s["acceptance_per_position"][0]
    assert first > MIN_FIRST_ACCEPT[method], (method, s)
    assert s["mean_accepted_length"] > MIN_MEAN_ACCEPTED[method], (method, s)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_acceptance_rate_one_draft_at_a_time(method, reference):
    """K = 1: the acceptance rate is the share of single drafts the target accepts."""
    llm, outs = _run(method, reference[0], 1)
    assert outs == reference[1](frozenset(llm.engine.eos_token_ids), outs)
    s = llm.stats()
    assert s["acceptance_rate"] > MIN_RATE_K1[method], (method, s)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_low_precision_heads_keep_their_acceptance(method, reference):
    """The heads in bf16 with int8 weights (the demo's drafter) still accept like the fp32
    ones at K = 1 (measured: the same 0.56 / 0.56 on these prompts), losslessly."""
    llm, outs = _run(method, reference[0], 1, draft_dtype="bfloat16", draft_quantize="int8")
    assert outs == reference[1](frozenset(llm.engine.eos_token_ids), outs)
    assert llm.deployed.drafter.dtype == torch.bfloat16
    s = llm.stats()
    assert s["acceptance_rate"] > MIN_RATE_K1[method], (method, s)


def test_with_lookup_drafts(reference):
    """EAGLE-3 + n-gram lookup with the demo's bf16 / int8 drafter (its third run): lossless on
    the real model, with lookup drafting part of the steps (24-token replies repeat little;
    longer ones gain more, see bench/acceptance.py --lookups)."""
    llm, outs = _run("eagle3", reference[0], K, prompt_lookup_max=4, draft_dtype="bfloat16",
                     draft_quantize="int8")
    assert outs == reference[1](frozenset(llm.engine.eos_token_ids), outs)
    s = llm.stats()
    assert 0 < s["lookup_steps"] < s["draft_steps"]
    assert s["mean_accepted_length"] > MIN_MEAN_ACCEPTED["eagle3"], s


def test_default_mtp_head_resolves(reference):
    import specdeploy
    from specdeploy.deploy.spec import FINAL, load_drafter
    from specdeploy.models.drafters.mtp_head import MTPHead

    model = specdeploy.load_model(None)
    drafter, layers = load_drafter(model, SpecConfig("mtp", 2))
    assert isinstance(drafter, MTPHead) and layers == (FINAL,)
    assert drafter.d2t is not None and drafter.d2t.shape == (6144,)  # its training vocab
    assert drafter.embed(torch.tensor([[1]])).shape == (1, 1, model.cfg.hidden_size)
