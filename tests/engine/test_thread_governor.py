"""engine/threads.py: the thread governor picks the count that is faster now, and switching
counts between steps leaves greedy output unchanged on the fast kernels.

Oracles: synthetic step costs by thread count (exact: the governor only sees the seconds it is
given), and the same deployment's greedy tokens at a fixed thread count."""
from __future__ import annotations

import pytest
import torch

from specdeploy.engine.threads import ThreadGovernor


class Machine:
    """Per-row seconds by thread count; `set_threads` records every switch."""

    def __init__(self, cost: dict[int, float]):
        self.cost, self.applied, self.at = dict(cost), [], 2

    def set_threads(self, n: int) -> None:
        self.applied.append(n)
        self.at = n

    def run(self, gov: ThreadGovernor, steps: int, rows: int = 1) -> list[int]:
        """The thread count of every step."""
        counts = []
        for _ in range(steps):
            gov.before_step(rows)
            counts.append(self.at)
            gov.after_step(rows, self.cost[self.at] * rows)
        return counts


def test_idle_machine_keeps_the_configured_count_and_backs_off_its_trials():
    m = Machine({2: 1.0, 1: 1.6})
    gov = ThreadGovernor(2, 1, set_threads=m.set_threads, every=16, max_every=128, trial=2)
    counts = m.run(gov, 16 + 4 + 32 + 4 + 64 + 4 + 128 + 4 + 100)
    assert gov.current == 2 and gov.switches == 0
    assert gov.trials == 4 and gov.every == 128  # 16 -> 32 -> 64 -> 128 (capped)
    assert counts.count(1) == 4 * 2  # each trial: 2 steps at the other count
    assert counts[:16] == [2] * 16


def test_a_contended_machine_switches_to_one_thread_and_back_when_the_load_goes():
    m = Machine({2: 1.0, 1: 1.6})
    gov = ThreadGovernor(2, 1, set_threads=m.set_threads, every=64, trial=2)
    m.run(gov, 30)
    m.cost[2] = 40.0  # another process takes a core: the 2-thread barriers wait on it
    counts = m.run(gov, 3 + 4 + 10)
    # the slowdown starts a trial at once (3 slow steps; not the 64-step gap), 1 thread wins
    assert gov.current == 1 and gov.switches == 1
    assert counts[-10:] == [1] * 10
    m.cost[2] = 1.0  # the load is gone: the next trial (64 steps on) goes back to 2 threads
    m.run(gov, 64 + 4 + 5)
    assert gov.current == 2 and gov.switches == 2


def test_a_count_set_by_someone_else_is_set_back():
    """With `get_threads`, the count actually set is read back: another caller's
    torch.set_num_threads between steps does not leave the chosen count's steps at it."""
    m = Machine({2: 40.0, 1: 1.6})
    gov = ThreadGovernor(2, 1, set_threads=m.set_threads, get_threads=lambda: m.at, every=8,
                         trial=1)
    m.run(gov, 8 + 2 + 2)
    assert gov.current == 1
    m.at = 2  # e.g. another deployment in the process set its own count
    assert m.run(gov, 3) == [1, 1, 1]


def test_prefill_steps_run_at_the_current_count_unmeasured():
    m = Machine({2: 1.0, 1: 1.6})
    gov = ThreadGovernor(2, 1, set_threads=m.set_threads, every=4, trial=1, max_rows=64)
    counts = m.run(gov, 50, rows=500)  # prefill chunks only: no trial ever starts
    assert set(counts) == {2} and gov.trials == 0
    with pytest.raises(ValueError, match="threads: must be >= 1"):
        ThreadGovernor(0, 1, set_threads=m.set_threads)


def test_switching_threads_between_steps_keeps_greedy_tokens(tmp_path, monkeypatch):
    """A governor that tries the other count every other step (so most steps alternate 2, 1):
    the same tokens as a fixed count, plain and with n-gram lookup verify steps, two
    sequences at once; the controller never learns from a trial step."""
    from specdeploy import LLM, SamplingParams, SpecConfig
    from specdeploy import tokenizer as tok_mod
    from specdeploy.models import llama
    from specdeploy.ops.ggml_linear import kernel_unavailable
    from tests.checkpoint.test_gguf import Q, _tiny_llama_gguf

    if kernel_unavailable() is not None:
        pytest.skip(f"ggml kernels unavailable: {kernel_unavailable()}")
    src = llama.make_tiny(tmp_path / "st", seed=7)
    path = _tiny_llama_gguf(src, tmp_path / "tiny.gguf", Q.Q4_1)
    real = tok_mod.load_tokenizer
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))  # tiny GGUF: no vocab
    prompts = [[5, 6, 7, 8] * 6, list(range(10, 30))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        for spec in (None, SpecConfig("ngram", 4, prompt_lookup_num_tokens=6)):
            llm = LLM(str(path), max_batch_size=2, max_seq_len=96, kernels="fast", spec=spec,
                      threads=1)
            want = [o.token_ids for o in llm.generate(prompts, params)]
            seen = []

            def set_threads(n, seen=seen):
                seen.append(n)
                torch.set_num_threads(n)

            gov = ThreadGovernor(2, 1, set_threads=set_threads, every=1, max_every=1, trial=1,
                                 margin=-1e6)  # every trial "wins": the count flips each time
            llm.engine.threads = gov
            got = [o.token_ids for o in llm.generate(prompts, params)]
            assert got == want
            assert gov.trials >= 3 and gov.switches >= 3 and {1, 2} <= set(seen)
            assert {"threads", "thread_trials", "thread_switches"} <= set(llm.stats())
    finally:
        torch.set_num_threads(before)


def test_threads_option_is_checked():
    from specdeploy import LLM
    from specdeploy.cli_args import threads_arg

    with pytest.raises(ValueError, match="threads='auto' needs kernels='fast' on the CPU"):
        LLM(threads="auto", kernels="exact")
    with pytest.raises(ValueError, match="threads: must be >= 1, got 0"):
        LLM(threads=0)
    with pytest.raises(ValueError, match="threads: must be a positive integer or 'auto'"):
        LLM(threads="many")
    assert threads_arg("auto") == "auto" and threads_arg("3") == 3
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="got 'x'"):
        threads_arg("x")
