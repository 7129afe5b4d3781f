"""Vision tower vs language-model prefill, and decode speed with and without MTP after an image.

    .venv/bin/python bench/vision_prefill.py [--model DIR | --mid] [--reps 3] [--threads 1]
        [--json-out FILE]

On the tiny VLM (`make-tiny --arch qwen3_5_moe --mtp-layers 1` when --model is not given), fp32,
one sequence: for 1, 2 and 4 random 448x448 images in one chat prompt, the image
preprocessing (PIL resize + patchify, timed apart), the tower's time (the deployment's
`vision_seconds`, one call per request) and the rest of the request (the exported language
model's prefill over the whole prompt in one chunk, plus engine overhead), medians over
--reps. Then 64 greedy tokens after a one-image prompt: decode tokens/s plain and with the
checkpoint's MTP head at K = 1 and 3 (the tiny head is random, so acceptance is near zero: this
measures the overhead of speculation around a VLM target, not its gain), and plain decoding with
the replayed steps (CPU graphs, the default) against eager steps (`cpu_graphs=False`), the two
deployments alternating over --reps rounds (medians, and the median of per-round ratios).
`--mid`: the random mid-size Qwen3.5-MoE of bench/vs_llamacpp_moe.py (8 layers, hidden 512,
32 experts top 4; its tiny tower) in place of the tiny one. Prints JSON.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch


def images(n: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))
            for _ in range(n)]


def chat(imgs) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in imgs]
    return [{"role": "user", "content": parts + [{"type": "text", "text": "describe"}]}]


def prefill_split(llm, n: int, reps: int) -> dict:
    from specdeploy import SamplingParams

    d = llm.deployed
    tower, lm, pre, tokens = [], [], [], 0
    for r in range(reps + 1):  # the first run warms up
        imgs = images(n, seed=r)
        t0 = time.perf_counter()
        d.processor.preprocess(imgs)  # timed apart: the request repeats it
        p = time.perf_counter() - t0
        v0, t0 = d.vision_seconds, time.perf_counter()
        (out,) = llm.chat(chat(imgs), SamplingParams(max_tokens=1))
        wall = time.perf_counter() - t0
        if r:
            pre.append(p)
            tower.append(d.vision_seconds - v0)
            lm.append(wall - tower[-1] - p)
        tokens = len(out.prompt_token_ids)
    t, m = statistics.median(tower), statistics.median(lm)
    return {"images": n, "prompt_tokens": tokens, "preprocess_s": statistics.median(pre),
            "vision_tower_s": t, "lm_prefill_s": m, "vision_share": t / (t + m)}


def decode(llm, tokens: int) -> dict:
    from specdeploy import SamplingParams

    llm.chat(chat(images(1, seed=9)), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    if hasattr(llm.engine, "reset_spec_stats"):
        llm.engine.reset_spec_stats()
    (out,) = llm.chat(chat(images(1, seed=10)), SamplingParams(max_tokens=tokens,
                                                              ignore_eos=True))
    rec = {"decode_tokens_per_s": out.metrics.decode_tokens_per_s, "tokens": len(out.token_ids)}
    stats = llm.stats()
    if "mean_accepted_length" in stats:
        rec.update(mean_accepted_length=stats["mean_accepted_length"],
                   acceptance_rate=stats["acceptance_rate"])
    return rec


def graphs_vs_eager(model: str, kw: dict, tokens: int, reps: int) -> dict:
    """Plain decode after a one-image prompt, replayed steps vs eager ones, alternating."""
    from specdeploy import LLM

    llms = {"graphs": LLM(model, **kw), "eager": LLM(model, cpu_graphs=False, **kw)}
    rates: dict[str, list[float]] = {n: [] for n in llms}
    for r in range(reps):
        for name in (("graphs", "eager") if r % 2 == 0 else ("eager", "graphs")):
            rates[name].append(decode(llms[name], tokens)["decode_tokens_per_s"])
    runner = llms["graphs"].deployed.target.graph_runner
    return {"graphs_tokens_per_s": statistics.median(rates["graphs"]),
            "eager_tokens_per_s": statistics.median(rates["eager"]),
            "graphs_over_eager": statistics.median(g / e for g, e in zip(rates["graphs"],
                                                                        rates["eager"])),
            "rounds": rates, "replays": runner.replays, "refused": dict(runner.refused)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--mid", action="store_true",
                    help="the mid-size random Qwen3.5-MoE of bench/vs_llamacpp_moe.py")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    from specdeploy import LLM
    from specdeploy.bench import machine, print_json

    torch.set_num_threads(args.threads)
    model, name = args.model, args.model
    if model is None and args.mid:
        from vs_llamacpp_moe import QWEN

        from specdeploy.models import qwen3_5_moe as q35

        hf = q35.tiny_hf_config(mtp_layers=1)
        hf["text_config"] = dict(hf["text_config"], **QWEN)
        hf["vision_config"] = dict(hf["vision_config"], out_hidden_size=QWEN["hidden_size"])
        model = str(q35.make_tiny(tempfile.mkdtemp(prefix="mid_vlm_"), seed=0, mtp_layers=1,
                                  hf_config=hf))
        name = "mid-size random qwen3_5_moe VLM (bench/vs_llamacpp_moe.py's text model)"
    elif model is None:
        from specdeploy.models.qwen3_5_moe import make_tiny

        model = str(make_tiny(tempfile.mkdtemp(prefix="tiny_vlm_"), seed=0, mtp_layers=1))
        name = "tiny qwen3_5_moe VLM"
    kw = dict(max_batch_size=1, max_seq_len=4096, max_num_tokens=4096)
    llm = LLM(model, **kw)
    result = {"machine": machine(), "command": "bench/vision_prefill.py " + " ".join(
              sys.argv[1:] if argv is None else argv), "model": name,
              "dtype": "float32", "threads": args.threads, "image_size": [448, 448],
              "prefill": [prefill_split(llm, n, args.reps) for n in (1, 2, 4)],
              "decode": {"plain": decode(llm, args.decode_tokens)}}
    del llm
    result["decode"]["replayed_vs_eager"] = graphs_vs_eager(model, kw, args.decode_tokens,
                                                            max(args.reps, 2))
    for k in (1, 3):
        spec = LLM(model, spec={"method": "mtp", "num_draft_tokens": k}, **kw)
        result["decode"][f"mtp_k{k}"] = decode(spec, args.decode_tokens)
    print_json(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
