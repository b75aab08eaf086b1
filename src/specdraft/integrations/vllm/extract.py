"""Hidden-state extraction through a vLLM server: ``specdraft extract --engine vllm`` and the
``--engine vllm`` producer of ``specdraft serve-hidden-states``.

Same payloads as the HF path (``hidden_states/extract.py`` owns the store manifest, resume and
summary; ``hidden_states/service.py`` the producer protocol); only the capture differs:

  1. Map the slots to capture onto vLLM aux-layer ids (:func:`capture_plan`) and start a private
     server whose ``extract_hidden_states`` drafter captures them and whose
     :class:`~specdraft.integrations.vllm.connector.SpecdraftHiddenStatesConnector` writes payloads
     straight into the store -- or attach to a server the user started with the command
     :func:`server_command` prints (``--vllm-url``, ``--print-server-command``), after checking
     that it answers and that its connector serves our target and slots (:func:`attach`).
  2. Send each sample as a ``max_tokens=1`` completion with its token ids as the prompt and its
     key, slots and dtype in ``kv_transfer_params``; requests are sent concurrently so vLLM
     batches them.
  3. The server answers with the stored key only after the write; read the payload back and check
     it (checksums, token ids, slots, target) so a silent server-side failure cannot pass.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.extract import EXTRACT_ENGINES, ExtractJob
from specdraft.hidden_states.layers import LayerSlot
from specdraft.integrations.vllm.engine import CONNECTOR_CLASS, CONNECTOR_MODULE, CPU_ENV_DEFAULTS, VllmServer, complete, get_text
from specdraft.integrations.vllm.protocol import CHECK, DTYPE, ERROR, KEY, SAMPLE_ID, SERVER, SLOTS, STORE, slot_rows

if TYPE_CHECKING:
    from specdraft.data.dataset import PreparedDataset

log = logging.getLogger(__name__)


def how_to_start() -> str:
    """Where every attach error points the user."""
    return f"start it with the command that {setting('print_server_command')} prints (same flags plus {setting('print_server_command')})"


def capture_plan(slots: list[LayerSlot], num_layers: int) -> tuple[list[int], list[int], int]:
    """(vLLM aux-layer ids to capture, row of each slot among them, row of ``last_hidden``).

    vLLM id ``i`` is the input of layer ``i``; id ``num_layers`` is the last layer's output before
    the final norm (= ``last_hidden``). Example, 6 layers, slots output:1, input:3:
    ids [2, 3, 6], slot rows [0, 1], last row 2.
    """
    from specdraft.models.common.checkpoint import slot_to_aux_id

    for s in slots:
        s.check(num_layers)
    ids = sorted({slot_to_aux_id(s) for s in slots} | {num_layers})
    rows, last_row = slot_rows(slots, ids, num_layers)
    return ids, rows, last_row


def extraction_args(
    *,
    store: str,
    backend: str,
    dtype: str,
    target_dtype: str,
    target_info: dict,
    slots: list[LayerSlot],
    max_model_len: int | None,
    max_num_seqs: int,
) -> list[str]:
    """``api_server`` flags for a hidden-state extraction server writing into ``store``.

    ``slots``/``dtype`` are what it captures and the default of requests that name none; a
    request may ask for any subset of the slots, in any storage dtype. ``max_model_len=None``
    leaves the length limit (and the batch token budget) to vLLM.
    """
    layer_ids, _, _ = capture_plan(slots, int(target_info["num_layers"]))
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    transfer = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "store": store, "backend": backend, "dtype": dtype, "target": target_info, "slots": [s.to_json() for s in slots],
        },
    }  # fmt: skip
    lengths = (
        [] if max_model_len is None else ["--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(max(max_model_len, 2048))]
    )
    return [
        "--dtype", target_dtype, *lengths, "--max-num-seqs", str(max_num_seqs), "--no-enable-prefix-caching",
        "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip


@dataclass(frozen=True)
class ServerSpec:
    """Everything that decides how an extraction server is started (or which one may be attached)."""

    target_path: str  # the HF directory vLLM loads
    target_info: dict  # Target.describe()
    backend: str  # registered backend name the connector opens
    store: str  # the store's producer_location()
    slots: tuple[LayerSlot, ...]  # what the server captures
    dtype: str  # default storage dtype
    target_dtype: str
    max_model_len: int | None  # None: vLLM's default for the model
    max_num_seqs: int
    vllm_python: str | None = None
    vllm_args: str = ""

    def server(self) -> VllmServer:
        args = extraction_args(
            store=self.store, backend=self.backend, dtype=self.dtype, target_dtype=self.target_dtype, target_info=self.target_info,
            slots=list(self.slots), max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
        ) + shlex.split(self.vllm_args)  # fmt: skip
        return VllmServer(self.target_path, args, python=self.vllm_python)


def server_command(spec: ServerSpec) -> tuple[str, str]:
    """(shell command line that starts the server ``spec`` describes, its URL): for the user to run, then ``--vllm-url URL``."""
    server = spec.server()
    env = [f"{k}={v}" for k, v in CPU_ENV_DEFAULTS.items()]
    return shlex.join(["env", *env, *server.command()]), server.url


class ExtractionClient:
    """Sends samples to a running extraction server and checks what it stored in ``backend``.

    ``hint()`` ends every error: what to do (attached server) or where to look (its log).
    """

    def __init__(
        self, url: str, backend: Any, target_info: dict, *, model: str, max_model_len: int | None, hint: Callable[[], str] = how_to_start
    ):
        self.url = url
        self.backend = backend
        self.target_info = target_info
        self.model = model
        self.max_model_len = max_model_len
        self._hint = hint

    def store(self, key: str, token_ids: list[int], slots: list[LayerSlot], dtype: str) -> Any:
        """Have the server extract ``token_ids`` into ``key``; returns the verified ``HiddenStatePayload``."""
        import torch

        params = {SAMPLE_ID: key, SLOTS: [s.to_json() for s in slots], DTYPE: dtype}
        answer = complete(self.url, token_ids, max_tokens=1, model=self.model, kv_transfer_params=params)
        returned = answer.get("kv_transfer_params") or {}
        if ERROR in returned:
            raise SpecdraftError(f"the vLLM server at {self.url} refused to store {key!r}: {returned[ERROR]}; {self._hint()}")
        if returned.get(KEY) != key:
            raise SpecdraftError(
                f"the vLLM server at {self.url} did not store hidden states for {key!r} "
                f"(its answer's kv_transfer_params: {returned or None}); "
                f"it must run the extract_hidden_states speculative method with the specdraft connector ({CONNECTOR_CLASS}); "
                f"{self._hint()}"
            )
        try:
            payload = self.backend.get(key)
        except SpecdraftError as exc:
            if returned.get(STORE) == self.backend.producer_location():
                raise SpecdraftError(
                    f"{exc}; the vLLM server at {self.url} reported storing it, so its write failed; {self._hint()}"
                ) from None
            raise SpecdraftError(
                f"{exc}; the vLLM server at {self.url} reported storing it in {returned.get(STORE)}, but this process reads "
                f"{self.backend.location}: they must be the same store; {self._hint()}"
            ) from None
        stale = payload.mismatches(fingerprint=self.target_info["fingerprint"], slots=slots, dtype=dtype, token_ids=torch.tensor(token_ids))
        if stale:
            raise SpecdraftError(
                f"the vLLM server at {self.url} stored {key!r} in {self.backend.location} but not as requested: {'; '.join(stale)}; "
                f"it was started for another target or layers; {self._hint()}"
            )
        return payload


def attach(url: str, backend: Any, target_info: dict, slots: list[LayerSlot], dtype: str, *, longest: int) -> ExtractionClient:
    """A client of the server the user started at ``url``, after checking it can serve us.

    Checks: ``/v1/models`` answers; the served model fits ``longest`` tokens (+1 generated) and,
    when its directory is visible here, is our target; a ``CHECK`` request (stores nothing, so it
    works before the store has memory) finds our connector, configured for our target, capturing
    ``slots``. Where it writes is checked by the first sample itself (:meth:`ExtractionClient.store`
    reads every payload back): the same store may be spelled differently on the server's host.
    """
    from specdraft.targets.identity import fingerprint

    url = url.rstrip("/").removesuffix("/v1")
    try:
        model = served_model(url)
    except SpecdraftError as exc:
        raise SpecdraftError(f"{setting('vllm_url')} {url}: {exc}; {how_to_start()}, then pass its URL") from None
    name, limit = model["id"], model.get("max_model_len")
    if isinstance(limit, int) and longest + 1 > limit:
        raise SpecdraftError(
            f"{setting('vllm_url')} {url} serves at most {limit} tokens per sequence, the longest "
            f"request needs {longest + 1}; "
            f"restart it with --max-model-len {longest + 1}"
        )
    root = Path(str(model.get("root") or ""))
    if root.is_dir() and root.resolve() != Path(target_info["path"]).resolve():  # a directory visible here: same weights?
        served = fingerprint(root)
        if served != target_info["fingerprint"]:
            raise SpecdraftError(
                f"{setting('vllm_url')} {url} serves {root} (fingerprint {served}), not the target {target_info['path']} "
                f"(fingerprint {target_info['fingerprint']}); {how_to_start()}"
            )
    params = {CHECK: True, SLOTS: [s.to_json() for s in slots], DTYPE: dtype}
    try:
        answer = complete(url, list(range(1, min(9, int(target_info["vocab_size"])))), max_tokens=1, model=name, kv_transfer_params=params)
    except SpecdraftError as exc:
        raise SpecdraftError(f"{setting('vllm_url')} {url}: the check request failed ({exc}); {how_to_start()}") from None
    returned = answer.get("kv_transfer_params") or {}
    if ERROR in returned:
        raise SpecdraftError(f"the vLLM server at {url} cannot serve this run: {returned[ERROR]}; {how_to_start()}")
    server = returned.get(SERVER)
    if not isinstance(server, dict):
        raise SpecdraftError(
            f"the vLLM server at {url} did not answer specdraft's check (its kv_transfer_params: {returned or None}): it must run the "
            f"extract_hidden_states speculative method with the specdraft connector ({CONNECTOR_CLASS}); {how_to_start()}"
        )
    if server.get("target_fingerprint") != target_info["fingerprint"]:
        raise SpecdraftError(
            f"the vLLM server at {url} writes payloads of target fingerprint {server.get('target_fingerprint')!r}, "
            f"this run needs {target_info['fingerprint']!r} ({target_info['path']}); {how_to_start()}"
        )
    if server.get("store") != backend.producer_location():
        log.warning(
            "the vLLM server at %s writes to %s; this run reads %s (checked with the first sample)",
            url,
            server.get("store"),
            backend.producer_location(),
        )
    log.info("attached to the vLLM extraction server at %s (model %s, captured layer ids %s)", url, name, server.get("layer_ids"))
    return ExtractionClient(url, backend, target_info, model=name, max_model_len=limit if isinstance(limit, int) else None)


def served_model(url: str) -> dict:
    """The first entry of the server's ``GET /v1/models`` (``id``, ``root``, ``max_model_len``)."""
    text = get_text(f"{url}/v1/models", timeout=10.0)
    try:
        model = json.loads(text)["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        model = None
    if not isinstance(model, dict) or not isinstance(model.get("id"), str):
        raise SpecdraftError(f"GET {url}/v1/models did not answer a model list ({text[:200]!r}); is it a vLLM OpenAI server?")
    return model


@contextlib.contextmanager
def extraction_client(spec: ServerSpec, backend: Any, *, url: str | None, longest: int) -> Iterator[ExtractionClient]:
    """Attach to ``url`` when given, else start the server ``spec`` describes (stopped on exit)."""
    if url:
        yield attach(url, backend, spec.target_info, list(spec.slots), spec.dtype, longest=longest)
        return
    start = time.perf_counter()
    with spec.server() as server:
        log.info("vLLM server up in %.1f s (log: %s)", time.perf_counter() - start, server.log_path)
        model = served_model(server.url)
        yield ExtractionClient(
            server.url,
            backend,
            spec.target_info,
            model=model["id"],
            max_model_len=model.get("max_model_len"),
            hint=lambda: f"server log {server.log_path}:\n{server.log_tail()}",
        )


def extract_spec(
    config: Any, backend: Any, target_path: str | Path, target_info: dict, slots: list[LayerSlot], max_model_len: int
) -> ServerSpec:
    """The extraction server ``specdraft extract`` (an ``ExtractConfig``) starts or attaches to."""
    return ServerSpec(
        target_path=str(target_path), target_info=target_info, backend=config.backend, store=backend.producer_location(),
        slots=tuple(slots), dtype=config.dtype, target_dtype=config.target_dtype, max_model_len=max_model_len,
        max_num_seqs=config.batch_size, vllm_python=config.vllm_python, vllm_args=config.vllm_args,
    )  # fmt: skip


def describe_target(name: str) -> dict:
    """``Target.describe()`` of ``name`` from its config and files alone: the weights stay in vLLM."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from specdraft.targets import fingerprint, resolve_target_dir, tokenizer_hash
    from specdraft.targets.base import Target

    path = resolve_target_dir(name)
    config = AutoConfig.from_pretrained(path)
    return Target(
        name=name,
        path=path,
        model=SimpleNamespace(config=config),
        tokenizer=None,
        fingerprint=fingerprint(path),
        tokenizer_hash=tokenizer_hash(path),
    ).describe()


def extract_server_command(config: Any) -> tuple[str, str]:
    """``specdraft extract --print-server-command``: the server a later ``--vllm-url`` run of ``config`` can attach to."""
    from specdraft.data.dataset import PreparedDataset
    from specdraft.hidden_states.backends import open_backend

    dataset = PreparedDataset(config.dataset)
    name = config.target or dataset.target_info.get("name")
    if not name:
        raise SpecdraftError(f"{dataset.directory}/manifest.json records no target name; pass {setting('target')}")
    target_info = describe_target(name)
    selected = min(len(dataset), config.max_samples or len(dataset))
    longest = int(max(int(n) for n in dataset.lengths()[:selected]))
    with open_backend(config.backend, config.out) as backend:
        spec = extract_spec(config, backend, target_info["path"], target_info, config.resolve_slots(target_info["num_layers"]), longest + 1)
    return server_command(spec)


@EXTRACT_ENGINES.register("vllm")
def extract_with_vllm(job: ExtractJob) -> tuple[int, int]:
    """Steps 1-3 for the ``pending`` rows; returns (tokens, bytes stored) like the HF engine."""
    backend, config, dataset, target, slots = job.backend, job.config, job.dataset, job.target, job.slots
    if config.device != "cpu":
        log.info("--device %s is ignored with --engine vllm: the vLLM build decides where the target runs", config.device)
    target.family.require_vllm_aux("extract hidden states")
    lengths = dataset.lengths()
    order = sorted(job.pending, key=lambda i: -int(lengths[i]))
    if not order:
        return 0, 0
    longest = int(max(int(lengths[i]) for i in order))
    spec = extract_spec(config, backend, target.path, job.target_info, slots, longest + 1)  # + the one generated token
    with extraction_client(spec, backend, url=config.vllm_url, longest=longest) as client:
        return send_samples(client, dataset, order, slots=slots, dtype=config.dtype, concurrency=config.batch_size, progress=job.progress)


def send_samples(
    client: ExtractionClient,
    dataset: PreparedDataset,
    rows: list[int],
    *,
    slots: list[LayerSlot],
    dtype: str,
    concurrency: int,
    progress: bool = False,
) -> tuple[int, int]:
    """Steps 2-3 against a running extraction server; returns (tokens, bytes stored)."""
    from tqdm import tqdm

    def one(i: int) -> tuple[int, int]:
        row = dataset[i]
        payload = client.store(row["sample_id"], [int(t) for t in row["input_ids"]], slots, dtype)
        return payload.num_tokens, client.backend.stored_size(payload)

    tokens = written = 0
    with ThreadPoolExecutor(concurrency) as pool, tqdm(total=len(rows), unit="sample", desc="extract (vllm)", disable=not progress) as bar:
        for n_tokens, n_bytes in pool.map(one, rows):
            tokens += n_tokens
            written += n_bytes
            bar.update(1)
    return tokens, written
