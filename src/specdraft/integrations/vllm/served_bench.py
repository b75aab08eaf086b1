"""``specdraft bench-serve``: speed-ups as users see them, served by vLLM, plain against speculative.

vLLM is started with the target alone, then with each of vLLM's own lookup baselines and each drafter
checkpoint, one server at a time and with the same engine flags. Every server gets the same held-out
prompts at each concurrency level through a streaming client of the standard library (TTFT and TPOT need
the stream; token ids come back with ``return_token_ids``), and the level is bracketed by two readings of
vLLM's spec-decode counters. Replies are compared token by token with the plain server's at the same
concurrency; at each divergence the target, in specdraft's own fp32 runtime, says whether it was a
near-tie (``served_report.judge_divergence``). Figures and files: ``served_report``.

Why not GuideLLM (the load generator speculators' evaluation uses): it installs here without touching torch,
but brings ~27 packages (sanic, datasets, pandas, faker, ...) into the training environment, sends text
rather than the chat-templated token ids of the held-out suites, returns no token ids to compare with plain
serving, and knows nothing of vLLM's spec-decode counters, which must bracket each level. What it would add
(request-rate sweeps, synthetic data) this comparison does not need.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.integrations.vllm.engine import CPU_ENV_DEFAULTS, SERVED_NAME, VllmServer, find_vllm_python, is_cpu_build, vllm_version
from specdraft.integrations.vllm.metrics import SpecDecodeCounters, read_spec_decode_metrics
from specdraft.integrations.vllm.served_report import (
    NEAR_TIE,
    RequestRecord,
    best_draft_schedules,
    first_difference,
    judge_divergence,
    level_figures,
    speedups,
)
from specdraft.registry import Registry
from specdraft.utils.config import config_field
from specdraft.utils.io import DirKind, atomic_dir, atomic_write_bytes, atomic_write_json, json_field_is
from specdraft.utils.lock import claims_output
from specdraft.utils.vllm_options import VllmServerOptions, draft_schedule_option, parse_draft_schedule

PLAIN = "plain"
#: What `specdraft bench-serve` writes; replaced whole, so a rerun with fewer servers leaves no stale log or plot.
SERVED_DIR = DirKind(
    "specdraft bench-serve run",
    "served.json",
    json_field_is("format", "specdraft.served_bench"),
    frozenset({"served.json", "served.md", "served.png", "logs"}),
    patterns=(".*.tmp",),
)


@dataclass
class ServedBenchConfig(VllmServerOptions):
    """Which servers, on which prompts, at which concurrency levels."""

    out: str = config_field(help="run directory: served.json, served.md, served.png and the servers' logs/ (replaced whole)")
    target: str = config_field("smollm2-135m", help="embedded target name or a local Hugging Face model directory")
    drafters: list[str] = config_field(
        [],
        help="comma-separated drafter checkpoints served with the target (what `specdraft serve` starts), 'LABEL=DIR' to "
        "name one in the report; the vLLM-CPU runner serves eagle3 and dflash",
    )
    baselines: list[str] = config_field(
        ["ngram", "suffix"],
        help="vLLM's own drafter-free methods served beside the drafters: ngram (prompt lookup, k=4, "
        "n-grams of 2-4) and suffix (suffix decoding; left out, and said so, where vLLM lacks arctic_inference)",
    )
    draft_tokens: list[int] = config_field(
        [],
        help="comma-separated draft tokens per round to serve each drafter with, one server per value, labelled "
        "LABEL-kN (default: the checkpoint's own); with several, the report gives the measured best per concurrency",
    )
    draft_schedule: str = config_field(
        "",
        help="draft tokens by batch size for every speculative server (drafters and vLLM's baselines), as `specdraft serve "
        "--draft-schedule`, e.g. '1:3,2-:0'",
    )
    suite: str = config_field("quick", help="held-out prompt suite, as `specdraft eval --suite` (ignored with --prompts)")
    prompts: str = config_field("", help="JSONL prompt file ('prompt' or 'messages' per line, optional 'id'/'domain')")
    limit_per_domain: int = config_field(0, help="use at most this many prompts per domain (0 = all)")
    max_new_tokens: int = config_field(64, help="greedy tokens generated per request (EOS ignored)")
    concurrency: list[int] = config_field([1, 2, 4, 8, 16], help="comma-separated numbers of clients sending requests at once")
    dtype: str = config_field(
        "bfloat16",
        help="vLLM's --dtype for every server: bfloat16 (vLLM-CPU's choice) or float32, where greedy replies of "
        "speculative and plain serving must agree except at near-ties",
        metadata={"choices": list(NEAR_TIE)},
    )
    request_timeout: float = config_field(600.0, help="seconds one streamed request may take")
    plots: bool = config_field(True, help="write served.png (needs matplotlib)")

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise SpecdraftError(f"{setting('concurrency')} values must be >= 1, got {self.concurrency}")
        if self.max_new_tokens < 1:
            raise SpecdraftError(f"{setting('max_new_tokens')} must be >= 1, got {self.max_new_tokens}")
        if self.limit_per_domain < 0:
            raise SpecdraftError(f"{setting('limit_per_domain')} must be >= 0, got {self.limit_per_domain}")
        if self.dtype not in NEAR_TIE:
            raise SpecdraftError(f"{setting('dtype')} must be one of {', '.join(NEAR_TIE)}, got {self.dtype!r}")
        for name in self.baselines:
            BASELINES.get(name)  # an unknown name is refused here, with the known ones
        if any(k < 1 for k in self.draft_tokens):
            raise SpecdraftError(f"{setting('draft_tokens')} values must be >= 1, got {self.draft_tokens}")
        parse_draft_schedule(self.draft_schedule)


@dataclass(frozen=True)
class VllmBaseline:
    """One of vLLM's own speculative methods: its ``--speculative-config`` and the module it imports, if any."""

    speculative_config: dict[str, Any]
    needs_module: str = ""


BASELINES: Registry[VllmBaseline] = Registry("vLLM baseline")
BASELINES.register("ngram")(VllmBaseline({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
BASELINES.register("suffix")(VllmBaseline({"method": "suffix"}, needs_module="arctic_inference"))


@dataclass(frozen=True)
class ServerSpec:
    """A server of the comparison: its label, what it runs (for the report) and how to build it, unstarted."""

    label: str
    what: str
    make: Callable[[Path], VllmServer]  # log path -> server
    drafter: str = ""  # a drafter's label, shared by the servers of a --draft-tokens sweep
    k: int = 0  # a drafter's draft tokens per round


def _has_module(python: Path, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(python), "-c", probe], capture_output=True, check=False).returncode == 0


def resolve_servers(config: ServedBenchConfig, target_dir: Path, engine_flags: list[str]) -> tuple[list[ServerSpec], list[dict]]:
    """The plain server, the baselines this vLLM has and the drafters, in that order; and the baselines left out, why."""
    from specdraft.eval.runner import split_label
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server, read_drafter_info

    python = find_vllm_python(config.vllm_python)

    def plain(extra: list[str]) -> Callable[[Path], VllmServer]:
        return lambda log: VllmServer(target_dir, [*extra, *engine_flags], python=config.vllm_python, log_path=log)

    def drafted(serve: ServeConfig) -> Callable[[Path], VllmServer]:
        return lambda log: drafter_server(serve, log_path=str(log))

    by_batch = draft_schedule_option(config.draft_schedule)  # every speculative server's, the drafters' through ServeConfig
    shown = f", draft schedule {config.draft_schedule}" if by_batch else ""
    servers = [ServerSpec(PLAIN, "the target alone", plain([]))]
    skipped = []
    for name in config.baselines:
        baseline = BASELINES.get(name)
        if baseline.needs_module and not _has_module(python, baseline.needs_module):
            skipped.append({"label": name, "why": f"vLLM's {name} method needs the {baseline.needs_module} package, which {python} lacks"})
            continue
        spec = json.dumps({**baseline.speculative_config, **by_batch})
        servers.append(ServerSpec(name, f"vLLM's {name} ({spec})", plain(["--speculative-config", spec])))
    for item in config.drafters:
        label, path = split_label(item)
        info = read_drafter_info(path)  # refuses a directory that is no checkpoint before any server starts
        name = label or Path(path).name
        for k in config.draft_tokens or [info.num_speculative_tokens]:
            serve = ServeConfig(
                drafter=path,
                target=str(target_dir),
                vllm_python=config.vllm_python,
                vllm_args=shlex.join(engine_flags),
                num_speculative_tokens=k,
                draft_schedule=config.draft_schedule,
            )
            servers.append(
                ServerSpec(
                    f"{name}-k{k}" if len(config.draft_tokens) > 1 else name,
                    f"{info.method} drafter {path} (k={k}{shown})",
                    drafted(serve),
                    drafter=name,
                    k=k,
                )
            )
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise SpecdraftError(
            f"{setting('drafters')} and {setting('baselines')} give servers the same label ({', '.join(labels)}); "
            "name drafters with LABEL=DIR"
        )
    return servers, skipped


def stream_completion(url: str, prompt: list[int], *, max_tokens: int, timeout: float) -> tuple[float, float | None, float, list[int]]:
    """One greedy streamed ``/v1/completions`` request with a token-id prompt: (start, first token, end, token ids)."""
    parts = urllib.parse.urlsplit(url)
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    if parts.hostname is None:
        raise SpecdraftError(f"{url} names no host to stream from")
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    started = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise SpecdraftError(f"{url}/v1/completions answered HTTP {response.status}: {response.read().decode(errors='replace')[:500]}")
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids")
            if ids is None:
                raise SpecdraftError(f"{url} streams no token_ids; this benchmark needs a vLLM that honours return_token_ids")
            if ids and first is None:
                first = time.perf_counter()
            tokens += ids
    except OSError as exc:
        raise SpecdraftError(f"streaming from {url} failed: {exc}") from None
    finally:
        connection.close()
    return started, first, time.perf_counter(), tokens


def drive_level(
    url: str, prompts: list[list[int]], domains: list[str], concurrency: int, *, max_tokens: int, timeout: float
) -> tuple[list[RequestRecord], SpecDecodeCounters]:
    """Every prompt (cycled up to ``concurrency`` requests) through ``concurrency`` clients; the counters' delta over the
    level. One client runs its requests back to back and reads the counters around each, so each carries its own."""
    order = [i % len(prompts) for i in range(max(len(prompts), concurrency))]
    alone = concurrency == 1

    def one(i: int) -> RequestRecord:
        before = read_spec_decode_metrics(url) if alone else None
        started, first, ended, tokens = stream_completion(url, prompts[i], max_tokens=max_tokens, timeout=timeout)
        own = read_spec_decode_metrics(url) - before if before is not None else None
        return RequestRecord(i, domains[i], started, first, ended, tuple(tokens), own)

    before = read_spec_decode_metrics(url)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        records = list(pool.map(one, order))
    return records, read_spec_decode_metrics(url) - before


def _engine(config: ServedBenchConfig) -> dict[str, Any]:
    python = find_vllm_python(config.vllm_python)
    env = {**CPU_ENV_DEFAULTS, **os.environ}
    return {
        "vllm": vllm_version(python) or "vllm (version unknown)",
        "cpu_build": is_cpu_build(python),
        "python": str(python),
        "env": {k: env[k] for k in CPU_ENV_DEFAULTS},
    }


def agreement(records: list[RequestRecord], plain: list[RequestRecord], prompt_ids: list[str]) -> dict[str, Any]:
    """Replies compared with the plain server's same request; each divergence's first differing position."""
    divergences = []
    for j, (mine, theirs) in enumerate(zip(records, plain)):
        k = first_difference(list(mine.tokens), list(theirs.tokens))
        if k is not None:
            divergences.append(
                {
                    "prompt_id": prompt_ids[mine.index],
                    "request": j,
                    "index": mine.index,
                    "position": k,
                    "plain_token": theirs.tokens[k] if k < len(theirs.tokens) else None,
                    "served_token": mine.tokens[k] if k < len(mine.tokens) else None,
                }
            )
    return {"compared": len(records), "identical": len(records) - len(divergences), "divergences": divergences}


def explain_divergences(
    levels: list[dict], plain_records: dict[int, list[RequestRecord]], prompts: list[list[int]], config: ServedBenchConfig, target_dir: Path
) -> None:
    """Judge, in place, every divergence with the fp32 target's logits after the common prefix (loaded only if needed)."""
    found = [d for lv in levels for d in (lv.get("agreement") or {}).get("divergences", [])]
    if not found:
        return
    import torch

    from specdraft.targets import load_target

    target = load_target(str(target_dir), dtype="float32")
    for lv in levels:
        for d in (lv.get("agreement") or {}).get("divergences", []):
            prefix = [*prompts[d["index"]], *plain_records[lv["concurrency"]][d["request"]].tokens[: d["position"]]]
            if d["plain_token"] is None or d["served_token"] is None:
                d.update(near_tie=False, flagged=True, top2_gap=float("nan"), why="one reply is shorter: a server stopped early")
                continue
            with torch.no_grad():
                logits = target.model(torch.tensor([prefix])).logits[0, -1].float().tolist()
            d.update(judge_divergence(logits, d["plain_token"], d["served_token"], config.dtype))


@claims_output(SERVED_DIR, command="specdraft bench-serve")  # before any server starts: a foreign or locked --out costs nothing
def run_served_bench(config: ServedBenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """Serve, drive, compare; writes ``served.json``, ``served.md`` and ``served.png`` into ``config.out``."""
    from transformers import AutoTokenizer

    from specdraft.eval.suites import load_prompts
    from specdraft.integrations.vllm.served_report import render_markdown, write_plot
    from specdraft.targets import resolve_target_dir

    target_dir = resolve_target_dir(config.target)
    engine_flags = ["--dtype", config.dtype, *shlex.split(config.vllm_args)]
    servers, skipped = resolve_servers(config, target_dir, engine_flags)
    suite = load_prompts(None if config.prompts else config.suite, config.prompts or None, config.limit_per_domain or None)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [p.token_ids(tokenizer) for p in suite]
    domains = [p.domain for p in suite]
    prompt_ids = [p.prompt_id for p in suite]
    levels: list[dict[str, Any]] = []
    plain_records: dict[int, list[RequestRecord]] = {}
    started = time.perf_counter()
    with atomic_dir(config.out, SERVED_DIR) as out:
        for spec in servers:
            server = spec.make(out / "logs" / f"{spec.label}.log")
            if progress:
                print(f"bench-serve: starting {spec.label} (log: {server.log_path})", flush=True)
            with server:
                stream_completion(server.url, prompts[0], max_tokens=config.max_new_tokens, timeout=config.request_timeout)  # warm-up
                for c in config.concurrency:
                    records, counters = drive_level(
                        server.url, prompts, domains, c, max_tokens=config.max_new_tokens, timeout=config.request_timeout
                    )
                    level = {"server": spec.label, "concurrency": c, **level_figures(records, counters)}
                    if spec.label == PLAIN:
                        plain_records[c] = records
                    else:
                        level["agreement"] = agreement(records, plain_records[c], prompt_ids)
                    levels.append(level)
                    if progress:
                        print(
                            f"  {spec.label} @ {c}: {level['per_user_tok_s']:.1f} tok/s per user, "
                            f"{level['throughput_tok_s']:.1f} tok/s total",
                            flush=True,
                        )
        speedups(levels, PLAIN)
        best = (
            {} if config.draft_schedule else best_draft_schedules([(s.drafter, s.k, s.label) for s in servers if s.drafter], levels, PLAIN)
        )
        explain_divergences(levels, plain_records, prompts, config, target_dir)
        report = {
            "format": "specdraft.served_bench",
            "format_version": 1,
            "engine": _engine(config),
            "setup": {
                "target": config.target,
                "suite": config.prompts or config.suite,
                "num_prompts": len(suite),
                "max_new_tokens": config.max_new_tokens,
                "dtype": config.dtype,
                "engine_flags": engine_flags,
                "draft_schedule": config.draft_schedule,
            },
            "config": asdict(config),
            "servers": [{"label": s.label, "what": s.what, **({"drafter": s.drafter, "k": s.k} if s.drafter else {})} for s in servers],
            "skipped": skipped,
            "best_draft_schedules": best,
            "wall_s": time.perf_counter() - started,
            "levels": levels,
            "prompts": [{**p.to_json(), "prompt_tokens": len(ids)} for p, ids in zip(suite, prompts)],
        }
        atomic_write_json(out / "served.json", report)
        atomic_write_bytes(out / "served.md", render_markdown(report).encode())
        if config.plots:
            write_plot(report, out / "served.png")
    return report
