"""vLLM's structural tags (`response_format: {"type": "structural_tag", "structures": [...],
"triggers": [...]}` and `structured_outputs.structural_tag`): free text in which each trigger
must go on as one of its structures, begin + a JSON value of the schema + end. Checked on a tiny
Llama's tokenizer: texts written by hand, whose expected verdicts are stated here, walked
through the compiled grammar's matcher (all tokens fit, or the first that breaks the rule is
where the walk stops); and the server's plumbing and 400s."""
from __future__ import annotations

import json

import openai
import pytest

from specdeploy.serving.sampling_fields import FieldError, structural_tag
from tests.spec.tiny_targets import Target

pytest.importorskip("llguidance")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
TAG = {"type": "structural_tag", "triggers": ["<tool="],
       "structures": [{"begin": "<tool=add>", "schema": SCHEMA, "end": "</tool>"},
                      {"begin": "<tool=neg>", "schema": SCHEMA, "end": "</tool>"}]}
CASES = [  # text, the characters of it that fit (None: all)
    ('Hello <tool=add>{"a": 1}</tool> and <tool=neg>{"a":-2}</tool> done', None),
    ("plain text, no call", None),
    ("a < b and tool = x", None),  # text that is not the trigger
    ('Hi <tool=add>{"b": 1}', len('Hi <tool=add>{"')),  # a key the schema forbids
    ("x <tool=sub>", len("x <tool=")),  # no structure begins so
    ('<tool=add>{"a": 1}<end>', len('<tool=add>{"a": 1}<')),  # not its end ("</tool>")
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return Target("llama", tmp_path_factory.mktemp("stag")).llm(None)


@pytest.mark.parametrize("text, fits", CASES)
def test_texts_fit_where_the_rule_says(llm, text, fits):
    g = llm.engine.grammar_compiler().compile_key(("grammar", structural_tag(TAG, "f")))
    tok = llm.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    n = len(g.matcher().walk(ids)) - 1
    if fits is None:
        assert n == len(ids), (text, tok.decode(ids[:n]))
    else:  # the walk stops at the token holding the first character that breaks the rule
        assert len(tok.decode(ids[:n])) <= fits < len(tok.decode(ids[:n + 1])), \
            (text, tok.decode(ids[:n]))


def test_conversion_refuses_what_it_cannot_state():
    good = structural_tag(json.dumps(TAG), "structured_outputs.structural_tag")
    assert good == structural_tag(TAG, "x")  # JSON text or object alike
    bad = [("{not json", "JSON"), ([1], "object"), ({"format": {}}, "not supported"),
           ({"structures": [], "triggers": ["<"]}, "structures"),
           ({**TAG, "triggers": []}, "triggers"),
           ({**TAG, "structures": [{"begin": "<x>", "schema": SCHEMA, "end": ""}]}, "triggers"),
           ({**TAG, "structures": [{"begin": "<tool=a>", "schema": "s", "end": ""}]}, "schema")]
    for value, words in bad:
        with pytest.raises(FieldError, match=words) as e:
            structural_tag(value, "response_format")
        assert e.value.param == "response_format"


def test_server_takes_both_spellings(llm, serve):
    from specdeploy.serving.app import create_app

    with serve(create_app(llm, model_name="m")) as srv:
        c = srv.client(None)
        msgs = [{"role": "user", "content": "call"}]
        for extra in ({"response_format": TAG},
                      {"structured_outputs": {"structural_tag": json.dumps(TAG)}}):
            r = c.chat.completions.create(model="m", messages=msgs, max_tokens=12,
                                          temperature=0, extra_body=extra)
            assert r.choices[0].finish_reason in ("stop", "length")
        for extra, param in (({"response_format": {"type": "structural_tag"}},
                              "response_format"),
                             ({"structured_outputs": {"structural_tag": "{"}},
                              "structured_outputs.structural_tag")):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="m", messages=msgs, max_tokens=4,
                                          extra_body=extra)
            assert e.value.body["param"] == param
