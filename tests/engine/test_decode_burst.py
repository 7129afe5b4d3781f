"""Decode bursts (engine/decode_burst.py) on the CPU, through the CUDA-graph runner's padded
static path (`capture=False`): B greedy decode steps back to back, each step's input token fed
from the previous step's argmax tensor (the runner's `ids`), give the tokens and finish reasons
of step-by-step decoding (the oracle: the same engine without bursts), for the three
architectures; stops inside a burst drop the rest; a waiting request, penalties or logprobs
take normal steps."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.engine.cuda_graphs import install
from tests.spec.tiny_targets import LIMITS, METHODS, Target


@pytest.fixture(scope="module", params=sorted(METHODS))
def target(request, tmp_path_factory) -> Target:
    return Target(request.param, tmp_path_factory.mktemp("burst"))


_DEPLOYED: dict = {}  # (target, device, cpu_graphs, opts) -> a deployment with its runner


def _engine(target, burst: int, device: str = "cpu", cpu_graphs: bool = False, **opts):
    """A fresh Engine (empty pages, prefix cache and state slots) over a deployment built once
    per target and options: building (export) is most of these tests' time, and an Engine
    never reads what an earlier one left in the cache buffers (its prefills start from
    position 0 and a zero recurrent state)."""
    from specdeploy.deploy.build import build
    from specdeploy.engine import Engine

    key = (id(target), device, cpu_graphs, tuple(sorted(opts.items())))
    if key not in _DEPLOYED:
        dep = build(str(target.path), vision=False, device=device, **LIMITS, **opts)
        install(dep, LIMITS["max_batch_size"],
                capture=None if device.startswith("cuda") else cpu_graphs)
        _DEPLOYED[key] = dep
    dep = _DEPLOYED[key]
    if getattr(dep, "graph_runner", None) is not None:  # each run's replays counted from 0
        dep.graph_runner.replays = 0
    engine = Engine(dep, max_batch_size=LIMITS["max_batch_size"])
    engine.num_scheduler_steps = burst
    return engine


def _run(engine, prompts, params) -> tuple[list[tuple[list[int], str]], int]:
    """(token ids, finish reason) per prompt, and the engine's step() calls."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    done, calls = {}, 0
    while engine.has_unfinished() and calls < 500:
        calls += 1
        for out in engine.step():
            if out.finish_reason:
                done[out.request_id] = (out.token_ids, out.finish_reason)
    return [done[i] for i in ids], calls


def run(target, burst: int, params, device: str = "cpu", **opts):
    return _run(_engine(target, burst, device, **opts), target.prompts[:3], params)


def test_bursts_give_the_step_by_step_tokens(target):
    """max_tokens 16, 7 and 13 with bursts of 4: whole bursts, and ones cut by max_tokens."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (16, 7, 13)]
    want, steps = run(target, 1, params)
    got, calls = run(target, 4, params)
    assert got == want
    assert calls < steps - 6  # the decodes ran in bursts: fewer step() calls


def test_bursts_of_cpu_graph_replays_give_the_step_by_step_tokens(target):
    """The same with CPU graphs (engine/cpu_graphs.py): each burst step a replay (the tiny
    fp32 Qwen3.5's torch recurrent paths included: they read only whether each sequence has a
    cached state, which every replayed step has)."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (16, 7, 13)]
    want, steps = run(target, 1, params)
    engine = _engine(target, 4, cpu_graphs=True)
    got, calls = _run(engine, target.prompts[:3], params)
    assert got == want
    runner = engine.deployed.graph_runner
    assert runner.replays > 10 and not runner.refused, (runner.replays, runner.refused)
    assert calls < steps - 6


def test_a_stop_inside_a_burst_drops_the_rest(target):
    """A stop token that step-by-step decoding meets at its 6th token (inside the second
    burst of 4): the same tokens and reason, nothing after it."""
    free = [SamplingParams(max_tokens=16, ignore_eos=True)] * 3
    plain, _ = run(target, 1, free)
    stops = [SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[ids[5]])
             for ids, _ in plain]
    want, _ = run(target, 1, stops)
    got, _ = run(target, 4, stops)
    assert got == want
    assert all(reason == "stop" and len(ids) <= 6 for ids, reason in got)


def test_seeded_sampling_in_bursts_draws_what_steps_draw(target):
    """Seeded sampled requests (temperature, top-k / top-p, min_p) in bursts: each generator
    drawn once a step, in the same order, so the same tokens as step by step."""
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=1),
              SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.2, top_k=20,
                             top_p=0.9, seed=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, min_p=0.05,
                             seed=3)]
    want, steps = run(target, 1, params)
    got, calls = run(target, 4, params)
    assert got == want
    assert calls < steps - 4
    assert len({tuple(ids) for ids, _ in want}) == 3


def test_what_reads_tokens_step_by_step_takes_normal_steps(target):
    """Penalties and logprobs act between steps: no bursts (as many step() calls), the same
    tokens."""
    params = [SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=3)]
    for p in params:
        want, steps = run(target, 1, [p] * 3)
        got, calls = run(target, 4, [p] * 3)
        assert [ids for ids, _ in got] == [ids for ids, _ in want]
        assert calls == steps


def test_a_waiting_request_stops_bursts():
    """max_batch_size 1 and two requests: the second waits, so the first decodes step by
    step until it finishes (a burst would hold the queue)."""
    from specdeploy.engine.decode_burst import burst_len
    from specdeploy.engine.scheduler import ScheduledSeq

    class Seq:
        def __init__(self):
            self.params = SamplingParams(max_tokens=10, temperature=0.0)
            self.output_ids, self.matcher, self.mm = [1], None, None
            self.num_cached, self.pages = 6, [0]

        def __len__(self):
            return 7

    class Blocks:
        num_free, restores = 100, []

        def extra_pages(self, seq, total):
            return 1

        def can_grow_all(self, wants):
            return sum(self.extra_pages(s, t) for s, t in wants) <= self.num_free

    class Sched:
        waiting: list = []

    class Eng:
        num_scheduler_steps, threads, prefix, max_seq_len = 4, None, None, 64
        deployed = type("D", (), {"graph_runner": object()})()
        scheduler, blocks = Sched(), Blocks()

    batch = [ScheduledSeq(Seq(), 1)]
    eng = Eng()
    assert burst_len(eng, batch) == 4
    eng.scheduler.waiting = [Seq()]
    assert burst_len(eng, batch) == 0
    eng.scheduler.waiting = []
    eng.blocks.num_free = 0  # its burst's page cannot be reserved
    assert burst_len(eng, batch) == 0


def test_option_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(None, num_scheduler_steps=0, max_batch_size=1, max_seq_len=64)


def test_pages_a_burst_filled_serve_prefix_hits(target):
    """Prefix caching on (the default): a reply decoded in bursts registers its pages; a second
    request that repeats the prompt and 40 of the reply's tokens hits them (counted) and
    continues as it does without bursts."""
    first = [SamplingParams(max_tokens=48, ignore_eos=True)]
    prompt = target.prompts[2]
    outs = []
    for burst in (1, 8):
        engine = _engine(target, burst)
        assert engine.prefix is not None
        [(reply, _)], calls = _run(engine, [prompt], first)
        assert burst == 1 or calls < 30  # most of its 48 tokens came in bursts
        hits = engine.prefix.hits
        again = [SamplingParams(max_tokens=12, ignore_eos=True)]
        [(cont, _)], _ = _run(engine, [list(prompt) + reply[:40]], again)
        assert engine.prefix.hits > hits  # the second request reused cached pages
        outs.append((reply, cont))
    assert outs[1] == outs[0]
