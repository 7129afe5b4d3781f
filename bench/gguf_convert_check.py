"""llama.cpp's own converter and runtime against specdeploy's GGUF reader, on tiny NemotronH,
Qwen3.5-MoE and dense Qwen3.5.

The unit tests (tests/checkpoint/test_gguf_nemotron_h.py) write their GGUFs with a test-side
converter that follows llama.cpp's; this checks that assumption against the real thing, once
per llama.cpp version:
1. tiny NemotronH checkpoints (dense; MoE with a latent projection and an MTP head) and a tiny
   Qwen3.5-MoE (fewer key than value heads, an MTP head) are converted by llama.cpp's
   convert_hf_to_gguf.py (from the llama-cpp-python sdist, `--llamacpp-src`), and a tiny dense
   Qwen3.5 ("qwen35") with an MTP head, and tiny Qwen2 / Qwen3 / Qwen3-MoE ("qwen2" /
   "qwen3" / "qwen3moe"), Qwen3-VL / Qwen3-VL-MoE ("qwen3vl" / "qwen3vlmoe") and Qwen3-Next
   with an MTP head ("qwen3next"), GLM-4.5 with an MTP layer ("glm4moe"), Granite 4.0-H
   ("granitehybrid"), DeepSeek-V3 and V2 ("deepseek2");
2. specdeploy loads each GGUF; its logits are compared with transformers' on the safetensors
   checkpoint, and its parameters (MTP head included) with those loaded from the checkpoint;
3. llama.cpp itself (llama-cpp-python, built by bench/setup_llamacpp.sh) runs the same GGUF, and
   its last-position logits are compared with transformers';
4. the tiny Qwen3.5-MoE's, dense Qwen3.5's and Qwen3-VL's vision towers are converted with
   `--mmproj` (llama.cpp's mmproj GGUF):
   specdeploy's reader (checkpoint/gguf_mmproj.py) against the checkpoint's `model.visual.*`
   tensors and vision config, a text GGUF + mmproj deployment's greedy tokens with an image
   against the safetensors checkpoint's, and llama.cpp's own image embeddings of that mmproj
   (libmtmd: tokenize, encode the image chunk) against specdeploy's tower on a 64 x 48 image
   (a whole number of merged patches: neither tool resizes it).
It prints one JSON object (the machine, the command, the max |difference| per check).

NOTE (llama-cpp-python 0.3.36): the converter takes any NemotronH config as "nemotron_h_moe"
once transformers (which fills in MoE defaults) is installed, and writes a dense model's MLP
layers with a feed-forward length of 0; llama.cpp then reads them as Mamba2 and refuses the
file ("llamacpp_error"). specdeploy reads layer kinds from the tensors and loads it.

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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdeploy.checkpoint.gguf import GGUFReader  # noqa: E402
from specdeploy.loading import load_model  # noqa: E402
from specdeploy.models import nemotron_h as nh  # noqa: E402

CONVERT = """
import sys
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
import gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
def no_sentencepiece(self, *args, **kwargs):  # (Qwen2's converter tries it first; without the
    raise FileNotFoundError("no tokenizer.model")  # package it fails instead of falling back)
TextModel._set_vocab_sentencepiece = no_sentencepiece
add = gguf.SpecialVocab.add_to_gguf
def add_with_a_merge(self, gw, quiet=False):
    self.merges = self.merges or ["a b"]
    return add(self, gw, quiet=quiet)
gguf.SpecialVocab.add_to_gguf = add_with_a_merge
import runpy
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def models(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (tiny checkpoint, transformers class of its oracle)."""
    from specdeploy.models import deepseek_v3 as ds
    from specdeploy.models import glm4_moe, granite_hybrid, llama, qwen3_moe, qwen3_next, qwen3_vl
    from specdeploy.models import qwen3_5_moe as q35
    from tests.checkpoint.test_gguf_nemotron_h import DENSE, MOE

    return {
        "nemotron_h_dense": (nh.make_tiny(tmp / "nh_dense", seed=5, hf_config=DENSE),
                             "NemotronHForCausalLM"),
        "nemotron_h_moe_mtp": (nh.make_tiny(tmp / "nh_moe", seed=5, mtp_layers=1, hf_config=MOE),
                               "NemotronHForCausalLM"),
        "qwen3_5_moe_mtp": (q35.make_tiny(tmp / "q35", seed=5, mtp_layers=1),
                            "Qwen3_5MoeForConditionalGeneration"),
        **{kind: (llama.make_tiny(tmp / kind, seed=5, config_overrides=llama.tiny_qwen_config(
            kind)), f"Qwen{kind[-1]}ForCausalLM") for kind in ("qwen2", "qwen3")},
        "qwen3_moe": (qwen3_moe.make_tiny(tmp / "q3moe", seed=5, config_overrides={
            "mlp_only_layers": []}), "Qwen3MoeForCausalLM"),
        "qwen3_5_dense_mtp": (q35.make_tiny(tmp / "q35d", seed=5, mtp_layers=1,
                                            hf_config=q35.tiny_hf_config(1, dense=True)),
                              "Qwen3_5ForConditionalGeneration"),
        "qwen3_vl": (qwen3_vl.make_tiny(tmp / "q3vl", seed=5), "Qwen3VLForConditionalGeneration"),
        "qwen3_next_mtp": (qwen3_next.make_tiny(tmp / "q3next", seed=5, mtp_layers=1),
                           "Qwen3NextForCausalLM"),
        "qwen2_moe": (qwen3_moe.make_tiny(tmp / "q2moe", seed=5, config_overrides={
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "shared_expert_intermediate_size": 48, "qkv_bias": True, "norm_topk_prob": False,
            "mlp_only_layers": []}), "Qwen2MoeForCausalLM"),
        "granite_hybrid": (granite_hybrid.make_tiny(tmp / "granite", seed=5),
                           "GraniteMoeHybridForCausalLM"),
        # (one routing group: llama.cpp stores none, as the released GLM-4.5 configs have)
        "glm4_moe_mtp": (glm4_moe.make_tiny(tmp / "glm", seed=5, mtp_layers=1, hf_config={
            **glm4_moe.tiny_hf_config(1), "n_group": 1}), "Glm4MoeForCausalLM"),
        # ("deepseek2": V3's sigmoid routing with groups and YaRN; V2's group-limited softmax;
        # mscale = mscale_all_dim, as the releases: the file keeps one. A q latent in both:
        # llama.cpp takes a file without one for V2-Lite by its 26 / 27 layers only. NOTE
        # (0.3.36): llama.cpp's V2 logits are ~1.3 off transformers' with routing groups, 1e-3
        # with one: its group score is not V2's best-expert max; specdeploy follows transformers)
        **{f"deepseek_{k}": (ds.make_tiny(tmp / f"ds_{k}", seed=5, hf_config={
            **ds.tiny_hf_config(**kw), "rope_scaling": {
                **ds.tiny_hf_config(yarn=True)["rope_scaling"], "mscale": 0.707,
                "mscale_all_dim": 0.707}}), f"Deepseek{k.upper()}ForCausalLM")
           for k, kw in (("v3", {}), ("v2", {"v2": "group_limited_greedy"}))},
        # (every layer MoE: llama.cpp's qwen3vlmoe has no dense MLP tensors)
        "qwen3_vl_moe": (qwen3_vl.make_tiny(tmp / "q3vlmoe", seed=5, moe=True, text_overrides={
            "mlp_only_layers": []}), "Qwen3VLMoeForConditionalGeneration"),
    }


def convert(src_dir: Path, ckpt: Path, out: Path, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{src_dir}:{src_dir / 'gguf-py'}"}
    r = subprocess.run([sys.executable, "-c", CONVERT, str(ckpt), "--outfile", str(out),
                        "--outtype", "f32", *extra], cwd=src_dir, env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{r.stderr[-3000:]}")


def param_diff(ckpt: Path, gguf_path: Path) -> float:
    """Max |difference| of the parameters loaded from the GGUF and from the checkpoint."""
    a = load_model(gguf_path, dtype="float32", with_mtp=None).state_dict()
    b = load_model(ckpt, dtype="float32", with_mtp=None).state_dict()
    if a.keys() != b.keys():
        raise RuntimeError(f"parameters differ: {sorted(set(a) ^ set(b))[:8]}")
    return max((a[k] - b[k]).abs().max().item() for k in b)


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


def llamacpp_image_embd(text_gguf: Path, mmproj: Path, img) -> np.ndarray | str | None:
    """llama.cpp's (libmtmd's) embeddings of one RGB image [tokens, projection dim]; None
    without llama-cpp-python, a string where it refuses."""
    import ctypes

    try:
        import llama_cpp
        from llama_cpp import mtmd_cpp as mtmd
    except ImportError:
        return None
    try:
        llm = llama_cpp.Llama(model_path=str(text_gguf), n_ctx=256, verbose=False, n_threads=2)
    except ValueError as e:
        return str(e)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu, p.print_timings, p.n_threads = False, False, 2
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm._model.model, p)
    if not ctx:
        return "mtmd_init_from_file failed"
    try:
        a = np.asarray(img.convert("RGB"), dtype=np.uint8)
        data = (ctypes.c_uint8 * a.size).from_buffer_copy(a.tobytes())
        bitmap = mtmd.mtmd_bitmap_init(a.shape[1], a.shape[0], data)
        chunks = mtmd.mtmd_input_chunks_init()
        text = mtmd.mtmd_input_text()
        text.text = b"x " + mtmd.mtmd_default_marker()
        text.text_len, text.add_special, text.parse_special = len(text.text), False, True
        if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text),
                              (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1):
            return "mtmd_tokenize failed"
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != 1:  # (MTMD_INPUT_CHUNK_TYPE_IMAGE)
                continue
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if mtmd.mtmd_encode_chunk(ctx, chunk):
                return "mtmd_encode_chunk failed"
            out = mtmd.mtmd_get_output_embd(ctx)
            # (Qwen3-VL: each token's embedding, then its DeepStack levels' features)
            width = llama_cpp.llama_model_n_embd_inp(llm._model.model)
            return np.ctypeslib.as_array(out, shape=(n * width,)).reshape(n, -1).copy()
        return "no image chunk"
    finally:
        mtmd.mtmd_free(ctx)


def mmproj_check(src_dir: Path, ckpt: Path, tmp: Path, converted_text: Path, name: str
                 ) -> dict:
    """The converter's mmproj of `ckpt` (a Qwen3.5 or Qwen3-VL VLM) read back and deployed
    beside the text GGUF the tests write (the converter's text file carries a merge the tiny
    vocabulary lacks: see the module doc)."""
    from PIL import Image

    from specdeploy import LLM, SamplingParams
    from specdeploy.checkpoint import open_checkpoint
    from tests.checkpoint.gguf_qwen3_5_layout import write_gguf
    from tests.vision.test_gguf_qwen3_vl import write_text_gguf

    text_gguf = tmp / f"{name}_text_for_mmproj.gguf"
    if name.startswith("qwen3_vl"):
        write_text_gguf(ckpt, text_gguf, "moe" if name.endswith("moe") else "dense")
    else:
        write_gguf(ckpt, text_gguf)

    out = tmp / f"{name}_mmproj.gguf"
    convert(src_dir, ckpt, out, "--mmproj")
    mm, st = open_checkpoint(out), open_checkpoint(ckpt)
    names = sorted(k for k in st.keys() if k.startswith("model.visual."))
    ours = sorted(k for k in mm.keys() if k.startswith("model.visual."))
    if ours != names:
        raise RuntimeError(f"mmproj tensors differ: {sorted(set(ours) ^ set(names))[:8]}")
    vision = mm.config["vision_config"]
    same = {k: vision[k] == st.config["vision_config"].get(k) for k in vision}
    img = Image.new("RGB", (56, 40), (200, 30, 90))
    prompt = "look <|vision_start|><|image_pad|><|vision_end|> now"
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    opts = dict(max_batch_size=1, max_seq_len=512)
    want = LLM(str(ckpt), **opts).generate(prompt, sp, images=[img])[0].token_ids
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())["size"]
    got = LLM(str(text_gguf), mmproj=str(out), mm_processor_kwargs={
        "min_pixels": pre["shortest_edge"], "max_pixels": pre["longest_edge"]}, **opts
    ).generate(prompt, sp, images=[img])[0].token_ids
    check = {"tower_vs_checkpoint_max_abs": max(
                 (mm.get(k) - st.get(k).float()).abs().max().item() for k in names),
             "vision_config_fields_equal": same, "projector": mm.metadata["clip.projector_type"],
             "greedy_with_an_image_equal": got == want}
    from specdeploy.deploy.vlm import load_vision
    from specdeploy.vision.image import ImageProcessor

    pic = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), np.uint8))
    theirs = llamacpp_image_embd(converted_text, out, pic)
    if isinstance(theirs, str):
        check["llamacpp_error"] = theirs
    elif theirs is not None:
        proc = ImageProcessor.from_config(mm.config["preprocessor"]).with_kwargs(
            {"min_pixels": 64, "max_pixels": 1 << 24})
        pix = proc.preprocess([pic])
        ours = load_vision(mm, torch.float32)(pix.pixel_values, torch.tensor(pix.grid_thw))
        check["llamacpp_image_tokens"] = theirs.shape[0]
        check["ours_image_tokens"] = ours.shape[0]
        if theirs.shape == tuple(ours.shape):
            check["llamacpp_image_embd_vs_ours_max_abs"] = float(
                np.abs(theirs - ours.numpy()).max())
            check["ours_image_embd_max_abs"] = float(ours.abs().max())
    return check


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp-src", type=Path, required=True,
                    help="vendor/llama.cpp of the llama-cpp-python sdist")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--only", nargs="*", default=None, help="these models only (names as in "
                    "the JSON: qwen3_vl, qwen3_vl_moe, qwen3_5_moe_mtp, ...)")
    args = ap.parse_args()
    import transformers

    result = {"machine": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv), "checks": {}}
    ids = [5, 17, 40, 41, 42, 3, 99, 64, 12, 77, 31, 8, 90, 23, 55, 61]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ckpt, oracle_cls) in models(Path(tmp)).items():
            if args.only and name not in args.only:
                continue
            out = Path(tmp) / f"{name}.gguf"
            convert(args.llamacpp_src, ckpt, out)
            oracle = getattr(transformers, oracle_cls).from_pretrained(
                ckpt, dtype=torch.float32, attn_implementation="eager").eval()
            x = torch.tensor([ids])
            want = oracle(input_ids=x, use_cache=False).logits[0]
            ours = load_model(out, dtype="float32")(x)[0]
            check = {"ours_vs_transformers_max_abs": (ours - want).abs().max().item(),
                     "params_vs_checkpoint_max_abs": param_diff(ckpt, out),
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
            if name.startswith(("qwen3_5", "qwen3_vl")):
                result["checks"][f"{name}_mmproj"] = mmproj_check(args.llamacpp_src, ckpt,
                                                                  Path(tmp), out, name)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
