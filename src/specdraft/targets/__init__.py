"""Target models: resolve a name or path, convert embedded GGUF targets once, load with identity."""

from specdraft.targets.base import Target
from specdraft.targets.embedded import DEFAULT_TARGET, EMBEDDED_TARGETS, EmbeddedTarget
from specdraft.targets.identity import cache_root, fingerprint, tokenizer_hash
from specdraft.targets.loading import load_target, resolve_target_dir

__all__ = [
    "DEFAULT_TARGET",
    "EMBEDDED_TARGETS",
    "EmbeddedTarget",
    "Target",
    "cache_root",
    "fingerprint",
    "load_target",
    "resolve_target_dir",
    "tokenizer_hash",
]
