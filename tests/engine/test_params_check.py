"""SamplingParams' rules (engine/params_check.py): strict types, finite bounded values, the field
named in every error; the server uses the same rules (tests/serving/test_hostile.py)."""
from __future__ import annotations

import numpy as np
import pytest

from specdeploy import SamplingParams
from specdeploy.engine.params_check import MIN_TEMPERATURE, check_for_model

NAN, INF = float("nan"), float("inf")
BAD = {
    "max_tokens": [True, "8", 0, -1, 2.0, 2**40, None],
    "temperature": ["0.5", True, -0.1, 1e-45, 1e-300, NAN, INF, -INF, 1e9, None, [1.0]],
    "top_p": [0, 0.0, -0.5, 1.0001, NAN, "1", True, None],
    "top_k": [-1, 10**30, 2.5, "5", True, None],
    "seed": ["x", 1.5, -1, 2**64, True],
    "stop": [5, [5], [""], ["a"] * 17, ["x" * 513], b"ab", [None]],
    "stop_token_ids": [["5"], [True], 5, "12", [-1], [1.5], [10**30]],
    "ignore_eos": ["yes", 1, 0, None],
    "min_p": [-0.1, 1.5, NAN, "0.1", True],
    "min_tokens": [-1, 17, 2.0, True],  # at most max_tokens (16)
    "presence_penalty": [2.5, -2.5, NAN, "1"],
    "frequency_penalty": [INF, True],
    "repetition_penalty": [0, 0.0, -1.0, 101.0, NAN],
    "logprobs": [-1, 21, 2.0, True],
    "guided_json": ["{not json", "[1]", 5, ["a"]],
    "json_object": ["yes", 1],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD.items() for v in vs],
                         ids=lambda x: repr(x)[:20])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(f"{field}: "), str(e.value)


def test_good_values_are_normalized_not_coerced():
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3),
                       stop="x", stop_token_ids=[np.int64(7)], seed=2**64 - 1)
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.top_k) is int
    assert p.stop == ("x",) and p.stop_token_ids == (7,) and p.seed == 2**64 - 1
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1).temperature == 1


def test_model_bounds():
    check_for_model(SamplingParams(top_k=100, stop_token_ids=[99]), 100)
    with pytest.raises(ValueError, match="^top_k: "):
        check_for_model(SamplingParams(top_k=101), 100)
    with pytest.raises(ValueError, match="^stop_token_ids: "):
        check_for_model(SamplingParams(stop_token_ids=[100]), 100)


def test_schema_normalized_and_exclusive():
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    p = SamplingParams(guided_json=schema)
    assert p.guided_json == '{"type":"object","properties":{"b":{},"a":{}}}'  # order kept
    assert p.structured and not p.penalized and SamplingParams(min_tokens=1).penalized
    with pytest.raises(ValueError, match="^guided_json: "):
        SamplingParams(guided_json=schema, json_object=True)
