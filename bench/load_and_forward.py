"""Load time of the default model and a 512-token full-sequence forward, ours vs transformers.

    .venv/bin/python bench/load_and_forward.py [--tokens 512] [--reps 5] [--load-reps 3]
                                              [--skip-hf-load] [--threads N]

Load: `specdeploy.load_model(None)` (GGUF Q4_1 → fp32) vs `AutoModelForCausalLM.from_pretrained(
dir, gguf_file=...)`, wall time in this process after imports. Forward: logits of one [1, T]
sequence, fp32, inference mode, median over `--reps` (interleaved) after a warm-up, both with the
same weights (transformers' own GGUF load, or ours re-exported with --skip-hf-load). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


CPU_S: list[float] = []  # process CPU seconds of every timed call, in order


def timed(fn, reps: int) -> tuple[list[float], object]:
    """Wall seconds per call; the CPU seconds go to CPU_S (steadier on a shared machine)."""
    times, out = [], None
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t)
        CPU_S.append(time.process_time() - c)
    return times, out


def hf_from_ours(ours):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.default_model import default_model_path
    from specdeploy.models import llama

    cfg = open_checkpoint(default_model_path()).config
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.load_state_dict(llama.params_to_checkpoint(ours.state_dict(), ours.cfg), strict=False)
    model.tie_weights()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--load-reps", type=int, default=3)
    ap.add_argument("--skip-hf-load", action="store_true", help="skip transformers' GGUF load")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from specdeploy.default_model import DEFAULT_GGUF, default_model_path
    from specdeploy.loading import load_model

    load_ours, ours = timed(lambda: load_model(None), args.load_reps)
    load_cpu = CPU_S[-args.load_reps:]
    result = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "python": platform.python_version()},
        "command": " ".join([sys.executable, *sys.argv]),
        "load_s": {"ours_median": statistics.median(load_ours), "ours_all": load_ours,
                   "ours_cpu_median": statistics.median(load_cpu)},
    }
    if args.skip_hf_load:
        hf = hf_from_ours(ours)
    else:
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as d:
            (Path(d) / DEFAULT_GGUF).symlink_to(default_model_path())
            (t_hf,), hf = timed(lambda: AutoModelForCausalLM.from_pretrained(
                d, gguf_file=DEFAULT_GGUF, dtype=torch.float32).eval(), 1)
        result["load_s"].update(transformers=t_hf, transformers_cpu=CPU_S[-1],
                                ratio=statistics.median(load_ours) / t_hf)

    ids = torch.randint(0, ours.cfg.vocab_size, (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    fwd_ours, fwd_hf, cpu_ours, cpu_hf = [], [], [], []
    with torch.inference_mode():
        a, b = ours(ids), hf(ids).logits  # warm-up, and the two must agree
        for _ in range(args.reps):  # interleaved, so both see the same machine noise
            fwd_ours += timed(lambda: ours(ids), 1)[0]
            cpu_ours.append(CPU_S[-1])
            fwd_hf += timed(lambda: hf(ids).logits, 1)[0]
            cpu_hf.append(CPU_S[-1])
    med_ours, med_hf = statistics.median(fwd_ours), statistics.median(fwd_hf)
    result["forward_s"] = {"tokens": args.tokens, "ours_median": med_ours,
                           "transformers_median": med_hf, "ratio": med_ours / med_hf,
                           "cpu_ratio": statistics.median(cpu_ours) / statistics.median(cpu_hf),
                           "ours_all": fwd_ours, "transformers_all": fwd_hf,
                           "max_abs_logit_diff": (a - b).abs().max().item()}
    result["load_avg_1m"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
