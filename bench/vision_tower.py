"""The vision tower alone at a released size, fp32 vs bf16 (`mm_encoder_dtype`), on this CPU.

    PYTHONPATH=. python bench/vision_tower.py [--sides 448 896] [--rounds 3] [--threads 2]
        [--video-seconds 10] [--json-out FILE]

A random tower of Qwen3.5-35B-A3B's vision config (27 blocks, hidden 1152, MLP 4304, 16 heads,
16-pixel patches, merge 2, output 2048: ~0.45B parameters) on one square image of each side
(patches = (side / 16)^2, image tokens a quarter of that), in fp32 and in bf16, the two
alternating over --rounds (after one warm-up call each); medians and the median per-round
ratio. What an image request's first token waits for before the language model's prefill.
`--video-seconds S`: also a 640 x 360 clip of S seconds as the released video preprocessor
gives it (2 frames a second, 640 x 352 frames: one (1, 22, 40) step of 220 tokens per frame
pair), through the tower as a deployment runs it (`forward_chunked`, 16,384-patch groups), one
call in each dtype after the images.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
CONFIG = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
              num_position_embeddings=2304, in_channels=3, hidden_act="gelu_pytorch_tanh")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", type=int, nargs="+", default=[448, 896])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--video-seconds", type=float, default=0.0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from specdeploy.bench import machine, print_json
    from specdeploy.deploy.vlm import cpu_bf16_matmul
    from specdeploy.models.qwen3_5_vision import VisionConfig, VisionModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tower = VisionModel(VisionConfig.from_hf({"vision_config": CONFIG})).eval()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    towers = {"float32": tower, "bfloat16": VisionModel(VisionConfig.from_hf(
        {"vision_config": CONFIG})).eval().to(torch.bfloat16)}
    towers["bfloat16"].load_state_dict({k: v.bfloat16() for k, v in tower.state_dict().items()})
    result = {"machine": machine(), "command": "bench/vision_tower.py " + " ".join(sys.argv[1:]),
              "parameters_m": round(sum(p.numel() for p in tower.parameters()) / 1e6, 1),
              "cpu_bf16_matmul": cpu_bf16_matmul(), "images": []}
    for side in args.sides:
        g = side // CONFIG["patch_size"]
        pix, grid = torch.randn(g * g, 3 * 2 * 16 * 16), torch.tensor([[1, g, g]])
        secs: dict[str, list[float]] = {n: [] for n in towers}
        with torch.inference_mode():
            for m in towers.values():  # warm-up
                m(pix, grid)
            for r in range(args.rounds):
                for name in (list(towers) if r % 2 == 0 else list(towers)[::-1]):
                    t = time.perf_counter()
                    towers[name](pix, grid)
                    secs[name].append(time.perf_counter() - t)
        row = {"side": side, "patches": g * g, "image_tokens": g * g // 4,
               **{f"{n}_s": round(statistics.median(v), 3) for n, v in secs.items()},
               "bf16_speedup": round(statistics.median(
                   a / b for a, b in zip(secs["float32"], secs["bfloat16"])), 2)}
        result["images"].append(row)
        print(row, file=sys.stderr, flush=True)
    if args.video_seconds:
        steps = int(args.video_seconds * 2) // 2  # 2 frames a second, 2 frames a step
        grid = [(steps, 22, 40)]
        pix = torch.randn(steps * 22 * 40, 3 * 2 * 16 * 16)
        secs = {}
        with torch.inference_mode():
            for name, m in towers.items():
                t = time.perf_counter()
                m.forward_chunked(pix, grid, 16384)
                secs[name] = time.perf_counter() - t
        result["video"] = {"seconds": args.video_seconds, "frames": 2 * steps,
                           "grid_thw": list(grid[0]), "video_tokens": steps * 22 * 40 // 4,
                           **{f"{n}_s": round(v, 2) for n, v in secs.items()},
                           "bf16_speedup": round(secs["float32"] / secs["bfloat16"], 2)}
        print(result["video"], file=sys.stderr, flush=True)
    print_json(result, args.json_out)


if __name__ == "__main__":
    main()
