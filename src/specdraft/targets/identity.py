"""Target identity: a short fingerprint of weights + tokenizer and a hash of the tokenizer alone.

Stored datasets, hidden states and drafters record both so later stages can refuse data made for
another target. The weight part hashes the full safetensors contents (a header-only hash would not
tell two same-shaped random inits apart); to keep loads cheap the per-file digest is cached under
``<cache>/fingerprints/`` keyed by absolute path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specdraft.utils.io import atomic_write_json, cache_root, sha256_file

# Files that define how text becomes token ids (and how chats are rendered), when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# config.json keys that change with the saving library, not with the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype")
# Smaller weight files are hashed on every load (cheaper than a sidecar per temporary test model).
_CACHE_MIN_BYTES = 64 << 20


def tokenizer_hash(directory: str | os.PathLike) -> str:
    """16-hex hash of the tokenizer files present in ``directory``."""
    directory = Path(directory)
    h = hashlib.sha256(b"specdraft-tokenizer-v1")
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def fingerprint(directory: str | os.PathLike) -> str:
    """16-hex hash of config (minus volatile keys), tokenizer files and weight contents."""
    directory = Path(directory)
    h = hashlib.sha256(b"specdraft-target-v1")
    config = json.loads((directory / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h.update(json.dumps(config, sort_keys=True).encode())
    h.update(tokenizer_hash(directory).encode())
    for path in sorted(directory.glob("*.safetensors")):
        h.update(path.name.encode() + b"\0" + _cached_file_digest(path).encode())
    return h.hexdigest()[:16]


def _cached_file_digest(path: Path) -> str:
    stat = path.stat()
    if stat.st_size < _CACHE_MIN_BYTES:
        return sha256_file(path)
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    sidecar = cache_root() / "fingerprints" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    try:
        cached = json.loads(sidecar.read_text())
        if cached.get("key") == key:
            return cached["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    try:
        atomic_write_json(sidecar, {"key": key, "sha256": digest})
    except OSError:  # a read-only cache only costs speed
        pass
    return digest
