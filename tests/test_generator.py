"""CachedGenerator: prompts, streaming, stop conditions, sampling, errors and what it commits."""

from __future__ import annotations

import pytest
import torch
from conftest import IdTokenizer, tiny_llama

from kvblocks import CachedGenerator, KVCacheTrie, PromptError, PromptTooLongError
from kvblocks.generate.params import GenerationParams, ParamError
from kvblocks.generate.sampling import LogitsProcessor
from kvblocks.specdec import ModelDrafter, PromptLookupDrafter, SpeculativeGenerator, truncated_model

PROMPT = [5, 17, 42, 9, 77, 3, 101, 64, 12, 8]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float64)


@pytest.fixture
def cache(model):
    return KVCacheTrie.for_model(model, capacity_tokens=1024)


@pytest.fixture
def gen(model, cache):
    return CachedGenerator(model, IdTokenizer(), cache)


@pytest.fixture(scope="module")
def greedy_tokens(model):
    """What the model generates greedily for PROMPT, without a cache."""
    return CachedGenerator(model, IdTokenizer(), None).generate(PROMPT, max_new_tokens=12).token_ids


def text_of(ids) -> str:
    return IdTokenizer().decode(ids)


class EosTokenizer(IdTokenizer):
    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id


# ---- prompts -------------------------------------------------------------------------------


def test_string_and_token_id_prompts_give_the_same_result(gen, greedy_tokens):
    from_ids = gen.generate(PROMPT, max_new_tokens=4)
    from_tensor = gen.generate(torch.tensor([PROMPT]), max_new_tokens=4)
    from_text = gen.generate(" ".join(map(str, PROMPT)), max_new_tokens=4)
    assert from_ids.token_ids == from_tensor.token_ids == from_text.token_ids == greedy_tokens[:4]
    assert from_ids.prompt_tokens == from_text.prompt_tokens == len(PROMPT)
    assert from_ids.text == text_of(greedy_tokens[:4])


def test_chat_messages_are_encoded_with_the_chat_template(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Say hi."}]
    result = CachedGenerator(model, tokenizer, None).generate(messages, max_new_tokens=2)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert result.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("prompt", [[], "", "   ", torch.zeros(0, dtype=torch.long)])
def test_empty_prompt_is_a_prompt_error(gen, prompt):
    with pytest.raises(PromptError, match="empty"):
        gen.generate(prompt)


def test_messages_without_content_are_a_prompt_error(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(PromptError, match="'role' and 'content'"):
        CachedGenerator(model, tokenizer, None).generate([{"role": "user"}])


def test_prompt_that_fills_the_context_is_too_long():
    model = tiny_llama(max_position_embeddings=16)
    gen = CachedGenerator(model, IdTokenizer(), None)
    with pytest.raises(PromptTooLongError, match="16 tokens"):
        gen.generate(list(range(16)))
    result = gen.generate(list(range(12)), max_new_tokens=10)
    assert len(result.token_ids) == 4 and result.finish_reason == "length"


# ---- streaming and stopping ----------------------------------------------------------------


def test_stream_pieces_concatenate_to_the_result(gen, greedy_tokens):
    pieces = list(gen.stream(PROMPT, max_new_tokens=8))
    result = pieces[-1].result
    assert result is not None and all(p.result is None for p in pieces[:-1])
    assert "".join(p.text for p in pieces) == result.text == text_of(greedy_tokens[:8])
    assert [t for p in pieces for t in p.token_ids] == result.token_ids


def test_max_new_tokens_ends_with_length(gen):
    result = gen.generate(PROMPT, max_new_tokens=3)
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


def test_eos_ends_with_stop(model, greedy_tokens):
    first = next(i for i, t in enumerate(greedy_tokens) if i >= 2 and t not in greedy_tokens[:i])
    eos = greedy_tokens[first]
    result = CachedGenerator(model, EosTokenizer(eos), None).generate(PROMPT, max_new_tokens=12)
    assert result.finish_reason == "stop"
    assert result.token_ids == greedy_tokens[: first + 1]
    assert result.text == text_of(greedy_tokens[:first])
    ignored = CachedGenerator(model, EosTokenizer(eos), None).generate(
        PROMPT, max_new_tokens=12, ignore_eos=True
    )
    assert ignored.token_ids == greedy_tokens and ignored.finish_reason == "length"


def test_stop_string_cuts_the_text_before_it_and_never_streams_part_of_it(gen, greedy_tokens):
    stop = text_of(greedy_tokens[4:6])  # e.g. " 17 3": its first characters appear before it completes
    full = text_of(greedy_tokens)
    pieces = list(gen.stream(PROMPT, max_new_tokens=12, stop=[" never", stop]))
    result = pieces[-1].result
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    assert "".join(p.text for p in pieces) == result.text


def test_stop_string_prefix_that_never_completes_is_released(gen, greedy_tokens):
    stop = text_of(greedy_tokens[4:5]) + " 999"  # never generated: vocab is 128
    pieces = list(gen.stream(PROMPT, max_new_tokens=8, stop=stop))
    result = pieces[-1].result
    assert result.finish_reason == "length"
    assert "".join(p.text for p in pieces) == result.text == text_of(greedy_tokens[:8])


def test_stop_string_in_real_text_is_cut_exactly_in_the_stream(smollm2):
    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, None)
    prompt = "The capital of France is"
    unstopped = list(gen.stream(prompt, max_new_tokens=10))
    full = unstopped[-1].result.text
    stop = "".join(p.text for p in unstopped[1:4])  # spans three tokens, e.g. ".\n\n"
    assert len(stop) >= 3 and full.index(stop) > 0
    pieces = list(gen.stream(prompt, max_new_tokens=10, stop=stop))
    result = pieces[-1].result
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    assert "".join(p.text for p in pieces) == result.text


# ---- sampling --------------------------------------------------------------------------------


def test_seed_makes_sampling_reproducible_with_and_without_the_cache(model, gen):
    no_cache = CachedGenerator(model, IdTokenizer(), None)
    kwargs = dict(max_new_tokens=10, temperature=1.0, seed=7)
    first = gen.generate(PROMPT, **kwargs)
    again = gen.generate(PROMPT, **kwargs)
    assert again.cached_tokens == len(PROMPT) - 1
    assert first.token_ids == again.token_ids == no_cache.generate(PROMPT, **kwargs).token_ids
    assert no_cache.generate(PROMPT, **dict(kwargs, seed=8)).token_ids != first.token_ids


def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_tokens(gen, greedy_tokens):
    assert gen.generate(PROMPT, max_new_tokens=8, temperature=1.5, top_k=1).token_ids == greedy_tokens[:8]
    assert gen.generate(PROMPT, max_new_tokens=8, temperature=1.5, top_p=1e-9).token_ids == greedy_tokens[:8]


def test_temperature_top_k_top_p_sampling_runs(gen, model):
    result = gen.generate(PROMPT, max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1)
    assert len(result.token_ids) == 8
    assert all(0 <= t < model.config.vocab_size for t in result.token_ids)


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(max_new_tokens=0)]
)
def test_bad_sampling_arguments_are_value_errors(gen, kwargs):
    with pytest.raises(ValueError):
        gen.generate(PROMPT, **kwargs)


# ---- what is committed to the cache ----------------------------------------------------------


def test_prompt_and_generated_tokens_are_committed(gen, cache):
    first = gen.generate(PROMPT, max_new_tokens=5)
    computed = PROMPT + first.token_ids[:-1]  # the last sampled token was never fed to the model
    assert cache.cached_length(PROMPT + first.token_ids) == len(computed)
    assert gen.generate(PROMPT, max_new_tokens=5).cached_tokens == len(PROMPT) - 1
    assert cache.stats()["locked_tokens"] == 0


def test_abandoned_stream_commits_what_was_computed_and_releases_its_lock(gen, cache):
    gen.generate(PROMPT, max_new_tokens=1)
    prompt = [*PROMPT, 1, 2]
    stream = gen.stream(prompt, max_new_tokens=20)
    seen = [next(stream).token_ids[0] for _ in range(3)]
    assert cache.stats()["locked_tokens"] > 0  # the hit stays locked while the request runs
    stream.close()
    assert cache.stats()["locked_tokens"] == 0
    assert cache.cached_length(prompt + seen) == len(prompt) + 2  # the third token was never fed


def test_timings_are_positive_and_ordered(gen):
    result = gen.generate(PROMPT, max_new_tokens=3)
    assert 0 < result.ttft_s <= result.total_s


def test_interleaved_streams_on_one_cache_give_their_solo_results(model, gen, cache):
    solo = CachedGenerator(model, IdTokenizer(), None)
    prompts = [[*PROMPT, 1], [*PROMPT, 2], [*PROMPT[:4], 3]]
    want = [solo.generate(p, max_new_tokens=6).token_ids for p in prompts]
    gen.generate(PROMPT, max_new_tokens=1)
    streams = [gen.stream(p, max_new_tokens=6) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    for _ in range(6):
        for tokens, stream in zip(got, streams):
            tokens.extend(next(stream).token_ids)
    assert got == want
    assert cache.stats()["locked_tokens"] == 0


# ---- options: GenerationParams or keywords ---------------------------------------------------


def test_params_object_and_keywords_give_the_same_result(gen, greedy_tokens):
    by_keywords = gen.generate(PROMPT, max_new_tokens=6, stop=None, seed=3, ignore_eos=True)
    by_params = gen.generate(PROMPT, GenerationParams(max_new_tokens=6, seed=3, ignore_eos=True))
    assert by_keywords.token_ids == by_params.token_ids == greedy_tokens[:6]


def test_params_and_keywords_together_are_a_type_error(gen):
    with pytest.raises(TypeError, match="not both"):
        gen.generate(PROMPT, GenerationParams(), max_new_tokens=3)
    with pytest.raises(TypeError, match="GenerationParams"):
        gen.generate(PROMPT, 3)
    with pytest.raises(TypeError, match="no_such_option"):
        gen.generate(PROMPT, no_such_option=1)


def test_logit_bias_outside_the_vocabulary_is_a_param_error(gen, model):
    params = GenerationParams(logit_bias={model.config.vocab_size: 1.0})
    with pytest.raises(ParamError, match="outside the vocabulary") as caught:
        gen.check_params(params)
    assert caught.value.param == "logit_bias"
    with pytest.raises(ParamError, match="outside the vocabulary"):
        gen.generate(PROMPT, params)


# ---- logits processors -------------------------------------------------------------------------

PROCESSED = dict(
    presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={2: -5.0, 21: 1.5}
)


def test_penalties_follow_the_processors_over_full_forwards(model, greedy_tokens):
    """Greedy with penalties and bias equals argmax of the processed logits of a cache-free forward."""
    params = GenerationParams(max_new_tokens=10, **PROCESSED)
    got = CachedGenerator(model, IdTokenizer(), None).generate(PROMPT, params).token_ids
    want: list[int] = []
    for _ in range(10):
        processor = LogitsProcessor(params, PROMPT, (), model.config.vocab_size, torch.device("cpu"))
        for token in want:
            processor.accept(token)
        logits = model(torch.tensor([PROMPT + want])).logits[0, -1]
        want.append(int(processor(logits).argmax()))
    assert got == want != greedy_tokens[:10]


@pytest.mark.parametrize("logprobs", [None, 3])
def test_processed_greedy_tokens_with_the_cache_equal_those_without(logprobs):
    model = tiny_llama(torch.float32)
    shared = [*PROMPT, 90, 91, 92, 93]
    params = GenerationParams(max_new_tokens=12, logprobs=logprobs, **PROCESSED)
    want = CachedGenerator(model, IdTokenizer(), None).generate([*shared, 7], params)
    cached = CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=1024))
    cached.generate([*shared, 6], params)
    got = cached.generate([*shared, 7], params)
    assert got.cached_tokens == len(shared)
    assert got.token_ids == want.token_ids
    if logprobs is not None:
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_min_tokens_holds_off_an_eos_heavy_bias(model):
    eos = 7
    gen = CachedGenerator(model, EosTokenizer(eos), None)
    assert gen.generate(PROMPT, logit_bias={eos: 100.0}).token_ids == [eos]
    result = gen.generate(PROMPT, max_new_tokens=12, logit_bias={eos: 100.0}, min_tokens=4)
    assert len(result.token_ids) == 5 and eos not in result.token_ids[:4]
    assert result.token_ids[4] == eos and result.finish_reason == "stop"


def test_ignore_eos_keeps_generating_an_eos_heavy_bias(model):
    eos = 7
    gen = CachedGenerator(model, EosTokenizer(eos), None)
    result = gen.generate(
        PROMPT, GenerationParams(max_new_tokens=5, logit_bias={eos: 100.0}, ignore_eos=True)
    )
    assert result.token_ids == [eos] * 5 and result.finish_reason == "length"


def test_stop_strings_before_min_tokens_are_ignored(gen, greedy_tokens):
    stop = text_of(greedy_tokens[1:2])  # completed by the second token, never again in the first 12
    assert text_of(greedy_tokens).count(stop) == 1
    early = gen.generate(PROMPT, max_new_tokens=8, stop=stop)
    assert early.token_ids == greedy_tokens[:2] and early.finish_reason == "stop"
    pieces = list(gen.stream(PROMPT, max_new_tokens=8, stop=stop, min_tokens=2))
    result = pieces[-1].result
    assert result.token_ids == greedy_tokens[:8] and result.finish_reason == "length"
    assert "".join(p.text for p in pieces) == result.text == text_of(greedy_tokens[:8])


def test_a_stop_string_completed_after_min_tokens_is_cut_from_unshown_text(gen, greedy_tokens):
    stop = text_of(greedy_tokens[1:3])  # begins with the second token, completed by the third
    pieces = list(gen.stream(PROMPT, max_new_tokens=8, stop=stop, min_tokens=2))
    result = pieces[-1].result
    assert result.token_ids == greedy_tokens[:3] and result.finish_reason == "stop"
    assert "".join(p.text for p in pieces) == result.text == text_of(greedy_tokens[:1])


class OnlyTokens:
    """A constraint that allows one fixed token sequence, then is done."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.position = 0

    def start(self) -> OnlyTokens:
        return OnlyTokens(self.tokens)

    def mask(self, logits: torch.Tensor) -> None:
        keep = logits[self.tokens[self.position]].clone()
        logits.fill_(float("-inf"))
        logits[self.tokens[self.position]] = keep

    def advance(self, token: int) -> None:
        assert token == self.tokens[self.position]
        self.position += 1

    def done(self) -> bool:
        return self.position == len(self.tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_forces_its_tokens_and_ends_the_sequence(gen, temperature):
    forced = [11, 12, 13, 14]
    params = GenerationParams(max_new_tokens=10, temperature=temperature, constraint=OnlyTokens(forced))
    for _ in range(2):  # the second run hits the cache; each run starts a fresh constraint
        pieces = list(gen.stream(PROMPT, params))
        result = pieces[-1].result
        assert result.token_ids == forced and result.finish_reason == "stop"
        assert "".join(p.text for p in pieces) == result.text == text_of(forced)


# ---- log-probabilities ---------------------------------------------------------------------------


def test_logprobs_are_the_models_log_softmax_and_leave_greedy_tokens_unchanged():
    model = tiny_llama(torch.float32)
    gen = CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=1024))
    plain = gen.generate(PROMPT, max_new_tokens=8)
    pieces = list(gen.stream(PROMPT, max_new_tokens=8, logprobs=5))
    result = pieces[-1].result
    assert result.cached_tokens > 0 and result.token_ids == plain.token_ids and plain.logprobs is None
    assert [e for p in pieces for e in p.logprobs] == result.logprobs
    assert all(len(p.logprobs) == len(p.token_ids) for p in pieces)
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + result.token_ids])).logits[0].log_softmax(-1)
    for i, entry in enumerate(result.logprobs):
        want = full[len(PROMPT) - 1 + i]
        assert entry.token == result.token_ids[i]
        assert entry.logprob == pytest.approx(want[entry.token].item(), abs=1e-5)
        assert len(entry.top) == 5 and entry.top[0][0] == entry.token  # greedy: the argmax
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(want.topk(5).values.tolist(), abs=1e-5)


def test_logprobs_with_output_logits_keep_one_row_per_token(gen):
    result = gen.generate(PROMPT, max_new_tokens=4, logprobs=0, output_logits=True)
    assert len(result.logits) == len(result.logprobs) == 4
    assert all(entry.top == [] for entry in result.logprobs)
    assert gen.generate(PROMPT, max_new_tokens=4, logprobs=1).logits is None


def test_prompt_logprobs_score_the_whole_prompt_without_the_cache(model, gen, cache, greedy_tokens):
    gen.generate(PROMPT, max_new_tokens=1)  # the prompt would otherwise hit
    result = gen.generate(PROMPT, max_new_tokens=6, prompt_logprobs=3)
    assert result.cached_tokens == 0 and result.cache_bypass == "prompt_logprobs"
    assert result.token_ids == greedy_tokens[:6]
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    assert len(result.prompt_logprobs) == len(PROMPT) and result.prompt_logprobs[0] is None
    for i, entry in enumerate(result.prompt_logprobs[1:], start=1):
        assert entry.token == PROMPT[i]
        assert entry.logprob == pytest.approx(want[i - 1, PROMPT[i]].item(), abs=1e-10)
        assert [t for t, _ in entry.top] == want[i - 1].topk(3).indices.tolist()
    assert cache.cached_length(PROMPT) == len(PROMPT)
    again = gen.generate(PROMPT, max_new_tokens=6)
    assert again.cached_tokens == len(PROMPT) - 1 and again.cache_bypass is None
    assert again.prompt_logprobs is None and again.token_ids == result.token_ids


def test_prompt_logprobs_of_a_one_token_prompt(gen):
    result = gen.generate([5], max_new_tokens=2, prompt_logprobs=1)
    assert result.prompt_logprobs == [None] and len(result.token_ids) == 2


# ---- speculative decoding -----------------------------------------------------------------------


@pytest.mark.parametrize("option", ["presence_penalty", "frequency_penalty", "min_tokens", "logit_bias"])
def test_speculative_generator_refuses_logits_processors_by_name(model, option):
    values = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 2, "logit_bias": {3: 1.0}}
    sg = SpeculativeGenerator(model, IdTokenizer(), None, drafter=PromptLookupDrafter(), gamma=2)
    params = GenerationParams(**{option: values[option]})
    with pytest.raises(ParamError, match=option) as caught:
        sg.check_params(params)
    assert caught.value.param == option
    with pytest.raises(ParamError, match=option):
        sg.generate(PROMPT, params)


def test_speculative_generator_reports_the_same_logprobs(model, greedy_tokens):
    plain = CachedGenerator(model, IdTokenizer(), None)
    drafter = ModelDrafter(truncated_model(model, 1))
    sg = SpeculativeGenerator(model, IdTokenizer(), None, drafter=drafter, gamma=3)
    params = GenerationParams(max_new_tokens=10, logprobs=2, prompt_logprobs=2)
    want, got = plain.generate(PROMPT, params), sg.generate(PROMPT, params)
    assert got.token_ids == want.token_ids == greedy_tokens[:10] and got.spec.rounds < 10
    for a, b in zip(got.logprobs + got.prompt_logprobs[1:], want.logprobs + want.prompt_logprobs[1:]):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-10)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
