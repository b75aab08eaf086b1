"""Hidden-state stores behind one interface (``base.HiddenStateBackend``), dispatched by name via ``BACKENDS``."""

from specdraft.hidden_states.backends import file as _file  # noqa: F401  (registers "file")
from specdraft.hidden_states.backends import mooncake as _mooncake  # noqa: F401  (registers "mooncake"; imports Mooncake lazily)
from specdraft.hidden_states.backends.base import BACKENDS, HiddenStateBackend, open_backend

__all__ = ["BACKENDS", "HiddenStateBackend", "open_backend"]
