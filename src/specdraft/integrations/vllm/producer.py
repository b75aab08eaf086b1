"""``specdraft serve-hidden-states --engine vllm``: the producer's target runs in a vLLM server.

The service (``hidden_states/service.py``) keeps the HTTP protocol, validation and batching; this
engine only turns each group of requests into concurrent ``max_tokens=1`` completions against an
extraction server (``extract.py``), started here or the user's at ``--vllm-url``. The server
captures a fixed set of layers (``--layers``, default: every method preset's slots), and each
request names the subset it wants and the storage dtype; its connector writes the payload under
the request's key, and the reply comes only after the payload was read back and checked.
Loading this module registers the engine in ``hidden_states/service.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LAYER_PRESETS, LayerSlot, parse_slots
from specdraft.hidden_states.service import PRODUCER_ENGINES, RequestError, ServiceConfig
from specdraft.integrations.vllm.extract import ServerSpec, capture_plan, describe_target, extraction_client, server_command
from specdraft.integrations.vllm.protocol import slot_rows
from specdraft.targets.base import Target

log = logging.getLogger(__name__)


def capture_slots(layers: str | None, num_layers: int) -> list[LayerSlot]:
    """``--layers``, else the union of every ``extract --method`` preset's slots (each preset that fits the target).

    The presets, not ``METHODS``: a method registered only in one process (a test's toy) must not change what a
    server started from another process's ``--print-server-command`` captures."""
    import specdraft.models  # noqa: F401  (each method's package registers its preset)

    if layers is not None:
        return parse_slots(layers, num_layers)
    union: set[LayerSlot] = set()
    for name in LAYER_PRESETS:
        with contextlib.suppress(SpecdraftError):  # a preset that needs more layers than the target has
            union.update(LAYER_PRESETS.get(name)(num_layers))
    return sorted(union)


def service_spec(config: ServiceConfig, backend: Any, target_info: dict) -> ServerSpec:
    """The extraction server a ``ServiceConfig`` starts or attaches to (vLLM chooses its max model length)."""
    return ServerSpec(
        target_path=target_info["path"], target_info=target_info, backend=config.backend, store=backend.producer_location(),
        slots=tuple(capture_slots(config.layers, int(target_info["num_layers"]))), dtype="bfloat16", target_dtype=config.target_dtype,
        max_model_len=None, max_num_seqs=config.max_batch, vllm_python=config.vllm_python, vllm_args=config.vllm_args,
    )  # fmt: skip


def producer_server_command(config: ServiceConfig) -> tuple[str, str]:
    """``specdraft serve-hidden-states --engine vllm --print-server-command``: (command line, URL it will serve)."""
    from specdraft.hidden_states.backends import open_backend

    with open_backend(config.backend, config.store) as backend:
        return server_command(service_spec(config, backend, describe_target(config.target)))


@PRODUCER_ENGINES.register("vllm")
class VllmProducer:
    """A ``ProducerEngine`` whose requests go to a vLLM extraction server; see the module docstring.

    ``run`` returns at once: up to ``max_batch`` requests are in flight on a thread pool, so vLLM
    batches them continuously while the service forms the next group.
    """

    def __init__(self, config: ServiceConfig, backend: Any, target: Target | None = None):
        if config.device != "cpu":
            log.info("--device %s is ignored with --engine vllm: the vLLM build decides where the target runs", config.device)
        self.backend = backend
        self.target_info = target.describe() if target is not None else describe_target(config.target)
        spec = service_spec(config, backend, self.target_info)
        self._layer_ids = capture_plan(list(spec.slots), int(self.target_info["num_layers"]))[0]
        self._stack = contextlib.ExitStack()
        self.client = self._stack.enter_context(extraction_client(spec, backend, url=config.vllm_url, longest=1))
        limit = self.client.max_model_len
        self.max_tokens = limit - 1 if isinstance(limit, int) else config.max_tokens
        self._pool = ThreadPoolExecutor(config.max_batch, thread_name_prefix="specdraft-vllm-producer")

    def check_slots(self, slots: list[LayerSlot]) -> None:
        slot_rows(slots, self._layer_ids, int(self.target_info["num_layers"]))

    def run(self, slots: list[LayerSlot], dtype: str, jobs: list[Any]) -> None:
        for job in jobs:
            future = self._pool.submit(self.client.store, job.key, job.token_ids.tolist(), slots, dtype)
            future.add_done_callback(functools.partial(self._finish, job))

    def _finish(self, job: Any, future: Future) -> None:
        try:
            payload = future.result()
        except Exception as exc:  # noqa: BLE001 - reported to the waiting client, who retries elsewhere
            log.warning("vLLM extraction of %r failed: %s", job.key, exc)
            job.finish(error=RequestError(500, f"extraction failed on the producer: {exc}"))
            return
        job.finish(result={"key": job.key, "bytes": self.backend.stored_size(payload), "num_tokens": payload.num_tokens})

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._stack.close()
