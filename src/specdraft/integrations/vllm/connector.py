"""vLLM KV-connector plugin that stores captured target hidden states as specdraft payloads.

Loaded *inside* the vLLM engine (``kv_connector_module_path="specdraft.integrations.vllm.connector"``,
``kv_connector="SpecdraftHiddenStatesConnector"``), next to vLLM's ``extract_hidden_states``
speculative method. That method copies the residual stream of the layers listed in
``eagle_aux_hidden_state_layer_ids`` into the KV cache of one fake attention layer (one "head" per
layer id, ``head_size`` = hidden size). vLLM id ``i < L`` is the input of decoder layer ``i``
(= HF ``hidden_states[i]``); id ``L`` is the last layer's output before the final norm.

Why our own connector: vLLM's example connector writes raw tensors (no manifest, no checksums) and
needs CUDA streams. This one writes the same self-describing :class:`HiddenStatePayload` as the
HF path, through any registered backend, and writes it *in the step that completes the prompt*:

  1. Scheduler side (``build_connector_meta``): track each request's blocks of the hidden-state
     KV group; when a step computes the request's last prompt token, order a save
     (sample id, and optionally slots and dtype, from the request's ``kv_transfer_params``;
     requests without a sample id are ignored; slots the captured layers do not cover are refused).
  2. Worker side (``wait_for_save``, which vLLM runs after the drafter, i.e. after the cache-only
     layer stored this step's states): gather the rows of every ordered request, build payloads,
     ``backend.put`` them. CPU: synchronous gather. CUDA: the gathers of a step are queued on a
     side stream into pinned memory and synchronised once before writing (untested here).
  3. Scheduler side (``request_finished``): report ``{"specdraft_key", "specdraft_store"}`` in
     ``kv_transfer_params`` (``{"specdraft_error"}`` for a refused request; for a
     ``specdraft_check`` request, which stores nothing, the server's description). The step's outputs
     are only built after step 2 returned, so the client never sees a key before its write
     landed; a failed write is logged and the key is simply absent from the store, which the
     client checks.

``kv_connector_extra_config`` (written by :func:`specdraft.integrations.vllm.extract.extraction_args`)::

  {"store": location, "backend": "file", "dtype": "bfloat16", "target": Target.describe(),
   "slots": [{"layer": 1, "side": "output"}, ...]}

``slots``/``dtype`` are the defaults of requests that name none. Which row of the captured layer
ids (the fake layer's heads) holds a slot follows from the speculative config's
``eagle_aux_hidden_state_layer_ids`` (:func:`~specdraft.integrations.vllm.protocol.slot_rows`), so
the rows cannot disagree with what the server really captures. ``store`` is the store's
``producer_location()`` (for Mooncake: ``segment_mb=0``, the engine holds no data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.config import STORAGE_DTYPE_NAMES
from specdraft.hidden_states.layers import LayerSlot
from specdraft.integrations.vllm.protocol import CHECK, DTYPE, ERROR, KEY, SAMPLE_ID, SERVER, SLOTS, STORE, slot_rows

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from specdraft.hidden_states.backends.base import HiddenStateBackend

logger = init_logger(__name__)


@dataclass
class SaveOrder:
    """One request whose prompt is fully in the hidden-state cache this step."""

    req_id: str
    sample_id: str
    token_ids: list[int]
    block_ids: list[int]
    plan: _Plan


@dataclass
class SpecdraftConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveOrder] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    """What one request's payload holds: its slots, their rows among the captured ids, the dtype."""

    slots: tuple[LayerSlot, ...]
    rows: tuple[int, ...]
    last_row: int
    dtype: str


@dataclass
class _Tracked:
    sample_id: str
    token_ids: list[int]
    block_ids: list[int]
    plan: _Plan | None
    error: str | None = None
    ordered: bool = False


class SpecdraftHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: captured hidden states -> ``HiddenStatePayload`` in a specdraft store."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # Reuse vLLM's own lookup of the hidden-state KV group and its block size.
        self._group = ExampleHiddenStatesConnector._find_cache_kv_group_id(kv_cache_config)
        self._block_size = ExampleHiddenStatesConnector._get_cache_block_size(vllm_config, kv_cache_config, self._group)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        missing = [k for k in ("store", "dtype", "target", "slots") if k not in extra]
        if missing:
            raise ValueError(f"SpecdraftHiddenStatesConnector: kv_connector_extra_config lacks {', '.join(missing)}")
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("SpecdraftHiddenStatesConnector needs --speculative-config with method extract_hidden_states")
        self._layer_ids = [int(i) for i in spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids]
        self._store = str(extra["store"])
        self._backend_name = str(extra.get("backend", "file"))
        self._target = dict(extra["target"])
        self._num_layers = int(self._target["num_layers"])
        # The configured defaults must be servable, or the server would refuse every plain request.
        self._default_plan = self._plan([LayerSlot.from_json(s) for s in extra["slots"]], str(extra["dtype"]))
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._checks: dict[str, dict] = {}  # req_id -> kv_transfer_params answer of a check request
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._backend: HiddenStateBackend | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    def _plan(self, slots: list[LayerSlot], dtype: str) -> _Plan:
        if dtype not in STORAGE_DTYPE_NAMES:
            raise SpecdraftError(f"dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPE_NAMES)}")
        if not slots:
            raise SpecdraftError("no slots requested")
        rows, last_row = slot_rows(slots, self._layer_ids, self._num_layers)
        return _Plan(tuple(slots), tuple(rows), last_row, dtype)

    def _request_plan(self, params: dict) -> _Plan:
        """The request's own slots/dtype, else the configured ones."""
        if SLOTS not in params and DTYPE not in params:
            return self._default_plan
        try:
            slots = [LayerSlot.from_json(s) for s in params[SLOTS]] if SLOTS in params else list(self._default_plan.slots)
        except (KeyError, TypeError, ValueError):
            raise SpecdraftError(f'{SLOTS} {params[SLOTS]!r:.200} is not a list of {{"layer": int, "side": "input"|"output"}}') from None
        return self._plan(slots, str(params.get(DTYPE, self._default_plan.dtype)))

    def _check(self, params: dict) -> dict:
        """The answer to a ``CHECK`` request: could its slots/dtype be served, and what is this server."""
        try:
            self._request_plan(params)
        except SpecdraftError as exc:
            return {ERROR: str(exc)}
        info = {
            "store": self._store,
            "backend": self._backend_name,
            "target_fingerprint": self._target.get("fingerprint"),
            "layer_ids": self._layer_ids,
        }
        return {SERVER: info}

    # ----- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Step 1: follow blocks of tracked requests; order saves for prompts completed this step."""
        meta = SpecdraftConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            params = ((new.sampling_params.extra_args or {}).get("kv_transfer_params") if new.sampling_params else None) or {}
            if params.get(CHECK):
                self._checks[new.req_id] = self._check(params)
                continue
            sample_id = params.get(SAMPLE_ID)
            if sample_id is None or new.prompt_token_ids is None:
                continue
            try:
                plan, error = self._request_plan(params), None
            except SpecdraftError as exc:  # reported in kv_transfer_params; the engine keeps serving
                plan, error = None, str(exc)
            self._tracked[new.req_id] = _Tracked(str(sample_id), list(new.prompt_token_ids), list(new.block_ids[self._group]), plan, error)
            self._maybe_order(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:  # preempted and resumed: a fresh block list
                    tracked.block_ids = list(new_blocks[self._group])
                    tracked.ordered = False
                else:
                    tracked.block_ids.extend(new_blocks[self._group])
            self._maybe_order(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_order(self, meta: SpecdraftConnectorMetadata, req_id: str, computed_after_step: int) -> None:
        tracked = self._tracked[req_id]
        if tracked.plan is not None and not tracked.ordered and computed_after_step >= len(tracked.token_ids):
            tracked.ordered = True
            meta.saves.append(SaveOrder(req_id, tracked.sample_id, tracked.token_ids, list(tracked.block_ids), tracked.plan))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Step 3: the payload was written during the step that finished the prompt."""
        check = self._checks.pop(request.request_id, None)
        if check is not None:
            return False, check
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None and tracked.error is not None:
            return False, {ERROR: f"sample {tracked.sample_id!r} not stored: {tracked.error}"}
        if tracked is None or not tracked.ordered:
            return False, None
        return False, {KEY: tracked.sample_id, STORE: self._store}

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[self._group] if self._group < len(block_ids) else [])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # [blocks, heads(=layers), block, hidden]: what extract_from_kv_cache indexes

    # ----- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        from specdraft.hidden_states.backends.base import open_backend
        from specdraft.integrations.mooncake import backend as _mooncake  # noqa: F401  (registers "mooncake" in this vLLM process)

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"SpecdraftHiddenStatesConnector needs exactly one cache-only layer, found {layers}")
        self._kv_cache = kv_caches[layers[0]]
        if self._kv_cache.shape[2] != self._block_size:
            raise ValueError(f"hidden-state block size {self._kv_cache.shape[2]} != expected {self._block_size}")
        # Open the store now, so an unreachable one (e.g. a Mooncake master) stops the engine at
        # start-up with the backend's message instead of failing every request.
        self._backend = open_backend(self._backend_name, self._store)

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the cache-only layer already stored the states; wait_for_save copies them out

    def wait_for_save(self) -> None:
        """Step 2: gather and write every payload ordered for this step."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, SpecdraftConnectorMetadata) or not meta.saves or self._kv_cache is None:
            return
        gathered = self._gather([(o.block_ids, len(o.token_ids)) for o in meta.saves])
        for order, rows in zip(meta.saves, gathered):
            try:
                self._write(order, rows)
            except Exception:  # one bad sample must not kill the engine; the client sees the key missing
                logger.exception("specdraft: writing hidden states of sample %r to %s failed", order.sample_id, self._store)

    def _slot_mapping(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long)
        return (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()[:num_tokens]

    def _gather(self, requests: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        """[T, layer ids, D] per request, on the CPU."""
        cache = self._kv_cache
        assert cache is not None  # wait_for_save checked it
        if cache.device.type != "cuda":
            return [extract_from_kv_cache(cache, self._slot_mapping(b, n), n).clone() for b, n in requests]
        # CUDA (untested here): queue all gathers + device->pinned copies on a side stream ordered
        # after this step's cache writes, then wait once.
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=cache.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(cache.device))
        out = []
        with torch.cuda.stream(stream):
            for b, n in requests:
                rows = extract_from_kv_cache(cache, self._slot_mapping(b, n).to(cache.device, non_blocking=True), n)
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                out.append(host)
        stream.synchronize()
        return out

    def _write(self, order: SaveOrder, rows: torch.Tensor) -> None:
        from specdraft.hidden_states.payload import HiddenStatePayload

        plan = order.plan
        payload = HiddenStatePayload.create(
            sample_id=order.sample_id,
            target_info=self._target,
            slots=list(plan.slots),
            token_ids=torch.tensor(order.token_ids, dtype=torch.int64),
            hidden_states=rows[:, list(plan.rows)],
            last_hidden=rows[:, plan.last_row],
            dtype=plan.dtype,
        )
        assert self._backend is not None  # register_kv_caches opened it before any step
        self._backend.put(order.sample_id, payload)
