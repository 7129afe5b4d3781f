"""Peak resident memory of `LLM()` with its defaults on the default model, where the bytes are,
and (when `llama_cpp` is importable) llama.cpp's peak for the same GGUF. Prints one JSON object.

Each measurement runs in a fresh subprocess (peak RSS = VmHWM of /proc/self/status, which only
grows): torch imported, then the deployment built, then one short greedy generate. llama.cpp
runs the same prompt at the same context length (n_ctx = specdeploy's max_seq_len).

    python bench/memory.py [--max-tokens 32] [--kwargs '{"kernels": "fast"}'] [--no-llamacpp]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPT = "The capital of France is"

_SPECDEPLOY = r"""
import json, sys
from specdeploy.deploy.memory import process_memory
torch_mem = process_memory()
from specdeploy import LLM, SamplingParams
llm = LLM(**json.loads(sys.argv[1]))
built = process_memory()
out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=int(sys.argv[3]), temperature=0))
stats = llm.stats()
target = getattr(llm.deployed, "target", llm.deployed)
w = target.weight_bytes()
print(json.dumps({"rss_after_import": torch_mem.get("rss"), "rss_after_build": built.get("rss"),
                  "peak_rss_after_build": built.get("peak_rss"),
                  "rss_after_generate": stats.get("rss_bytes"),
                  "peak_rss": stats.get("peak_rss_bytes"),
                  "weight_bytes": {"graph_tensors": w.params, "held_by_transforms": w.closures},
                  "kv_cache_reserved_bytes": stats["cache_bytes"],
                  "max_seq_len": llm.max_model_len, "text": out[0].text}))
"""

_LLAMACPP = r"""
import json, sys
from llama_cpp import Llama
# NOTE: not specdeploy's helper: importing specdeploy imports torch (~230 MB), which llama.cpp
# does not need and which would be counted against it
def process_memory():
    out = {}
    for line in open("/proc/self/status"):
        key = {"VmRSS": "rss", "VmHWM": "peak_rss"}.get(line.split(":")[0])
        if key:
            out[key] = int(line.split()[1]) * 1024
    return out
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), verbose=False)
out = llm(sys.argv[3], max_tokens=int(sys.argv[4]), temperature=0)
m = process_memory()
print(json.dumps({"rss_after_generate": m.get("rss"), "peak_rss": m.get("peak_rss"),
                  "n_ctx": int(sys.argv[2]), "text": out["choices"][0]["text"]}))
"""


def _run(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or [f"rc {proc.returncode}"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kwargs", default="{}", help="LLM(...) keyword arguments as JSON")
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    mib = 2 ** 20
    ours = _run(_SPECDEPLOY, args.kwargs, PROMPT, str(args.max_tokens))
    result = {"command": " ".join(["python", *sys.argv]), "cores": os.cpu_count(),
              "load_avg": os.getloadavg(), "specdeploy": ours}
    try:
        import importlib.util

        have = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        have = False
    if have and not args.no_llamacpp and "error" not in ours:
        from specdeploy.default_model import default_model_path

        ref = _run(_LLAMACPP, str(default_model_path()), str(ours["max_seq_len"]), PROMPT,
                   str(args.max_tokens))
        result["llama_cpp"] = ref
        if ref.get("peak_rss"):
            result["peak_ratio_vs_llama_cpp"] = round(ours["peak_rss"] / ref["peak_rss"], 2)
    else:
        result["llama_cpp"] = "not importable (bench/setup_llamacpp.sh installs it)" if not \
            have else "skipped"
    if "peak_rss" in ours:
        result["specdeploy_peak_mib"] = round(ours["peak_rss"] / mib, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
