"""Serve a specdraft drafter checkpoint with vLLM's OpenAI server (``specdraft serve``).

Everything vLLM needs is read from the checkpoint's speculators ``config.json``: the method
(``speculators_model_type``, which is also vLLM's ``--speculative-config`` method name), the
number of draft tokens per round (``proposal_methods[0].speculative_tokens``) and the target
(``specdraft.target.path``, else the embedded target's ``specdraft.target.name``, else
``speculators_config.verifier.name_or_path``).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specdraft.errors import SpecdraftError, setting
from specdraft.integrations.vllm.engine import VllmServer, find_vllm_python, is_cpu_build
from specdraft.utils.config import config_field
from specdraft.utils.net import require_token_beyond_loopback
from specdraft.utils.vllm_options import VllmServerOptions, draft_schedule_option, parse_draft_schedule

if TYPE_CHECKING:
    from specdraft.models.base import VllmServing


@dataclass
class ServeConfig(VllmServerOptions):
    drafter: str = config_field(help="drafter checkpoint directory (speculators format, written by specdraft train)")
    target: str | None = config_field(None, help="target name or HF directory; default: the target recorded in the checkpoint")
    port: int | None = config_field(None, help="port on 127.0.0.1; default: a free one")
    host: str = config_field("127.0.0.1", help="address to bind; anything but loopback requires --token")
    token: str | None = config_field(None, help="API key clients must send (Authorization: Bearer TOKEN; vLLM's --api-key)")
    num_speculative_tokens: int | None = config_field(None, help="draft tokens per round; default: the checkpoint's")
    draft_schedule: str = config_field(
        "",
        help="draft tokens per round by batch size, vLLM's num_speculative_tokens_per_batch_size: 'BATCHES:K' comma-separated, "
        "BATCHES one size (1), a range (2-8) or an open one (9-), from 1 up; K=0 turns drafting off at those sizes, "
        "e.g. '1:3,2-:0' drafts 3 tokens for a lone request and none when requests share a step; a K above the draft "
        "tokens per round drafts all of them (vLLM caps it)",
    )
    adaptive_verification: bool = config_field(
        False,
        help="DSpark on a CUDA vLLM: size each round's verification from the confidence head "
        "(vLLM's enable_adaptive_verification; vLLM uses the raw head, not specdraft's calibration)",
    )

    def __post_init__(self) -> None:
        require_token_beyond_loopback(self.host, self.token)
        parse_draft_schedule(self.draft_schedule)  # refused here, before any server starts


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
        raise SpecdraftError(
            f"{path}: cannot read the drafter config ({exc}); pass a checkpoint directory written by `specdraft train`"
        ) from None
    method = cfg.get("speculators_model_type")
    if not isinstance(method, str):
        raise SpecdraftError(f"{path} has no speculators_model_type; is {directory} a drafter checkpoint?")
    spec = cfg.get("speculators_config") or {}
    proposals = spec.get("proposal_methods") or [{}]
    tokens = proposals[0].get("speculative_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        raise SpecdraftError(f"{path}: speculators_config.proposal_methods[0].speculative_tokens is {tokens!r}, expected an integer >= 1")
    recorded = (cfg.get("specdraft") or {}).get("target", {})  # an embedded target is recorded by name, without a local path
    target = recorded.get("path") or recorded.get("name") or (spec.get("verifier") or {}).get("name_or_path")
    return DrafterInfo(method=method, num_speculative_tokens=tokens, target=target, fields=cfg)


def serving(method: str) -> VllmServing:
    """The family's claims (``MethodSpec.serving``); a method specdraft does not know is left to vLLM."""
    from specdraft.models import METHODS
    from specdraft.models.base import VllmServing

    return METHODS.get(method).serving if method in METHODS else VllmServing()


def drafter_server(config: ServeConfig, *, log_path: str | None = None) -> VllmServer:
    """An unstarted :class:`VllmServer` running the target with ``config.drafter`` as its speculator."""
    from transformers import AutoConfig

    from specdraft.models import METHODS
    from specdraft.targets import resolve_target_dir
    from specdraft.targets.families import family_of

    info = read_drafter_info(config.drafter)
    claims = serving(info.method)
    python = find_vllm_python(config.vllm_python)
    cpu = is_cpu_build(python)
    if not claims.cpu and cpu:
        on_cpu = " and ".join(m for m in sorted(METHODS.names(), reverse=True) if METHODS.get(m).serving.cpu)
        raise SpecdraftError(
            f"{config.drafter} is a {info.method} drafter, which the vLLM-CPU runner cannot serve "
            f"(it supports {on_cpu}); on this machine decode with specdraft's built-in runtime: "
            f"`specdraft generate --target {config.target or info.target} --drafter {info.method} --drafter-path {config.drafter}`"
        )
    target = config.target or info.target
    if not target:
        raise SpecdraftError(f"{config.drafter}/config.json records no target; pass --target")
    target_dir = resolve_target_dir(target)
    family = family_of(AutoConfig.from_pretrained(target_dir))
    family.require_vllm_aux(f"serve a {info.method} drafter")
    family.require_vllm_build(cpu=cpu, drafting=True)
    if config.adaptive_verification and not claims.adaptive_verification:
        raise SpecdraftError(f"{setting('adaptive_verification')} is a DSpark feature of vLLM; {config.drafter} is a {info.method} drafter")
    speculative = {
        "method": info.method,
        "model": str(Path(config.drafter).resolve()),
        "num_speculative_tokens": config.num_speculative_tokens or info.num_speculative_tokens,
        **(
            claims.options(
                info.fields, info.num_speculative_tokens, config.num_speculative_tokens, config.adaptive_verification, config.drafter
            )
            if claims.options
            else {}
        ),
    }
    speculative.update(draft_schedule_option(config.draft_schedule))
    args = ["--speculative-config", json.dumps(speculative), *shlex.split(config.vllm_args)]
    if config.token:
        args += ["--api-key", config.token]
    return VllmServer(target_dir, args, python=config.vllm_python, port=config.port, host=config.host, log_path=log_path)
