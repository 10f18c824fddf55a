"""GenerationParams: defaults, normalisation and the errors a bad option gets."""

from __future__ import annotations

import math

import pytest

from kvblocks.generate.params import GenerationParams, ParamError
from kvblocks.generate.sampling import SamplingParams


def test_defaults_process_nothing():
    p = GenerationParams()
    assert p.logit_processors == () and not p.processes_logits
    assert p.sampling == SamplingParams()
    assert p.stop == () and p.logit_bias == {}


def test_sampling_params_carry_temperature_top_p_top_k_min_p():
    p = GenerationParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1)
    assert p.sampling == SamplingParams(0.7, 0.9, 5, 0.1)
    assert not p.processes_logits  # sampling filters are not logits processors


def test_logit_processors_name_each_active_option():
    p = GenerationParams(presence_penalty=0.1, logit_bias={3: 1.0}, min_tokens=2)
    assert set(p.logit_processors) == {"presence_penalty", "logit_bias", "min_tokens"}
    assert p.processes_logits
    assert GenerationParams(constraint=object()).logit_processors == ("constraint",)
    assert GenerationParams(repetition_penalty=1.1).logit_processors == ("repetition_penalty",)


@pytest.mark.parametrize("stop, want", [("x", ("x",)), (None, ()), (["a", "b"], ("a", "b"))])
def test_stop_is_normalised_to_a_tuple(stop, want):
    assert GenerationParams(stop=stop).stop == want


def test_logit_bias_values_become_floats():
    assert GenerationParams(logit_bias={7: 2}).logit_bias == {7: 2.0}


@pytest.mark.parametrize(
    "options, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(frequency_penalty=math.nan), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-2), "prompt_logprobs"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={5: math.inf}), "logit_bias"),
    ],
)
def test_bad_options_are_param_errors_naming_the_option(options, name):
    with pytest.raises(ParamError, match=name) as caught:
        GenerationParams(**options)
    assert caught.value.param == name and isinstance(caught.value, ValueError)
