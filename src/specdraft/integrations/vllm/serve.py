"""Serve a specdraft drafter checkpoint with vLLM's OpenAI server (``specdraft serve``).

Everything vLLM needs is read from the checkpoint's speculators ``config.json``: the method
(``speculators_model_type``, which is also vLLM's ``--speculative-config`` method name), the
number of draft tokens per round (``proposal_methods[0].speculative_tokens``) and the target
(``specdraft.target.path``, else ``speculators_config.verifier.name_or_path``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry
from specdraft.integrations.vllm.engine import VllmServer, find_vllm_python
from specdraft.utils.config import config_field
from specdraft.utils.net import is_loopback
from specdraft.utils.vllm_options import VllmServerOptions

#: Methods whose proposer the vLLM-CPU model runner lacks (it has ngram, draft_model, eagle3, dflash).
CPU_UNSUPPORTED_METHODS = frozenset({"dspark"})


@dataclass
class ServeConfig(VllmServerOptions):
    drafter: str = config_field(help="drafter checkpoint directory (speculators format, written by specdraft train)")
    target: str | None = config_field(None, help="target name or HF directory; default: the target recorded in the checkpoint")
    port: int | None = config_field(None, help="port on 127.0.0.1; default: a free one")
    host: str = config_field("127.0.0.1", help="address to bind; anything but loopback requires --token")
    token: str | None = config_field(None, help="API key clients must send (Authorization: Bearer TOKEN; vLLM's --api-key)")
    num_speculative_tokens: int | None = config_field(None, help="draft tokens per round; default: the checkpoint's")
    adaptive_verification: bool = config_field(
        False, help="DSpark on a CUDA vLLM: size each round's verification from the confidence head "
        "(vLLM's enable_adaptive_verification; vLLM uses the raw head, not specdraft's calibration)"
    )

    def __post_init__(self) -> None:
        if not self.token and not is_loopback(self.host):
            raise SpecdraftError(
                f"--host {self.host} is reachable from other machines: pass --token SECRET (clients send it as a bearer token) "
                "or bind 127.0.0.1"
            )


@dataclass(frozen=True)
class DrafterInfo:
    method: str
    num_speculative_tokens: int
    target: str | None
    fields: dict = field(default_factory=dict, compare=False)  # the whole config.json, for method checks


def read_drafter_info(directory: str | Path) -> DrafterInfo:
    """What vLLM needs to know about a checkpoint, from its ``config.json`` only (no torch)."""
    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"{path}: cannot read the drafter config ({exc}); pass a checkpoint directory written by `specdraft train`") from None
    method = cfg.get("speculators_model_type")
    if not isinstance(method, str):
        raise SpecdraftError(f"{path} has no speculators_model_type; is {directory} a drafter checkpoint?")
    spec = cfg.get("speculators_config") or {}
    proposals = spec.get("proposal_methods") or [{}]
    tokens = proposals[0].get("speculative_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        raise SpecdraftError(f"{path}: speculators_config.proposal_methods[0].speculative_tokens is {tokens!r}, expected an integer >= 1")
    target = (cfg.get("specdraft") or {}).get("target", {}).get("path") or (spec.get("verifier") or {}).get("name_or_path")
    return DrafterInfo(method=method, num_speculative_tokens=tokens, target=target, fields=cfg)


#: method -> (checkpoint info, serve config) -> extra ``--speculative-config`` entries, raising what vLLM cannot serve.
SPECULATIVE_OPTIONS: Registry[Callable[[DrafterInfo, ServeConfig], dict]] = Registry("vLLM serving method")


@SPECULATIVE_OPTIONS.register("dspark")
def dspark_options(info: DrafterInfo, config: ServeConfig) -> dict:
    """vLLM 0.32's DSpark (GPU runner): one query block of ``num_speculative_tokens`` slots, anchor first, so it
    must equal the trained block size; only the vanilla Markov head exists there (``qwen3_dspark.py``)."""
    head = info.fields.get("markov_head_type", "vanilla")
    if head != "vanilla":
        raise SpecdraftError(
            f"{config.drafter}: markov_head_type is {head!r}; vLLM 0.32 serves only the 'vanilla' Markov head (its DSpark "
            "loader has no weights for the others); train with markov_head vanilla, or decode with specdraft's built-in runtime"
        )
    trained = info.num_speculative_tokens  # = block_size: every slot, the anchor's included, drafts a token
    if config.num_speculative_tokens not in (None, trained):
        raise SpecdraftError(
            f"{config.drafter}: --num-speculative-tokens {config.num_speculative_tokens} differs from the trained block of "
            f"{trained} drafts; vLLM's DSpark runs a block of num_speculative_tokens slots, which must be {trained}"
        )
    options = {"num_speculative_tokens": trained}
    if config.adaptive_verification:
        if not info.fields.get("enable_confidence_head", True):
            raise SpecdraftError(f"{config.drafter}: --adaptive-verification needs a confidence head; this drafter has none")
        options["enable_adaptive_verification"] = True
    return options


def is_cpu_build(python: Path) -> bool:
    """True when the vLLM in ``python``'s environment is the ``vllm-cpu`` distribution (checked without importing vLLM)."""
    probe = "import importlib.metadata as m\ntry:\n m.version('vllm-cpu'); print(1)\nexcept m.PackageNotFoundError:\n print(0)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False)
    return out.stdout.strip() == "1"


def drafter_server(config: ServeConfig, *, log_path: str | None = None) -> VllmServer:
    """An unstarted :class:`VllmServer` running the target with ``config.drafter`` as its speculator."""
    from transformers import AutoConfig

    from specdraft.targets import resolve_target_dir
    from specdraft.targets.families import family_of

    info = read_drafter_info(config.drafter)
    python = find_vllm_python(config.vllm_python)
    if info.method in CPU_UNSUPPORTED_METHODS and is_cpu_build(python):
        raise SpecdraftError(
            f"{config.drafter} is a {info.method} drafter, which the vLLM-CPU runner cannot serve "
            f"(it supports eagle3 and dflash); on this machine decode with specdraft's built-in runtime: "
            f"`specdraft generate --target {config.target or info.target} --drafter {info.method} --drafter-path {config.drafter}`"
        )
    target = config.target or info.target
    if not target:
        raise SpecdraftError(f"{config.drafter}/config.json records no target; pass --target")
    target_dir = resolve_target_dir(target)
    family_of(AutoConfig.from_pretrained(target_dir)).require_vllm_aux(f"serve a {info.method} drafter")
    if config.adaptive_verification and info.method not in SPECULATIVE_OPTIONS:
        raise SpecdraftError(f"--adaptive-verification is a DSpark feature of vLLM; {config.drafter} is a {info.method} drafter")
    speculative = {
        "method": info.method,
        "model": str(Path(config.drafter).resolve()),
        "num_speculative_tokens": config.num_speculative_tokens or info.num_speculative_tokens,
        **(SPECULATIVE_OPTIONS.get(info.method)(info, config) if info.method in SPECULATIVE_OPTIONS else {}),
    }
    args = ["--speculative-config", json.dumps(speculative), *shlex.split(config.vllm_args)]
    if config.token:
        args += ["--api-key", config.token]
    return VllmServer(target_dir, args, python=config.vllm_python, port=config.port, host=config.host, log_path=log_path)
