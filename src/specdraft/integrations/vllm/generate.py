"""``specdraft prepare --regenerate --engine vllm``: the target's replies from a private vLLM server.

Why: vLLM batches continuously -- a finished request frees its slot for the next prompt at once --
while a padded HF ``generate`` batch runs until its longest reply ends, so vLLM keeps the CPU busy
with useful tokens.

Each prompt is one ``/v1/completions`` request with its token ids as the prompt and the HF
settings: ``max_tokens`` = ``max_new_tokens``, the same temperature (0 = greedy), request seed
``seed + batch index`` (the seed HF uses for that batch), the target's end-of-turn ids as
``stop_token_ids``. The server runs with ``--generation-config vllm``, so no sampling default
from the model's ``generation_config.json`` applies that HF would not apply either, and in the
target's dtype (``--vllm-args='--dtype bfloat16'`` overrides it). ``batch_size`` requests are in
flight at once; a batch is handed back (and written by the caller) as soon as its last request
is answered. Loading this module registers the engine in ``data/regenerate.py``.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
from collections.abc import Generator, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from specdraft.data.regenerate import (
    REGENERATION_ENGINES,
    SERVER_ENGINES,
    Batch,
    EngineRequest,
    GenerationSettings,
    ServerEngine,
    cut_at_eos,
)
from specdraft.errors import SpecdraftError
from specdraft.integrations.vllm.engine import VllmServer, complete, find_vllm_python, vllm_version

log = logging.getLogger(__name__)


def server_args(*, dtype: str, max_model_len: int, max_num_seqs: int, extra: str = "") -> list[str]:
    """``api_server`` flags of a regeneration server (``extra`` last, so the user's flags win)."""
    return [
        "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--generation-config", "vllm", *shlex.split(extra),
    ]  # fmt: skip


def request_body(settings: GenerationSettings, eos_ids: frozenset[int] | set[int], *, seed: int) -> dict:
    """The ``/v1/completions`` fields (besides model and prompt) that reproduce HF's decoding settings."""
    return {
        "temperature": float(settings.temperature),
        "seed": seed,
        "stop_token_ids": sorted(eos_ids),
        "return_token_ids": True,
        "skip_special_tokens": False,
    }


def completion_ids(answer: dict, eos_ids: frozenset[int] | set[int], *, url: str) -> list[int]:
    """The generated ids of one answer, cut after the first end-of-turn id like HF's."""
    choice = (answer.get("choices") or [{}])[0]
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list):
        raise SpecdraftError(f"the vLLM server at {url} returned no token_ids (answer: {str(answer)[:300]}); it must be vLLM >= 0.10")
    return cut_at_eos([int(t) for t in tokens], eos_ids)


def start_server(request: EngineRequest, batches: list[Batch], *, startup_timeout: float = 600.0) -> VllmServer:
    """A started regeneration server for ``request.target``, sized for ``batches`` (the caller stops it)."""
    settings = request.settings
    longest = max(len(p) for _, prompts in batches for p in prompts)
    dtype = str(request.target.model.dtype).removeprefix("torch.")
    args = server_args(
        dtype=dtype, max_model_len=longest + settings.max_new_tokens, max_num_seqs=settings.batch_size, extra=request.vllm_args
    )
    server = VllmServer(request.target.path, args, python=request.vllm_python, startup_timeout=startup_timeout).start()
    log.info("vLLM server up (log: %s)", server.log_path)
    return server


@REGENERATION_ENGINES.register("vllm")
@contextlib.contextmanager
def vllm_batches(request: EngineRequest, batches: list[Batch]) -> Iterator[Iterator[Batch]]:
    """Yield the completions of ``batches`` as they finish, from ``request.server`` (one the engine probe
    started, sized for every prompt; the caller stops it) or else a server started for them here."""
    own = request.server is None
    server = start_server(request, batches) if own else request.server
    try:
        finished = _run(server, request, batches)
        try:
            yield finished
        finally:
            finished.close()  # cancels the queued requests before the server stops
    finally:
        if own:
            server.stop()


def probe_batch(server: VllmServer, request: EngineRequest, prompts: list[list[int]]) -> list[list[int]]:
    """The completions of one batch (``request.settings``), all requests in flight together: what the engine probe times."""
    finished = _run(server, request, [(0, prompts)])
    try:
        return next(finished)[1]
    finally:
        finished.close()


def _run(server: VllmServer, request: EngineRequest, batches: list[Batch]) -> Generator[Batch, None, None]:
    settings = request.settings
    eos = request.eos_ids

    def one(prompt: list[int], seed: int) -> list[int]:
        answer = complete(server.url, prompt, max_tokens=settings.max_new_tokens, **request_body(settings, eos, seed=seed))
        return completion_ids(answer, eos, url=server.url)

    pool = ThreadPoolExecutor(settings.batch_size)
    try:
        futures: dict[int, list[Future]] = {
            index: [pool.submit(one, p, settings.seed + index) for p in prompts] for index, prompts in batches
        }
        waiting = {f: index for index, fs in futures.items() for f in fs}
        while waiting:
            done, _ = wait(waiting, return_when=FIRST_COMPLETED)
            for f in done:
                index = waiting.pop(f)
                if index in futures and all(g.done() for g in futures[index]):
                    yield index, [g.result() for g in futures.pop(index)]
    except SpecdraftError as exc:
        raise SpecdraftError(f"{exc}; server log {server.log_path}:\n{server.log_tail()}") from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


SERVER_ENGINES.register("vllm")(ServerEngine(locate=find_vllm_python, version=vllm_version, start=start_server, probe=probe_batch))
