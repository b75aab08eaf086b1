"""Hidden-state stores behind one interface (``base.HiddenStateBackend``), dispatched by name via ``BACKENDS``.

``file`` is built in; ``mooncake`` is registered by ``integrations/mooncake/backend.py`` when the integrations load.
"""

from specdraft.hidden_states.backends import file as _file  # noqa: F401  (registers "file")
from specdraft.hidden_states.backends.base import BACKENDS, HiddenStateBackend, open_backend

__all__ = ["BACKENDS", "HiddenStateBackend", "open_backend"]
