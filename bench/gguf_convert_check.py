"""llama.cpp's own converter and runtime against specdeploy's GGUF reader, on tiny NemotronH.

The unit tests (tests/checkpoint/test_gguf_nemotron_h.py) write their GGUFs with a test-side
converter that follows llama.cpp's; this checks that assumption against the real thing, once
per llama.cpp version:
1. tiny NemotronH checkpoints (dense; MoE with a latent projection and an MTP head) are converted
   by llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python sdist, `--llamacpp-src`);
2. specdeploy loads each GGUF; its logits are compared with transformers' on the safetensors
   checkpoint, and its tensors with the checkpoint's;
3. llama.cpp itself (llama-cpp-python, built by bench/setup_llamacpp.sh) runs the same GGUF, and
   its last-position logits are compared with transformers'.
It prints one JSON object (the machine, the command, the max |difference| per check).

The converter refuses a tokenizer whose pre-tokenizer hash it does not know (the tiny
character tokenizer's), so it runs with `get_vocab_base_pre` returning "default"; llama.cpp
refuses a BPE vocabulary without merges (the tiny one has none), so the file gets one ("a b":
the checks feed token ids, nothing is tokenized).

Usage (the sdist: `pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all:`):
  PYTHONPATH=.:/work/llamacpp python bench/gguf_convert_check.py \
      --llamacpp-src /path/to/llama_cpp_python-0.3.36/vendor/llama.cpp [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdeploy.checkpoint import open_checkpoint  # noqa: E402
from specdeploy.checkpoint.gguf import GGUFReader  # noqa: E402
from specdeploy.loading import load_model  # noqa: E402
from specdeploy.models import nemotron_h as nh  # noqa: E402

CONVERT = """
import sys
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
import gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
add = gguf.SpecialVocab.add_to_gguf
def add_with_a_merge(self, gw, quiet=False):
    self.merges = self.merges or ["a b"]
    return add(self, gw, quiet=quiet)
gguf.SpecialVocab.add_to_gguf = add_with_a_merge
import runpy
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def configs() -> dict[str, tuple[dict, int]]:
    from tests.checkpoint.test_gguf_nemotron_h import DENSE, MOE

    return {"dense": (DENSE, 0), "moe_mtp": (MOE, 1)}


def convert(src_dir: Path, ckpt: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{src_dir}:{src_dir / 'gguf-py'}"}
    r = subprocess.run([sys.executable, "-c", CONVERT, str(ckpt), "--outfile", str(out),
                        "--outtype", "f32"], cwd=src_dir, env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{r.stderr[-3000:]}")


def tensor_diff(ckpt: Path, gguf_path: Path) -> float:
    st, gg = open_checkpoint(ckpt), GGUFReader(gguf_path)
    worst = 0.0
    for key in st.keys():
        if ".mixer.experts." in key:
            head, e, proj = key.rsplit(".", 3)[0], int(key.split(".")[5]), key.rsplit(".", 2)[1]
            got = gg.get(f"{head}.{proj}")[e]
        else:
            got = gg.get(key)
        worst = max(worst, (got - st.get(key)).abs().max().item())
    return worst


@torch.no_grad()
def llamacpp_logits(gguf_path: Path, ids: list[int]) -> torch.Tensor | str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    try:
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=64, logits_all=True,
                              verbose=False, n_threads=os.cpu_count() or 1)
    except ValueError as e:  # llama.cpp refuses the file
        return str(e)
    llm.eval(ids)
    return torch.tensor(llm.scores[:len(ids)], dtype=torch.float32)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp-src", type=Path, required=True,
                    help="vendor/llama.cpp of the llama-cpp-python sdist")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    import transformers

    result = {"machine": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv), "checks": {}}
    ids = [5, 17, 40, 41, 42, 3, 99, 64, 12, 77, 31, 8, 90, 23, 55, 61]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (hf, mtp) in configs().items():
            ckpt = nh.make_tiny(Path(tmp) / name, seed=5, mtp_layers=mtp, hf_config=hf)
            out = Path(tmp) / f"{name}.gguf"
            convert(args.llamacpp_src, ckpt, out)
            oracle = transformers.NemotronHForCausalLM.from_pretrained(
                ckpt, dtype=torch.float32, attn_implementation="eager").eval()
            x = torch.tensor([ids])
            want = oracle(x, use_cache=False).logits[0]
            ours = load_model(out, dtype="float32")(x)[0]
            check = {"ours_vs_transformers_max_abs": (ours - want).abs().max().item(),
                     "tensors_vs_checkpoint_max_abs": tensor_diff(ckpt, out),
                     "gguf_arch": GGUFReader(out).metadata["general.architecture"],
                     "mtp_tensors": sum(k.startswith("mtp.") for k in GGUFReader(out).keys())}
            theirs = llamacpp_logits(out, ids)
            if isinstance(theirs, str):
                check["llamacpp_error"] = theirs
            elif theirs is not None:
                v = theirs.shape[-1]
                check["llamacpp_vs_transformers_max_abs"] = (
                    theirs - want[:, :v]).abs().max().item()
                check["llamacpp_vs_ours_max_abs"] = (theirs - ours[:, :v]).abs().max().item()
            result["checks"][name] = check
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
