"""Resolve a target name or path to a plain HF directory and load it as a ``Target``."""

from __future__ import annotations

import logging
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.targets.base import Target
from specdraft.targets.embedded import DEFAULT_TARGET, EMBEDDED_TARGETS, ensure_embedded
from specdraft.targets.families import family_of
from specdraft.targets.identity import fingerprint, tokenizer_hash

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
#: What transformers loads with ``use_safetensors=True``; a stray ``*.safetensors`` beside a pickle does not count.
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # weights that unpickle (run code) when loaded


def resolve_target_dir(name_or_path: str = DEFAULT_TARGET) -> Path:
    """An embedded name (converted on first use) or a local HF causal-LM directory."""
    if name_or_path in EMBEDDED_TARGETS:
        return ensure_embedded(name_or_path)
    path = Path(name_or_path).expanduser()
    embedded = ", ".join(EMBEDDED_TARGETS.names())
    if not path.is_dir():
        raise SpecdraftError(
            f"target {name_or_path!r} is neither an embedded target ({embedded}) nor a local directory; "
            f"pass an embedded name or the path of a Hugging Face model directory (config.json + *.safetensors + tokenizer)"
        )
    if not (path / "config.json").is_file():
        raise SpecdraftError(
            f"target directory {path} has no config.json; it must be a Hugging Face causal-LM directory (embedded targets: {embedded})"
        )
    if not any((path / name).is_file() for name in SAFETENSORS_WEIGHTS):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        found = f"; it holds pickle weights ({', '.join(pickles)})" if pickles else ""
        raise SpecdraftError(
            f"target directory {path} has no {' or '.join(SAFETENSORS_WEIGHTS)}{found}. specdraft never loads pickled weights; "
            'convert them once: python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{path}').save_pretrained('{path}-safetensors')\" (in a trusted environment), then pass that directory"
        )
    return path


def load_target(name_or_path: str = DEFAULT_TARGET, *, dtype: str = "float32", device: str = "cpu") -> Target:
    """Load a target causal LM (eval mode) with its tokenizer and identity hashes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specdraft.utils.compute import parse_device

    if dtype not in DTYPES:
        raise SpecdraftError(f"dtype {dtype!r} is not supported; choose one of: {', '.join(DTYPES)}")
    target_device = parse_device(device)  # before minutes of loading, not after
    path = resolve_target_dir(name_or_path)
    try:
        family_of(AutoConfig.from_pretrained(path))  # an unsupported family fails here, before any work
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"cannot read the config of target {path}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"cannot load the tokenizer of target {path}: {exc}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise SpecdraftError(f"the tokenizer in {path} has no chat template; specdraft renders conversations with it")
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), use_safetensors=True)
    except (OSError, ValueError, SafetensorError) as exc:  # SafetensorError: a truncated or damaged weights file
        raise SpecdraftError(f"cannot load target model {path}: {exc}") from None
    # transformers wraps PreTrainedModel.to with functools.wraps(nn.Module.to), whose type takes the model as the first argument
    model.to(target_device).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    return Target(
        name=name_or_path,
        path=path,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint(path),
        tokenizer_hash=tokenizer_hash(path),
    )
