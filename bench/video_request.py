"""A video request end to end, against transformers' `generate` on the same model and inputs.

    .venv/bin/python bench/video_request.py [--mid] [--seconds 10] [--tokens 32] [--reps 3]
        [--threads 2] [--json-out FILE]

A random clip (--seconds at 30 fps, 320 x 240, H.264 in MP4, written with PyAV) in one chat
prompt on the tiny Qwen3.5-MoE VLM (or `--mid`: bench/vs_llamacpp_moe.py's mid-size text model
with the tiny tower), fp32, one sequence. Ours: the request's time split into decoding the
sampled frames (PyAV), preprocessing (resize + patches), the vision tower, and the rest (the
language model's prefill over the prompt in one chunk, then --tokens greedy tokens), medians
over --reps. transformers: `generate` on the same checkpoint with our expanded prompt ids and
our pixel values (its own video processor needs torchvision, which this CPU build lacks), so
its time covers the tower, prefill and decode only; greedy tokens are compared. Prints JSON.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch


def clip_bytes(seconds: float, fps: int = 30, w: int = 320, h: int = 240) -> bytes:
    import io

    import av

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    c = av.open(buf, "w", format="mp4")
    s = c.add_stream("libx264", rate=fps)
    s.width, s.height, s.pix_fmt = w, h, "yuv420p"
    yy, xx = np.mgrid[0:h, 0:w]
    for i in range(int(seconds * fps)):
        f = ((xx + yy + 3 * i)[..., None] + rng.integers(0, 30, (h, w, 3))) % 256
        for p in s.encode(av.VideoFrame.from_ndarray(f.astype(np.uint8), format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    return buf.getvalue()


def chat(data: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": data},
                                         {"type": "text", "text": "what happens"}]}]


def ours(llm, data: bytes, tokens: int, reps: int) -> dict:
    from specdeploy import SamplingParams
    from specdeploy.vision.video_decode import decode_video

    d = llm.deployed
    vp = d.video_processor
    rows = []
    out = None
    for r in range(reps + 1):  # the first run warms up
        t0 = time.perf_counter()
        frames, fps, idx = decode_video(data, "clip", vp.sample, vp.max_input_pixels)
        t1 = time.perf_counter()
        vp.preprocess_one((frames, {"fps": fps, "frames_indices": idx}))
        t2 = time.perf_counter()
        v0 = d.vision_seconds
        (out,) = llm.chat(chat(data), SamplingParams(max_tokens=tokens, ignore_eos=True))
        wall = time.perf_counter() - t2
        tower = d.vision_seconds - v0
        if r:
            rows.append({"decode_s": t1 - t0, "preprocess_s": t2 - t1, "tower_s": tower,
                         "request_s": wall, "lm_s": wall - tower - (t2 - t0),
                         "ttft_s": out.metrics.ttft})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if rows[0][k] is not None}
    clip = vp.preprocess_one(data)
    return {**med, "frames_sampled": len(clip.timestamps) * vp.temporal_patch_size,
            "grid_thw": list(clip.grid_thw), "prompt_tokens": len(out.prompt_token_ids),
            "token_ids": out.token_ids, "rounds": rows}


def transformers_generate(model: str, ids: list[int], clip, tokens: int, reps: int) -> dict:
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    t = torch.tensor([ids])
    video_id = hf.config.video_token_id
    kw = dict(input_ids=t, attention_mask=torch.ones_like(t),
              mm_token_type_ids=2 * (t == video_id).int(),
              pixel_values_videos=clip.pixel_values,
              video_grid_thw=torch.tensor([clip.grid_thw]), max_new_tokens=tokens,
              min_new_tokens=tokens, do_sample=False)
    times, out = [], None
    for r in range(reps + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(**kw)[0, t.shape[1]:].tolist()
        if r:
            times.append(time.perf_counter() - t0)
    return {"request_s": statistics.median(times), "rounds_s": times, "token_ids": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mid", action="store_true")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    from specdeploy import LLM
    from specdeploy.bench import machine, print_json
    from specdeploy.models import qwen3_5_moe as q35

    torch.set_num_threads(args.threads)
    hf = q35.tiny_hf_config(mtp_layers=1)
    name = "tiny qwen3_5_moe VLM"
    if args.mid:
        from vs_llamacpp_moe import QWEN

        hf["text_config"] = dict(hf["text_config"], **QWEN)
        hf["vision_config"] = dict(hf["vision_config"], out_hidden_size=QWEN["hidden_size"])
        name = "mid-size random qwen3_5_moe VLM (bench/vs_llamacpp_moe.py's text model)"
    model = str(q35.make_tiny(tempfile.mkdtemp(prefix="video_vlm_"), seed=0, mtp_layers=1,
                              hf_config=hf))
    data = clip_bytes(args.seconds)
    llm = LLM(model, max_batch_size=1, max_seq_len=4096, max_num_tokens=4096,
              enable_prefix_caching=False)
    mine = ours(llm, data, args.tokens, args.reps)
    (o,) = llm.chat(chat(data), __import__("specdeploy").SamplingParams(max_tokens=1))
    clip = llm.deployed.video_processor.preprocess_one(data)
    peer = transformers_generate(model, o.prompt_token_ids, clip, args.tokens, args.reps)
    agree = next((i for i, (a, b) in enumerate(zip(mine["token_ids"], peer["token_ids"]))
                  if a != b), len(peer["token_ids"]))
    result = {"machine": machine(), "command": "bench/video_request.py " + " ".join(
              sys.argv[1:] if argv is None else argv), "model": name, "dtype": "float32",
              "threads": args.threads, "clip": {"seconds": args.seconds, "fps": 30,
                                                "size": [320, 240], "codec": "h264",
                                                "bytes": len(data)},
              "ours": mine, "transformers_generate": peer,
              # the same scope as transformers' time: tower + prefill + decode
              "speedup_vs_transformers": peer["request_s"] / (
                  mine["request_s"] - mine["decode_s"] - mine["preprocess_s"]),
              "speedup_vs_transformers_incl_our_decode_and_preprocess":
                  peer["request_s"] / mine["request_s"],
              "greedy_tokens_agree": agree}
    print_json(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
