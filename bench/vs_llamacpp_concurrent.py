"""N concurrent requests: specdeploy vs llama.cpp on the same GGUF, greedy, in one process.

Set-up: llama-cpp-python built by bench/setup_llamacpp.sh (see bench/vs_llamacpp.py). Run:

    PYTHONPATH=<llama-cpp-python dir> .venv/bin/python bench/vs_llamacpp_concurrent.py
        [--model GGUF] [--concurrency 16] [--max-tokens 64] [--rounds 2] [--threads N]
        [--configs plain,plain-eager,plain-exact,lookup,auto] [--spec-kernels fast] [--note TEXT]
        [--json-out FILE]

Both systems get the same N distinct prompts (token ids: held-out ShareGPT first turns with the
chat template, bench/acceptance.py `heldout_prompts`, as bench/vs_llamacpp.py), all submitted at
once, each decoding exactly --max-tokens new tokens greedily (EOS ignored).

- llama.cpp: what its `batched` example does, through llama-cpp-python's low-level API: one
  context with n_seq_max = N (a KV stream per sequence unless --kv-unified), every prompt
  prefilled in one `llama_decode` (seq_id = its index; n_ubatch splits it), then each step one
  token per sequence in one `llama_decode`, the argmax of each sequence's logits on the host.
  The KV cache is cleared before every run.
- specdeploy: `LLM(max_batch_size=N, ...)` and one `generate(N prompts)` call (continuous
  batching; prompts prefilled in chunks of max_num_tokens=512 beside running decodes). Prefix
  caching is off (--prefix-caching turns it on): the rounds repeat the same prompts, and
  llama.cpp recomputes them each time.

Rounds are interleaved, each in its own shuffled order (seeded by the round). NOTE: a fixed
order gives each configuration the same place and the same predecessor every round; rotating
it moves the place but keeps the predecessor (plain always ran right after llama.cpp), and
every speculative row then measured 0.95-0.99x plain where two plain deployments in the same
run differed by under 1% (2026-12-05). The deployments' build order matters as much: built
before plain, the same speculative rows measured 1.01-1.04x (and plain-b, built last, 1.03x;
bench/results/vs_llamacpp_concurrent_avx512_1205_specfirst.json). Deployments in one process
differ by a few % for no reason of their own, so differences under ~3% at 16 need runs with
the build order changed (the order of --configs). Reported per system: medians over
rounds of the total rate (new tokens / wall, prefill included), of the decode rate (tokens made
after every sequence had its first token / the time from then on) and of per-round ratios to
llama.cpp; and how far each configuration's tokens agree with llama.cpp's.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402
from fast_kernels_agreement import first_divergence  # noqa: E402
from vs_llamacpp import SPECS, _median, cpu_info  # noqa: E402

from specdeploy import LLM, SamplingParams  # noqa: E402
from specdeploy.bench import machine, peak_rss_mib, print_json  # noqa: E402

# configuration: kernels (no speculation). "plain-b": a second deployment of plain, a control:
# two identical deployments in one process differed by ~1-2% per round here (2026-12-05), the
# floor under which a speculative row's ratio to plain says nothing
PLAIN = {"plain": "fast", "plain-exact": "exact", "plain-b": "fast", "plain-eager": "fast"}


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"llama.cpp side: cannot import llama_cpp ({e}). Build it with "
                         "`PYTHON=.venv/bin/python bash bench/setup_llamacpp.sh DIR` and put "
                         "DIR on PYTHONPATH (or without DIR, into that environment).") from e
    return llama_cpp


class LlamaCppBatched:
    """llama.cpp's `batched` example on N distinct prompts (low-level llama-cpp-python API)."""

    def __init__(self, path: str, threads: int, n_seq: int, n_ctx: int, n_batch: int,
                 kv_unified: bool):
        llama_cpp = import_llama_cpp()
        import numpy as np
        from llama_cpp._logger import set_verbose  # its log callback prints all otherwise

        set_verbose(False)
        self.np, self.L = np, llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = kv_unified
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.version, self.system_info = (llama_cpp.__version__,
                                          llama_cpp.llama_print_system_info().decode())
        self.params = {"n_ctx": llama_cpp.llama_n_ctx(self.ctx), "n_batch": n_batch,
                       "n_ubatch": 512, "n_seq_max": llama_cpp.llama_n_seq_max(self.ctx),
                       "kv_unified": kv_unified, "flash_attn_type": int(cp.flash_attn_type),
                       "n_threads": threads}

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, seq_id, wants logits) rows."""
        b = self.batch
        for k, (tok, pos, seq, logits) in enumerate(items):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, pos, 1, logits
            b.seq_id[k][0] = seq
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        row = self.L.llama_get_logits_ith(self.ctx, i)
        return int(self.np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())

    def run(self, prompts: list[list[int]], n: int):
        """(tokens per sequence, seconds in all, decode tokens, decode seconds)."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        items, last = [], []
        for s, p in enumerate(prompts):
            items += [(t, j, s, j == len(p) - 1) for j, t in enumerate(p)]
            last.append(len(items) - 1)
        self._decode(items)
        outs = [[self._argmax(k)] for k in last]
        t1 = time.perf_counter()
        for step in range(1, n):
            self._decode([(o[-1], len(p) + step - 1, s, True)
                          for s, (p, o) in enumerate(zip(prompts, outs))])
            for s, o in enumerate(outs):
                o.append(self._argmax(s))
        t2 = time.perf_counter()
        return outs, t2 - t0, len(prompts) * (n - 1), t2 - t1


def ours_run(llm: LLM, prompts: list[list[int]], n: int):
    """The same for one `generate` of every prompt; decode starts once all have a token."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    t1 = time.perf_counter()
    t_all = max(o.metrics.first_token_time for o in outs)
    n_dec = sum(t > t_all for o in outs for t in o.metrics.token_times)
    return [list(o.token_ids) for o in outs], t1 - t0, n_dec, t1 - t_all


def build(args, kw: dict) -> dict:
    configs = {}
    for name in args.configs:
        if name in PLAIN:  # plain-eager: without CPU graphs (engine/cpu_graphs.py)
            configs[f"specdeploy {name}"] = LLM(args.model, kernels=PLAIN[name], **kw,
                                                **({"cpu_graphs": False}
                                                   if name == "plain-eager" else {}))
        else:
            configs[f"specdeploy {name} ({args.spec_kernels})"] = LLM(
                args.model, kernels=args.spec_kernels, spec=SPECS[name](), **kw)
    return configs


def agreement(toks: list[list[int]], ref: list[list[int]]) -> dict:
    firsts = [first_divergence(a, b) for a, b in zip(toks, ref)]
    div = [f for f in firsts if f is not None]
    return {"identical_share": round(sum(f is None for f in firsts) / len(firsts), 3),
            "mean_first_divergence_of_diverged": round(sum(div) / len(div), 1) if div else None,
            "first_divergence_per_sequence": firsts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf (default: the embedded default)")
    ap.add_argument("--concurrency", "-n", type=int, default=16, help="requests (prompts)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--configs", default="plain,plain-exact,lookup,auto",
                    help=f"any of {', '.join(PLAIN)}, {', '.join(SPECS)}")
    ap.add_argument("--spec-kernels", default="fast", help="kernels of the speculative rows")
    ap.add_argument("--kv-unified", action="store_true", help="llama.cpp: one KV buffer")
    ap.add_argument("--prefix-caching", action="store_true", help="specdeploy: keep it on")
    ap.add_argument("--note", default="", help="recorded as is (e.g. who else used the machine)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.configs if c not in PLAIN and c not in SPECS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; known: {', '.join([*PLAIN, *SPECS])}")
    if args.model is None:
        from specdeploy.default_model import default_model_path

        args.model = str(default_model_path())
    import_llama_cpp()  # fail before building anything
    n, m = args.concurrency, args.max_tokens
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    configs = build(args, dict(max_batch_size=n, max_seq_len=args.max_prompt_tokens + m + 64,
                               enable_prefix_caching=args.prefix_caching))
    tok = next(iter(configs.values())).tokenizer
    prompts = heldout_prompts(tok, n, args.max_prompt_tokens)
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} held-out prompts for --concurrency {n}")
    per_seq = -(-(max(map(len, prompts)) + m) // 256) * 256
    ref = LlamaCppBatched(args.model, args.threads, n, n * per_seq,
                          max(sum(map(len, prompts)), n), args.kv_unified)
    runners = {"llama.cpp": ref.run}
    runners.update({name: (lambda ps, k, llm=llm: ours_run(llm, ps, k))
                    for name, llm in configs.items()})
    for run in runners.values():  # warm-up: kernels built, caches touched
        run([p[:16] for p in prompts], 4)
    total = {name: [] for name in runners}
    dec = {name: [] for name in runners}
    tokens: dict = {}
    t_start = time.perf_counter()
    names = list(runners)
    for r in range(args.rounds):
        for name in random.Random(r).sample(names, len(names)):  # (seeded: the same each run)
            outs, wall, n_dec, dwall = runners[name](prompts, m)
            total[name].append(sum(map(len, outs)) / wall)
            dec[name].append(n_dec / dwall)
            tokens.setdefault(name, outs)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in total.items())
              + " tok/s", file=sys.stderr)
    rounds_s = time.perf_counter() - t_start
    base_t, base_d = total["llama.cpp"], dec["llama.cpp"]
    rows = {}
    for name in runners:
        row = rows[name] = {
            "tokens_per_s": round(_median(total[name]), 2),
            "vs_llamacpp": round(_median([a / b for a, b in zip(total[name], base_t)]), 3),
            "decode_tokens_per_s": round(_median(dec[name]), 2),
            "decode_vs_llamacpp": round(_median([a / b for a, b in zip(dec[name], base_d)]), 3),
            "tokens_per_s_per_round": [round(x, 2) for x in total[name]],
            "decode_tokens_per_s_per_round": [round(x, 2) for x in dec[name]],
            "vs_llamacpp_per_round": [round(a / b, 3) for a, b in zip(total[name], base_t)]}
        if name != "llama.cpp":
            row["agreement_with_llamacpp"] = agreement(tokens[name], tokens["llama.cpp"])
            llm = configs[name]
            if llm.spec is not None:
                stats = llm.stats()
                row["mean_accepted_length"] = round(stats.get("mean_accepted_length") or 0.0, 3)
                row["spec_off_batch_sizes"] = stats.get("spec_off_batch_sizes")
            if "specdeploy plain" in total and name != "specdeploy plain":
                # round by round: the machine drifts
                for key, rates in (("", total), ("decode_", dec)):
                    per = [a / b for a, b in zip(rates[name], rates["specdeploy plain"])]
                    row[f"{key}vs_our_plain"] = round(_median(per), 3)
                    row[f"{key}vs_our_plain_per_round"] = [round(x, 3) for x in per]
    print_json({
        "machine": machine(), "cpu": cpu_info(), "threads": args.threads,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "note": args.note, "command": " ".join(["python"] + sys.argv), "model": args.model,
        "llama_cpp_python": ref.version, "llama_cpp_system_info": ref.system_info,
        "llama_cpp_context": ref.params, "concurrency": n, "max_tokens": m,
        "rounds": args.rounds, "rounds_wall_s": round(rounds_s, 1),
        "prefix_caching": args.prefix_caching, "spec_kernels": args.spec_kernels,
        "prompt_tokens": [len(p) for p in prompts],
        "split": "held-out ShareGPT first turns, chat template (bench/acceptance.py)",
        "rates": "total = all new tokens / wall (prefill included); decode = tokens made after "
                 "every sequence had its first token / the time from then to the end",
        "results": rows, "peak_rss_mib_whole_process": round(peak_rss_mib(), 1)},
        args.json_out)


if __name__ == "__main__":
    main()
