"""A GGUF vision-language pair (text GGUF + mmproj) on the CPU: specdeploy vs llama.cpp (libmtmd),
batch 1, greedy, the same files.

    PYTHONPATH=.:/work/llamacpp python bench/vs_llamacpp_vlm.py \\
        --llamacpp-src .../llama_cpp_python-0.3.36/vendor/llama.cpp [--rounds 3] [--tokens 64]
        [--outtype q8_0] [--threads 2] [--json-out FILE]
        [--arch qwen3_5_moe|qwen3_vl_moe|qwen3_vl]

The checkpoint: a random Qwen3.5-MoE VLM, bench/vs_llamacpp_moe.py's mid-size text model (8
layers, hidden 512, 32 experts top 4) with a mid-size tower (`TOWER`: 4 blocks, hidden 256,
patch 16, merge 2); `--arch qwen3_vl_moe`: a Qwen3-VL-MoE of vs_llamacpp_moe.py's Qwen3-MoE
text shape (8 layers, hidden 1024, 48 experts top 8, Qwen3-30B-A3B's attention) and the same
tower with 3 DeepStack levels (after blocks 1-3, as the released towers' 8 / 16 / 24 of 27);
`--arch qwen3_vl`: the dense Qwen3-VL of vs_llamacpp_moe.py's Qwen3-0.6B block shape.
Converted by llama.cpp's own converter: the text GGUF (`--outtype`, the tokenizer given one
merge as in vs_llamacpp_moe.py) and the mmproj (`--mmproj`, F32). Each round, in alternating
order: one request of "describe" + one 448 x 448 image (14 x 14 merged patches:
neither tool resizes it, 196 image tokens in both) + "now" (the same token ids in both), then
--tokens greedy tokens.
- llama.cpp: libmtmd tokenizes the prompt with the image (its marker), `mtmd_helper_eval_chunks`
  encodes the image and prefills everything, then one `llama_decode` per token (the argmax of
  its logits on the host), the KV cache cleared before each round.
- specdeploy: `LLM(text.gguf, mmproj=..., mm_processor_kwargs=...)` (CPU graphs on, the
  default; prefix caching off, as llama.cpp's cache is cleared), `generate` with the image.
Reported: the prefill (image encode + prompt, to the first token) and decode tokens/s, medians
over rounds, and the median of per-round ratios. Random weights: the greedy tokens are compared
(first divergence) only to show both run the same model.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.vs_llamacpp_moe import (  # noqa: E402
    QWEN,
    QWEN3,
    QWEN3_MOE,
    _median,
    _with_a_merge_token,
    convert,
)

TOWER = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, patch_size=16,
             temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304)
SIDE = 448  # a multiple of patch x merge (32): no resize in either tool
# NOTE: no spaces: the tiny character vocabulary has no byte-level space token, which
# llama.cpp's tokenizer then drops where ours keeps one (the prompts would differ)
BEFORE, AFTER = "describe", "now"


def checkpoint(out: Path, arch: str = "qwen3_5_moe") -> Path:
    from specdeploy.models import qwen3_5_moe as q35
    from specdeploy.models import qwen3_vl

    if arch.startswith("qwen3_vl"):
        moe = arch == "qwen3_vl_moe"
        hf = qwen3_vl.tiny_hf_config(moe=moe)
        text = {k: v for k, v in (QWEN3_MOE if moe else QWEN3).items()}
        text["rope_parameters"] = dict(hf["text_config"]["rope_parameters"],
                                       mrope_section=[24, 20, 20])  # head_dim 128, as released
        hf["text_config"] = dict(hf["text_config"], **text)
        hf["vision_config"] = dict(hf["vision_config"], **TOWER, deepstack_visual_indexes=[
            1, 2, 3], out_hidden_size=text["hidden_size"])
        return _with_a_merge_token(qwen3_vl.make_tiny_from(out, hf, seed=0))
    hf = q35.tiny_hf_config(mtp_layers=1)
    hf["text_config"] = dict(hf["text_config"], **QWEN)
    hf["vision_config"] = dict(hf["vision_config"], **TOWER,
                               out_hidden_size=QWEN["hidden_size"])
    return _with_a_merge_token(q35.make_tiny(out, seed=0, mtp_layers=1, hf_config=hf))


class LlamaCppVLM:
    def __init__(self, text: Path, mmproj: Path, threads: int, n_ctx: int = 1024):
        import llama_cpp
        from llama_cpp import mtmd_cpp as mtmd
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        self.L, self.M = llama_cpp, mtmd
        self.llm = llama_cpp.Llama(model_path=str(text), n_ctx=n_ctx, n_batch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.ctx = self.llm._ctx.ctx
        p = mtmd.mtmd_context_params_default()
        p.use_gpu, p.print_timings, p.n_threads = False, False, threads
        self.mtmd = mtmd.mtmd_init_from_file(str(mmproj).encode(), self.llm._model.model, p)
        if not self.mtmd:
            raise RuntimeError(f"libmtmd could not load {mmproj}")
        self.n_vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(1, 0, 1)
        self.version = llama_cpp.__version__

    def _argmax(self) -> int:
        row = self.L.llama_get_logits_ith(self.ctx, -1)
        return int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())

    def run(self, img: np.ndarray, n: int) -> tuple[list[int], float, float, int]:
        """(tokens, prefill seconds, decode seconds, image tokens)."""
        L, M = self.L, self.M
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        data = (ctypes.c_uint8 * img.size).from_buffer_copy(img.tobytes())
        bitmap = M.mtmd_bitmap_init(img.shape[1], img.shape[0], data)
        chunks = M.mtmd_input_chunks_init()
        text = M.mtmd_input_text()
        text.text = (BEFORE.encode() + M.mtmd_default_marker() + AFTER.encode())
        text.text_len, text.add_special, text.parse_special = len(text.text), False, True
        if M.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(text),
                           (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1):
            raise RuntimeError("mtmd_tokenize failed")
        image_tokens = sum(M.mtmd_input_chunk_get_n_tokens(M.mtmd_input_chunks_get(chunks, i))
                           for i in range(M.mtmd_input_chunks_size(chunks))
                           if M.mtmd_input_chunk_get_type(M.mtmd_input_chunks_get(chunks, i)))
        n_past = L.llama_pos(0)
        if M.mtmd_helper_eval_chunks(self.mtmd, self.ctx, chunks, 0, 0, 512, True,
                                     ctypes.byref(n_past)):
            raise RuntimeError("mtmd_helper_eval_chunks failed")
        out = [self._argmax()]
        t1 = time.perf_counter()
        b = self.batch
        for j in range(1, n):
            b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = out[-1], n_past.value + j - 1, 1, 1
            b.seq_id[0][0], b.n_tokens = 0, 1
            if L.llama_decode(self.ctx, b):
                raise RuntimeError("llama_decode failed")
            out.append(self._argmax())
        t2 = time.perf_counter()
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bitmap)
        return out, t1 - t0, t2 - t1, image_tokens


def ours_run(llm, img, n: int) -> tuple[list[int], float, float, int]:
    from PIL import Image

    from specdeploy import SamplingParams

    prompt = f"{BEFORE}<|vision_start|><|image_pad|><|vision_end|>{AFTER}"
    t0 = time.perf_counter()
    (o,) = llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                        images=[Image.fromarray(img)])
    wall = time.perf_counter() - t0
    decode = (len(o.token_ids) - 1) / o.metrics.decode_tokens_per_s
    image = sum(t == llm.deployed.image_token_id for t in o.prompt_token_ids)
    return o.token_ids, wall - decode, decode, image


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-src", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--arch", default="qwen3_5_moe", choices=("qwen3_5_moe", "qwen3_vl_moe",
                                                              "qwen3_vl"))
    args = ap.parse_args()
    from specdeploy import LLM
    from specdeploy.bench import machine, print_json

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="vlm_vs_llamacpp_"))
    ckpt = checkpoint(tmp / "ckpt", args.arch)
    text, mmproj = tmp / f"text_{args.outtype}.gguf", tmp / "mmproj.gguf"
    convert(args.llamacpp_src, ckpt, text, args.outtype)
    convert(args.llamacpp_src, ckpt, mmproj, "f32", "--mmproj")
    pixels = SIDE * SIDE
    # NOTE: no prefix caching: the rounds repeat the request (image included), and llama.cpp
    # recomputes it each time
    ours = LLM(str(text), mmproj=str(mmproj), max_batch_size=1, max_seq_len=1024,
               enable_prefix_caching=False,
               mm_processor_kwargs={"min_pixels": pixels, "max_pixels": pixels})
    theirs = LlamaCppVLM(text, mmproj, args.threads)
    img = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    rows = {"specdeploy": [], "llama.cpp": []}
    for r in range(args.rounds):
        order = [("specdeploy", lambda: ours_run(ours, img, args.tokens)),
                 ("llama.cpp", lambda: theirs.run(img, args.tokens))]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            toks, pre, dec, image = fn()
            rows[name].append({"tokens": toks, "prefill_s": pre,
                               "decode_tokens_per_s": (len(toks) - 1) / dec, "image": image})
            print(f"round {r} {name}: prefill {pre * 1e3:.0f} ms, decode "
                  f"{rows[name][-1]['decode_tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    a, b = rows["specdeploy"], rows["llama.cpp"]
    same = next((i for i, (x, y) in enumerate(zip(a[0]["tokens"], b[0]["tokens"])) if x != y),
                min(len(a[0]["tokens"]), len(b[0]["tokens"])))
    result = {
        "machine": machine(), "command": "bench/vs_llamacpp_vlm.py " + " ".join(sys.argv[1:]),
        "arch": args.arch, "llama_cpp": theirs.version, "text_gguf": text.name,
        "mmproj": "F32",
        "image": [SIDE, SIDE], "image_tokens": {"specdeploy": a[0]["image"],
                                                "llama.cpp": b[0]["image"]},
        **{name: {"prefill_s": _median([x["prefill_s"] for x in xs]),
                  "decode_tokens_per_s": _median([x["decode_tokens_per_s"] for x in xs])}
           for name, xs in rows.items()},
        "decode_ours_over_llamacpp": _median([x["decode_tokens_per_s"] / y["decode_tokens_per_s"]
                                              for x, y in zip(a, b)]),
        "prefill_llamacpp_over_ours": _median([y["prefill_s"] / x["prefill_s"]
                                               for x, y in zip(a, b)]),
        "greedy_tokens_agree_for_first": same,
    }
    print_json(result, args.json_out)


if __name__ == "__main__":
    main()
