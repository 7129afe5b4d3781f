"""A GGUF whose tensors of one block kind are rewritten as random blocks of another kind.

llama-quantize writes IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS only with an importance
matrix, which llama-cpp-python's `llama_model_quantize` cannot be given. To time those kinds
against llama.cpp on the same file, take a file it did write (e.g. the IQ3_M one: IQ3_S for most
matrices) and swap each IQ3_S tensor for random blocks of the wanted kind, same shape: a model
of random values, the same for both tools (its tokens are no check of correctness here; the
tests compare the kinds with gguf-py's dequantization).

    .venv/bin/python bench/iq_retype.py SRC.gguf DST.gguf --from iq3_s --to iq2_xxs
"""
from __future__ import annotations

import argparse

import numpy as np


def random_blocks(kind, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Any bytes (codebook indices, signs, scales) with a small fp16 d: values up to ~0.05."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    div = {"IQ3_XXS": 12, "IQ3_S": 12, "IQ1_S": 1, "IQ1_M": 1}.get(kind.name, 4)
    d = (rng.uniform(1e-4, 3e-4, raw.shape[:-1]) / div).astype(np.float16).view(np.uint16)
    if kind == gguf.GGMLQuantizationType.IQ1_M:  # d in the scales' top nibbles
        sc = raw[..., 48:56].copy().view(np.uint16)
        for j in range(4):
            sc[..., j] = (sc[..., j] & 0x0FFF) | (((d >> 4 * j) & 0xF) << 12)
        raw[..., 48:56] = sc.view(np.uint8)
    else:
        raw[..., 0:2] = d[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def main() -> None:
    import gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--from", dest="src_kind", default="iq3_s")
    ap.add_argument("--to", dest="dst_kind", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    q = gguf.GGMLQuantizationType
    src_kind, dst_kind = q[args.src_kind.upper()], q[args.dst_kind.upper()]
    reader = gguf.GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(args.dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        main_type = field.types[0]
        sub = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), main_type, sub_type=sub)
    rng, swapped = np.random.default_rng(args.seed), 0
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape))  # numpy order
        if t.tensor_type == src_kind:
            writer.add_tensor(t.name, random_blocks(dst_kind, shape, rng), raw_dtype=dst_kind)
            swapped += 1
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.dst}: {swapped} {src_kind.name} tensors -> {dst_kind.name}")


if __name__ == "__main__":
    main()
