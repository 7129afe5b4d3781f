"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral 7B,
Phi-3): ids and decoded text against transformers' own GGUF tokenizer of the same file."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from specdeploy.checkpoint import CheckpointError
from specdeploy.engine.detokenizer import IncrementalDetokenizer
from specdeploy.engine.grammar_vocab import token_bytes
from specdeploy.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.
Hello world, hello there! Tokenizers split text into pieces; pieces merge into words.
In 2024 there were 365 days and 12 months. Numbers like 3.14 and 42 appear here.
Café au lait, naïve résumé: déjà vu."""
SPACE = "\u2581"
USER = "<|tool|>"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple   spaces   inside",
    "line one\nline two\n\nline four",
    "\n starts with a newline",
    "digits 1234567890 and 3.14",
    "Café déjà vu naïve",
    "Ünïcödé ßtraße — 日本語のテキスト",
    "emoji \U0001F600\U0001F680 done \u2764\ufe0f",
    f"call {USER} with args",
    f"{USER}at the start",
    "tabs\tand\ttabs",
    "xyz xyzzy thelazy brownfox",
    "",
    " ",
]


def _train_pieces(n_merges: int) -> list[str]:
    """A tiny SentencePiece-style BPE vocabulary: the pieces of `n_merges` greedy merges over
    the corpus (spaces as "▁", one in front of each word), best first."""
    words = Counter(SPACE + w for w in CORPUS.split())
    seqs = {w: list(w) for w in words}
    pieces = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, s in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return pieces


def write_spm_gguf(path, *, arch: str = "llama", add_space_prefix: bool | None = None,
                   add_bos: bool | None = None, add_eos: bool = False) -> list[str]:
    """<unk> <s> </s>, 256 byte tokens, merged pieces (scores by rank), single characters
    (lowest scores; no "ß", "日", emoji: those go through the byte tokens), a user-defined
    token and an unused one."""
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [T.BYTE] * 256
    merged = _train_pieces(220)
    # two overlapping pieces ("xyz": "x yz" by the scores, "xy z" the other way round)
    merged = [p for p in merged if p not in ("xy", "yz")]
    merged = merged[:10] + ["yz"] + merged[10:100] + ["xy"] + merged[100:]
    chars = sorted(set(CORPUS.replace(" ", "").replace("\n", "")) | {SPACE, "\t"} - set(merged))
    pieces = merged + [c for c in chars if c not in merged]
    if arch.startswith("gemma"):  # Gemma's files store a piece of spaces as spaces
        pieces.insert(5, "  ")
    tokens += pieces
    types += [T.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    tokens += [USER, "<unused0>"]
    types += [T.USER_DEFINED, T.UNUSED]
    scores += [0.0, 0.0]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def _prefix_free(text: str) -> bool:
    """No run of text that starts with a space or follows an added token: transformers'
    tokenizer of a "llama" file (Metaspace: "▁" in front of the text's start only, and only
    where none is) and llama.cpp agree on it."""
    return not text.startswith(" ") and USER not in text


def _reference(d, name="ref.gguf", **kw):
    """transformers' tokenizer of the same vocabulary written as a "phi3" file: its builder
    puts a "▁" in front of every run of text, as llama.cpp's SPM (see test_llamacpp_vocab)."""
    write_spm_gguf(d / name, arch=kw.pop("arch", "phi3"), **kw)
    return transformers.AutoTokenizer.from_pretrained(str(d), gguf_file=name)


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    tokens = write_spm_gguf(d / "spm.gguf")
    assert len(tokens) > 300
    ref = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file="spm.gguf")
    return load_tokenizer(d / "spm.gguf"), ref, tokens, _reference(d)


@pytest.mark.parametrize("text", TEXTS)
def test_spm_ids_and_decode_match_transformers(spm_pair, text):
    tok, ref_llama, _, ref = spm_pair
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == ref.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    if _prefix_free(text):  # the "llama" file's own transformers tokenizer agrees here
        assert ids == ref_llama.encode(text)
        assert tok.decode(ids) == ref_llama.decode(ids)
    if USER not in text:  # round trip (the added token, matched whole, loses a space after it)
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_spm_differs_from_transformers_llama_only_at_a_leading_space(spm_pair):
    """Where transformers' "llama" builder and llama.cpp part: " Hi" is "▁▁Hi" in llama.cpp
    (and SentencePiece's dummy prefix), "▁Hi" in transformers; we follow llama.cpp."""
    tok, ref_llama, tokens, _ = spm_pair
    def pieces(t, text):
        return [tokens[i] for i in t.encode(text, add_special_tokens=False)]

    assert pieces(tok, " the") == [SPACE, SPACE + "the"]
    assert pieces(ref_llama, " the") == [SPACE + "the"]
    assert pieces(tok, f"{USER}the") == [USER, SPACE + "the"]  # llama.cpp: after a token too
    assert pieces(ref_llama, f"{USER}the")[1:] != [SPACE + "the"]


def test_spm_pieces_are_merged_and_bytes_fall_back(spm_pair):
    tok, _, tokens, _ = spm_pair
    ids = tok.encode("the dog \U0001F600", add_special_tokens=False)
    pieces = [tokens[i] for i in ids]
    assert pieces[:2] == [SPACE + "the", SPACE + "dog"]  # whole words from the merges
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # the emoji's UTF-8 bytes
    assert tok.encode("x", add_special_tokens=True)[0] == tok.bos_token_id == 1
    assert tok.eos_token_ids == [2]
    assert tok.encode(USER, add_special_tokens=False) == [tokens.index(USER)]
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>",
                                  "unk_token": "<unk>", "pad_token": "<unk>"}


def test_spm_streaming_detokenizer_round_trips(spm_pair):
    tok = spm_pair[0]
    text = "Hello  world\nCafé \U0001F600 déjà vu — 日本"
    prompt = tok.encode("The prompt:")
    out_ids = tok.encode(" " + text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok.decode, prompt_ids=prompt)
    streamed = "".join(det.add(i) for i in out_ids) + det.flush()
    assert "\ufffd" not in streamed
    assert tok.decode(prompt + out_ids, skip_special_tokens=True) == "The prompt:" + streamed
    det = IncrementalDetokenizer(tok.decode)  # no prompt: the first piece's "▁" is dropped
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(det.add(i) for i in ids) + det.flush() == text


def test_spm_token_bytes_for_grammars(spm_pair):
    tok, _, tokens, _ = spm_pair
    tb = token_bytes(tok)
    assert tb[tokens.index(SPACE + "the")] == b" the"
    assert tb[tokens.index("<0xF0>")] == b"\xf0"
    assert 1 not in tb and 2 not in tb  # <s> </s>


@pytest.mark.parametrize("kw", [dict(add_bos=False), dict(add_eos=True),
                                dict(add_bos=True, add_eos=True), dict(arch="phi3"),
                                dict(arch="gemma3", add_space_prefix=False)])
def test_spm_flags_and_phi3_match_transformers(tmp_path, kw):
    write_spm_gguf(tmp_path / "v.gguf", **kw)
    tok = load_tokenizer(tmp_path / "v.gguf")
    ref = _reference(tmp_path, **{"arch": "phi3", **kw})  # gemma3: its own builder
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids), text


def test_spm_without_space_prefix(tmp_path):
    """`add_space_prefix = false` (llama.cpp: no "▁" in front of the text)."""
    tokens = write_spm_gguf(tmp_path / "v.gguf", add_space_prefix=False)
    tok = load_tokenizer(tmp_path / "v.gguf")
    ids = tok.encode("the dog", add_special_tokens=False)
    assert not tokens[ids[0]].startswith(SPACE) and tokens[ids[-1]] == SPACE + "dog"
    assert tok.decode(ids) == "the dog"
    assert tok.decode(tok.encode(" the dog")) == "<s> the dog"
    write_spm_gguf(tmp_path / "w.gguf", add_space_prefix=True)
    ids = load_tokenizer(tmp_path / "w.gguf").encode("the dog", add_special_tokens=False)
    assert [tokens[i] for i in ids] == [SPACE + "the", SPACE + "dog"]


def test_wrong_construction_differs(spm_pair):
    """The comparison can fail: the same vocabulary without the space prefix, with merges
    ranked the wrong way round, or without byte fallback encodes some text differently from
    transformers; and the oracle's ids do hold the overlap the scores decide ("x yz")."""
    from tokenizers import models, normalizers

    from specdeploy.tokenizer import _spm_merges

    tok, _, tokens, ref = spm_pair
    assert [tokens[i] for i in ref.encode("xyz", add_special_tokens=False)] == [SPACE, "x", "yz"]
    vocab = {t: i for i, t in enumerate(tokens)}
    n = len(tokens) - 261
    right = _spm_merges(tokens, [0.0] * 259 + [-float(i) for i in range(n)] + [0.0, 0.0])
    flip = _spm_merges(tokens, [0.0] * 259 + [float(i) for i in range(n)] + [0.0, 0.0])
    wrong = []
    for model in (models.BPE(vocab=vocab, merges=flip, fuse_unk=True, byte_fallback=True),
                  models.BPE(vocab=vocab, merges=right, fuse_unk=True, unk_token="<unk>"),
                  None):
        b = tok.backend.__class__.from_str(tok.backend.to_str())
        if model is None:
            b.normalizer = normalizers.Replace(" ", SPACE)
        else:
            b.model = model
        wrong.append(b)
    for b in wrong:
        assert any(b.encode(t).ids != ref.encode(t) for t in TEXTS)


def test_unknown_tokenizer_model_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model("rwkv")
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="'rwkv' is not supported"):
        load_tokenizer(tmp_path / "v.gguf")


LLAMACPP_SRCS = [os.environ.get("LLAMACPP_SRC", ""),
                 "/work/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"]


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_llamacpp_vocab(name):
    """llama.cpp's own SPM vocabularies (Llama's 32000 pieces; Phi-3's) and the ids its
    tokenizer test expects for them (models/ggml-vocab-*.gguf.inp / .out of the llama.cpp
    tree, as in the llama-cpp-python sdist; `LLAMACPP_SRC`): every text the same ids."""
    found = [Path(d) / "models" / f"ggml-vocab-{name}.gguf" for d in LLAMACPP_SRCS if d]
    found = [f for f in found if f.is_file()]
    if not found:
        pytest.skip("llama.cpp's vocabulary files not here (set LLAMACPP_SRC)")
    f = found[0]
    texts = Path(f"{f}.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = Path(f"{f}.out").read_text().split("\n")
    tok = load_tokenizer(f)
    assert len(texts) > 40
    for text, want in zip(texts, expected):
        assert tok.encode(text, add_special_tokens=False) == [int(x) for x in want.split()], text
