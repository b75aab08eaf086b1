"""The machine choices one stage runs with, resolved once at its start, logged in one block and passed down.

Each choice says where it came from, so a log (and a report) tells a figure measured now from one read back from the
cache (``tuning/measured.py``: delete the file to measure again) or one a flag or config gave. A stage fills only
the fields it uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

log = logging.getLogger(__name__)

#: How a choice was made, as the log words it (``flag``: the user's setting, never measured).
SOURCES = {"flag": "given", "measured": "measured now", "cached": "from cache", "only": "the only one that applies",
           "default": "default", "dry run": "dry run", "as given": "as given"}


@dataclass(frozen=True)
class Choice:
    """One machine choice: its value, how it was made (a key of :data:`SOURCES`) and the seconds each candidate took."""

    value: Any
    source: str
    seconds: dict[str, float] = field(default_factory=dict)

    def describe(self, unit: float = 1e3, suffix: str = "ms") -> str:
        figures = ", ".join(f"{k} {v * unit:.1f} {suffix}" for k, v in self.seconds.items())
        return f"{self.value} ({SOURCES.get(self.source, self.source)}{f': {figures}' if figures else ''})"

    @classmethod
    def from_facts(cls, facts: dict[str, Any] | None, name: str) -> Choice | None:
        """A choice from the ``{name, name_source, name_seconds}`` facts reports record (None where ``name`` is absent)."""
        if not facts or facts.get(name) is None:
            return None
        return cls(facts[name], str(facts.get(f"{name}_source", "default")), dict(facts.get(f"{name}_seconds") or {}))


@dataclass(frozen=True)
class MachineSettings:
    """What a stage resolved: the target's (or the trained module's) forward path, the CPU thread count, the compute
    dtype, and a drafter's own path and dtype. None: the stage does not use that choice."""

    stage: str
    forward_path: Choice | None = None
    threads: Choice | None = None
    compute_dtype: Choice | None = None
    draft_forward_path: Choice | None = None
    draft_dtype: Choice | None = None

    def describe(self) -> str:
        lines = [f"{self.stage} machine settings:"]
        for f in fields(self):
            choice = getattr(self, f.name)
            if isinstance(choice, Choice):
                lines.append(f"  {f.name.replace('_', ' ')}: {choice.describe()}")
        return "\n".join(lines)

    def log(self) -> None:
        """The stage's one log block."""
        log.info("%s", self.describe())
