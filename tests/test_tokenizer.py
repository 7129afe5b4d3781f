"""Tokenizers: the default GGUF vocabulary and a HF directory, against transformers."""
from __future__ import annotations

import pytest

from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_tiny_tokenizer
from specdeploy.default_model import DEFAULT_GGUF, default_model_path
from specdeploy.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world", " leading space and trailing ", "ünïcödé 😀 中文字符 العربية ñ",
    "<|im_start|>user\nhi<|im_end|>\n", "  multiple   spaces\n\n\ttabs 12345 3.14159",
    "don't I'll we've THEY'RE", "", "<|endoftext|>def f(x):\n    return x**2  # ok",
    "a" * 300,
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? ünï 😀"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    (d / DEFAULT_GGUF).symlink_to(default_model_path())
    ref = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file=DEFAULT_GGUF)
    return load_tokenizer(None), ref


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_transformers(gguf_pair, text):
    tok, ref = gguf_pair
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == ref(text, add_special_tokens=special)["input_ids"]
        assert tok.decode(ids) == ref.decode(ids)
        plain = ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=True) == plain


@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:2]])  # with / without system turn
def test_gguf_chat_template_matches_transformers(gguf_pair, messages, gen_prompt):
    tok, ref = gguf_pair
    text = tok.apply_chat_template(messages, add_generation_prompt=gen_prompt)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=gen_prompt,
                                           tokenize=False)
    assert tok.encode(text) == ref(text)["input_ids"]


def test_gguf_special_ids(gguf_pair):
    tok, ref = gguf_pair
    assert tok.eos_token_ids == [2] == [ref.eos_token_id]
    assert tok.bos_token_id == 1 and tok.vocab_size == 49152 == len(ref)
    assert tok.decode([2]) == "<|im_end|>"


def test_hf_dir_matches_transformers(tmp_path):
    write_tiny_tokenizer(tmp_path, vocab_size=128)
    tok = load_tokenizer(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["hello, world!", "<|im_start|>a\nb<|im_end|>"]:
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == ref.decode(ref(text)["input_ids"])
    msgs = MESSAGES[:2]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False)
    assert tok.eos_token_ids == [2] and tok.vocab_size == 128


def test_hf_dir_chat_template_file_and_errors(tmp_path):
    write_tiny_tokenizer(tmp_path, vocab_size=128)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}")
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "u", "content": "<é>"}]) == '[u]"<é>"'
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(Exception, match="no system role"):
        tok.apply_chat_template([])
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|access"):  # sandboxed: no attribute escapes
        tok.apply_chat_template([])
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_gguf_without_vocabulary_is_rejected(tmp_path):
    cut = tmp_path / "x.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(2000))
    with pytest.raises(CheckpointError, match="truncated"):
        load_tokenizer(cut)


# Where a GGUF vocabulary's pre-tokenizer name changes the split before BPE (llama.cpp's
# llama-vocab.cpp groups; bench/gguf_tokenizer_check.py compares whole encodings with
# llama.cpp's tokenizer): the pieces of one text under each name, written out by hand.
SPLIT_TEXT = "HelloWorld 12345 cafe\u0301"
SPLIT_PIECES = {
    "gpt-2": ["HelloWorld", " 12345", " cafe", "\u0301"],
    "llama3": ["HelloWorld", " ", "123", "45", " cafe", "\u0301"],
    "glm4": ["HelloWorld", " ", "123", "45", " cafe", "\u0301"],
    "pixtral": ["HelloWorld", " ", "123", "45", " cafe", "\u0301"],
    "qwen2": ["HelloWorld", " ", "1", "2", "3", "4", "5", " cafe", "\u0301"],
    "qwen35": ["HelloWorld", " ", "1", "2", "3", "4", "5", " cafe\u0301"],
    "tekken": ["Hello", "World", " ", "1", "2", "3", "4", "5", " cafe\u0301"],
}


@pytest.mark.parametrize("pre", sorted(SPLIT_PIECES))
def test_gguf_pre_tokenizer_split_by_name(tmp_path, pre):
    gguf = pytest.importorskip("gguf")
    from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer

    write_tiny_tokenizer(tmp_path, 128)
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    add_tokenizer(w, tmp_path, 128, pre=pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_tokenizer(tmp_path / "v.gguf")
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str(SPLIT_TEXT)
    assert [SPLIT_TEXT[a:b] for _, (a, b) in pieces] == SPLIT_PIECES[pre]


@pytest.mark.parametrize("pre, ids", [("llama-bpe", [5]), ("glm4", [5]), ("gpt-2", [4, 2]),
                                      ("qwen2", [4, 2])])
def test_gguf_ignore_merges_by_name(tmp_path, pre, ids):
    """llama.cpp's `ignore_merges` (Llama 3, GLM-4 vocabularies): a piece that is a whole
    token is that token, though the merges alone would not spell it ("abc": only "a b" is a
    merge); other vocabularies take the merges ("ab", "c")."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "c", "Ġ", "ab", "abc"])
    w.add_token_types([1] * 6)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_tokenizer(tmp_path / "v.gguf").encode("abc", add_special_tokens=False) == ids
