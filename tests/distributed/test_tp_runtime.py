"""Tensor / expert parallelism end to end: 2 ranks as real processes (gloo on 127.0.0.1).

Oracle: greedy output of the same checkpoint on one process (TP=1, no speculation), token for
token, over a batch of mixed prompt lengths; speculative runs also with drafts forced to the
oracle's tokens (all accepted: the mirrored `commit` path). Then a killed rank: the next step
fails with an error naming it within a bounded time, for `LLM` and for the server.
"""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.deploy.passes.shard import param_bytes
from tests.spec.tiny_targets import Target

# checkpoint_every=1: recurrent targets checkpoint at every page, so a short shared prefix hits
LIMITS = dict(max_batch_size=4, max_seq_len=160, max_cache_gib=0.05, page_size=8,
              checkpoint_every=1)
TOKENS = 10
K = 3


def _ids(outs):
    return [o.token_ids for o in outs]


def _params():
    return SamplingParams(max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            t = Target(arch, root)
            t.prompts = t.prompts[:3] + t.prompts[4:]  # lengths 1, 7, 33, 12
            llm = LLM(str(t.path), **LIMITS)
            t.baseline = _ids(llm.generate(t.prompts, _params()))
            t.baseline_bytes = param_bytes(llm.deployed.gm)
            t.loaded_bytes = llm.deployed.load_stats["load_peak_bytes"]  # the whole model
            llm.reset_prefix_cache()
            t.shared_cold = llm.generate([SHARED[1]], _lp_params())[0]
            t.prompt_lp = llm.generate([t.prompts[2]], _plp_params())[0].prompt_logprobs
            cache[arch] = t
        return cache[arch]

    return get


_PREFIX = [(7 * i) % 90 + 5 for i in range(43)]  # 5 pages and 3 tokens: a hit mid-page
SHARED = (_PREFIX + [11, 12, 13, 14, 15, 16, 17, 18, 19], _PREFIX + [21, 22, 23, 24, 25, 26])


def _check_rank_memory(t, ranks):
    """Per-rank loading: each rank held its share of the checkpoint's weights while loading
    (plus one whole tensor being sliced), never the whole model. Llama's share is exact: the
    embedding and norms replicated, everything else (vocab-parallel head included) halved."""
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["load_peak_bytes"] < 0.75 * t.loaded_bytes, (r, t.loaded_bytes)
    if t.arch != "llama":
        return
    from specdeploy.loading import load_model

    sizes = {n: p.numel() * p.element_size() for n, p in load_model(t.path).named_parameters()}
    replicated = sum(b for n, b in sizes.items() if "embed_tokens" in n or "norm" in n)
    share = replicated + (sum(sizes.values()) - replicated) // 2
    assert share < 0.75 * sum(sizes.values())
    for r in ranks:
        assert r["load_resident_bytes"] == share
        assert share <= r["load_peak_bytes"] <= share + max(sizes.values())


def _lp_params():
    return SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0)


def _plp_params():
    return SamplingParams(max_tokens=2, prompt_logprobs=0)


def _check_prompt_logprobs(llm, t):
    """The prompt's logprobs (every row of a prefill chunk, engine/prompt_logprobs.py) under
    TP equal TP=1's within 1e-4 (fp32; the row-parallel reductions sum in another order)."""
    got = llm.generate([t.prompts[2]], _plp_params())[0].prompt_logprobs
    assert len(got) == len(t.prompt_lp) == len(t.prompts[2]) and got[0] is None
    for i, (a, b) in enumerate(zip(got[1:], t.prompt_lp[1:])):
        tok = t.prompts[2][i + 1]
        assert abs(a[tok] - b[tok]) < 1e-4, (i, a, b)


def _check_prefix_hits(llm, want):
    """Prefix caching under TP: the second prompt hits the first's pages (and, on recurrent
    targets, restores checkpointed states on every rank) and answers as the TP=1 cold run:
    the same tokens and their logprobs within 1e-4 (a tiny random model's greedy tokens barely
    move with a stale state on one rank; its logprobs move by ~1e-3)."""
    llm.reset_prefix_cache()
    llm.generate([SHARED[0]], _params())
    before = llm.stats()["prefix_cache_hits"]
    got = llm.generate([SHARED[1]], _lp_params())[0]
    assert llm.stats()["prefix_cache_hits"] - before == 40  # the 5 full shared pages
    assert got.token_ids == want.token_ids
    lp = [d[i] for d, i in zip(got.logprobs, got.token_ids)]
    ref = [d[i] for d, i in zip(want.logprobs, want.token_ids)]
    assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4, (lp, ref)


def _oracle(t):
    by_prompt = {tuple(p): b for p, b in zip(t.prompts, t.baseline)}

    def propose(seq, k):
        cont = by_prompt[tuple(seq.prompt_ids)]
        return (cont[len(seq.output_ids):len(seq.output_ids) + k] + [3] * k)[:k]

    return propose


CASES = [  # arch, speculation, tp, ep
    ("llama", True, 2, 1),
    ("nemotron_h", False, 2, 2),
    ("nemotron_h", True, 2, 1),
    ("qwen3_5_moe", False, 2, 1),
    ("qwen3_5_moe", True, 2, 2),
]


@pytest.mark.parametrize("arch,spec,tp,ep", CASES,
                         ids=[f"{a}-{'spec' if s else 'plain'}-tp{t}ep{e}" for a, s, t, e in CASES])
def test_tp2_greedy_equals_tp1(targets, arch, spec, tp, ep):
    t = targets(arch)
    # speculation with SpecConfig's default cost controller (calibrated over mirrored forwards)
    llm = LLM(str(t.path), spec=t.spec(K, "cost") if spec else None, tensor_parallel_size=tp,
              expert_parallel_size=ep, dist_timeout=30, **LIMITS)
    try:
        assert _ids(llm.generate(t.prompts, _params())) == t.baseline
        _check_prompt_logprobs(llm, t)
        graph = llm.deployed.target.gm if spec else llm.deployed.gm
        assert param_bytes(graph) < 0.75 * t.baseline_bytes  # sharded: rank 0 holds ~half
        _check_rank_memory(t, llm.deployed.rank_memory)
        _check_prefix_hits(llm, t.shared_cold)
        if spec:
            llm.engine.reset_spec_stats()
            llm.engine.fix_drafts(_oracle(t))
            # the same prompts again: their cached pages hit (restored states on every rank)
            assert _ids(llm.generate(t.prompts, _params())) == t.baseline
            assert llm.stats()["mean_accepted_length"] > 2
    finally:
        llm.shutdown()


def test_vision_language_target_on_two_ranks(targets, monkeypatch):
    """A VLM on 2 ranks: rank 0 runs the tower and the embedding and sends each step's input
    embeddings (the images' pixels left behind); image, video and text requests, plain and MTP
    (K drafts every step: mirrored verify steps and commits), give the one-process tokens."""
    from specdeploy.distributed import runtime
    from tests.vision.conftest import rand_image
    from tests.vision.video_util import rand_frames

    t = targets("qwen3_5_moe")
    prompts = ["describe <|vision_start|><|image_pad|><|vision_end|> now", "hello there",
               "two <|vision_start|><|image_pad|><|vision_end|> x "
               "<|vision_start|><|image_pad|><|vision_end|>",
               "clip <|vision_start|><|video_pad|><|vision_end|> then"]
    images = [[rand_image(40, 56, 1)], [], [rand_image(64, 32, 2), rand_image(30, 30, 3)], []]
    videos = [[], [], [], [(rand_frames(12, 24, 32, 4), {"fps": 6})]]
    opts = dict(LIMITS, max_num_tokens=16)  # prefill chunks split the images
    want = _ids(LLM(str(t.path), **opts).generate(prompts, _params(), images=images,
                                                  videos=videos))
    sent = []
    send = runtime.send

    def spy(msg):
        sent.extend(m for m in msg or () if m[0] == "forward_embeds")
        send(msg)

    monkeypatch.setattr(runtime, "send", spy)
    for spec in (None, t.spec(K)):
        llm = LLM(str(t.path), spec=spec, tensor_parallel_size=2, dist_timeout=30, **opts)
        try:
            assert hasattr(llm.deployed, "image_features")  # rank 0's tower, over the Leader
            assert _ids(llm.generate(prompts, _params(), images=images, videos=videos)) == want
            if spec is not None:
                assert llm.stats()["draft_steps"] > 0
        finally:
            llm.shutdown()
    assert sent and all(m[1][0].mm_rows is None for m in sent)  # no pixels went to rank 1
