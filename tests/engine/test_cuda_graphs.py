"""engine/cuda_graphs.py on the CPU: its padded, static-shaped decode steps run eagerly
(`capture=False`, the one part a CPU can check) and leave greedy output as it was; the steps it
must not take are left to the eager path; what it cannot serve is refused."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.cache.metadata import SEG_EXTEND, Segment, build_metadata
from specdeploy.engine.cuda_graphs import install
from tests.spec.tiny_targets import LIMITS, METHODS, Target


@pytest.fixture(scope="module", params=sorted(METHODS))
def target(request, tmp_path_factory) -> Target:
    return Target(request.param, tmp_path_factory.mktemp("graphs"))


_DEPLOYED: dict = {}  # (target, runner, device, K, drafts, opts) -> (deployment, its runner)


def _deployed(target, runner: bool, device: str, spec: int, drafts: bool, opts: dict):
    """A deployment (and its runner) built once per target and options, its runners' counts
    zeroed: building (export) is most of these tests' time, and each run takes a fresh Engine
    (empty pages and slots; prefills start from position 0 and a zero recurrent state)."""
    from specdeploy.deploy.build import build

    key = (id(target), runner, device, spec, drafts, tuple(sorted(opts.items())))
    if key not in _DEPLOYED:
        dep = build(str(target.path), vision=False, device=device,
                    spec=target.spec(spec) if spec else None, **LIMITS, **opts)
        capture = None if device.startswith("cuda") else False  # a CUDA device captures
        run = install(dep, LIMITS["max_batch_size"], capture=capture,
                      drafts=drafts) if runner else None
        if run is not None:  # the drafter programs, for the tests that look at their runners
            run.test_drafts = list(getattr(dep, "drafts", ()))
        _DEPLOYED[key] = dep, run
    dep, run = _DEPLOYED[key]
    for r in [run] + [getattr(d, "graph_runner", None) for d in getattr(run, "test_drafts", ())]:
        if r is not None:
            r.replays, r.replays_by_tokens = 0, type(r.replays_by_tokens)()
    return dep, run


def _greedy(target, runner: bool, device: str = "cpu", spec: int = 0, drafts: bool = False,
            oracle: list[list[int]] | None = None, on_device: bool = True,
            max_tokens: int = 16, **opts):
    """Greedy tokens of 3 prompts (decode steps of 3 sequences pad to the bucket of 4), from an
    Engine over a text-only deployment (the tiny Qwen3.5 has a vision tower)."""
    from specdeploy.engine import Engine

    dep, run = _deployed(target, runner, device, spec, drafts, opts)
    if spec:
        from specdeploy.engine.speculative import SpecEngine as Engine
    engine = Engine(dep, max_batch_size=LIMITS["max_batch_size"])
    if spec and hasattr(engine.own_source, "on_device"):
        engine.own_source.on_device = on_device
    if oracle is not None:  # drafts that are all accepted (the drafter's own still run)
        prompts = target.prompts[:3]

        def next_tokens(seq, k):
            i = next(i for i, p in enumerate(prompts) if seq.all_ids[:len(p)] == list(p))
            done = len(seq.all_ids) - len(prompts[i])
            return oracle[i][done:done + k]

        engine.fix_drafts(next_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in target.prompts[:3]]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids], run


def test_greedy_unchanged_through_the_padded_steps(target):
    want, _ = _greedy(target, runner=False)
    got, runner = _greedy(target, runner=True)
    assert runner.buckets == (1, 2, 4, 8)
    assert got == want
    assert runner.replays >= 10  # most steps were decode steps, each through the runner


def test_greedy_spec_through_the_padded_verify_steps(target):
    """Fixed K = 3: every step after the prefills verifies 1 + 3 tokens per sequence."""
    want, _ = _greedy(target, runner=False)
    got, runner = _greedy(target, runner=True, spec=3)
    assert got == want
    assert runner.replays >= 3


def test_greedy_spec_with_drafter_steps_through_the_runner(target):
    """The drafter programs' runners too (`drafts=True`): their one-token chain steps and the
    catch-ups of several tokens after a verify step (every row's logits, the last taken) go
    through the padded static path (hidden rows padded with zeros) and greedy output stays
    plain's."""
    want, _ = _greedy(target, runner=False)
    got, runner = _greedy(target, runner=True, spec=3, drafts=True)
    assert got == want
    # drafts that are all accepted: the drafter's catch-ups after them are 1 + 3 tokens
    got, oracle_runner = _greedy(target, runner=True, spec=3, drafts=True, oracle=want)
    assert got == want
    catch_ups = sum(n for d in oracle_runner.test_drafts
                    for k, n in d.graph_runner.replays_by_tokens.items() if k > 1)
    assert catch_ups >= 3, [d.graph_runner.replays_by_tokens for d in oracle_runner.test_drafts]
    drafts = [d.graph_runner for d in runner.test_drafts]
    assert drafts and all(r is not None and r.takes_hidden for r in drafts)
    assert sum(r.replays for r in drafts) >= 3
    assert not runner.takes_hidden


def test_drafter_chain_on_the_device_drafts_what_the_host_chain_drafts(target, monkeypatch):
    """`ModelDrafter._chain_on_device` (each draft fed to the next chain step on the device,
    one host copy of the drafts at the end) proposes, step for step, the drafts of the host
    chain (a sync and a host-built input per step), and greedy output stays plain's."""
    chain_drafts_match(target, monkeypatch)


def chain_drafts_match(target, monkeypatch, **opts):
    from specdeploy.engine.drafting import ModelDrafter
    from specdeploy.engine.speculative import SpecEngine

    seen, taken = [], []
    verify, chain = SpecEngine._verify, ModelDrafter._chain_on_device

    def record(self, batch, segs, out):
        seen[-1].append([list(s.seq.spec.drafts) for s in batch])
        return verify(self, batch, segs, out)

    def count(self, *a):
        took = chain(self, *a)
        taken[-1] += took
        return took

    monkeypatch.setattr(SpecEngine, "_verify", record)
    monkeypatch.setattr(ModelDrafter, "_chain_on_device", count)
    want, _ = _greedy(target, runner=False, **opts)
    runs = []
    for on_device in (False, True):
        seen.append([])
        taken.append(0)
        runs.append(_greedy(target, runner=True, spec=3, drafts=True, on_device=on_device,
                            **opts)[0])
    assert runs[0] == runs[1] == want
    assert taken[0] == 0 and taken[1] >= 3
    assert seen[1] == seen[0]
    assert sum(len(d) for step in seen[1] for d in step) >= 9  # drafts were made and compared


def test_deferred_catch_ups_replay_in_pieces(target, monkeypatch):
    """A controller that never drafts but probes (a synthetic cost model where drafts never
    pay; rejected probes double the gap to 8, 16, 32 steps) defers the drafter's catch-up: the
    probes' catch-ups of 4..32 rows replay in pieces (`_catch_up_pieces`), and give the
    last-row logits and hidden state (and the drafts) of one eager forward over all the rows."""
    deferred_pieces_match(target, monkeypatch)


def deferred_pieces_match(target, monkeypatch, **opts):
    from specdeploy.engine.drafting import ModelDrafter
    from specdeploy.engine.spec_control import CostController
    from specdeploy.engine.speculative import SpecEngine
    from tests.spec.test_spec_controller import NEVER

    seen, heads = [], []
    verify, init, chain = SpecEngine._verify, SpecEngine.__init__, ModelDrafter._chain_on_device

    def catch_up(self, drafting, logits, hidden):  # the catch-up's last rows, each probe
        heads[-1].append((logits.clone(), hidden.clone()))
        return chain(self, drafting, logits, hidden)

    def record(self, batch, segs, out):
        seen[-1].append([list(s.seq.spec.drafts) for s in batch])
        return verify(self, batch, segs, out)

    def never(self, *a, **kw):  # every engine _greedy builds: the synthetic controller
        init(self, *a, **kw)
        self.set_controller(CostController(NEVER, self.k, self.max_k))

    monkeypatch.setattr(SpecEngine, "_verify", record)
    monkeypatch.setattr(SpecEngine, "__init__", never)
    monkeypatch.setattr(ModelDrafter, "_chain_on_device", catch_up)
    # the deferrals here are 4, 8, 16 rows (the probe gaps): one piece each; pieces of 3 rows
    # at most put every catch-up in several, as longer odd deferrals are
    monkeypatch.setattr(ModelDrafter, "_pieces",
                        lambda self, n: [3] * (n // 3) + [n % 3] * bool(n % 3))
    runs = []
    for drafts in (False, True):  # drafter programs eager / through their runners
        seen.append([])
        heads.append([])
        runs.append(_greedy(target, runner=True, spec=3, drafts=drafts, max_tokens=64,
                            **opts))
    (eager, _), (pieces, runner) = runs
    assert pieces == eager
    assert seen[1] == seen[0]
    assert len(heads[1]) == len(heads[0]) >= 4
    for (lw, hw), (lg, hg) in zip(heads[0], heads[1]):  # fp32; pieces vs one forward
        torch.testing.assert_close(lg, lw, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hg, hw, rtol=1e-4, atol=1e-4)
    pieces = sum(n for d in runner.test_drafts for k, n in d.graph_runner.replays_by_tokens.items()
                 if k == 3)
    assert pieces >= 6  # the deferrals' pieces replayed
    assert sum(len(d) for step in seen[1] for d in step) >= 3  # probes drafted


def test_only_uniform_steps_are_taken(target):
    from specdeploy.deploy.build import build

    runner = install(build(str(target.path), vision=False, **LIMITS), 8, capture=False)
    pages = list(range(4))
    decode = build_metadata([Segment([5], 3, pages, 0), Segment([6], 9, pages, 1)])
    assert runner.bucket(decode) == 2
    assert runner.bucket(build_metadata([Segment([5], 3, pages, 0)] * 3)) == 4
    verify = build_metadata([Segment([5, 6], 3, pages, 0, 2, SEG_EXTEND)] * 3)
    assert runner.bucket(verify) == 4
    prefill = build_metadata([Segment([5, 6, 7], 0, pages, 0)])
    ragged = build_metadata([Segment([5, 6], 3, pages, 0, 2, SEG_EXTEND),
                             Segment([5, 6, 7], 3, pages, 1, 3, SEG_EXTEND)])
    one_logit = build_metadata([Segment([5, 6], 3, pages, 0, 1, SEG_EXTEND)])
    fresh = build_metadata([Segment([5], 0, pages, 0)])
    ckpt = build_metadata([Segment([5], 3, pages, 0, ckpt=[(0, 1)])])
    nine = build_metadata([Segment([5], 3, pages, i % 8) for i in range(9)])
    for meta in (prefill, ragged, one_logit, fresh, ckpt, nine):
        assert runner.bucket(meta) is None
        assert runner.bucket(replace(meta, lists=None)) is None  # the tensor path agrees
    for meta, b in ((decode, 2), (verify, 4)):
        assert runner.bucket(replace(meta, lists=None)) == b
    static = runner._static(decode, 2)
    assert static.page_table.shape == (2, 4)  # its width bucket (max_pages: 4 or 16 here)
    if runner.max_pages > 5:  # page size 16: a row of 5 pages widens to 8, not to max_pages
        five = runner._static(build_metadata([Segment([5], 3, list(range(5)), 0)]), 1)
        assert five.page_table.shape == (1, 8) and runner.max_pages > 8
        assert five.page_table[0, :5].tolist() == list(range(5))
        assert not five.page_table[0, 5:].any()
    three = runner._static(build_metadata([Segment([5], 3, pages, 0)] * 3), 4)
    assert three.slot_idx.tolist() == [0, 0, 0, runner.scratch_slot]
    assert (three.page_table[3] == runner.scratch_page).all()


def _feed_cases(ps: int) -> dict[str, list[Segment]]:
    """Replayable steps: padded or not, decode or verify, rows of different page counts."""
    return {
        "decode_1": [Segment([7], ps + 3, [4, 9], 2)],
        "decode_3_padded": [Segment([5], 3, [1], 0), Segment([6], 2 * ps + 1, [2, 6, 3], 1),
                            Segment([8], ps, [5, 7], 3)],
        "decode_5_pages": [Segment([5], 4 * ps + 2, [1, 2, 3, 4, 8], 0)],
        "verify_2x4": [Segment([5, 6, 7, 8], 9, [3], 0, 4, SEG_EXTEND),
                       Segment([1, 2, 3, 4], ps + 5, [6, 2], 1, 4, SEG_EXTEND)],
        "verify_3x2_padded": [Segment([5, 6], 3 + i, [i + 1], i, 2, SEG_EXTEND)
                              for i in range(3)],
    }


@pytest.mark.parametrize("case", list(_feed_cases(16)))
def test_host_list_feed_equals_the_tensor_path(target, case):
    """graph_feed over the step's host lists gives the graph the same buffer, page width and
    bucket as padding, widening and concatenating its tensors (the path without lists)."""
    from specdeploy.engine.graph_feed import static_width

    dep, runner = _deployed(target, True, "cpu", 0, False, {})
    segs = _feed_cases(runner.page_size)[case]
    meta = build_metadata(segs)
    bare = replace(meta, lists=None)
    b = runner.bucket(meta)
    if max(len(s.pages) for s in segs) > runner.max_pages:  # past max_seq_len: eager, both
        assert b is None and runner.bucket(bare) is None
        return
    assert b is not None and b == runner.bucket(bare)
    static = runner._static(bare, b)
    want = torch.cat([t.reshape(-1) for t in dep_target(dep).device_inputs(static).values()])
    width = static_width(meta.lists, meta.num_tokens // meta.num_seqs, b, runner.page_size,
                         runner.widths)
    assert width == static.page_table.shape[1]
    assert runner.feed(meta, b, width) == want.tolist()


def dep_target(dep):
    return getattr(dep, "target", dep)


def test_page_widths():
    """Graphs are captured per page-table width: powers of two, then max_seq_len's pages."""
    from specdeploy.engine.cuda_graphs import page_widths

    assert page_widths(1) == (1,)
    assert page_widths(8) == (1, 2, 4, 8)
    assert page_widths(10) == (1, 2, 4, 8, 10)
    assert page_widths(16) == (1, 2, 4, 8, 16)


def test_refused_where_it_cannot_run(target):
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(str(target.path), cuda_graphs=True, **LIMITS)  # the CPU
    from specdeploy.deploy.build import build

    dep = build(str(target.path), **LIMITS)  # (the tiny Qwen3.5: a vision-language target)
    with pytest.raises(ValueError, match="needs a CUDA"):
        install(dep, 8)
    assert getattr(dep, "target", dep).graph_runner is None


def test_cli_flag():
    from specdeploy.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--cuda-graphs"])
    assert args.cuda_graphs is True
    assert torch.device("cpu").type == "cpu"


def test_catch_up_pieces_lengths():
    """Pieces of a catch-up: lengths 1..K + 1 or powers of two, longest first, summing to n."""
    from specdeploy.engine.drafting import ModelDrafter

    d = ModelDrafter.__new__(ModelDrafter)
    d.k = 3
    assert d._pieces(5) == [4, 1]
    assert d._pieces(13) == [8, 4, 1]
    assert d._pieces(33) == [32, 1]
    assert d._pieces(64) == [32, 32]
    d.k = 5
    assert d._pieces(7) == [6, 1]
    for n in range(1, 65):
        got = d._pieces(n)
        assert sum(got) == n and all(z <= 6 or z & (z - 1) == 0 for z in got)
