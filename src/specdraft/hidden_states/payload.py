"""The self-describing per-sample hidden-state payload, shared by every transport.

One payload = one sample: three tensors plus a manifest saying exactly what they are, so a file
(or a Mooncake object, or a vLLM connector's output) can be checked on its own, long after it was
written, without trusting file names or side tables.

Shape symbols: T = tokens in the sample, S = number of layer slots, D = target hidden size.

  hidden_states  [T, S, D]  storage dtype; slot s holds ``manifest["slots"][s]``
  token_ids      [T]        int64; the tokens the target was run on
  last_hidden    [T, D]     storage dtype; the input of the target's final norm, so that
                            ``lm_head(norm(last_hidden))`` rebuilds the target logits

Serialised form: safetensors bytes whose metadata key ``"specdraft"`` holds the manifest JSON::

  {"format": "specdraft.hidden_states", "format_version": 1, "sample_id": "...",
   "target": {name, fingerprint, tokenizer_hash, num_layers, hidden_size, ...},
   "slots": [{"layer": 2, "side": "input"}, ...],
   "tensors": {"hidden_states": {"dtype": "bfloat16", "shape": [T, S, D], "sha256": "..."}, ...}}

The checksum covers each tensor's raw little-endian bytes (as stored), so it can be recomputed by
any reader that can see the tensor data: :meth:`PayloadRows.open` hashes them straight from a stored file and
then reads only the rows a sequence-parallel rank collates.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.config import STORAGE_DTYPE_NAMES
from specdraft.hidden_states.layers import LayerSlot

FORMAT_NAME = "specdraft.hidden_states"
FORMAT_VERSION = 1
METADATA_KEY = "specdraft"
TENSOR_KEYS = ("hidden_states", "token_ids", "last_hidden")
TARGET_KEYS = ("name", "fingerprint", "tokenizer_hash", "num_layers", "hidden_size")

#: Storage dtypes by name: bfloat16 halves the bytes, float32 keeps captures bit-exact.
STORAGE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in STORAGE_DTYPE_NAMES}
_DTYPE_NAMES = {v: k for k, v in STORAGE_DTYPES.items()} | {torch.int64: "int64"}


def storage_dtype(name: str) -> torch.dtype:
    try:
        return STORAGE_DTYPES[name]
    except KeyError:
        raise SpecdraftError(f"unknown hidden-state dtype {name!r}; choose one of: {', '.join(STORAGE_DTYPES)}") from None


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (row-major), independent of how it was serialised."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()


def _tensor_record(t: torch.Tensor) -> dict:
    return {"dtype": _DTYPE_NAMES.get(t.dtype, str(t.dtype)), "shape": list(t.shape), "sha256": tensor_sha256(t)}


@dataclass(frozen=True)
class _Found:
    """What a reader sees of one stored tensor, to check against the manifest's record; ``sha256`` runs only once the
    dtype and shape agree (hashing is the costly part)."""

    dtype: str
    shape: list[int]
    sha256: Callable[[], str]


def _check_records(where: str, manifest: dict, found: dict[str, _Found]) -> None:
    """Every tensor's dtype, shape and checksum against the manifest; ``SpecdraftError`` naming ``where``, the tensor and
    what differs."""
    records = manifest.get("tensors") or {}
    for key in TENSOR_KEYS:
        expected = records.get(key)
        if expected is None:
            raise SpecdraftError(f"{where}: manifest has no record for tensor {key!r}")
        actual = {"dtype": found[key].dtype, "shape": found[key].shape}
        for prop in ("dtype", "shape"):
            if actual[prop] != expected.get(prop):
                raise SpecdraftError(f"{where}: tensor {key!r} has {prop} {actual[prop]} but the manifest says {expected.get(prop)}")
        digest = found[key].sha256()
        if digest != expected.get("sha256"):
            raise SpecdraftError(
                f"{where}: tensor {key!r} checksum {digest[:12]}... does not match the manifest's "
                f"{str(expected.get('sha256'))[:12]}...; the data is corrupt, re-extract it"
            )


def _manifest_of(header: Any, *, source: str) -> dict:
    """The payload manifest in a parsed safetensors header (its ``__metadata__``), checked to be this format."""
    try:
        manifest = json.loads(header["__metadata__"][METADATA_KEY])
        if not isinstance(manifest, dict):
            raise TypeError(f"manifest is a {type(manifest).__name__}, not an object")
    except (KeyError, ValueError, TypeError) as exc:
        raise SpecdraftError(f"{source}: safetensors metadata lacks a valid {METADATA_KEY!r} manifest ({exc}); re-extract it") from None
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise SpecdraftError(
            f"{source}: format {manifest.get('format')!r} version {manifest.get('format_version')!r} "
            f"is not {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    return manifest


def _missing_parts(manifest: dict, tensors: Any) -> list[str]:
    missing = [k for k in ("sample_id", "target", "slots", "tensors") if k not in manifest]
    return missing + [f"tensor {k!r}" for k in TENSOR_KEYS if k not in tensors]


class _Described:
    """What the manifest says of a payload, shared by a whole one (``HiddenStatePayload``) and one read by rows
    (``PayloadRows``): the tensors need only a ``shape`` and a ``dtype`` here."""

    manifest: dict
    token_ids: torch.Tensor
    hidden_states: Any
    last_hidden: Any

    @property
    def sample_id(self) -> str:
        return self.manifest["sample_id"]

    @property
    def slots(self) -> list[LayerSlot]:
        return [LayerSlot.from_json(s) for s in self.manifest["slots"]]

    @property
    def target_info(self) -> dict:
        return dict(self.manifest["target"])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def dtype(self) -> str:
        """Storage dtype name of ``hidden_states``/``last_hidden``."""
        return self.manifest["tensors"]["hidden_states"]["dtype"]

    def mismatches(self, *, fingerprint: str | None, slots: list[LayerSlot], dtype: str, token_ids: torch.Tensor) -> list[str]:
        """What differs from the expected capture (empty when the payload is the one wanted)."""
        problems = []
        if self.target_info.get("fingerprint") != fingerprint:
            problems.append(f"target fingerprint {self.target_info.get('fingerprint')!r} != {fingerprint!r}")
        if self.slots != list(slots):
            problems.append(f"slots {','.join(map(str, self.slots))} != {','.join(map(str, slots))}")
        if self.dtype != dtype:
            problems.append(f"dtype {self.dtype} != {dtype}")
        if not torch.equal(self.token_ids, token_ids.to(torch.int64)):
            problems.append("token ids differ from the dataset row")
        return problems

    def _check_layout(self, *, source: str) -> None:
        """Shapes must agree with each other, with the slots and with the target's hidden size."""
        s = len(self.manifest["slots"])
        d = int(self.manifest["target"]["hidden_size"])
        if self.token_ids.dim() != 1:
            raise SpecdraftError(f"{source}: tensor 'token_ids' has shape {list(self.token_ids.shape)}, expected [T]")
        t = int(self.token_ids.shape[0])
        for key, shape in (("hidden_states", (t, s, d)), ("last_hidden", (t, d))):
            got = tuple(getattr(self, key).shape)
            if got != shape:
                raise SpecdraftError(
                    f"{source}: tensor {key!r} has shape {list(got)}, expected {list(shape)} for T={t} tokens, S={s} slots, D={d}"
                )
        if self.hidden_states.dtype != self.last_hidden.dtype or self.hidden_states.dtype not in _DTYPE_NAMES:
            raise SpecdraftError(
                f"{source}: hidden_states/last_hidden dtypes {self.hidden_states.dtype}/{self.last_hidden.dtype} differ or are unsupported"
            )


@dataclass
class HiddenStatePayload(_Described):
    """One sample's captured hidden states plus the manifest that describes (and checksums) them.

    Build new payloads with :meth:`create`; :meth:`from_bytes` restores and verifies stored ones.
    ``manifest`` is what the writer recorded; :meth:`verify` compares it against the tensors.
    """

    hidden_states: torch.Tensor
    token_ids: torch.Tensor
    last_hidden: torch.Tensor
    manifest: dict = field(repr=False)

    @classmethod
    def create(
        cls,
        *,
        sample_id: str,
        target_info: dict,
        slots: list[LayerSlot],
        token_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        last_hidden: torch.Tensor,
        dtype: str = "bfloat16",
    ) -> HiddenStatePayload:
        """Cast to the storage dtype, move to CPU and record shapes, dtypes and checksums."""
        store = storage_dtype(dtype)
        tensors = {
            "hidden_states": hidden_states.detach().to("cpu", store).contiguous(),
            "token_ids": token_ids.detach().to("cpu", torch.int64).contiguous(),
            "last_hidden": last_hidden.detach().to("cpu", store).contiguous(),
        }
        missing = [k for k in TARGET_KEYS if k not in target_info]
        if missing:
            raise SpecdraftError(f"target description for sample {sample_id!r} lacks {', '.join(missing)}")
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "sample_id": str(sample_id),
            "target": {k: target_info[k] for k in TARGET_KEYS},
            "slots": [s.to_json() for s in slots],
            "tensors": {k: _tensor_record(v) for k, v in tensors.items()},
        }
        payload = cls(manifest=manifest, **tensors)
        payload._check_layout(source=f"sample {sample_id!r}")
        payload._check_rows()
        return payload

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {k: getattr(self, k) for k in TENSOR_KEYS}
        return save(tensors, metadata={METADATA_KEY: json.dumps(self.manifest, sort_keys=True)})

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str) -> HiddenStatePayload:
        """Parse and verify; ``source`` (a path or key) names the object in every error."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(data)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise SpecdraftError(
                f"{source}: not a readable safetensors payload ({exc}); it is truncated or corrupt, re-extract it"
            ) from None
        # safetensors.torch.load drops metadata; read the header directly (8-byte length + JSON).
        try:
            header_len = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + header_len])
        except ValueError as exc:
            raise SpecdraftError(f"{source}: safetensors metadata lacks a valid {METADATA_KEY!r} manifest ({exc}); re-extract it") from None
        manifest = _manifest_of(header, source=source)
        missing = _missing_parts(manifest, tensors)
        if missing:
            raise SpecdraftError(f"{source}: payload lacks {', '.join(missing)}; re-extract it")
        payload = cls(manifest=manifest, **{k: tensors[k] for k in TENSOR_KEYS})
        payload.verify(source=source)
        return payload

    def verify(self, *, source: str | None = None) -> None:
        """Check every tensor's dtype, shape and checksum against the manifest, and the layout.

        Raises ``SpecdraftError`` naming the sample, the tensor and what differs.
        """
        where = f"{source} (sample {self.sample_id!r})" if source else f"sample {self.sample_id!r}"
        found = {}
        for key in TENSOR_KEYS:
            t = getattr(self, key)
            found[key] = _Found(_DTYPE_NAMES.get(t.dtype, str(t.dtype)), list(t.shape), functools.partial(tensor_sha256, t))
        _check_records(where, self.manifest, found)
        self._check_layout(source=where)

    def _check_rows(self) -> None:
        """Refuse a capture with a degenerate token row (all zero, constant across D, or non-finite), as stored.

        Why: a real token's activation at a real layer is never constant across the hidden dimension, but a
        capture that missed its layer (a hook on the wrong module, a hybrid target whose layer returns nothing,
        an engine that never wrote the rows) yields zeros, and a drafter trained on them validates on the same
        garbage and then serves at tau ~1 (speculators #613). Checked as stored, so a bf16/fp16 overflow counts.
        """
        named = [(f"layer {slot.layer} {slot.side}", self.hidden_states[:, s]) for s, slot in enumerate(self.slots)]
        named.append(("last_hidden (the final norm's input)", self.last_hidden))
        for name, rows in named:
            rows = rows.float()
            finite = torch.isfinite(rows).all(dim=-1)
            constant = rows.amax(dim=-1) == rows.amin(dim=-1)
            bad = (~finite | constant).nonzero().flatten()
            if bad.numel():
                t = int(bad[0])
                what = (
                    "non-finite values" if not finite[t] else ("all zeros" if not rows[t].any() else f"the constant {rows[t, 0].item():g}")
                )
                raise SpecdraftError(
                    f"sample {self.sample_id!r}: {name} holds {what} at token {t} "
                    f"({bad.numel()} of {rows.shape[0]} rows degenerate); a real activation never does, so the capture "
                    "missed that layer or the target computed garbage there; check the target's family adapter and "
                    "dtype before extracting (stored nothing for this sample)"
                )


#: safetensors' header dtype names -> the manifest's.
_HEADER_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64"}
#: Bytes hashed per read while verifying a stored file: a fixed buffer, whatever the sample's size.
HASH_CHUNK = 8 << 20


def file_range_sha256(f: Any, start: int, end: int, *, chunk: int = HASH_CHUNK) -> str:
    """sha256 of bytes [start, end) of the open binary file ``f``, read through one ``chunk``-byte buffer. Not through
    an mmap: the pages of a mapping count in the process's resident memory while it is mapped, the figure a
    sequence-parallel rank's windowed read exists to lower; the page cache behind plain reads does not."""
    h = hashlib.sha256()
    buffer = memoryview(bytearray(min(chunk, max(end - start, 1))))
    f.seek(start)
    left = end - start
    while left:
        n = f.readinto(buffer[: min(left, len(buffer))])
        if not n:
            raise EOFError(f"the file ends {left} bytes before the tensor's data does")
        h.update(buffer[:n])
        left -= n
    return h.hexdigest()


class StoredRows:
    """One tensor of a stored payload, read from its file (memory-mapped by ``safetensors.safe_open``) only where it
    is sliced along its first dimension: ``rows[a:b]`` is the tensor ``[b - a, ...]``, as for a loaded tensor. What
    ``collate`` reads of a sample is exactly the rows of its window, so nothing else of the sample is loaded."""

    def __init__(self, handle: Any, name: str, shape: list[int], dtype: torch.dtype):
        self._handle, self.name, self.shape, self.dtype = handle, name, torch.Size(shape), dtype

    def __len__(self) -> int:
        return int(self.shape[0])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if rows.step not in (None, 1):
            raise TypeError(f"stored tensor {self.name!r} is read by a range of rows, not by {rows!r}")
        return self._handle.get_slice(self.name)[rows]


@dataclass
class PayloadRows(_Described):
    """A stored payload verified whole but loaded by rows: ``token_ids`` is loaded (small), ``hidden_states`` and
    ``last_hidden`` are ``StoredRows``. What a sequence-parallel rank reads (``HiddenStateDataset(..., reads=
    "windowed")``): it collates 1/N of each row, so it holds 1/N of a sample's states, where a whole read held all
    of them (and their serialised bytes) first.

    The guarantee is the whole read's: every tensor's dtype, shape and sha256 are checked against the manifest
    before any row is used, by hashing its bytes from the file in fixed-size chunks (``file_range_sha256``), so a
    changed byte anywhere in a tensor is refused with the same error. The rows come from that same file: the mapping
    is opened after hashing and refused if the path then names another file (an atomic replace in between). A
    write into the verified file in place, between this check and the rows' read in the same step, is not seen."""

    token_ids: torch.Tensor
    hidden_states: StoredRows
    last_hidden: StoredRows
    manifest: dict = field(repr=False)

    @classmethod
    def open(cls, path: Path, *, source: str) -> PayloadRows:
        """Verify the payload stored at ``path`` and open it for row reads; ``source`` names it in every error.
        ``FileNotFoundError``/``IsADirectoryError`` pass through for the caller to name the sample."""
        from safetensors import SafetensorError, safe_open

        with open(path, "rb") as f:
            try:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len)) if 0 < header_len <= 100_000_000 else None
                if not isinstance(header, dict):
                    raise ValueError("no JSON object in its header")
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
                raise SpecdraftError(
                    f"{source}: not a readable safetensors payload ({exc}); it is truncated or corrupt, re-extract it"
                ) from None
            if not _same_file(os.fstat(f.fileno()), os.stat(path)):
                raise SpecdraftError(f"{source}: the file was replaced while it was being read; read it again once its writer is done")
            manifest = _manifest_of(header, source=source)
            missing = _missing_parts(manifest, header)
            if missing:
                raise SpecdraftError(f"{source}: payload lacks {', '.join(missing)}; re-extract it")
            where = f"{source} (sample {manifest['sample_id']!r})"
            base = 8 + header_len
            found = {}
            for key in TENSOR_KEYS:
                entry = header[key]
                begin, end = (base + int(x) for x in entry["data_offsets"])
                found[key] = _Found(
                    _HEADER_DTYPES.get(entry["dtype"], entry["dtype"]),
                    list(entry["shape"]),
                    functools.partial(file_range_sha256, f, begin, end),
                )
            try:
                _check_records(where, manifest, found)
            except EOFError as exc:
                raise SpecdraftError(f"{where}: {exc}; it is truncated, re-extract it") from None
        rows = {
            key: StoredRows(handle, key, found[key].shape, getattr(torch, found[key].dtype)) for key in ("hidden_states", "last_hidden")
        }
        payload = cls(token_ids=handle.get_tensor("token_ids"), manifest=manifest, **rows)
        payload._check_layout(source=where)
        return payload


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)
