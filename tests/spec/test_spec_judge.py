"""The judge of speculation at large batches (engine/spec_judge.py): its trials and decisions on
synthetic steps (exact arithmetic of tokens per second), and an engine whose judge switches
speculation on and off every few steps staying lossless (oracle: the plain engine's greedy
output), its drafter catching up after each stretch off."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.engine import spec_judge as J
from specdeploy.engine.spec_judge import SpecJudge
from tests.spec.tiny_targets import LIMITS, Target


def _hold(judge: SpecJudge, batch: int, steps: int) -> None:
    for _ in range(steps):
        judge.record(batch, judge.on(batch), 1, 1.0)


def _run_trial(judge: SpecJudge, batch: int, on_step, off_step) -> list[bool]:
    """Steps through one whole trial; (tokens, seconds) per step by mode. Returns the modes."""
    modes = []
    for _ in range(2 * J.TRIAL * J.BLOCK):
        on = judge.on(batch)
        modes.append(on)
        judge.record(batch, on, *(on_step if on else off_step))
    return modes


def test_a_trial_alternates_blocks_then_keeps_the_faster_mode():
    judge = SpecJudge(frozenset(range(16, 21)), 8)
    _hold(judge, 17, J.FIRST)  # the calibration's mode (off) first, untried
    assert not judge.on(17) and judge.state() == {32: "off (trial)"}
    # on: 20 tokens in 10 ms (2,000 tok/s); off: 16 in 9 ms (1,778): on wins
    modes = _run_trial(judge, 17, (20, 0.010), (16, 0.009))
    assert modes[:J.BLOCK] == [False] * J.BLOCK  # started from the calibration's off
    assert modes[J.BLOCK:2 * J.BLOCK] == [True] * J.BLOCK
    assert sum(modes) == J.TRIAL * J.BLOCK and judge.trials == 1
    assert judge.on(17) and judge.on(32) and judge.state() == {32: "on"}
    assert not judge.on(16)  # another bucket: 9-16, still the calibration's
    for _ in range(J.HOLD - 1):  # held, whatever the steps now say
        judge.record(17, True, 1, 1.0)
        assert judge.on(17)
    judge.record(17, True, 1, 1.0)
    assert judge.state() == {16: "off", 32: "on (trial)"}  # and tried again
    modes = _run_trial(judge, 18, (17, 0.010), (16, 0.009))  # 1,700 vs 1,778: off now
    assert modes[0] is True and not judge.on(18) and judge.trials == 2


def test_speculation_must_win_by_the_margin():
    judge = SpecJudge(frozenset(), 8)
    _hold(judge, 8, J.FIRST)
    _run_trial(judge, 8, (1000 * (1 + J.MARGIN / 2), 1.0), (1000, 1.0))
    assert not judge.on(8)
    judge = SpecJudge(frozenset(), 8)
    _hold(judge, 8, J.FIRST)
    _run_trial(judge, 8, (1000 * (1 + 2 * J.MARGIN), 1.0), (1000, 1.0))
    assert judge.on(8)


def test_small_batches_keep_the_calibration_and_stale_steps_do_not_count():
    judge = SpecJudge(frozenset(range(4, 9)), 8)
    assert judge.on(3) and not judge.on(4)  # below min_batch: the prior, never trialled
    judge.record(4, False, 1, 1.0)
    assert judge.state() == {}
    assert [J.bucket_of(b) for b in (8, 9, 15, 16, 17, 32, 33)] == [8, 16, 16, 16, 32, 32, 64]
    judge = SpecJudge(frozenset(), 8)
    _hold(judge, 12, J.FIRST)
    assert judge.on(12)
    judge.record(12, False, 10**6, 1e-6)  # planned off before this block began: ignored
    judge.record(12, True, 1, 1.0)
    assert judge._bucket(12).tokens_off == 0 and judge._bucket(12).tokens_on == 1
    judge.record(12, True, 1, 0.0)  # no time measured: ignored
    assert judge._bucket(12).tokens_on == 1


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_an_engine_switching_every_few_steps_is_lossless(tmp_path, monkeypatch, arch):
    """12 sequences (batch >= 8: judged), trials of 2-step blocks and holds of 3 steps: the
    drafter is switched off and on dozens of times (its rows deferred, then caught up)."""
    monkeypatch.setattr(J, "BLOCK", 2)
    monkeypatch.setattr(J, "TRIAL", 2)
    monkeypatch.setattr(J, "HOLD", 3)
    monkeypatch.setattr(J, "FIRST", 2)
    target = Target(arch, tmp_path)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = (target.prompts * 3)[:12]
    limits = {**LIMITS, "max_batch_size": 12}
    plain = [o.token_ids for o in LLM(str(target.path), **limits).generate(prompts, params)]
    llm = LLM(str(target.path), spec=target.spec(3, controller="cost"), **limits)
    judge = llm.engine.judge
    assert judge is not None
    seen, record = [], judge.record

    def spy(batch, on, tokens, seconds):
        seen.append(on)
        record(batch, on, tokens, seconds)

    judge.record = spy
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert judge.trials >= 2 and True in seen and False in seen
    assert llm.stats()["spec_judged_batches"]
