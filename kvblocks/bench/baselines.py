"""The ways of serving a request that `kvblocks bench` workloads compare, one class each.

Every server gets the same requests one at a time (the workload runner interleaves servers
request by request), generates greedily exactly `max_new_tokens` tokens and reports its time to
first token, its output and how many prompt tokens it did not have to prefill. `prepare` and
`finish` run untimed around each timed `serve`; only the ideal uses them, for its oracle's
bookkeeping.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvblocks.adapters import hf
from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.generate.generator import CachedGenerator, ModelRunner
from kvblocks.generate.sampling import SamplingParams, choose

Clock = Callable[[], float]
GREEDY = SamplingParams()


@dataclass(slots=True, frozen=True)
class Request:
    """One request as a server sees it. `system` / `system_len`: the shared system prompt an
    application knows about (what the deepcopy recipe keys on); `ideal_hit`: tokens the ideal
    finds already computed; `more_turns`: the conversation continues after this request."""

    ids: list[int]
    conversation: int
    system: int
    system_len: int
    max_new_tokens: int
    ideal_hit: int
    more_turns: bool


@dataclass(slots=True, frozen=True)
class Served:
    ttft_s: float
    tokens: list[int]
    hit: int


def complete(runner: ModelRunner, past, new_ids: Sequence[int], max_new: int, clock: Clock, t0: float):
    """Prefill `new_ids` on `past`, then decode greedily: (time to first token, tokens)."""
    tokens = [choose(runner.forward(new_ids, past)[-1], GREEDY, None)]
    ttft = clock() - t0
    while len(tokens) < max_new:
        tokens.append(choose(runner.forward(tokens[-1:], past)[-1], GREEDY, None))
    return ttft, tokens


def cache_bytes(cache) -> int:
    """Bytes of the K/V tensors a transformers cache holds (views count their visible part)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


class Server:
    name = ""

    def reset(self) -> None:
        """Forget everything cached (untimed): every workload starts cold."""

    def prepare(self, request: Request) -> None:
        """Untimed work before `serve`."""

    def serve(self, request: Request, clock: Clock) -> Served:
        raise NotImplementedError

    def finish(self, request: Request) -> None:
        """Untimed work after `serve`."""

    def held_bytes(self) -> int:
        """KV bytes kept between requests."""
        return 0

    def close(self) -> None:
        pass


class Kvblocks(Server):
    """`CachedGenerator` over a `KVCacheTrie`: the whole product path (match, re-attach, prefill,
    decode with text assembly, insert of prompt and reply)."""

    name = "kvblocks"

    def __init__(
        self, model, tokenizer, capacity_tokens: int, eviction: str | None = None, name: str | None = None
    ) -> None:
        self.model, self.tokenizer, self.capacity = model, tokenizer, capacity_tokens
        self.eviction = eviction
        if name is not None:
            self.name = name
        self.trie: KVCacheTrie | None = None
        self.gen: CachedGenerator | None = None

    def reset(self) -> None:
        self.trie = KVCacheTrie.for_model(self.model, capacity_tokens=self.capacity, eviction=self.eviction)
        self.gen = CachedGenerator(self.model, self.tokenizer, self.trie)

    def serve(self, request: Request, clock: Clock) -> Served:
        assert self.gen is not None, "reset() first"
        t0 = clock()
        ttft, result = None, None
        for piece in self.gen.stream(request.ids, max_new_tokens=request.max_new_tokens, ignore_eos=True):
            if ttft is None:
                ttft = clock() - t0
            result = piece.result
        assert result is not None and ttft is not None
        return Served(ttft, result.token_ids, result.cached_tokens)

    def held_bytes(self) -> int:
        return self.trie.stats()["resident_bytes"] if self.trie is not None else 0


class NoReuse(Server):
    """Plain generation: prefill the whole prompt every time."""

    name = "no reuse"

    def __init__(self, model) -> None:
        self.runner, self.config = ModelRunner(model), model.config

    def serve(self, request: Request, clock: Clock) -> Served:
        t0 = clock()
        past = hf.empty_cache(self.config)
        ttft, tokens = complete(self.runner, past, request.ids, request.max_new_tokens, clock, t0)
        return Served(ttft, tokens, 0)


class DeepcopyRecipe(Server):
    """transformers' prompt-reuse recipe, done right: prefill each system prompt once by ids,
    `copy.deepcopy` that cache for every request, prefill the rest of the prompt, decode.

    The system prompt is prefilled by the first request that needs it (timed, like any cold
    start). `max_prefixes` keeps at most that many system caches, least recently used out.
    """

    name = "deepcopy recipe"

    def __init__(self, model, max_prefixes: int | None = None) -> None:
        self.runner, self.config, self.max_prefixes = ModelRunner(model), model.config, max_prefixes
        self.store: OrderedDict[int, object] = OrderedDict()

    def reset(self) -> None:
        self.store.clear()

    def serve(self, request: Request, clock: Clock) -> Served:
        t0 = clock()
        n = request.system_len
        prompt_cache = self.store.get(request.system)
        hit = n if prompt_cache is not None else 0
        if prompt_cache is None:
            prompt_cache = hf.empty_cache(self.config)
            self.runner.forward(request.ids[:n], prompt_cache)
            self.store[request.system] = prompt_cache
            while self.max_prefixes is not None and len(self.store) > self.max_prefixes:
                self.store.popitem(last=False)
        self.store.move_to_end(request.system)
        past = copy.deepcopy(prompt_cache)
        ttft, tokens = complete(self.runner, past, request.ids[n:], request.max_new_tokens, clock, t0)
        return Served(ttft, tokens, hit)

    def held_bytes(self) -> int:
        return sum(cache_bytes(c) for c in self.store.values())


class Ideal(Server):
    """The bare model prefilling only what an oracle says is already computed (`ideal_hit`).

    The oracle keeps every system prompt's KV and every open conversation's history as ready
    caches; handing one over (a copy cropped to `ideal_hit`) happens untimed in `prepare`, so
    `serve` is just the prefill of the rest and the decode.
    """

    name = "ideal"

    def __init__(self, model) -> None:
        self.runner, self.config = ModelRunner(model), model.config
        self.systems: dict[int, object] = {}
        self.conversations: dict[int, object] = {}
        self.past = None

    def reset(self) -> None:
        self.systems.clear()
        self.conversations.clear()
        self.past = None

    def prepare(self, request: Request) -> None:
        h = request.ideal_hit
        past = self.conversations.pop(request.conversation, None)
        if past is None and h > 0:
            past = copy.deepcopy(self.systems[request.system])
        if past is None:
            past = hf.empty_cache(self.config)
        assert hf.seq_length(past) >= h, (hf.seq_length(past), h)
        hf.crop(past, h)
        self.past = past

    def serve(self, request: Request, clock: Clock) -> Served:
        t0 = clock()
        h = request.ideal_hit
        ttft, tokens = complete(self.runner, self.past, request.ids[h:], request.max_new_tokens, clock, t0)
        return Served(ttft, tokens, h)

    def finish(self, request: Request) -> None:
        if request.system not in self.systems:
            system = copy.deepcopy(self.past)
            hf.crop(system, request.system_len)
            self.systems[request.system] = system
        if request.more_turns:
            self.conversations[request.conversation] = self.past
        self.past = None

    def held_bytes(self) -> int:
        caches = [*self.systems.values(), *self.conversations.values()]
        return sum(cache_bytes(c) for c in caches)


@dataclass(slots=True, frozen=True)
class BatchingConfig:
    """transformers continuous batching settings (`ContinuousBatchingConfig`) used on CPU."""

    page_size: int
    num_blocks: int
    max_batch_tokens: int

    def make(self):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        return ContinuousBatchingConfig(
            page_size=self.page_size, num_blocks=self.num_blocks, max_batch_tokens=self.max_batch_tokens
        )


class BatchingManager:
    """A started `ContinuousBatchingManager` whose prefix-cache hits are counted per request.

    The counting wraps the manager's own `PagedAttentionCache.search_prefix_match` on that one
    instance (no global patch): it is where the scheduler asks how many prompt tokens it can
    take from shared blocks.
    """

    def __init__(self, model, max_new_tokens: int, config: BatchingConfig) -> None:
        from transformers import GenerationConfig

        attn = model.config._attn_implementation
        generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
        self.manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=config.make()
        )
        if model.config._attn_implementation != attn:
            self.manager.destroy()
            raise RuntimeError(
                f"continuous batching switched the model's attention from {attn} to "
                f"{model.config._attn_implementation}; load the model with sdpa to compare on one model"
            )
        self.hits: dict[str, int] = {}
        self.lock = threading.Lock()
        self.manager.start()
        while self.manager.batch_processor is None:
            if not self.manager.is_running():
                raise RuntimeError("the continuous batching thread stopped while starting")
            threading.Event().wait(0.005)
        cache = self.manager.batch_processor.cache
        search = cache.search_prefix_match

        def counted(request_id: str, prompt_ids: list[int]) -> int:
            n = search(request_id, prompt_ids)
            with self.lock:
                self.hits[request_id] = n
            return n

        cache.search_prefix_match = counted
        self.cache_bytes = int(cache.cache_tensor.numel() * cache.cache_tensor.element_size())
        self.prefix_sharing = bool(cache.use_prefix_sharing)

    def hit(self, request_id: str) -> int:
        with self.lock:
            return self.hits.pop(request_id, 0)

    def close(self) -> None:
        self.manager.stop(block=True)
        self.manager.destroy()


def check_output(output, request_id: str):
    if output is None or output.error is not None:
        why = "the generation thread stopped (its error is logged above)" if output is None else output.error
        raise RuntimeError(f"continuous batching request {request_id} failed: {why}")
    return output


class ContinuousBatching(Server):
    """transformers' `ContinuousBatchingManager` (paged cache, block-level prefix sharing), fed the
    same requests one at a time: it is the engine behind `model.generate_batch`."""

    name = "transformers CB"

    def __init__(self, model, config: BatchingConfig, max_new_tokens: int) -> None:
        self.model, self.config, self.max_new_tokens = model, config, max_new_tokens
        self.batching: BatchingManager | None = None

    def reset(self) -> None:
        self.close()
        self.batching = BatchingManager(self.model, self.max_new_tokens, self.config)

    def serve(self, request: Request, clock: Clock) -> Served:
        assert self.batching is not None, "reset() first"
        manager = self.batching.manager
        t0 = clock()
        rid = manager.add_request(request.ids, max_new_tokens=request.max_new_tokens, streaming=True)
        ttft, last = None, None
        for output in manager.request_id_iter(rid):
            if ttft is None:
                ttft = clock() - t0
            last = output
        last = check_output(last, rid)
        assert ttft is not None
        return Served(ttft, list(last.generated_tokens), self.batching.hit(rid))

    def held_bytes(self) -> int:
        return self.batching.cache_bytes if self.batching is not None else 0

    def close(self) -> None:
        if self.batching is not None:
            self.batching.close()
            self.batching = None


@dataclass(slots=True)
class BatchRun:
    """All requests of one round handed to continuous batching at once (`generate_batch` style)."""

    outputs: list[list[int]]
    hits: list[int]
    ttft_s: list[float]


def generate_all_at_once(batching: BatchingManager, prompts: list[list[int]], max_new: int) -> BatchRun:
    """What `model.generate_batch(prompts)` does, on a manager whose hits are counted.

    TTFT here is from submission to the first token, queueing behind the other requests included
    (wall clock: transformers time-stamps tokens with `time.perf_counter`).
    """
    manager = batching.manager
    ids = manager.add_requests(prompts, max_new_tokens=max_new, record_timestamps=True)
    done: dict[str, object] = {}
    while len(done) < len(ids):
        output = manager.get_result(timeout=1.0)
        if output is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped before all requests finished")
            continue
        if output.is_finished():
            done[output.request_id] = check_output(output, output.request_id)
    results = [done[rid] for rid in ids]
    return BatchRun(
        [list(r.generated_tokens) for r in results],
        [batching.hit(rid) for rid in ids],
        [r.timestamps[0] - r.created_time for r in results],
    )


def working_bytes(request: Request, token_bytes: int) -> int:
    """KV of one request's own cache at its largest (prompt plus all but the last reply token)."""
    return (len(request.ids) + request.max_new_tokens - 1) * token_bytes
