"""Target identity: a short fingerprint of weights + tokenizer and a hash of the tokenizer alone.

Stored datasets, hidden states and drafters record both so later stages can refuse data made for
another target. The weight part hashes the full safetensors contents (a header-only hash would not
tell two same-shaped random inits apart). Hashing half a gigabyte of weights on every load would add
a pass over the whole file to each command, so the digest of a large file is cached under
``<cache>/fingerprints/`` (``utils/cache.py``) keyed by its absolute path, size, inode, mtime and
ctime: a write into the file, or a file put in its place, changes the key and the file is hashed
again (a user can set an mtime back, not a ctime).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specdraft.utils.cache import cached
from specdraft.utils.io import cache_root, sha256_file

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
DIGEST_FORMAT = "specdraft-file-digest-v2"  # v1 was keyed by path, size and mtime only, with no checksum


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
        h.update(path.name.encode() + b"\0" + file_digest(path).encode())
    return h.hexdigest()[:16]


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's content, cached for large files (see the module docstring)."""
    path = Path(path)
    stat = path.stat()
    if stat.st_size < _CACHE_MIN_BYTES:
        return sha256_file(path)
    key = {
        "path": str(path.resolve()),
        "size": stat.st_size,
        "inode": stat.st_ino,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
    }
    sidecar = cache_root() / "fingerprints" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".json")
    digest, _ = cached(
        sidecar, lambda: {"sha256": sha256_file(path)}, format=DIGEST_FORMAT, key=key, what=f"digest of {path}", parse=_sha256_hex
    )
    return digest


def _sha256_hex(value: dict) -> str:
    digest = value["sha256"]
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise ValueError(f"{digest!r} is not a sha256")
    return digest
