"""The cost controller is the default of every SpecConfig (issue 21: a speculative configuration
is never slower than plain decoding): the dataclass, the CLI flags of `generate` / `serve`, vLLM's
`--speculative-config` JSON and the engine a default SpecConfig builds; "off" stays one option
away (fixed K)."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.cli import build_parser
from specdeploy.models.registry import family_module
from specdeploy.spec_args import spec_from_args

LIMITS = dict(max_batch_size=2, max_seq_len=128, max_cache_gib=0.02)


@pytest.mark.parametrize("method", ["eagle3", "mtp", "ngram"])
def test_spec_config_defaults_to_cost(method):
    assert SpecConfig(method).controller == "cost"
    assert SpecConfig(method, controller="off").controller == "off"


def test_from_dict_defaults_to_cost():
    assert SpecConfig.from_dict({"method": "ngram"}).controller == "cost"
    assert SpecConfig.from_dict({"method": "deepseek_mtp",
                                 "num_speculative_tokens": 2}).controller == "cost"
    assert SpecConfig.from_dict({"method": "ngram", "controller": "off"}).controller == "off"


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_cli_flags_default_to_cost(command):
    ap = build_parser()
    args = ap.parse_args(command + ["--spec", "ngram"])
    assert args.spec_controller == "cost" and spec_from_args(args).controller == "cost"
    args = ap.parse_args(command + ["--spec", "eagle3", "--spec-controller", "off"])
    assert spec_from_args(args).controller == "off"
    args = ap.parse_args(command + ["--speculative-config", '{"method": "ngram"}'])
    assert spec_from_args(args).controller == "cost"
    args = ap.parse_args(command + ["--speculative-config",
                                    '{"method": "ngram", "controller": "off"}'])
    assert spec_from_args(args).controller == "off"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctl") / "llama"
    family_module("llama").make_tiny(path, seed=0)
    return str(path)


def test_default_engine_has_a_controller_and_stays_lossless(tiny):
    """SpecConfig("ngram") with no controller argument builds a calibrated controller (no
    drafter forwards to pay for lookup drafts); greedy output is still the plain one."""
    prompt = [5, 6, 7, 8, 9] * 6  # a loop: n-gram lookup finds drafts
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    (want,) = LLM(tiny, **LIMITS).generate([prompt], params)
    llm = LLM(tiny, spec=SpecConfig("ngram"), **LIMITS)
    ctl = llm.engine.controller
    assert ctl is not None and not ctl.drafter
    assert llm.engine._measured is not None and llm.engine._measured.target
    (got,) = llm.generate([prompt], params)
    assert got.token_ids == want.token_ids


def test_off_engine_has_no_controller(tiny):
    llm = LLM(tiny, spec=SpecConfig("ngram", controller="off"), **LIMITS)
    assert llm.engine.controller is None and llm.engine._measured is None


@pytest.mark.parametrize("max_seq_len", [16, 24])
def test_short_context_calibrates_and_stays_lossless(tiny, max_seq_len):
    """A context too short for the full calibration schedule: fewer steps and a shorter prompt
    (the default must not break a short deployment)."""
    limits = dict(LIMITS, max_seq_len=max_seq_len)
    prompt, params = [5, 6, 7, 8] * 2, SamplingParams(max_tokens=max_seq_len - 8, ignore_eos=True)
    (want,) = LLM(tiny, **limits).generate([prompt], params)
    llm = LLM(tiny, spec=SpecConfig("ngram"), **limits)
    assert llm.engine.controller is not None and len(llm.engine._measured.target) >= 2
    assert llm.generate([prompt], params)[0].token_ids == want.token_ids


def test_no_room_to_calibrate_is_named(tiny):
    limits = dict(LIMITS, max_seq_len=12)
    with pytest.raises(ValueError, match="controller='off'"):
        LLM(tiny, spec=SpecConfig("ngram"), **limits)
    assert LLM(tiny, spec=SpecConfig("ngram", controller="off"), **limits).engine.controller is None


def test_auto_keeps_an_explicit_off(tiny):
    from specdeploy.spec_auto import resolve_auto

    assert resolve_auto(SpecConfig("auto"), tiny).controller == "cost"
    assert resolve_auto(SpecConfig("auto", controller="off"), tiny).controller == "off"
