"""specdeploy's GGUF tokenizer against llama.cpp's, per `tokenizer.ggml.pre` split.

For each pre-tokenizer name specdeploy maps to its own split (specdeploy/tokenizer.py), a
vocabulary-only copy of the default model's GGUF (its byte-level BPE vocabulary and merges)
is written with that name, and both tokenizers encode the same texts (digits, case changes,
combining marks, contractions, newlines and runs of spaces, code, CJK); printed as JSON: per
name, how many texts gave the same ids, and the first difference. llama.cpp
(llama-cpp-python, bench/setup_llamacpp.sh) is the oracle: it implements the splits itself.

    PYTHONPATH=.:/work/llamacpp python bench/gguf_tokenizer_check.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMES = ("gpt-2", "smollm", "llama3", "pixtral", "qwen2", "qwen35", "tekken")
TEXTS = [
    "Hello world! 12345 and 3.14159, 1000000 items.",
    "HelloWorld camelCaseWords XMLHttpRequest iPhone MacOS",
    "café naïve résumé (decomposed: cafe\u0301 nai\u0308ve)",
    "don't won't I'm you're he'll she'd they've IT'S DON'T",
    "line one\nline two\n\n\n   indented\tand\ttabs  \n  trailing   ",
    "def f(x):\n    return x ** 2  # comment\n\nprint(f(10))",
    "中文字符 和 日本語のテキスト 한국어",
    "emoji 🙂👍 and symbols ©®™ — “quotes” ‘single’ …",
    "URL: https://example.com/path?q=1&r=2 email a.b@c.de",
    "   leading spaces and 42nd street, 7th ave, 2024-12-05",
]


def vocab_copy(src: Path, out: Path, pre: str) -> Path:
    """`src`'s metadata (vocabulary, merges, llama hparams) without tensors, pre set to `pre`."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import llama_cpp

    from specdeploy.default_model import default_model_path
    from specdeploy.tokenizer import load_tokenizer

    src = Path(default_model_path())
    result = {"machine": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv), "vocabulary": src.name, "names": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in NAMES:
            path = vocab_copy(src, Path(tmp) / f"{pre}.gguf", pre)
            ours = load_tokenizer(path)
            theirs = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            same, first = 0, None
            for text in TEXTS:
                a = ours.encode(text, add_special_tokens=False)
                b = theirs.tokenize(text.encode(), add_bos=False, special=False)
                if a == b:
                    same += 1
                elif first is None:
                    first = {"text": text, "ours": a[:24], "llama.cpp": b[:24]}
            result["names"][pre] = {"same": same, "of": len(TEXTS), "first_difference": first}
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
