"""``specdraft extract --engine vllm``: the target runs in a vLLM server, our connector writes the store.

Same store format as the HF path (``hidden_states/extract.py`` owns the manifest, resume and
summary); only the capture differs:

  1. Map the requested slots to vLLM aux-layer ids (:func:`capture_plan`) and start a private
     server whose ``extract_hidden_states`` drafter captures them and whose
     :class:`~specdraft.integrations.vllm.connector.SpecdraftHiddenStatesConnector` writes payloads
     straight into the store.
  2. Send each pending sample as a ``max_tokens=1`` completion with its token ids as the prompt
     and its sample id in ``kv_transfer_params``; ``batch_size`` requests are in flight at once so
     vLLM batches them.
  3. The server answers with the stored key only after the write; read the payload back and check
     it (checksums, token ids, slots) so a silent server-side failure cannot pass.
"""

from __future__ import annotations

import logging
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.integrations.vllm.protocol import KEY, SAMPLE_ID
from specdraft.integrations.vllm.engine import CONNECTOR_CLASS, CONNECTOR_MODULE, VllmServer, complete

log = logging.getLogger(__name__)


def capture_plan(slots: list[LayerSlot], num_layers: int) -> tuple[list[int], list[int], int]:
    """(vLLM aux-layer ids to capture, row of each slot among them, row of ``last_hidden``).

    vLLM id ``i`` is the input of layer ``i``; id ``num_layers`` is the last layer's output before
    the final norm (= ``last_hidden``). Example, 6 layers, slots output:1, input:3:
    ids [2, 3, 6], slot rows [0, 1], last row 2.
    """
    from specdraft.models.common.checkpoint import slot_to_aux_id

    for s in slots:
        s.check(num_layers)
    wanted = [slot_to_aux_id(s) for s in slots]
    ids = sorted(set(wanted) | {num_layers})
    return ids, [ids.index(i) for i in wanted], ids.index(num_layers)


def extraction_args(*, store: str, backend: str, dtype: str, target_dtype: str, target_info: dict, slots: list[LayerSlot],
                    max_model_len: int, max_num_seqs: int) -> list[str]:
    """``api_server`` flags for a hidden-state extraction server writing into ``store``."""
    import json

    layer_ids, slot_rows, last_row = capture_plan(slots, int(target_info["num_layers"]))
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
            "store": store, "backend": backend, "dtype": dtype, "target": target_info,
            "slots": [s.to_json() for s in slots], "slot_rows": slot_rows, "last_row": last_row,
        },
    }  # fmt: skip
    return [
        "--dtype", target_dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max(max_model_len, 2048)), "--no-enable-prefix-caching",
        "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip


def extract_with_vllm(backend, config, dataset, pending, target, target_info, slots, progress) -> tuple[int, int]:
    """Steps 1-3 for the ``pending`` rows; returns (tokens, bytes stored) like the HF engine."""
    start = time.perf_counter()
    if config.device != "cpu":
        log.info("--device %s is ignored with --engine vllm: the vLLM build decides where the target runs", config.device)
    lengths = dataset.lengths()
    order = sorted(pending, key=lambda i: -int(lengths[i]))
    if not order:
        return 0, 0
    max_len = int(max(int(lengths[i]) for i in order)) + 1  # + the one generated token
    args = extraction_args(
        store=backend.producer_location(),
        backend=config.backend, dtype=config.dtype, target_dtype=config.target_dtype, target_info=target_info,
        slots=slots, max_model_len=max_len, max_num_seqs=config.batch_size,
    ) + shlex.split(config.vllm_args)  # fmt: skip
    with VllmServer(target.path, args, python=config.vllm_python) as server:
        log.info("vLLM server up in %.1f s (log: %s)", time.perf_counter() - start, server.log_path)
        return send_samples(server, backend, dataset, order, target_info=target_info, slots=slots, dtype=config.dtype,
                            concurrency=config.batch_size, progress=progress)


def send_samples(server: VllmServer, backend, dataset, rows: list[int], *, target_info: dict, slots: list[LayerSlot], dtype: str,
                 concurrency: int, progress: bool = False) -> tuple[int, int]:
    """Steps 2-3 against a running extraction server; returns (tokens, bytes stored)."""
    from tqdm import tqdm

    def one(i: int) -> tuple[int, int]:
        row = dataset[i]
        ids = [int(t) for t in row["input_ids"]]
        answer = complete(server.url, ids, max_tokens=1, kv_transfer_params={SAMPLE_ID: row["sample_id"]})
        key = (answer.get("kv_transfer_params") or {}).get(KEY)
        if key != row["sample_id"]:
            raise SpecdraftError(
                f"vLLM server did not store sample {row['sample_id']!r} (answer kv_transfer_params: "
                f"{answer.get('kv_transfer_params')}); server log {server.log_path}:\n{server.log_tail()}"
            )
        return _check_stored(backend, row, target_info, slots, dtype, server)

    tokens = written = 0
    with ThreadPoolExecutor(concurrency) as pool, tqdm(total=len(rows), unit="sample", desc="extract (vllm)", disable=not progress) as bar:
        for n_tokens, n_bytes in pool.map(one, rows):
            tokens += n_tokens
            written += n_bytes
            bar.update(1)
    return tokens, written


def _check_stored(backend, row: dict, target_info: dict, slots: list[LayerSlot], dtype: str, server: Any) -> tuple[int, int]:
    """Read the payload the server wrote, verify it, return (tokens, bytes stored)."""
    sid = row["sample_id"]
    try:
        payload = backend.get(sid)
    except SpecdraftError as exc:
        raise SpecdraftError(f"{exc}; the vLLM server reported it stored (server log {server.log_path})") from None
    stale = payload.mismatches(fingerprint=target_info["fingerprint"], slots=slots, dtype=dtype, token_ids=row["input_ids"])
    if stale:
        raise SpecdraftError(f"{backend.location}: sample {sid!r} written by the vLLM server does not match the request: {'; '.join(stale)}")
    return payload.num_tokens, backend.stored_size(payload)
