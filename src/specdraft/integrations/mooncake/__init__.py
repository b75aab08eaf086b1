"""Mooncake distributed store integration: a byte-blob transport and the master's lifecycle.

``client`` and ``master`` know nothing about models or payloads; ``backend`` maps hidden-state payloads onto
blobs and registers the ``mooncake`` hidden-state backend. Importing this package does not import ``mooncake`` itself.
"""

from specdraft.integrations.mooncake.client import MooncakeClient, MooncakeClientConfig, close_shared_clients, shared_client
from specdraft.integrations.mooncake.master import MasterConfig, MooncakeMaster, master_status, start_master, stop_master

__all__ = [
    "MasterConfig",
    "MooncakeClient",
    "MooncakeClientConfig",
    "MooncakeMaster",
    "close_shared_clients",
    "master_status",
    "shared_client",
    "start_master",
    "stop_master",
]
