"""Request parsing, stop-string hold-back and the Prometheus text, without a server."""
from __future__ import annotations

import pytest

from specdeploy.serving import protocol as P
from specdeploy.serving.chat import parse_chat
from specdeploy.serving.metrics import ServerMetrics, parse_text
from specdeploy.serving.replies import _held_back

LIMITS = P.Limits(model_name="m", max_seq_len=32, kv_capacity=24, vocab_size=100)


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_held_back():
    assert _held_back("hello wor", ("world",)) == 3
    assert _held_back("hello", ("lo!", "o")) == 2
    assert _held_back("hello", ()) == 0
    assert _held_back("abc", ("x",)) == 0


def test_parse_defaults_and_limits():
    tok = CharTokenizer()
    r = P.parse_completion({"prompt": "abc"}, tok, LIMITS)
    assert r.prompts == [tok.encode("abc")] and r.params[0].max_tokens == 16
    assert r.params[0].temperature == 1.0 and not r.stream
    r = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                      "top_k": -1, "stop": "x"}, tok, LIMITS)
    n = len(r.prompts[0])
    assert r.params[0].max_tokens == 24 - n  # the KV cache is the binding limit here
    assert r.params[0].stop == ("x",) and r.params[0].top_k == 0
    with pytest.raises(P.APIError) as e:
        P.parse_completion({"prompt": "a" * 24}, tok, LIMITS)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(P.APIError) as e:
        P.parse_completion({"prompt": "abc", "max_tokens": 22}, tok, LIMITS)
    assert e.value.param == "max_tokens"
    with pytest.raises(P.APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}],
                    "frequency_penalty": 2.5}, tok, LIMITS)
    assert e.value.param == "frequency_penalty" and e.value.code == "invalid_value"
    assert P.APIError(429, "full").body()["error"]["type"] == "rate_limit_error"


def test_generation_config_defaults_reach_the_sampling_fields():
    """generation_config's min_p / repetition_penalty fill unset fields; a request's own value
    wins; n choices each get them (and their own seed); the field table refuses none of them."""
    import dataclasses

    tok = CharTokenizer()
    limits = dataclasses.replace(LIMITS, sampling_defaults={
        "temperature": 0.5, "min_p": 0.1, "repetition_penalty": 1.2})
    r = P.parse_completion({"prompt": "abc", "n": 2, "seed": 7, "logprobs": 1}, tok, limits)
    assert [p.seed for p in r.params] == [7, 8] and r.n == 2 and len(r.prompts) == 2
    assert all(p.min_p == 0.1 and p.repetition_penalty == 1.2 and p.temperature == 0.5
               and p.logprobs == 1 for p in r.params)
    r = parse_chat({"messages": [{"role": "user", "content": "x"}], "min_p": 0.3,
                    "repetition_penalty": 1.0, "presence_penalty": 0.5, "min_tokens": 2,
                    "logprobs": True, "top_logprobs": 2}, tok, limits)
    p = r.params[0]
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.min_tokens, p.logprobs) == (
        0.3, 1.0, 0.5, 2, 2)
    assert P.parse_completion({"prompt": "abc", "guided_regex": "a+"}, tok,
                              LIMITS).params[0].grammar_key == ("regex", "a+")
    r = P.parse_completion({"prompt": "abc", "structured_outputs": {"choice": ["a.", "b"]}}, tok,
                           LIMITS)
    assert r.params[0].guided_choice == ("a.", "b")
    assert r.params[0].grammar_key == ("regex", "(a\\.|b)")
    g = 'root ::= "a" root | "b"'
    for body in ({"guided_grammar": g}, {"structured_outputs": {"grammar": g}}):
        r = P.parse_completion({"prompt": "abc", **body}, tok, LIMITS)
        assert r.params[0].grammar_key == ("grammar", g)
    with pytest.raises(P.APIError) as e:
        P.parse_completion({"prompt": "abc", "guided_grammar": g, "guided_regex": "a"}, tok,
                           LIMITS)
    assert e.value.param == "guided_grammar"
    with pytest.raises(P.APIError) as e:
        P.parse_completion({"prompt": "abc", "guided_grammar": " "}, tok, LIMITS)
    assert e.value.param == "guided_grammar"
    for body, field in (({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
                         "structured_outputs"),
                        ({"guided_choice": []}, "guided_choice"),
                        ({"guided_choice": ["a", 3]}, "guided_choice"),
                        ({"guided_regex": ""}, "guided_regex")):
        with pytest.raises(P.APIError) as e:
            P.parse_completion({"prompt": "abc", **body}, tok, LIMITS)
        assert e.value.param == field, body


def test_metrics_text():
    m = ServerMetrics()
    m.tokens(3, 0.05, [0.01, 0.02])
    m.request_finished("length", 0.2)
    m.http_response("/v1/completions", 200)
    engine = {"num_pages": 10, "free_pages": 7, "num_running": 1, "draft_steps": 4,
              "num_draft_tokens": 2, "draft_tokens": 8, "accepted_tokens": 5,
              "accepted_per_position": [3, 2], "lookup_steps": 3, "lookup_accepted_tokens": 4,
              "undrafted_steps": 6}
    v = parse_text(m.render(engine, queue_len=2))
    assert v["specdeploy_cache_pages_in_use"] == 3 and v["specdeploy_num_requests_waiting"] == 2
    assert v['specdeploy_time_to_first_token_seconds_bucket{le="0.06"}'] == 1
    assert v['specdeploy_time_to_first_token_seconds_bucket{le="0.04"}'] == 0
    assert v["specdeploy_inter_token_latency_seconds_count"] == 2
    assert v['specdeploy_spec_accepted_tokens_per_position_total{position="1"}'] == 2
    assert v["specdeploy_spec_lookup_steps_total"] == 3
    assert v["specdeploy_spec_lookup_accepted_tokens_total"] == 4
    assert v["specdeploy_spec_undrafted_steps_total"] == 6
    assert v['specdeploy_http_requests_total{endpoint="/v1/completions",status="200"}'] == 1


def test_cache_usage_weighs_the_window_groups_pages_by_their_bytes():
    """A sliding-window page group's pages hold fewer layers than a full-context page: the
    usage fraction is of bytes (exact arithmetic here), and each group has its own counts."""
    engine = {"num_pages": 10, "free_pages": 7, "num_win_pages": 20, "free_win_pages": 5,
              "page_bytes": 4096, "win_page_bytes": 1024}
    v = parse_text(ServerMetrics().render(engine, queue_len=0))
    usage = next(val for k, val in v.items() if k.startswith("vllm:kv_cache_usage_perc"))
    assert usage == pytest.approx((3 * 4096 + 15 * 1024) / (10 * 4096 + 20 * 1024), rel=1e-12)
    assert v["specdeploy_cache_pages_in_use"] == 3 and v["specdeploy_cache_pages_total"] == 10
    assert v["specdeploy_cache_window_pages_in_use"] == 15
    assert v["specdeploy_cache_window_pages_total"] == 20
    plain = parse_text(ServerMetrics().render({"num_pages": 10, "free_pages": 7}, queue_len=0))
    assert next(val for k, val in plain.items()
                if k.startswith("vllm:kv_cache_usage_perc")) == pytest.approx(0.3, rel=1e-12)
    assert "specdeploy_cache_window_pages_total" not in plain
