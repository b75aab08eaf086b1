"""``kv_transfer_params`` keys shared by the connector (inside vLLM) and its clients (vLLM-free)."""

#: Sent by the client: the store key (sample id) the request's hidden states are written under.
SAMPLE_ID = "specdraft_sample_id"
#: Answered by the server once the payload is stored: the key, and the store it went to.
KEY = "specdraft_key"
STORE = "specdraft_store"
