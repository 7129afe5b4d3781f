"""Context-free grammars (`guided_grammar`, engine/grammar_cfg.py) on a tiny Llama, with and without
EAGLE-3. Oracles the parser did not produce: a recursive-descent checker written here for a
non-regular language (nested brackets), the regular-grammar path (outlines-core) for a language
both can state (the same allowed tokens, so the same greedy output), masks rebuilt token by
token by a fresh matcher, and the plain deployment for speculation (greedy equal, with the real
drafter and with oracle drafts past which some are wrong)."""
from __future__ import annotations

import re

import pytest
import torch

from specdeploy import SamplingParams
from tests.spec.test_sampling_features import _both_sources
from tests.spec.tiny_targets import Target

pytest.importorskip("llguidance")
K = 3
# nested brackets around a word: not a regular language (GBNF, as llama.cpp / xgrammar take)
NESTED = '''root ::= "[" inner "]"
inner ::= word | "[" inner "]" | inner "," inner
word ::= [a-d]+'''
NESTED_LARK = '''start: "[" inner "]"
inner: WORD | "[" inner "]" | inner "," inner
WORD: /[a-d]+/'''


def _nested_ok(text: str) -> bool:
    """Recursive descent over NESTED's language."""
    pos = 0

    def inner() -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(text) and text[pos] == ",":
            pos += 1
            if not item():
                return False
        return True

    def item() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "[":
            pos += 1
            if not inner() or pos >= len(text) or text[pos] != "]":
                return False
            pos += 1
            return True
        m = re.match(r"[a-d]+", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    if not text.startswith("["):
        return False
    pos = 1
    return inner() and text[pos:] == "]"


def test_the_checker_itself():
    assert _nested_ok("[a]") and _nested_ok("[[ab],c,[[d]]]")
    assert not _nested_ok("[a") and not _nested_ok("[]") and not _nested_ok("[a]]")
    assert not _nested_ok("[a,]") and not _nested_ok("[e]")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return Target("llama", tmp_path_factory.mktemp("cfg"))


@pytest.mark.parametrize("grammar", [NESTED, NESTED_LARK], ids=["gbnf", "lark"])
@pytest.mark.parametrize("k", [None, K])
def test_outputs_are_sentences_of_a_nonregular_grammar(target, k, grammar):
    """Greedy and sampled replies that stop are sentences; one cut short by max_tokens is a
    prefix of one (never a wrong character)."""
    llm = target.llm(k)
    prompts = target.prompts[:3]
    stopped = 0
    for extra in ({}, {"temperature": 1.0, "seed": 5}):
        for out in llm.generate(prompts, SamplingParams(max_tokens=40, guided_grammar=grammar,
                                                        **extra)):
            if out.finish_reason == "stop":
                stopped += 1
                assert _nested_ok(out.text), out.text
            else:
                assert re.fullmatch(r"[\[\],a-d]*", out.text) and out.text.startswith("[")
    assert stopped >= 2


def test_greedy_speculation_equals_plain(target):
    prompts = target.prompts[:4]
    params = SamplingParams(max_tokens=30, guided_grammar=NESTED)
    plain, own, oracle, accepted = _both_sources(target, prompts, params)
    assert accepted > 0
    for p, a, b in zip(plain, own, oracle):
        assert a.token_ids == p.token_ids and b.token_ids == p.token_ids


def test_a_regular_language_gives_the_regular_paths_tokens(target):
    """The same language as guided_regex (outlines-core's automaton) and as guided_grammar
    (llguidance's parser): the same allowed tokens, so the same greedy tokens."""
    llm = target.llm(None)
    prompts = target.prompts[:3]
    regex = r"(ab|c)[0-9]{1,3}-(xy|z)"
    grammar = 'root ::= ("ab" | "c") [0-9] [0-9]? [0-9]? "-" ("xy" | "z")'
    a = llm.generate(prompts, SamplingParams(max_tokens=12, guided_regex=regex))
    b = llm.generate(prompts, SamplingParams(max_tokens=12, guided_grammar=grammar))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(re.fullmatch(regex, o.text) for o in b)


def test_row_masks_equal_token_by_token_masks(target):
    """A verify step's row masks (drafts consumed and rolled back) equal the masks of a fresh
    matcher fed the same tokens one at a time; the committed position is unchanged; drafts
    past a forbidden one or past an end of reply repeat the last mask; walk counts the drafts
    that fit."""
    llm = target.llm(None)
    g = llm.engine.grammar_compiler().compile_key(("grammar", NESTED))
    tok = llm.tokenizer
    ids = [tok.encode(s, add_special_tokens=False) for s in ("[", "ab", ",", "[", "c")]
    drafts = [t for part in ids for t in part]
    m = g.matcher()
    before = m.row_masks([], 1)[0]
    rows = m.row_masks(drafts, len(drafts) + 1)
    assert torch.equal(m.row_masks([], 1)[0], before)  # nothing committed moved
    ref = g.matcher()
    want = [ref.row_masks([], 1)[0]]
    for t in drafts:
        ref.advance(t)
        want.append(ref.row_masks([], 1)[0])
    assert torch.equal(rows, torch.stack(want))
    assert len(m.walk(drafts)) == len(drafts) + 1
    bad = tok.encode("e", add_special_tokens=False)
    assert len(m.walk(drafts[:2] + bad + drafts[2:])) == 3
    cut = m.row_masks(drafts[:2] + bad, 5)
    assert torch.equal(cut[2], cut[3]) and torch.equal(cut[:3], rows[:3])
    eos = sorted(llm.engine.eos_token_ids)[0]
    closed = [t for s in ("[", "a", "]") for t in tok.encode(s, add_special_tokens=False)]
    assert len(m.walk(closed + [eos])) == len(closed) + 2  # a complete sentence may end
    assert len(m.walk(closed[:2] + [eos])) == 3  # an incomplete one may not
    with pytest.raises(ValueError, match="guided_grammar"):
        g.matcher().advance(bad[0])


def test_bad_grammars_name_the_field(target):
    llm = target.llm(None)
    for bad in ("root ::= undefined_rule", "start: (", "root ::= \"a"):
        with pytest.raises(ValueError, match="grammar"):
            llm.generate([target.prompts[0]], SamplingParams(max_tokens=4, guided_grammar=bad))
    for bad in ("", "  ", 3):
        with pytest.raises(ValueError, match="guided_grammar"):
            SamplingParams(guided_grammar=bad)
    with pytest.raises(ValueError, match="one structured output kind"):
        SamplingParams(guided_grammar=NESTED, guided_regex="a")
