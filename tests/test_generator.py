"""CachedGenerator: prompts, streaming, stop conditions, sampling, errors and what it commits."""

from __future__ import annotations

import pytest
import torch
from conftest import IdTokenizer, tiny_llama

from kvblocks import CachedGenerator, KVCacheTrie, PromptError, PromptTooLongError

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
