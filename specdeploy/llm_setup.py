"""What `LLM(...)` checks before it loads anything, and the step graphs it installs after the
build (CUDA graphs on a GPU, recorded kernel calls on the CPU). Beside llm.py to keep that file
the API itself."""
from __future__ import annotations

import os
from collections.abc import Callable

from specdeploy.engine.threads import check_threads


def check_engine_args(*, threads, kernels: str, device, scheduling_policy: str, cuda_graphs,
                      cpu_graphs, max_num_tokens, num_scheduler_steps) -> None:
    """Refuse, by name, engine arguments that cannot work (before minutes of loading)."""
    check_threads(threads, kernels, device)
    from specdeploy.engine.scheduler import POLICIES

    if scheduling_policy not in POLICIES:
        raise ValueError(f"scheduling_policy: must be one of {', '.join(POLICIES)}, got "
                         f"{scheduling_policy!r}")
    if cuda_graphs and not str(device).startswith("cuda"):
        raise ValueError(f"cuda_graphs: needs a CUDA device, got device={device!r}")
    if cpu_graphs and str(device) != "cpu":
        raise ValueError(f"cpu_graphs: needs device='cpu', got device={device!r}")
    if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
        raise ValueError(f"max_num_tokens: must be a positive integer, got {max_num_tokens!r}")
    if not isinstance(num_scheduler_steps, int) or num_scheduler_steps < 1:
        raise ValueError(f"num_scheduler_steps: must be an integer >= 1, got "
                         f"{num_scheduler_steps!r}")


def install_step_graphs(deployed, max_batch_size: int, *, device, cuda_graphs, cpu_graphs,
                        threads, compile: bool, log: Callable[[str], None]) -> None:
    """CUDA graphs on a CUDA device (None: wherever they can serve; True: required), else CPU
    graphs on the CPU (None: on unless steps are eager, threads are governed ("auto": a replay
    holds one thread count), the graph is compiled, or SPECDEPLOY_CPU_GRAPHS=0). Each covers
    the drafter's chain steps too (SPECDEPLOY_DRAFT_GRAPHS=0: not them). Where a default-on
    kind cannot serve, it is logged and left off; where it was asked for, the error stands."""
    from specdeploy.engine.cuda_graphs import install

    drafts = os.environ.get("SPECDEPLOY_DRAFT_GRAPHS", "1") != "0"
    if cuda_graphs or (cuda_graphs is None and str(device).startswith("cuda")):
        try:
            install(deployed, max_batch_size, drafts=drafts)
        except ValueError as e:
            if cuda_graphs:
                raise
            log(f"CUDA graphs off ({e})")
    if cpu_graphs or (cpu_graphs is None and str(device) == "cpu" and cuda_graphs is not False
                      and threads != "auto" and not compile
                      and os.environ.get("SPECDEPLOY_CPU_GRAPHS", "1") != "0"):
        try:
            install(deployed, max_batch_size, capture=True, drafts=drafts)
        except ValueError as e:
            if cpu_graphs:
                raise
            log(f"CPU graphs off ({e})")
