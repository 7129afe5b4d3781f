"""The CPU thread count, chosen between engine steps by measuring (`LLM(threads="auto")`).

Why: a decode step of a small model is a few milliseconds of many short parallel regions; every
region ends at a barrier, so when one of the step's threads loses its core to another process
(a browser, a build, a test run on a laptop's 2 cores), the whole step waits for it. Measured on
a 2-core machine with one other busy process: 2 threads fell from ~90 to 1-6 tokens/s, 1
thread kept ~90 (llama.cpp: 66 -> 0.3). No fixed count is right on a shared machine, so the
governor runs a short trial now and then, alternating the two counts step by step (adjacent
steps see nearly the same batch), and keeps the faster.

Trials are rare while they confirm the current count (the gap doubles up to `max_every`
steps) and come at once when the steps turn much slower (`slow`: 1.5x) than the current
count's recent median (another process just started). Only decode and verify steps (up to
`max_rows` rows) are measured; prefill steps run at the current count.

Lossless: switching is only offered where the kernels are thread-invariant (the fast kernels:
an output never depends on the thread count, tested in tests/ops), so greedy output is the same
tokens whatever the governor picks. Trial steps at the other count are not shown to the cost
controller (their timings belong to another count).
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable


class ThreadGovernor:
    """`high`: the configured thread count; `low`: the fallback (1). `set_threads(n)` applies a
    count (torch.set_num_threads: every kernel reads it per call), `get_threads()` (optional)
    reads it back (torch.get_num_threads). `trialing` is true during
    a step at the other count; `as_dict` reports the choice."""

    def __init__(self, high: int, low: int = 1, *, set_threads: Callable[[int], None],
                 get_threads: Callable[[], int] | None = None, every: int = 128,
                 max_every: int = 4096, trial: int = 4, margin: float = 0.1,
                 slow: float = 1.5, max_rows: int = 64):
        if high < 1 or low < 1:
            raise ValueError(f"threads: must be >= 1, got high={high} low={low}")
        self.high, self.low = high, low
        self.current = high
        self.set_threads, self.get_threads = set_threads, get_threads
        self.base_every, self.max_every, self.every = every, max_every, every
        self.trial, self.margin, self.slow, self.max_rows = trial, margin, slow, max_rows
        self._since = 0  # measured steps since the last trial
        self._recent: deque[float] = deque(maxlen=16)  # the current count's per-row seconds
        self._plan: list[int] = []  # the counts of the trial's steps still to run
        self._trial: dict[int, list[float]] = {}
        self._step_count: int | None = None  # the count this step runs at (None: unmeasured)
        self._applied = high
        self.switches = 0
        self.trials = 0
        set_threads(high)

    @property
    def trialing(self) -> bool:
        """This step runs at another count than the chosen one (a trial step)."""
        return self._step_count is not None and self._step_count != self.current

    def before_step(self, rows: int) -> None:
        """Called before a step of `rows` rows: sets its thread count."""
        if self.low == self.high or rows > self.max_rows or rows < 1:
            self._step_count = None
            self._apply(self.current)
            return
        if not self._plan and self._due():
            self._start_trial()
        n = self._plan[0] if self._plan else self.current
        self._apply(n)
        self._step_count = n

    def after_step(self, rows: int, seconds: float) -> None:
        """The step set up by `before_step` took `seconds`."""
        n, self._step_count = self._step_count, None
        if n is None or not seconds > 0:
            return
        per_row = seconds / max(rows, 1)
        if self._plan:
            self._plan.pop(0)
            self._trial.setdefault(n, []).append(per_row)
            if not self._plan:
                self._decide()
            return
        self._since += 1
        self._recent.append(per_row)

    def _apply(self, n: int) -> None:
        # NOTE: with `get_threads`, the count actually set (others may set it in between)
        if n != (self.get_threads() if self.get_threads is not None else self._applied):
            self.set_threads(n)
            self._applied = n

    # ---- internals ------------------------------------------------------------------------------
    def _due(self) -> bool:
        if self._since >= self.every:
            return True
        # a sudden slowdown: the last 3 steps' median `slow` times the median before them
        # (NOTE: not each of the 3: under load the N-thread steps swing 2-15x, some below)
        r = list(self._recent)
        if len(r) >= 8:
            return statistics.median(r[-3:]) > self.slow * statistics.median(r[:-3])
        return False

    def _start_trial(self) -> None:
        other = self.low if self.current == self.high else self.high
        self._plan = [other, self.current] * self.trial  # alternating: the same batches
        self._trial = {}
        self.trials += 1

    def _decide(self) -> None:
        other = self.low if self.current == self.high else self.high
        mine = statistics.median(self._trial.get(self.current, [float("inf")]))
        theirs = statistics.median(self._trial.get(other, [float("inf")]))
        self._since = 0
        self._recent.clear()
        if theirs < (1.0 - self.margin) * mine:
            self.current = other
            self.switches += 1
            self.every = self.base_every
        else:
            self.every = min(2 * self.every, self.max_every)

    def as_dict(self) -> dict:
        return {"threads": self.current, "thread_trials": self.trials,
                "thread_switches": self.switches, "thread_trial_every": self.every}


def check_threads(threads, kernels: str, device) -> None:
    """`LLM(threads=)`: None, a positive count, or "auto" (fast kernels on the CPU only)."""
    if threads is None:
        return
    if isinstance(threads, bool) or not (threads == "auto" or isinstance(threads, int)):
        raise ValueError(f"threads: must be a positive integer or 'auto', got {threads!r}")
    if isinstance(threads, int) and threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    if threads == "auto" and (kernels != "fast" or not str(device).startswith("cpu")):
        raise ValueError("threads='auto' needs kernels='fast' on the CPU (thread-invariant "
                         f"kernels), got kernels={kernels!r} device={device!r}")
