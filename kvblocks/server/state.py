"""What every route shares, kept on `app.state.served`: the engine's front door (`Frontend`), the config."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from fastapi import Request

import kvblocks
from kvblocks.cache.namespace import Scope
from kvblocks.engine.frontend import Frontend
from kvblocks.generate.grammar import DEFAULT_LIMITS, GrammarLimits
from kvblocks.server.auth import ApiKeys, Principal
from kvblocks.server.bounds import MAX_TOKENIZING, FairGate
from kvblocks.server.cost import CountCaps, TemplateCost
from kvblocks.server.errors import APIError
from kvblocks.server.guard import Admission, principal_of
from kvblocks.server.pins import PrefixPins
from kvblocks.server.response_store import ResponseStore
from kvblocks.telemetry.history import History


@dataclass(slots=True, frozen=True)
class CorsConfig:
    """Which browser origins may call the server (`--allowed-origins`), as vLLM names the options."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("GET", "POST", "DELETE", "OPTIONS")
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@dataclass(slots=True)
class ServerConfig:
    """`keys` None: an open server (every caller is an admin of the default tenant)."""

    model_name: str
    keys: ApiKeys | None = None
    default_max_tokens: int = 256
    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 30.0
    lenient: bool = False
    tool_parser: str | None = None
    max_prompts: int = 128  # prompts in one completions request
    max_branches: int = 256  # engine requests one HTTP request may become (prompts x best_of, n)
    drain_timeout_s: float = 30.0
    history_interval_s: float = 5.0  # seconds between samples of /v1/cache/history
    history_window_s: float = 6 * 3600  # how far back it reaches
    vllm_metrics: bool = True  # /metrics also under vLLM's names (kvblocks.telemetry.vllm_metrics)
    kv_mode: str = "exact"  # how KV blocks are reused when a request does not say (--kv-mode)
    blend_recompute: float = 0.15  # --blend-recompute
    stored_bytes_per_tenant: int = 64 << 20  # stored /v1/responses (--store-max-bytes-per-tenant)
    stored_bytes: int = 512 << 20  # all tenants' together (--store-max-bytes)
    stored_ttl_s: float = 3600.0  # --store-ttl
    caps: CountCaps = field(default_factory=CountCaps)  # --max-messages, --max-input-items, ...
    max_blocks: int = 64  # KV blocks in one request (--max-blocks)
    max_block_tokens: int | None = None  # their tokens in all (--max-block-tokens; None: the model's context)
    cors: CorsConfig | None = None  # --allowed-origins (None: no CORS headers, browsers are refused)
    grammar: GrammarLimits = DEFAULT_LIMITS  # --max-schema-bytes, --max-schema-depth, --grammar-timeout
    quantization: str = "none"  # --quantization: not "none" labels every response (`labels`)

    def labels(self) -> dict[str, str]:
        """Fields every response of an approximate model carries: `quantization` ("int8") where the
        server runs a quantised model, nothing where it runs the model's own weights."""
        return {} if self.quantization == "none" else {"quantization": self.quantization}


@dataclass(slots=True)
class Served:
    """`prompt_chars`: the most characters a prompt that fits the context can have (None: no bound),
    and `template_cost`: what the chat template costs per message, both set at start-up;
    `tokenize_gate` bounds the tokenisations running at once, shares them fairly by tenant and
    charges each tenant's time in it to the engine's ledger (`TenantLedger.charge_time`: the tokens
    the engine does in that time)."""

    engine: Frontend
    config: ServerConfig
    started: float = field(default_factory=time.time)
    admission: Admission = field(default_factory=Admission)
    prompt_chars: int | None = None
    template_cost: TemplateCost = field(default_factory=TemplateCost)
    tokenize_gate: FairGate = field(init=False)
    history: History | None = None
    pins: PrefixPins | None = None  # `cache_control` pins, made on first use (None: no cache)
    responses: ResponseStore | None = None  # stored /v1/responses, made on first use
    fingerprint: str | None = None  # `system_fingerprint()`, once computed

    def __post_init__(self) -> None:
        keys = self.config.keys
        self.tokenize_gate = FairGate(
            MAX_TOKENIZING,
            (lambda tenant: keys.limits(tenant).weight) if keys else (lambda tenant: 1.0),
            lambda tenant, seconds: self.engine.ledger.charge_time(tenant, seconds),
        )

    def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: the model (the fingerprint of its config and weights that
        names its cache namespace, and its dtype) and the kvblocks version, hashed; the same across
        restarts of one build on one model. Without a cache it hashes the weights, so start-up
        (`warm_up`) computes it once."""
        if self.fingerprint is None:
            namespace = self.engine.namespace()
            identity = json.dumps([namespace.model, namespace.dtype, kvblocks.__version__])
            self.fingerprint = "fp_" + hashlib.sha256(identity.encode()).hexdigest()[:16]
        return self.fingerprint

    def prefix_pins(self) -> PrefixPins | None:
        if self.pins is None and self.engine.cache is not None:
            self.pins = PrefixPins(self.engine.cache, self.tenant_weights())
        return self.pins

    def response_store(self) -> ResponseStore:
        if self.responses is None:
            c, weights = self.config, self.tenant_weights()
            self.responses = ResponseStore(
                c.stored_bytes_per_tenant,
                c.stored_bytes,
                c.stored_ttl_s,
                weight=lambda t: weights.get(t, 1.0),
            )
        return self.responses

    def tenant_weights(self) -> dict[str, float]:
        """Every tenant this server knows, with its weight (the keys file's; an open server has one)."""
        return {"": 1.0} if self.config.keys is None else self.config.keys.weights()


def served(request: Request) -> Served:
    return request.app.state.served


def caller(request: Request) -> Principal:
    return principal_of(request.scope)


def require_engine_view(request: Request) -> None:
    """Load, server info and metrics describe every tenant's traffic: routers and admins only."""
    if not caller(request).sees_engine:
        raise APIError(
            403,
            "this route shows every tenant's traffic: it needs a router or admin key",
            type_="permission_error",
            code="router_or_admin_only",
        )


def scope_of(request: Request, cache_salt: str | None) -> Scope:
    """The request's place in the cache: its key's tenant, refined by its own cache_salt."""
    return Scope(caller(request).tenant, cache_salt or "")
