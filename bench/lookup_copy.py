"""Where n-gram lookup drafts are right, by copy length, and what choosing runs by it buys.

    .venv/bin/python bench/lookup_copy.py [--prompts 30] [--fit-from 6] [--max-tokens 128]
        [--threads 1] [--costs FILE] [--json-out FILE]

The default model's greedy replies (fast kernels) to held-out ShareGPT prompts; at every
position of every reply, the lookup match the engine would make there (engine/lookup.py,
n-gram (4, 2)), its copy length (`NgramIndex.copied`) and how many of its 16 drafts the reply
then follows. Prints, as JSON:
- "hold": P(a copy of m tokens holds for one more) by `COPY_BUCKETS` of m, fitted on the
  prompts from --fit-from on (not the first ones, which bench/vs_llamacpp.py measures): the
  source of engine/spec_accept.py's LOOKUP_HOLD_PRIOR;
- "replay": tokens/s relative to plain decoding when each reply is decoded again on paper with
  this machine's step cost by rows (measured here at batch 1, or --costs: a JSON of drafts ->
  ms), for the first --fit-from prompts and for the rest: "fixed" lookup runs (K=3, doubled
  while accepted whole, as with controller="off"), "controller" the cost controller's own
  decisions (`CostController.allocate_rows` over the measured costs, its hold table learnt
  online from the prior), and "oracle" the best choice knowing every draft's fate (an upper
  bound for lookup drafts).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import heldout_prompts  # noqa: E402

from specdeploy import LLM, SamplingParams, SpecConfig  # noqa: E402
from specdeploy.bench import machine, print_json  # noqa: E402
from specdeploy.engine.lookup import NgramIndex  # noqa: E402
from specdeploy.engine.spec_accept import (  # noqa: E402
    COPY_BUCKETS,
    LOOKUP_HOLD_PRIOR,
    copy_bucket,
)
from specdeploy.engine.spec_control import CostController  # noqa: E402

RUN = 16  # longest lookup run


def positions(prompt: list[int], out: list[int]) -> list[tuple[bool, int, int]]:
    """Per reply position i (i tokens made): (a match, its copy length, drafts followed)."""
    seq, idx, rows = list(prompt) + list(out), NgramIndex(4, 2), []
    for t in range(len(prompt), len(seq)):
        prop = idx.propose(seq[:t], RUN)
        if prop is None:
            rows.append((False, 0, 0))
            continue
        acc = 0
        for a, b in zip(prop, seq[t:]):
            if a != b:
                break
            acc += 1
        rows.append((True, idx.copied, acc))
    return rows


def step_costs(llm_kw: dict, reps: int = 3) -> dict[int, float]:
    """Seconds of a whole engine step verifying k = 0..RUN drafts, batch 1, a 300-token
    context (fixed drafts: the engine's own step, Python included)."""
    llm = LLM(**llm_kw, spec=SpecConfig("ngram", 3, prompt_lookup_num_tokens=RUN,
                                        controller="off"))
    eng, want = llm.engine, {"k": 0}
    eng.fix_drafts(lambda seq, n: [seq.all_ids[-1]] * min(want["k"], n))
    samples: dict[int, list[float]] = {k: [] for k in range(RUN + 1)}
    prompt = [(7 + 13 * j) % llm.deployed.vocab_size for j in range(300)]
    for r in range(reps):
        eng.add_request(prompt, SamplingParams(max_tokens=1000, ignore_eos=True),
                        request_id=f"cost{r}")
        eng.step()
        for k in samples:
            want["k"] = k
            eng.step()  # proposes k; the next steps verify k
            for _ in range(3):
                t = time.perf_counter()
                eng.step()
                samples[k].append(time.perf_counter() - t)
        eng.abort(f"cost{r}")
        while eng.has_unfinished():
            eng.step()
    return {k: statistics.median(v) for k, v in samples.items()}


class _Spec:
    def __init__(self):
        self.control, self.lookup_copy = None, 0
        self.drafts, self.draft_probs, self.from_lookup = [], None, False


class _Seq:
    def __init__(self):
        self.spec = _Spec()


class _Table:
    def __init__(self, cost: dict[int, float]):
        self.cost = cost

    def target_s(self, rows: int) -> float:
        return self.cost[min(rows - 1, RUN)]

    def draft_s(self, rows: int) -> float:
        return 0.0


def replay(rows_by_reply, cost: dict[int, float], policy: str) -> float:
    """Tokens per second of decoding every reply again with `policy`, over plain's."""
    ctl = CostController(_Table(cost), 3, RUN, drafter=False) if policy == "controller" else None
    tokens = seconds = 0.0
    for rows in rows_by_reply:
        n, i, run = len(rows), 1, 3
        best = [0.0] * (n + 1)  # oracle: the least time from position i to the end
        if policy == "oracle":
            for j in range(n - 1, 0, -1):
                hit, _, acc = rows[j]
                best[j] = cost[0] + best[j + 1]
                for k in range(1, min(acc, n - 1 - j, RUN) + 1) if hit else ():
                    best[j] = min(best[j], cost[k] + best[min(j + k + 1, n)])
            tokens, seconds = tokens + n - 1, seconds + best[1]
            continue
        seq = _Seq()
        while i < n:
            hit, copied, acc = rows[i]
            k = 0
            if hit and policy == "fixed":
                k = min(run, n - i)
            elif hit:
                seq.spec.drafts, seq.spec.from_lookup = list(range(min(RUN, n - i))), True
                seq.spec.lookup_copy = copied
                ctl.cut([seq])
                k = len(seq.spec.drafts)
            a = min(acc, k)
            if k and policy == "fixed":
                run = min(2 * run, RUN) if a == k else 3
            elif k:
                ctl.observe(seq, a, k, True)
            tokens, seconds, i = tokens + a + 1, seconds + cost[k], i + a + 1
    plain = 1.0 / cost[0]  # a plain step makes one token
    return round(tokens / seconds / plain, 4)


def fit_hold(rows_by_reply) -> tuple[list[float], int]:
    """Laplace-smoothed P(hold) by copy bucket, every seen (match, position) pair."""
    hit, tot, matches = [1] * (len(COPY_BUCKETS) + 1), [2] * (len(COPY_BUCKETS) + 1), 0
    for rows in rows_by_reply:
        for ok, copied, acc in rows[1:]:
            if ok:
                matches += 1
                for j in range(min(acc + 1, RUN)):
                    b = copy_bucket(copied + j)
                    tot[b], hit[b] = tot[b] + 1, hit[b] + (j < acc)
    return [round(h / t, 2) for h, t in zip(hit, tot)], matches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--fit-from", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--costs", default=None, help="JSON {drafts: ms}, 0..16 (else measured)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kw = dict(max_batch_size=1, max_seq_len=2048, kernels="fast")
    llm = LLM(**kw)
    prompts = heldout_prompts(llm.tokenizer, args.prompts, 256)
    replies = []
    for p in prompts:
        (o,) = llm.generate([p], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        replies.append(positions(p, o.token_ids))
    del llm
    if args.costs:
        import json

        cost = {int(k): v / 1e3 for k, v in json.loads(Path(args.costs).read_text()).items()}
    else:
        cost = step_costs(kw)
    hold, matches = fit_hold(replies[args.fit_from:])
    parts = {"first": replies[:args.fit_from], "rest": replies[args.fit_from:]}
    print_json({
        "bench": "lookup_copy", "machine": machine(), "threads": args.threads,
        "command": " ".join(["python"] + sys.argv), "prompts": len(prompts),
        "fit_from": args.fit_from, "max_tokens": args.max_tokens,
        "step_ms_by_drafts": {k: round(v * 1e3, 3) for k, v in cost.items()},
        "copy_buckets": list(COPY_BUCKETS), "hold": hold, "hold_matches": matches,
        "hold_prior_in_use": list(LOOKUP_HOLD_PRIOR),
        "replay_vs_plain": {name: {pol: replay(r, cost, pol) for pol in
                                   ("fixed", "controller", "oracle")}
                            for name, r in parts.items() if r}},
        args.json_out)


if __name__ == "__main__":
    main()
