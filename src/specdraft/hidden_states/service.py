"""A hidden-state producer service: a process that holds the target and extracts on request.

Why a service: in online training the target runs on inference nodes and the trainer only names
the samples it wants next. A producer answers ``POST /extract`` by running the target on the
given token ids, writing the payload to a hidden-state backend (Mooncake, or a shared directory)
under the requested key, and replying with that key only once the write has landed, so the
consumer can fetch it at once.

Protocol (JSON over HTTP, ``Authorization: Bearer TOKEN`` when the service has a token)::

  GET  /health   -> 200 {"status": "ok", "target": Target.describe(), "engine", "backend", "max_batch",
                         "requests", "batches", "largest_batch", "busy_s"}  (busy_s: seconds the worker
                         spent running batches, so clients can tell how loaded a producer is)
  POST /extract  {"key": "s/1#ab-0", "token_ids": [1, 2, ...],
                  "slots": [{"layer": 1, "side": "output"}, ...],
                  "dtype": "bfloat16",              (optional; storage dtype)
                  "target_fingerprint": "..."}      (optional; refused with 409 if it differs)
                 -> 200 {"key", "bytes", "num_tokens"}
  errors         -> 4xx/5xx {"error": "what is wrong and what to do"}
                    400 malformed request (``EXTRACT_SCHEMA``: integers are integers, no unknown
                    fields; nesting, size and JSON checked by ``utils/http_json.py``), 401 bad/missing
                    token, 404 unknown path, 405 other method, 408 body too slow, 409 other target,
                    411 no Content-Length, 413 body too large, 500 extraction/storage failed

Batching: HTTP handler threads only validate and enqueue; one worker thread takes the first queued
request, waits up to ``batch_wait_ms`` for more (at most ``max_batch``) and hands them to the
engine, one group per distinct slot list and dtype.

Engines (``PRODUCER_ENGINES``, chosen by ``--engine``) run the target; the protocol above is the
same for all, so a consumer cannot tell them apart:

  hf    the worker runs the group as one right-padded batch of the HF model in this process and
        writes each payload.
  vllm  (``integrations/vllm/producer.py``) the group's requests go to a vLLM server (started here,
        or the user's at ``--vllm-url``) whose connector writes each payload; the engine reads it
        back and checks it before replying, as ``specdraft extract --engine vllm`` does.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, cast

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.config import ENGINE_NAMES, STORAGE_DTYPE_NAMES
from specdraft.hidden_states.layers import LayerSlot
from specdraft.registry import Registry
from specdraft.targets.base import Target
from specdraft.targets.loading import DTYPES as TARGET_DTYPES
from specdraft.utils.config import config_field, require_finite
from specdraft.utils.http_json import OptionalField, RequestError, check_schema, read_json_body
from specdraft.utils.net import require_token_beyond_loopback
from specdraft.utils.vllm_options import VllmAttachOptions

log = logging.getLogger(__name__)

MAX_KEY_CHARS = 512
#: Seconds a connection may stay silent mid-request before it gets a 408 (or is dropped between requests).
REQUEST_TIMEOUT_S = 60.0
PROBE_ROWS = 64  # most rows of the --num-threads 0 timing probe


@dataclass
class ServiceConfig(VllmAttachOptions):
    target: str = config_field(help="target name or HF model directory the producer runs")
    backend: str = config_field(help="hidden-state backend payloads are written to (registered name: file, mooncake)")
    store: str = config_field(
        help="backend location: a directory shared with the trainer (file) or mooncake://HOST:PORT/NS?segment_mb=0&... "
        "(producers should contribute no memory: segment_mb=0)"
    )
    host: str = config_field("127.0.0.1", help="address to bind; anything but loopback requires --token")
    port: int = config_field(8700, help="TCP port (0 = any free port; the chosen URL is printed)")
    token: str | None = config_field(None, help="bearer token clients must send (Authorization: Bearer TOKEN)")
    max_batch: int = config_field(8, help="most queued requests run as one forward pass")
    batch_wait_ms: float = config_field(5.0, help="how long the worker waits for more requests to fill a batch")
    max_tokens: int = config_field(
        32768, help="longest accepted request (tokens); with --engine vllm also at most the server's max model length - 1"
    )
    target_dtype: str = config_field("float32", help="dtype the target runs in", metadata={"choices": list(TARGET_DTYPES)})
    device: str = config_field("cpu", help="device the target runs on (cpu, cuda, cuda:1, ...); --engine hf only")
    num_threads: int = config_field(
        0,
        help="--engine hf: torch CPU threads (0 = auto: the count that ran a --max-batch x 256-token forward fastest here, "
        "measured once per machine and cached)",
    )
    engine: str = config_field(
        "hf",
        help="what runs the target: hf (transformers, in this process) or vllm (a vLLM server, run by the vLLM "
        "environment --vllm-python finds, whose connector writes the payloads; started privately, or yours at --vllm-url)",
        metadata={"choices": list(ENGINE_NAMES)},
    )
    layers: str | None = config_field(
        None,
        help="--engine vllm: layer slots the vLLM server captures, e.g. 'output:1,input:2'; requests may ask for any "
        "subset (default: the slots of every method preset, so any drafter can train from this producer)",
    )

    def __post_init__(self) -> None:
        require_finite(self)
        if not 0 <= self.port < 65536:
            raise SpecdraftError(f"{setting('port')} {self.port} is not a TCP port (0-65535)")
        for name in ("max_batch", "max_tokens"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{setting(name)} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0 or self.num_threads < 0:
            raise SpecdraftError(f"{setting('batch_wait_ms')} and {setting('num_threads')} must be >= 0")
        require_token_beyond_loopback(self.host, self.token)
        self.check_vllm_options(self.engine)
        if self.layers is not None and self.engine != "vllm":
            raise SpecdraftError(
                f"{setting('layers')} chooses what a vLLM server captures: it needs "
                f"{setting('engine')} vllm (the hf engine serves any slots)"
            )


#: The shape of a ``POST /extract`` body (``check_schema``); ranges and meanings are checked in ``_parse``.
EXTRACT_SCHEMA = {
    "key": str,
    "token_ids": [int],
    "slots": [{"layer": int, "side": ("input", "output")}],
    "dtype": OptionalField(STORAGE_DTYPE_NAMES),
    "target_fingerprint": OptionalField(str),
}


@dataclass
class _Job:
    key: str
    token_ids: Any  # LongTensor [T]
    slots: tuple[LayerSlot, ...]
    dtype: str
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: RequestError | None = None

    def finish(self, *, result: dict | None = None, error: RequestError | None = None) -> None:
        """Hand the reply (or the error) to the HTTP thread waiting in ``submit``."""
        self.result, self.error = result, error
        self.done.set()


class ProducerEngine(Protocol):
    """What runs the target for the service (``PRODUCER_ENGINES``), built as ``factory(config, backend, target)``."""

    target_info: dict  # Target.describe() of what it runs
    max_tokens: int  # longest request it can run

    def check_slots(self, slots: list[LayerSlot]) -> None:
        """Raise ``SpecdraftError`` (sent back as 400) when this engine cannot capture ``slots``."""

    def run(self, slots: list[LayerSlot], dtype: str, jobs: list[_Job]) -> None:
        """Store each job's payload in the backend and ``finish`` it; may return before they finish."""

    def close(self) -> None:
        """Finish what was handed to ``run``, then release the target."""


#: ``--engine`` name -> factory(config, backend, target or None) -> ProducerEngine; ``vllm`` is registered by
#: ``integrations/vllm/producer.py``.
PRODUCER_ENGINES: Registry[Callable[[ServiceConfig, Any, Target | None], ProducerEngine]] = Registry("producer engine")


@PRODUCER_ENGINES.register("hf")
class HFProducer:
    """The HF model in this process; ``target`` may be passed pre-loaded (tests)."""

    def __init__(self, config: ServiceConfig, backend: Any, target: Target | None = None):
        from specdraft.tuning.threads import resolve_forward_threads

        if target is None:
            from specdraft.targets import load_target

            target = load_target(config.target, dtype=config.target_dtype, device=config.device)
        # The probe only ranks thread counts: a forward of PROBE_ROWS rows ranks them as a larger batch would, and a
        # huge --max-batch (a bound on batching, not a batch that will ever exist) must not become one.
        resolve_forward_threads(
            config.num_threads,
            target.model,
            fingerprint=target.fingerprint,
            rows=min(config.max_batch, PROBE_ROWS),
            tokens=min(256, config.max_tokens),
        )
        self.target = target
        self.target_info = target.describe()
        self.max_tokens = config.max_tokens
        self.backend = backend

    def check_slots(self, slots: list[LayerSlot]) -> None:
        pass  # every layer is captured by hooks on demand

    def run(self, slots: list[LayerSlot], dtype: str, jobs: list[_Job]) -> None:
        from specdraft.hidden_states.capture import HiddenStateCapture
        from specdraft.hidden_states.payload import HiddenStatePayload

        try:
            outputs = HiddenStateCapture(self.target.model, slots)([j.token_ids for j in jobs])
        except Exception as exc:  # reported to every waiting client
            log.exception("extraction of %d request(s) failed", len(jobs))
            for job in jobs:
                job.finish(error=RequestError(500, f"extraction failed on the producer: {type(exc).__name__}: {exc}"))
            return
        for job, (hidden, last) in zip(jobs, outputs):
            try:
                payload = HiddenStatePayload.create(
                    sample_id=job.key,
                    target_info=self.target_info,
                    slots=slots,
                    token_ids=job.token_ids,
                    hidden_states=hidden,
                    last_hidden=last,
                    dtype=dtype,
                )
                nbytes = self.backend.put(job.key, payload)
                job.finish(result={"key": job.key, "bytes": nbytes, "num_tokens": payload.num_tokens})
            except Exception as exc:  # noqa: BLE001 - reported to the waiting client
                log.warning("storing %r in %s failed: %s", job.key, self.backend.location, exc)
                job.finish(error=RequestError(500, f"storing {job.key!r} in {self.backend.location} failed: {exc}"))

    def close(self) -> None:
        pass


class HiddenStateService:
    """The producer: ``start()`` serves in background threads, ``close()`` stops; also a context manager.

    ``target`` and ``backend`` may be passed pre-built (tests); otherwise they are loaded from the config.
    """

    def __init__(self, config: ServiceConfig, *, target: Target | None = None, backend: Any = None):
        from specdraft.hidden_states.backends import open_backend

        self.config = config
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._stats = {"requests": 0, "batches": 0, "largest_batch": 0, "busy_s": 0.0}
        self._stats_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        if config.backend == "file":  # shared with the trainer and other producers, so checked writable but not locked
            from specdraft.utils.lock import probe_writable

            probe_writable(config.store, setting("store"))
        # Bind first: a busy port must not be found only after a vLLM engine took minutes to start.
        # Connections wait in the listen backlog until ``start`` serves them.
        try:
            self._server = ThreadingHTTPServer((config.host, config.port), _handler_class(self))
        except OSError as exc:
            raise SpecdraftError(
                f"cannot listen on {config.host}:{config.port} ({exc.strerror or exc}); choose another "
                f"{setting('port')} (0 = any free port)"
            ) from None
        self._server.daemon_threads = True
        with contextlib.ExitStack() as undo:  # released only if a later step fails
            undo.callback(self._server.server_close)
            self.backend = backend if backend is not None else open_backend(config.backend, config.store)
            undo.callback(self.backend.close)
            self.engine = PRODUCER_ENGINES.get(config.engine)(config, self.backend, target)
            undo.pop_all()
        self.target_info = self.engine.target_info
        self.max_tokens = min(config.max_tokens, self.engine.max_tokens)

    @property
    def url(self) -> str:
        # typeshed's server_address covers every socket family; this TCP server's is (host, port[, ...]).
        host, port = cast("tuple[str, int]", self._server.server_address[:2])
        return f"http://{host}:{port}"

    def health(self) -> dict:
        with self._stats_lock:
            stats = dict(self._stats)
        return {
            "status": "ok",
            "target": self.target_info,
            "engine": self.config.engine,
            "backend": self.config.backend,
            "max_batch": self.config.max_batch,
            **stats,
        }

    def start(self) -> HiddenStateService:
        self._threads = [
            threading.Thread(target=self._worker, name="specdraft-producer-worker", daemon=True),
            threading.Thread(target=self._server.serve_forever, name="specdraft-producer-http", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("serving hidden states of %s at %s -> %s", self.target_info["name"], self.url, self.config.store)
        return self

    def close(self) -> None:
        """Stop accepting, finish queued requests, release the engine and the backend."""
        if self._closing:
            return
        self._closing = True
        self._server.shutdown()
        self._server.server_close()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=60)
        self.engine.close()
        self.backend.close()

    def __enter__(self) -> HiddenStateService:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- request handling (HTTP threads) ----------------------------------------------------------

    def check_auth(self, header: str | None) -> None:
        if not self.config.token:
            return
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.config.token.encode()):
            raise RequestError(
                401,
                "missing or wrong bearer token: send 'Authorization: Bearer TOKEN' with the producer's token "
                "(`specdraft serve-hidden-states --token`)",
            )

    def submit(self, body: Any) -> dict:
        """Validate one request, queue it and wait until its payload is stored."""
        job = self._parse(body)
        if self._closing:
            raise RequestError(503, "the producer is shutting down; send the request to another producer")
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]  # finish() gives a result whenever it gives no error

    def _parse(self, body: Any) -> _Job:
        import torch

        check_schema(body, EXTRACT_SCHEMA)
        key = body["key"]
        if not key or len(key) > MAX_KEY_CHARS or not key.isprintable():
            raise RequestError(400, f"'key' must be a non-empty printable string of at most {MAX_KEY_CHARS} characters, got {key!r:.80}")
        wanted_fp = body.get("target_fingerprint")
        if wanted_fp is not None and wanted_fp != self.target_info["fingerprint"]:
            raise RequestError(
                409,
                f"this producer serves target {self.target_info['name']!r} (fingerprint {self.target_info['fingerprint']}), "
                f"the request wants fingerprint {wanted_fp!r}; point the client at producers of its target",
            )
        ids = body["token_ids"]
        vocab = int(self.target_info["vocab_size"])
        if not ids:
            raise RequestError(400, "'token_ids' must be a non-empty list of integers")
        if len(ids) > self.max_tokens:
            raise RequestError(
                400,
                f"{len(ids)} tokens exceed this producer's limit of {self.max_tokens} "
                "(`specdraft serve-hidden-states --max-tokens`, and a vLLM "
                "server's max model length - 1)",
            )
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(400, f"token id {bad} is outside the target's vocabulary (0..{vocab - 1})")
        if not body["slots"]:
            raise RequestError(400, '\'slots\' must be a non-empty list of {"layer": int, "side": "input"|"output"}')
        slots = []
        for i, obj in enumerate(body["slots"]):
            try:
                slot = LayerSlot(obj["layer"], obj["side"])
                slot.check(int(self.target_info["num_layers"]))
            except SpecdraftError as exc:
                raise RequestError(400, f"slots[{i}] {obj!r}: {exc}") from None
            slots.append(slot)
        try:
            self.engine.check_slots(slots)
        except SpecdraftError as exc:
            raise RequestError(400, f"this producer cannot serve these slots: {exc}") from None
        return _Job(key=key, token_ids=torch.tensor(ids, dtype=torch.long), slots=tuple(slots), dtype=body.get("dtype", "bfloat16"))

    # -- the worker (owns the model) --------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.config.batch_wait_ms / 1000
            stop = False
            while len(batch) < self.config.max_batch:
                try:
                    job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                batch.append(job)
            with self._stats_lock:
                self._stats["requests"] += len(batch)
                self._stats["batches"] += 1
                self._stats["largest_batch"] = max(self._stats["largest_batch"], len(batch))
            groups: dict[tuple, list[_Job]] = {}
            for job in batch:
                groups.setdefault((job.slots, job.dtype), []).append(job)
            started = time.perf_counter()
            for (slots, dtype), jobs in groups.items():
                self.engine.run(list(slots), dtype, jobs)
            with self._stats_lock:
                self._stats["busy_s"] += time.perf_counter() - started
            if stop:
                return


def _handler_class(service: HiddenStateService) -> type[BaseHTTPRequestHandler]:
    max_body = 64 + 16 * service.config.max_tokens + 64 * 1024  # ids as JSON text plus slots and key

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = REQUEST_TIMEOUT_S  # a client that announces a body and stalls must not hold a thread forever
        default_request_version = "HTTP/1.1"  # so a refusal of a garbled request line still carries a status line

        def log_message(self, format: str, *args: Any) -> None:  # `format`: the stdlib signature
            log.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The stdlib's own refusals (a malformed request line or header, an unsupported method) in JSON too;
            an unsupported method is 405, the client's mistake, not the stdlib's 501."""
            if code == 501 and self.command:
                code, message = 405, f"method {self.command} is not allowed; use GET /health or POST /extract"
            self.close_connection = True
            self._send(code, {"error": message or explain or "bad request"})

        def _guard(self, fn: Callable[[], dict]) -> None:
            try:
                service.check_auth(self.headers.get("Authorization"))
                self._send(200, fn())
            except RequestError as exc:
                self.close_connection = True
                self._send(exc.status, {"error": str(exc)})
            except Exception as exc:  # a bug must still answer, not leave the client an empty reply
                log.exception("request %s %s failed", self.command, self.path)
                self.close_connection = True
                self._send(500, {"error": f"the producer failed on this request: {type(exc).__name__}: {exc}"})

        def do_GET(self) -> None:  # the stdlib handler name
            self._route("/health", service.health)

        def do_POST(self) -> None:  # the stdlib handler name
            self._route("/extract", self._extract)

        def _route(self, path: str, fn: Callable[[], dict]) -> None:
            """Answer with ``fn`` when the request is for ``path`` (this method's one endpoint), else 404."""
            if self.path != path:
                self.close_connection = True
                self._send(404, {"error": f"no such endpoint {self.path!r}; use GET /health or POST /extract"})
                return
            self._guard(fn)

        def _extract(self) -> dict:
            return service.submit(read_json_body(self.headers, self.rfile, max_bytes=max_body))

    return Handler
