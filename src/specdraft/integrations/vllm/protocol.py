"""What the connector (inside vLLM) and its clients (vLLM-free) agree on: ``kv_transfer_params`` keys
and how requested layer slots map onto the layers the server captures."""

from __future__ import annotations

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot

#: Sent by the client: the store key (sample id) the request's hidden states are written under.
SAMPLE_ID = "specdraft_sample_id"
#: Sent by the client (optional; default: the connector's configured ones): the slots and storage
#: dtype of this request's payload. The slots may be any that the server's captured layers cover.
SLOTS = "specdraft_slots"
DTYPE = "specdraft_dtype"
#: Answered by the server once the payload is stored: the key, and the store it went to.
KEY = "specdraft_key"
STORE = "specdraft_store"
#: Answered instead of ``KEY`` when the connector refused the request (e.g. a slot it does not capture).
ERROR = "specdraft_error"
#: Sent by a client attaching to a server (with ``SLOTS``/``DTYPE``): check that the connector could
#: serve them and describe the server, but store nothing (the store may have no memory yet, e.g. a
#: Mooncake store whose holders are the trainers that start later). Answered as ``SERVER``:
#: ``{"store", "backend", "target_fingerprint", "layer_ids"}``, or ``ERROR``.
CHECK = "specdraft_check"
SERVER = "specdraft_server"


def slot_rows(slots: list[LayerSlot], layer_ids: list[int], num_layers: int) -> tuple[list[int], int]:
    """(row of each slot, row of ``last_hidden``) among the captured aux-layer ids ``layer_ids``.

    Id ``num_layers`` is the last layer's output before the final norm (``last_hidden``), so it
    must always be captured. Example, 6 layers, ids [2, 3, 6]: output:1 -> 0, input:3 -> 1, last 2.
    """
    from specdraft.models.common.checkpoint import slot_to_aux_id

    for s in slots:
        s.check(num_layers)
    missing = sorted({slot_to_aux_id(s) for s in slots} - set(layer_ids)) + ([] if num_layers in layer_ids else [num_layers])
    if missing:
        raise SpecdraftError(
            f"slots {', '.join(map(str, slots))} need vLLM aux-layer ids {missing}, which the server does not capture "
            f"(its eagle_aux_hidden_state_layer_ids are {list(layer_ids)}; id {num_layers} is the last layer's output)"
        )
    return [layer_ids.index(slot_to_aux_id(s)) for s in slots], layer_ids.index(num_layers)
