"""Command-line options shared by `specdeploy` subcommands, the benches and training: the model
and sampling flags and the objects built from them (beneath cli.py, bench.py and training/)."""
from __future__ import annotations

import argparse

from specdeploy.spec_args import add_spec_args, spec_from_args

DEVICE_HELP = "cpu (default), cuda or cuda:N; dtype auto = float32 on cpu, bfloat16 on cuda"
MODEL_HELP = ("HF directory, .gguf file or Hub id (org/name) already in the local Hugging Face "
              "cache (default: SmolLM2-135M)")
DTYPE_HELP = "auto, float32 (float, fp32), bfloat16 (bf16), float16 (half, fp16)"


def add_context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-model-len", "--max-seq-len", dest="max_seq_len", type=int,
                   default=None, help="prompt + output tokens per sequence (default: the model's "
                   "max_position_embeddings, at most 2048; more than it is refused)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the checkpoint's generation_config.json), "
                        "vllm (ignore it) or a directory holding one")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    add_context_args(p)
    add_budget_args(p)
    p.add_argument("--backend", choices=("graph", "eager"), default="graph")
    add_spec_args(p)
    p.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="weight-only int8 (lm_head, routers and the drafter excluded)")
    p.add_argument("--compile", action="store_true", help="torch.compile the deployed graph")
    p.add_argument("--kernels", choices=("exact", "fast"), default="fast",
                   help="GGUF Q4_0/Q4_1/Q8_0 linears: fast integer-dot kernels (default; 8-bit "
                        "activations, as llama.cpp) or the exact fp32 model")
    add_parallel_args(p)
    add_prefix_caching_arg(p)
    add_vision_args(p)


def add_vision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mmproj", default=None, metavar="FILE.gguf",
                   help="the vision tower of a text GGUF: llama.cpp's mmproj GGUF (a Qwen3.5 "
                        "tower beside a Qwen3.5-MoE text GGUF)")
    p.add_argument("--mm-processor-kwargs", type=json_dict, default=None, metavar="JSON",
                   help='the image resize\'s pixel limits and the video sampling, e.g. '
                        '\'{"max_pixels": 1003520, "fps": 1}\' (vLLM\'s; keys min_pixels, '
                        "max_pixels, fps, min_frames, max_frames, do_sample_frames)")
    p.add_argument("--mm-encoder-dtype", default="auto", metavar="DTYPE",
                   help="the vision tower's dtype (auto: the model's, but bfloat16 on a CPU "
                        "with native bf16 matmuls when the tower's values are bfloat16: "
                        "stored so, or an F16 mmproj of a bfloat16 tower)")
    p.add_argument("--limit-mm-per-prompt", type=json_dict, default=None, metavar="JSON",
                   help='the most images / videos one prompt may carry, e.g. \'{"image": 4, '
                        '"video": 1}\' (vLLM\'s; default: no limit)')


def vision_kwargs(args) -> dict:
    """LLM keyword arguments from `add_vision_args`."""
    return dict(mmproj=getattr(args, "mmproj", None),
                mm_processor_kwargs=getattr(args, "mm_processor_kwargs", None),
                mm_encoder_dtype=getattr(args, "mm_encoder_dtype", "auto"),
                limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None))


def json_dict(text: str) -> dict:
    import json

    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return v


def add_budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-cache-gib", type=float, default=None,
                   help="the caches' budget in GiB (default: half the memory free after loading)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction (0, 1] of the device's total memory this instance may hold, "
                        "weights included; the caches get the rest (not with --max-cache-gib)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="auto, float32, bfloat16, float16, fp8 (= fp8_e4m3: 1 byte a value, "
                        "scale 1.0 unless the checkpoint ships k/v scales), fp8_e5m2")


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_cuda_graphs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None,
                   help="require CUDA graphs: decode and verify steps replayed per batch-size "
                        "bucket (the default on CUDA wherever they can serve)")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs",
                   action="store_false", help="every step eager (vLLM's --enforce-eager)")
    p.add_argument("--num-scheduler-steps", type=positive_int, default=1,
                   help="decode steps run as bursts of up to N CUDA-graph replays, one "
                        "host sync each (vLLM's multi-step scheduling; default 1: off)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (worker processes here, or torchrun's); rank 0 runs the engine")
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="MoE expert groups among the ranks (must divide the TP size)")
    p.add_argument("--shard-layers", default=None,
                   help="comma-separated layer types to shard (mha,ssm,delta,mlp,moe,lm_head; "
                        "default all), the rest replicated")
    p.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds a collective waits before a dead or hung rank fails the step")


def parallel_kwargs(args) -> dict:
    """LLM keyword arguments from `add_parallel_args`."""
    layers = getattr(args, "shard_layers", None)
    return dict(tensor_parallel_size=args.tensor_parallel_size,
                expert_parallel_size=args.expert_parallel_size,
                shard_layers=None if layers is None else tuple(
                    s.strip() for s in layers.split(",") if s.strip()),
                dist_timeout=args.dist_timeout)


def add_prefix_caching_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share cached prompt prefixes (KV pages, recurrent "
                   "checkpoints); --no-enable-prefix-caching turns it off")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


THREADS_HELP = ("CPU threads: a count, or 'auto' (that many or 1, whichever the engine "
                "measures faster now; needs --kernels fast)")


def threads_arg(text: str) -> int | str:
    """--threads: a positive count or 'auto'."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer or 'auto', got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def llm_from_args(args, max_batch_size: int):
    from specdeploy.llm import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=max_batch_size,
               max_seq_len=args.max_seq_len, spec=spec_from_args(args),
               max_cache_gib=args.max_cache_gib,
               gpu_memory_utilization=args.gpu_memory_utilization,
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
               cuda_graphs=getattr(args, "cuda_graphs", None),
               num_scheduler_steps=getattr(args, "num_scheduler_steps", 1),
               backend=args.backend, progress=True, compile=args.compile, kernels=args.kernels,
               enable_prefix_caching=args.enable_prefix_caching,
               generation_config=args.generation_config,
               quantize=None if args.quantize == "none" else args.quantize,
               threads=args.threads, **parallel_kwargs(args), **vision_kwargs(args))


def sampling_from_args(args, **extra):
    from specdeploy.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, **extra)
