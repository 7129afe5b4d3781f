"""vLLM / OpenAI conventions of the server, with the official `openai` client, on a tiny Llama
whose tokenizer adds BOS and whose chat template writes it too (as Llama-3's do), uses
`{% generation %}`, `enable_thinking` and `tools`, and whose context is 512 positions.

References come from the same `LLM` before the server takes its engine."""
from __future__ import annotations

import json
import logging
import shutil

import httpx
import openai
import pytest

from specdeploy import LLM, SamplingParams
from tests.serving.conftest import KEY

MODEL = "tiny"
BOS = 0  # <|endoftext|> doubles as BOS here
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if tools %}[{{ tools | length }} tools]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")
CHAT = [{"role": "user", "content": "Hello there"}]
CONTINUE = CHAT + [{"role": "assistant", "content": "Gen"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def bos_dir(tiny_llama_dir, tmp_path_factory):
    from tokenizers import Tokenizer, processors

    d = tmp_path_factory.mktemp("bos") / "ckpt"
    shutil.copytree(tiny_llama_dir, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS)])
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<|endoftext|>", chat_template=TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = d / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 1}))
    return d


@pytest.fixture(scope="module")
def llm(bos_dir):
    return LLM(bos_dir, dtype="float32", max_batch_size=4, generation_config=bos_dir / "gen")


@pytest.fixture(scope="module")
def refs(llm):
    ids = llm.chat_ids(CHAT)
    no_think = llm.chat_ids(CHAT, chat_template_kwargs={"enable_thinking": False})
    cont = llm.chat_ids(CONTINUE, add_generation_prompt=False, continue_final_message=True)
    return {"ids": ids, "no_think": no_think, "cont": cont,
            "chat": llm.generate(ids, GREEDY)[0], "cont_out": llm.generate(cont, GREEDY)[0],
            "plain": llm.generate("Hi", SamplingParams(max_tokens=6))[0]}


@pytest.fixture(scope="module")
def srv(llm, refs, serve):
    from specdeploy.serving.app import create_app

    with serve(create_app(llm, model_name=MODEL, api_key=KEY)) as s:
        yield s


def _post(srv, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=30)


def test_chat_prompt_has_one_bos(srv, refs, llm):
    ids = refs["ids"]
    assert ids[0] == BOS and ids.count(BOS) == 1  # the template's; the tokenizer adds none
    assert llm.tokenizer.encode("x")[0] == BOS  # (which it would for raw text)
    r = srv.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                             temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == refs["chat"].text
    tok = _post(srv, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert tok["tokens"] == ids and tok["count"] == len(ids)


def test_template_kwargs_tools_and_continue_final_message(srv, refs, llm):
    assert refs["no_think"] != refs["ids"]
    assert llm.tokenizer.decode(refs["no_think"]).endswith("<think></think>")
    tok = _post(srv, "/tokenize", {"messages": CHAT,
                                   "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert tok["tokens"] == refs["no_think"]
    c = srv.client()
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(refs["no_think"])
    # tools are written by the template when nothing has to parse tool calls back
    tok = _post(srv, "/tokenize", {"messages": CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert "[1 tools]" in llm.tokenizer.decode(tok.json()["tokens"])
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, tools=TOOLS)
    # the final assistant message is continued, not closed
    assert llm.tokenizer.decode(refs["cont"]).endswith("assistant\nGen")
    r = c.chat.completions.create(model=MODEL, messages=CONTINUE, max_tokens=6, temperature=0,
                                  extra_body={"continue_final_message": True,
                                              "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(refs["cont"])
    assert r.choices[0].message.content == refs["cont_out"].text
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        c.chat.completions.create(model=MODEL, messages=CONTINUE, max_tokens=2,
                                  extra_body={"continue_final_message": True})


@pytest.mark.parametrize("endpoint, field, value", [
    ("chat", "use_beam_search", True), ("chat", "structural_tag", "{}"),
    ("chat", "reasoning_effort", "high"), ("chat", "modalities", ["text", "audio"]),
    ("chat", "echo", True), ("completion", "use_beam_search", True),
    ("completion", "guided_whitespace_pattern", " "), ("chat", "thinking_token_budget", 8),
    ("completion", "prompt_embeds", "e30="), ("chat", "logits_processors", ["x"]),
])
def test_known_unsupported_fields_are_400(srv, endpoint, field, value):
    c = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                      extra_body={field: value})
        else:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and e.value.body["code"] == "unsupported"


def test_harmless_and_unknown_fields(srv, caplog):
    c = srv.client()
    caplog.set_level(logging.WARNING, logger="specdeploy.serving")
    extra = {"modalities": ["text"], "priority": 0, "metadata": {"a": "b"},
             "frobnicate_unknown_19b": 1}
    for _ in range(2):
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, user="u",
                                      store=False, extra_body=extra)
        assert r.choices[0].finish_reason in ("stop", "length")
    lines = [r.getMessage() for r in caplog.records if "frobnicate_unknown_19b" in r.getMessage()]
    assert len(lines) == 1  # logged once, not per request


def test_context_limit_comes_from_the_model(srv, llm, bos_dir):
    assert llm.max_model_len == 512  # the tiny config's max_position_embeddings
    assert srv.client().models.list().data[0].max_model_len == 512
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=700)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(bos_dir, max_model_len=700)


def test_generation_config_defaults_apply_when_unset(srv, refs, llm):
    assert llm.sampling_defaults == {"temperature": 0.0, "top_k": 1}
    # no temperature given: the checkpoint's greedy default, not OpenAI's temperature 1
    r = srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=6)
    assert r.choices[0].text == refs["plain"].text


def test_tokenize_detokenize_version(srv, llm):
    from specdeploy.version import version

    ids = llm.tokenizer.encode("Hi", add_special_tokens=False)
    tok = _post(srv, "/tokenize", {"model": MODEL, "prompt": "Hi"}).json()
    assert tok == {"count": len(ids) + 1, "max_model_len": 512, "tokens": [BOS, *ids],
                   "token_strs": None}
    tok = _post(srv, "/tokenize", {"prompt": "Hi", "add_special_tokens": False,
                                   "return_token_strs": True}).json()
    assert tok["tokens"] == ids and tok["token_strs"] == ["H", "i"]
    assert _post(srv, "/detokenize", {"tokens": ids}).json() == {"prompt": "Hi"}
    r = _post(srv, "/detokenize", {"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert _post(srv, "/tokenize", {"prompt": "Hi"}, key=None).status_code == 401
    assert httpx.get(srv.url + "/version").json() == {"version": version()}


def test_vllm_metric_names(srv):
    srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    m = srv.wait_idle()
    lab = 'engine="0",model_name="tiny"'
    assert m[f"vllm:prompt_tokens_total{{{lab}}}"] == m["specdeploy_prompt_tokens_total"] > 0
    assert m[f"vllm:generation_tokens_total{{{lab}}}"] == m["specdeploy_generation_tokens_total"]
    assert m[f"vllm:time_to_first_token_seconds_count{{{lab}}}"] > 0
    assert m[f"vllm:inter_token_latency_seconds_count{{{lab}}}"] > 0
    assert m[f"vllm:e2e_request_latency_seconds_count{{{lab}}}"] > 0
    done = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'
    assert m[done] > 0  # (prometheus_client sorts the labels)
    assert m[f"vllm:num_requests_running{{{lab}}}"] == 0
    assert m[f"vllm:num_requests_waiting{{{lab}}}"] == 0
    assert f"vllm:kv_cache_usage_perc{{{lab}}}" in m
