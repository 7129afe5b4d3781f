"""specdeploy against llama.cpp on the same GGUF, batch size 1, greedy, in one process.

Set-up (once; builds llama-cpp-python from its sdist, ~10 min on 2 cores, see the script for
the CPU flags it builds with):

    PYTHON=.venv/bin/python bash bench/setup_llamacpp.sh            # into that environment
    PYTHON=.venv/bin/python bash bench/setup_llamacpp.sh DIR        # or into DIR (then put DIR
                                                                    # on PYTHONPATH)
Run:

    .venv/bin/python bench/vs_llamacpp.py [--model GGUF] [--prompts 6] [--max-tokens 128]
        [--rounds 3] [--threads N] [--configs plain,eager,lookup,mtp+lookup,eagle3]
        [--kernels exact,fast] [--spec-kernels fast] [--our-isa native|avx2] [--note TEXT]
        [--json-out FILE]

Every system gets the same prompt token ids: held-out ShareGPT first turns with the model's
chat template applied (bench/acceptance.py `heldout_prompts`), each run decoding exactly
--max-tokens new tokens greedily (EOS ignored, so every system makes as many tokens). All
configurations are built first; then each round sends every prompt through every configuration
in turn, the order shuffled by prompt and round (seeded; interleaved: a busy machine slows all
alike, and no configuration always follows the same one). Reported per configuration: the median
over rounds of the end-to-end rate (new tokens / wall time, prefill included) and of the decode
rate (tokens after the first / time after the first), and the medians of per-round ratios to
llama.cpp (each round's ratio taken within the round). The JSON carries the CPU model and flags,
the thread count, the load average before and after (other work on the machine), and how far
each configuration's tokens agree with llama.cpp's.

`--our-isa avx2` caps our kernels at what an AVX2-only CPU runs (the tiled linears'
SPECDEPLOY_GGML_ISA=avx2, the row kernels' AVX2 clones, attention without the AVX512-BF16 dot
products) on a machine that has more, to measure that path; llama.cpp keeps its own build.

Memory: every configuration is a deployment of its own, all alive at once. Before one copy of
the weights (issue 21) each took ~1 GB (fp32 + packed copies) and the full default set was
OOM-killed on a shared 24 GB machine; now a default-model deployment holds its GGUF blocks only
(~0.3 GB resident beyond torch; bench/memory.py).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402
from fast_kernels_agreement import first_divergence  # noqa: E402

from specdeploy import LLM, SamplingParams, SpecConfig  # noqa: E402
from specdeploy.bench import machine, peak_rss_mib, print_json  # noqa: E402
from specdeploy.engine.lookup import NgramIndex  # noqa: E402

# the CPU drafter precision (spec_auto._CPU_DRAFTER): a draft step is bound by reading its weights
DRAFTER = dict(draft_quantize="q8_0")
FIXED = dict(controller="off")  # fixed K: every step verifies K drafts
SPECS = {
    "lookup": lambda: SpecConfig("ngram", 3, prompt_lookup_num_tokens=16, **FIXED),
    "mtp+lookup": lambda: SpecConfig("mtp", 3, prompt_lookup_max=4, prompt_lookup_num_tokens=16,
                                     **FIXED, **DRAFTER),
    "eagle3": lambda: SpecConfig("eagle3", 3, **FIXED, **DRAFTER),
    "eagle3+lookup": lambda: SpecConfig("eagle3", 3, prompt_lookup_max=4,
                                        prompt_lookup_num_tokens=16, **FIXED, **DRAFTER),
    # the same with the cost controller (engine/spec_control.py), and what "auto" resolves to
    "lookup+ctl": lambda: SpecConfig("ngram", 3, prompt_lookup_num_tokens=16, controller="cost"),
    "mtp+lookup+ctl": lambda: SpecConfig("mtp", 3, prompt_lookup_max=4,
                                         prompt_lookup_num_tokens=16, controller="cost",
                                         **DRAFTER),
    "eagle3+ctl": lambda: SpecConfig("eagle3", 3, controller="cost", **DRAFTER),
    "eagle3+lookup+ctl": lambda: SpecConfig("eagle3", 3, prompt_lookup_max=4,
                                            prompt_lookup_num_tokens=16, controller="cost",
                                            **DRAFTER),
    "mtp+ctl": lambda: SpecConfig("mtp", 3, controller="cost", **DRAFTER),
    "mtp": lambda: SpecConfig("mtp", 3, **FIXED, **DRAFTER),
    # lookup + the shipped store of the model's replies (engine/suffix_store.py); no learning
    # from finished requests: the rounds ask the same prompts again
    "suffix": lambda: SpecConfig("suffix", 3, prompt_lookup_num_tokens=16,
                                 suffix_decoding_max_cached_requests=0, **FIXED),
    "suffix+ctl": lambda: SpecConfig("suffix", 3, prompt_lookup_num_tokens=16,
                                     suffix_decoding_max_cached_requests=0, controller="cost"),
    # K = 6: lookup runs start at 6 (the controller still chooses how many to verify)
    "suffix6+ctl": lambda: SpecConfig("suffix", 6, prompt_lookup_num_tokens=16,
                                      suffix_decoding_max_cached_requests=0, controller="cost"),
    # another store (a directory written by `specdeploy suffix-store`) in $SUFFIX_STORE_B, to
    # compare stores side by side in one run
    "suffix-b+ctl": lambda: SpecConfig("suffix", 3, prompt_lookup_num_tokens=16,
                                       suffix_store=os.environ["SUFFIX_STORE_B"],
                                       suffix_decoding_max_cached_requests=0, controller="cost"),
    "mtp+suffix+ctl": lambda: SpecConfig("mtp", 3, prompt_lookup_max=4,
                                         prompt_lookup_num_tokens=16, suffix_store="shipped",
                                         suffix_decoding_max_cached_requests=0,
                                         controller="cost", **DRAFTER),
    # NOTE: with no learning from finished requests, whatever auto picks (the rounds repeat
    # the prompts: a store of this run's own replies would draft them back)
    "auto": lambda: SpecConfig("auto", suffix_decoding_max_cached_requests=0),
}


def cpu_info() -> dict:
    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4", "ssse3"))]
    return {"model": model, "simd_flags": simd, "flags": flags}


class LlamaCpp:
    """llama-cpp-python's Llama on the same file: greedy, the KV cache reset per request (its
    `generate` would otherwise reuse a matching prompt prefix from the previous call)."""

    def __init__(self, path: str, threads: int, n_ctx: int):
        import llama_cpp

        self.version = llama_cpp.__version__
        self.system_info = llama_cpp.llama_print_system_info().decode()
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def run(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        """(tokens, seconds in all, seconds after the first token)."""
        self.llm.reset()
        out, t0, t_first = [], time.perf_counter(), None
        for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            out.append(tok)
            if t_first is None:
                t_first = time.perf_counter()
            if len(out) == n:
                break
        t1 = time.perf_counter()
        return out, t1 - t0, t1 - t_first


def ours_run(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    t0 = time.perf_counter()
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    wall = time.perf_counter() - t0
    return o.token_ids, wall, (len(o.token_ids) - 1) / o.metrics.decode_tokens_per_s


def copyable(prompts: list[list[int]], replies: dict) -> list[float]:
    """Per prompt: the share of its reply's tokens that the engine's n-gram lookup (n 4..2)
    would have drafted right as the next token."""
    out = []
    for i, p in enumerate(prompts):
        seq, idx, hit = list(p) + list(replies[i]), NgramIndex(4, 2), 0
        for t in range(len(p), len(seq)):
            prop = idx.propose(seq[:t], 1)
            hit += prop is not None and prop[0] == seq[t]
        out.append(round(hit / max(len(seq) - len(p), 1), 3))
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def build(args) -> dict:
    configs: dict = {}
    for kernels in args.kernels:
        configs[f"specdeploy plain ({kernels})"] = LLM(
            args.model, max_batch_size=1, max_seq_len=args.n_ctx, kernels=kernels)
    for name in args.configs:
        if name == "plain":
            continue
        if name == "eager":  # plain without CPU graphs (engine/cpu_graphs.py): each step's Python
            for kernels in args.kernels:
                configs[f"specdeploy eager ({kernels})"] = LLM(
                    args.model, max_batch_size=1, max_seq_len=args.n_ctx, kernels=kernels,
                    cpu_graphs=False)
            continue
        for kernels in args.spec_kernels:
            configs[f"specdeploy {name} ({kernels})"] = LLM(
                args.model, max_batch_size=1, max_seq_len=args.n_ctx, kernels=kernels,
                spec=SPECS[name]())
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf (default: the embedded default)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--configs", default="plain,lookup,mtp+lookup,eagle3",
                    help=f"plain and any of {', '.join(SPECS)}")
    ap.add_argument("--kernels", default="exact,fast", help="kernels of the plain rows")
    ap.add_argument("--spec-kernels", default="fast", help="kernels of the speculative rows")
    ap.add_argument("--note", default="", help="recorded as is (e.g. who else used the machine)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--our-isa", default="native", choices=("native", "avx2"),
                    help="avx2: our kernels as on an AVX2-only CPU (llama.cpp unchanged)")
    args = ap.parse_args()
    if args.our_isa == "avx2":  # before any deployment picks its kernels
        os.environ["SPECDEPLOY_GGML_ISA"] = "avx2"
        from specdeploy.ops import attention_rows, row_kernels

        caps = [row_kernels.max_isa(1), attention_rows.bf16_dots(False)]
        for cap in caps:  # NOTE: kept referenced: a dropped context manager restores on GC
            cap.__enter__()
    args.configs = [c for c in args.configs.split(",") if c]
    args.kernels = [k for k in args.kernels.split(",") if k]
    args.spec_kernels = [k for k in args.spec_kernels.split(",") if k]
    bad = [c for c in args.configs if c not in ("plain", "eager") and c not in SPECS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; known: plain, eager, {', '.join(SPECS)}")
    if "suffix-b+ctl" in args.configs and not os.environ.get("SUFFIX_STORE_B"):
        raise SystemExit("--configs suffix-b+ctl: set SUFFIX_STORE_B to a suffix store directory")
    if args.model is None:
        from specdeploy.default_model import default_model_path

        args.model = str(default_model_path())
    args.n_ctx = args.max_prompt_tokens + args.max_tokens + 64
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    ref = LlamaCpp(args.model, args.threads, args.n_ctx)
    configs = build(args)
    tok = next(iter(configs.values())).tokenizer
    prompts = heldout_prompts(tok, args.prompts, args.max_prompt_tokens)
    runners = {"llama.cpp": lambda p: ref.run(p, args.max_tokens)}
    runners.update({name: (lambda p, llm=llm: ours_run(llm, p, args.max_tokens))
                    for name, llm in configs.items()})
    for run in runners.values():  # warm-up: kernels built, caches touched
        run(prompts[0][:32])
    e2e = {name: [] for name in runners}
    dec = {name: [] for name in runners}
    tokens: dict = {name: {} for name in runners}
    per_prompt: dict = {name: {} for name in runners}  # decode tokens/s of each prompt, by round
    for r in range(args.rounds):
        tot = {name: [0, 0.0, 0, 0.0] for name in runners}
        names = list(runners)
        for i, p in enumerate(prompts):
            # NOTE: shuffled per prompt and round (seeded): a fixed order gave a configuration
            # always the same predecessor (whose weights had just evicted the caches), and so
            # does a rotation (it moves the start, not the cyclic order)
            order = random.Random(r * len(prompts) + i).sample(names, len(names))
            for name in order:
                run = runners[name]
                out, wall, after_first = run(p)
                t = tot[name]
                t[0], t[1], t[2], t[3] = t[0] + len(out), t[1] + wall, t[2] + len(out) - 1, \
                    t[3] + after_first
                tokens[name].setdefault(i, out)
                per_prompt[name].setdefault(i, []).append((len(out) - 1) / after_first)
        for name, (n, wall, nd, dwall) in tot.items():
            e2e[name].append(n / wall)
            dec[name].append(nd / dwall)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in e2e.items()),
              file=sys.stderr)
    base_e, base_d = e2e["llama.cpp"], dec["llama.cpp"]
    rows = {}
    for name in runners:
        firsts = [first_divergence(tokens[name][i], tokens["llama.cpp"][i])
                  for i in range(len(prompts))]
        row = rows[name] = {
            "tokens_per_s": round(_median(e2e[name]), 2),
            "vs_llamacpp": round(_median([a / b for a, b in zip(e2e[name], base_e)]), 3),
            "vs_llamacpp_per_round": [round(a / b, 3) for a, b in zip(e2e[name], base_e)],
            "decode_tokens_per_s": round(_median(dec[name]), 2),
            "decode_vs_llamacpp": round(_median([a / b for a, b in zip(dec[name], base_d)]), 3),
            "tokens_per_s_per_round": [round(x, 2) for x in e2e[name]],
            "first_divergence_from_llamacpp_per_prompt": firsts,
            "decode_tokens_per_s_per_prompt": [round(_median(per_prompt[name][i]), 1)
                                               for i in range(len(prompts))]}
        llm = configs.get(name)
        if llm is not None and llm.spec is not None:
            st = llm.stats()
            row["mean_accepted_length"] = round(st.get("mean_accepted_length") or 0.0, 3)
            # against our plain rows of the same kernels, round by round (the same prompts,
            # run next to each other): the goal's ratio, less exposed to the machine's drift
            plain = f"specdeploy plain {name.rsplit(' ', 1)[-1]}"
            if plain in dec:
                per = [a / b for a, b in zip(dec[name], dec[plain])]
                row["decode_vs_our_plain"] = round(_median(per), 3)
                row["decode_vs_our_plain_per_round"] = [round(x, 3) for x in per]
    print_json({
        "machine": machine(), "cpu": cpu_info(), "threads": args.threads,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "note": args.note, "command": " ".join(["python"] + sys.argv), "model": args.model,
        "our_isa": args.our_isa,
        "llama_cpp_python": ref.version, "llama_cpp_system_info": ref.system_info,
        "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "split": "held-out ShareGPT first turns, chat template (bench/acceptance.py)",
        "rates": "end to end = new tokens / wall (prefill included); decode = after the first",
        "copyable_share_per_prompt": {name: copyable(prompts, tokens[name])
                                      for name in tokens if name.startswith("specdeploy plain")},
        "copyable_note": "share of reply tokens that an n-gram lookup (n 4..2) over the prompt "
                         "and reply so far predicts: lookup drafts pay on content that repeats",
        "results": rows, "peak_rss_mib_whole_process": round(peak_rss_mib(), 1)},
        args.json_out)


if __name__ == "__main__":
    main()
