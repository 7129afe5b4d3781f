"""The cost controller's calibration on this machine: the deployed target and drafter forwards
timed by row count (`calibrate`), and the batch sizes at which speculation is off
(`off_batches`)."""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.engine.request import SamplingParams
from specdeploy.engine.spec_cost import TRUST_AFTER, MeasuredCost

# `off_batches`: speculation is off from a batch size where one draft for every sequence pays
# only at this acceptance or more (a compute-bound step). NOTE: on the default model at 16
# concurrent requests (2 cores, AVX-512, 2026-12-05) that acceptance is 0.64-0.84 in five
# calibrations, and suffix + controller, drafting in 5-8% of steps with 87% of its drafts
# accepted, ran at 0.95-0.98x plain in four bench runs: ~0.5 ms of a ~22 ms step is its host
# work (lookups, store, cut), and in a batch that finishes together the sequences a draft puts
# ahead wait for the slowest. At batch 1 it is 0-0.1, at 3 0-0.75 (noisy: see OFF_MIN_BATCH).
# On a 2-core Xeon with AMX (2026-12-05) it is 0.41-0.52 at 16 in four calibrations (AMX on or
# off), where 0.6 kept speculation on and `auto` ran at 0.915x plain in steady state (bench/
# spec_by_concurrency.py, 16 in flight) and 0.933x with 16 requests at once: lowered from 0.6.
OFF_BREAK_EVEN = 0.4
# ... judged at batch sizes of at least this. NOTE: below it a step reads the weights once for
# a few rows (a 6-row step cost ~1.2x a 3-row one here), but at batch 3 the calibrated ratio
# of 6 to 3 rows ranged 0-0.75 over nine calibrations: one slow timing of a ~4 ms step
OFF_MIN_BATCH = 8


def off_batches(cost_s, calibrated: tuple[int, ...], top: int) -> frozenset[int]:
    """The batch sizes (up to `top`) at which speculation is off. At each calibrated batch size
    B >= OFF_MIN_BATCH, r(B) = cost(2B) / cost(B) - 1 is the acceptance one draft for every
    sequence (B more rows) needs to pay (`cost_s`: the calibration table, where B and 2B rows
    were both timed). Off from the smallest B where r(B) >= OFF_BREAK_EVEN, up; where r
    crosses the threshold between two calibrated sizes B1 < B2, from the first size at which r
    linearly interpolated between them does. NOTE: the ratio is interpolated, not the cost of a
    row count between them: across the kernels' 8-row tiles a step of 9 rows cost ~1.6x one of
    6 (2026-12-05), and with one row more the break-even swings with a single noisy timing (a
    17th row: 0-2.8 between calibrations). Why interpolate: on a 2-core Xeon with AMX r(8) was
    0.37-0.43 and r(16) 0.35-0.60 in six calibrations; a calibration with r(8) just under 0.4
    kept speculation on at 9-15, and a server at 16 in flight (15 and 16 running in turn) made
    0.956x plain's tokens/s, against 0.993x where r(8) had turned it off from 8
    (bench/spec_by_concurrency.py --lockstep, 2026-12-05); at 8 itself it paid (1.01-1.06x)."""
    prev = None
    for b in sorted(x for x in calibrated if x >= OFF_MIN_BATCH):
        t0 = cost_s(b)
        if t0 <= 0:
            continue
        r = cost_s(2 * b) / t0 - 1.0
        if r >= OFF_BREAK_EVEN:
            start = b
            if prev is not None and prev[1] < OFF_BREAK_EVEN:
                b1, r1 = prev
                for x in range(b1 + 1, b + 1):
                    if r1 + (r - r1) * (x - b1) / (b - b1) >= OFF_BREAK_EVEN:
                        start = x
                        break
            return frozenset(range(start, top + 1))
        prev = (b, r)
    return frozenset()


def calibrate(engine, batches: tuple[int, ...] = (1, 3), reps: int = 3,
              prompt_len: int = 16) -> MeasuredCost:
    """Times the deployed target and drafter forwards on this machine by row count: for each
    batch size, dummy greedy requests decode with 0..K (and the longest lookup run) fixed
    drafts (engine.fix_drafts), each for `reps` steps after a warm-up one (fewer steps and a
    shorter prompt where the context or the cache is short); medians per row count, the first
    forward at each row count left out. The engine is left as it was (its stats, draft source
    and prefix cache reset; the requests aborted). ValueError where not even one step each
    fits."""
    d = engine.deployed
    dev = getattr(engine, "device", None)
    sync = None
    if dev is not None and torch.device(dev).type == "cuda":
        sync = torch.cuda.synchronize
    samples: dict[str, dict[int, list[float]]] = {"target": defaultdict(list),
                                                  "draft": defaultdict(list)}
    saved, inputs = {}, {}

    def timed(name: str, attr: str):
        fn = getattr(d, attr)
        saved[attr] = fn

        def run(meta, *a, **kw):
            if a and isinstance(a[0], torch.Tensor):
                inputs[name] = a[0]  # (the drafter's hidden input: `_time_catch_ups`' shape)
            t = time.perf_counter()
            out = fn(meta, *a, **kw)
            if sync is not None:  # NOTE: a CUDA forward returns at launch; time its kernels
                sync()
            # NOTE: the first forward at a row count is a warm-up (shape specialisation)
            seen = samples[name].setdefault(-meta.num_tokens, [])
            dt = time.perf_counter() - t
            (samples[name][meta.num_tokens] if seen else seen).append(dt)
            return out
        setattr(d, attr, run)

    controller, source = engine.controller, engine.source
    engine.controller = None
    kmax = engine.max_k
    want = {"k": 0}
    engine.fix_drafts(lambda seq, n: [seq.all_ids[-1]] * min(want["k"], n))
    timed("target", "forward")
    if getattr(d, "draft_forward", None) is not None and d.draft is not None:
        timed("draft", "draft_forward")
    vocab = d.vocab_size
    try:
        for b in batches:
            if b > engine.scheduler.max_batch_size:
                break
            fit = _fit(engine, b, reps, prompt_len)
            if fit is None:
                break
            schedule, n_prompt, room = fit
            ids = [f"__calibrate_{b}_{i}" for i in range(b)]
            sp = SamplingParams(max_tokens=min(len(schedule) * (kmax + 1) + 2, room),
                                ignore_eos=True)
            for i, rid in enumerate(ids):
                prompt = [(7 + 13 * i + j) % vocab for j in range(n_prompt)]
                engine.add_request(prompt, sp, request_id=rid)
            engine.step()  # the prefill
            for k in schedule + schedule[-1:]:  # a step verifies the previous step's drafts
                want["k"] = k
                engine.step()
            if "draft" in inputs:
                _time_catch_ups(engine, ids, reps, inputs["draft"])
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
    finally:
        for attr, fn in saved.items():
            setattr(d, attr, fn)
        engine.source, engine.controller = source, controller
        engine.reset_spec_stats()
        engine.stats.__init__()  # in place: others may hold it
        engine.reset_prefix_cache()
    med = {name: {r: statistics.median(v) for r, v in t.items() if r > 0 and v}
           for name, t in samples.items()}
    if not med["target"]:
        raise ValueError(f"controller: too little room to calibrate the cost controller "
                         f"(max_seq_len={engine.max_seq_len}, {engine.blocks.num_pages} pages "
                         f"of {engine.blocks.page_size}, up to {kmax} drafts); give "
                         f"controller='off' (fixed K) or a longer max_seq_len")
    return MeasuredCost(med["target"], med["draft"], refresh_every=8, trust_after=TRUST_AFTER)


# Rows a sequence's drafter catch-up feeds in calibration (`_time_catch_ups`), beside the 1..K+1
# of the drafting steps
CATCH_UP_ROWS = (8, 16, 32)


def _time_catch_ups(engine, ids: list[str], reps: int, like: torch.Tensor) -> None:
    """Times drafter forwards of n = CATCH_UP_ROWS rows a sequence (one logit each): the
    catch-up of a sequence that deferred its drafter rows for n steps while the controller gave
    it no drafts (engine/drafting.py `defer_rows`). Without them the drafter's table ended at K + 1
    rows a sequence and a catch-up of 17 deferred rows was priced as one of 4 (the last slope
    of a noisy table is often 0): ~0.46 against ~1.2 ms measured on the default model's
    EAGLE-3, which drove the measured / modelled drafting scale to ~4 and every draft out
    (2026-12-05). The rows overwrite the drafter cache of the calibration's own requests (at
    positions they already hold: no page is needed), which are aborted next. A drafter with
    recurrent state is left out (a catch-up there would move its state). `like`: a
    hidden input the drafter took (width, dtype, device)."""
    d = engine.deployed
    if any(getattr(getattr(p, "layout", None), "recurrent", False) for p in
           getattr(d, "drafts", ())):
        return
    seqs = [s for s in engine.scheduler.running if s.request_id in set(ids)]
    if not seqs:
        return
    for n in CATCH_UP_ROWS:
        if any(s.num_cached < n for s in seqs):
            break
        meta = build_metadata([Segment([0] * n, s.num_cached - n, s.pages, s.slot, 1)
                               for s in seqs])
        hidden = like.new_zeros(n * len(seqs), like.shape[-1])
        for _ in range(reps + 1):  # the first: the timed wrapper's warm-up
            d.draft_forward(meta, hidden)


def _fit(engine, b: int, reps: int, prompt_len: int):
    """(schedule of drafts per step, prompt length, tokens each request may make) for `b`
    calibration requests: `reps` steps per draft count and a `prompt_len` prompt, both cut
    down (to 1) until they fit the context and the cache; None if nothing fits."""
    kmax = engine.max_k
    per_seq = engine.blocks.num_pages * engine.blocks.page_size // b
    for r in range(reps, 0, -1):
        # NOTE: interleaved (0, 1, .., K, 0, 1, ..): in blocks, a row count's steps all ran
        # in whatever stretch the machine was in, and the ratio of 32 to 16 rows at batch 16
        # came out at 1.2-1.9 between calibrations (2026-12-05)
        schedule = [k for _ in range(r + 1) for k in sorted({*range(engine.k + 1), kmax})]
        n = min(prompt_len, engine.max_seq_len - kmax - 1 - len(schedule),
                per_seq - 2 * kmax - 2 - len(schedule))
        if n >= 1:
            return schedule, n, min(engine.max_seq_len - n - kmax - 1, per_seq - n - 2 * kmax - 2)
    return None
