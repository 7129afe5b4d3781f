"""What the batch-invariant pieces of the fast GGUF path cost, one run: a hybrid MoE GGUF with
the fast kernels, as deployed ("invariant": the F32 routers and the graph's sigmoid on
`row_invariant_linears`' kernels, the recurrent ops' exp / softplus / silu on
ops/elementwise.py's) against the same build with those on torch ("torch": the transform
disabled, ops/elementwise.py falling back to torch), in one process, rounds interleaved.

    PYTHONPATH=. .venv/bin/python bench/fast_rows_cost.py [--qtype q8_0] [--rounds 3]
        [--tokens 48] [--prompt 512] [--json-out FILE]

The model is bench/gguf_moe_blocks.py's (a random NemotronH MoE: hidden 512, Mamba2 /
attention / three MoE layers of 32 experts, top 4). Prints JSON: prefill seconds for one
`--prompt`-token prompt, greedy decode tokens/s at batch 1 and 8, per configuration and round,
and the median ratios invariant / torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _llm(path: str, invariant: bool):
    import specdeploy.deploy.build as B
    from specdeploy import LLM

    orig = B.build

    def build(model_path=None, options=None, **kw):
        if not invariant:
            options = dataclasses.replace(
                options, disabled=options.disabled | {"row_invariant_linears"})
        return orig(model_path, options, **kw)

    B.build = build
    try:
        return LLM(path, max_seq_len=1024, spec=None, kernels="fast", max_batch_size=8,
                   enable_prefix_caching=False)  # (every round the same prompts)
    finally:
        B.build = orig


def _torch_math(on: bool):
    """ops/elementwise.py on torch (on) or on its kernels (off)."""
    from specdeploy.ops import row_kernels

    if not hasattr(_torch_math, "orig"):
        _torch_math.orig = row_kernels.elementwise
    row_kernels.elementwise = (lambda name, x: None) if on else _torch_math.orig


def _round(llm, invariant: bool, prompt: int, tokens: int) -> dict:
    import torch

    from specdeploy import SamplingParams

    _torch_math(not invariant)
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 120, (prompt,), generator=g).tolist()
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        out = {"prefill_s": time.perf_counter() - t}
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for batch in (1, 8):
            prompts = [torch.randint(3, 120, (16,), generator=g).tolist() for _ in range(batch)]
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            out[f"decode_tok_s_b{batch}"] = batch * tokens / (time.perf_counter() - t)
        return out
    finally:
        _torch_math(False)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qtype", default="q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    import torch
    from gguf_moe_blocks import write

    with tempfile.TemporaryDirectory() as d:
        path = str(write(Path(d), args.qtype))
        llms = {"invariant": _llm(path, True), "torch": _llm(path, False)}
        info = {k: {i.name: i.detail for i in v.engine.deployed.infos
                    if i.name == "row_invariant_linears"} for k, v in llms.items()}
        rounds = {k: [] for k in llms}
        for r in range(args.rounds):
            order = list(llms) if r % 2 == 0 else list(reversed(llms))
            for name in order:
                rounds[name].append(_round(llms[name], name == "invariant", args.prompt,
                                           args.tokens))
    ratio = {}
    for key in rounds["invariant"][0]:
        per = [a[key] / b[key] for a, b in zip(rounds["invariant"], rounds["torch"])]
        ratio[key] = round(statistics.median(per), 3)
    result = {"machine": platform.machine(), "threads": torch.get_num_threads(),
              "command": "bench/fast_rows_cost.py " + " ".join(sys.argv[1:]),
              "qtype": args.qtype, "transform": info, "rounds": rounds,
              "median_ratio_invariant_over_torch": ratio}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
