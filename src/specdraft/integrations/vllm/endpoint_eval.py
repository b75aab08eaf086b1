"""Benchmark a running OpenAI-compatible vLLM server (e.g. one started by ``specdraft serve``).

Each prompt is rendered with the target's chat template and sent as token ids to ``/v1/completions``
(prompts of one domain at a time, ``concurrency`` requests in flight). Acceptance comes from the
server's own Prometheus counters (``vllm:spec_decode_*``), read before and after each domain, so the
figures are the server's, not a re-derivation: tau = 1 + accepted / drafts (bonus token included).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.decode.config import SamplingConfig
from specdraft.errors import SpecdraftError
from specdraft.eval.config import EvalConfig
from specdraft.eval.report import EVAL_DIR
from specdraft.eval.suites import EvalPrompt, load_prompts
from specdraft.integrations.vllm.engine import complete, get_text
from specdraft.integrations.vllm.metrics import read_spec_decode_metrics
from specdraft.utils.lock import claims_output


def _served_model(url: str) -> str:
    models = json.loads(get_text(f"{url}/v1/models")).get("data") or []
    if not models:
        raise SpecdraftError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def counters_as_metrics(counters: Any, *, requests: int, output_tokens: int, wall_s: float) -> dict[str, Any]:
    """The server's counters in the shape of ``DecodeMetrics.to_json`` so one report format serves both."""
    drafts = counters.num_drafts
    per_position = list(counters.accepted_per_position)
    return {
        "requests": requests,
        "output_tokens": output_tokens,
        "rounds": int(drafts),
        "drafted": int(counters.num_draft_tokens),
        "accepted": int(counters.num_accepted_tokens),
        "position_drafted": [int(drafts)] * len(per_position),  # vLLM verifies every drafted position
        "position_accepted": [int(a) for a in per_position],
        "tau": counters.mean_accepted_length,
        "acceptance_rate": counters.acceptance_rate,
        "position_acceptance": [a / drafts if drafts else 0.0 for a in per_position],
        "tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "mean_ttft_s": 0.0,  # not observable without streaming
        "time_per_output_token_s": wall_s * requests / output_tokens if output_tokens else 0.0,
    }


@claims_output(EVAL_DIR)  # before the decoding: a foreign, locked or read-only --out costs nothing
def run_endpoint_eval(
    config: EvalConfig, sampling: SamplingConfig = SamplingConfig(), *, tokenizer: Any = None, progress: bool = True
) -> dict[str, Any]:
    """Measure the server at ``config.endpoint``; writes the same report files as ``run_eval``, and its provenance."""
    from specdraft.eval.report import write_report
    from specdraft.utils.provenance import write_provenance

    setup = _set_up(config, sampling, tokenizer)
    started = time.perf_counter()
    runs = _measure(config, setup, progress=progress)
    report = _report(config, sampling, setup, runs, wall_s=time.perf_counter() - started)
    write_report(report, Path(config.out), plots=config.plots)
    write_provenance(config.out, config={"eval": config, "sampling": sampling}, target=report["target"], inputs=[config.prompts])
    return report


@dataclass
class _Endpoint:
    """The server and what is sent to it: its URL, the model it serves, the prompts and their token ids, the request
    options (sampling, seed) and the tokenizer that decodes the replies."""

    url: str
    model: str
    prompts: list[EvalPrompt]
    token_ids: list[list[int]]
    extra: dict[str, Any]
    tokenizer: Any
    outputs: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # [concurrency][prompt index] -> reply tokens

    def complete(self, i: int) -> list[int]:
        answer = complete(self.url, self.token_ids[i], model=self.model, **self.extra)
        return list(answer["choices"][0]["token_ids"])


def _set_up(config: EvalConfig, sampling: SamplingConfig, tokenizer: Any) -> _Endpoint:
    """Load the prompts (and the target's tokenizer unless given), ask the server what it serves, and warm it up."""
    url = config.endpoint.rstrip("/").removesuffix("/v1")
    prompts = load_prompts(None if config.prompts else config.suite, config.prompts or None, config.limit_per_domain or None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        from specdraft.targets import resolve_target_dir

        tokenizer = AutoTokenizer.from_pretrained(resolve_target_dir(config.target))
    token_ids = [p.token_ids(tokenizer) for p in prompts]
    model = _served_model(url)
    extra = {"temperature": sampling.temperature, "top_p": sampling.top_p, "return_token_ids": True, "seed": config.seed}
    if sampling.top_k:
        extra["top_k"] = sampling.top_k
    complete(url, token_ids[0][-16:], max_tokens=2, model=model)  # warm-up
    return _Endpoint(url, model, prompts, token_ids, {"max_tokens": config.max_new_tokens, **extra}, tokenizer)


def _measure(config: EvalConfig, endpoint: _Endpoint, *, progress: bool) -> list[dict[str, Any]]:
    """One run per concurrency level: every domain's prompts in turn, ``concurrency`` requests in flight, and the
    server's counters read around each domain and around the level; fills ``endpoint.outputs``."""
    from tqdm import tqdm

    url, prompts = endpoint.url, endpoint.prompts
    runs = []
    bar = tqdm(total=len(prompts) * len(config.concurrency), desc="eval endpoint", unit="prompt", disable=not progress)
    for concurrency in config.concurrency:
        outputs = endpoint.outputs[concurrency] = {}
        per_domain = {}
        totals: dict[str, Any] = {"requests": 0, "output_tokens": 0, "wall_s": 0.0}
        total_before = read_spec_decode_metrics(url)
        for domain in dict.fromkeys(p.domain for p in prompts):
            indices = [i for i, p in enumerate(prompts) if p.domain == domain]
            before, t0 = read_spec_decode_metrics(url), time.perf_counter()
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                for i, tokens in zip(indices, pool.map(endpoint.complete, indices)):
                    outputs[i] = tokens
                    bar.update(1)
            wall = time.perf_counter() - t0
            produced = sum(len(outputs[i]) for i in indices)
            per_domain[domain] = counters_as_metrics(
                read_spec_decode_metrics(url) - before, requests=len(indices), output_tokens=produced, wall_s=wall
            )
            totals["requests"] += len(indices)
            totals["output_tokens"] += produced
            totals["wall_s"] += wall
        runs.append(
            {
                "drafter": f"endpoint:{endpoint.model}",
                "concurrency": concurrency,
                "overall": counters_as_metrics(read_spec_decode_metrics(url) - total_before, **totals),
                "per_domain": dict(sorted(per_domain.items())),
                "speedup": None,
                "identical_to_autoregressive": None,
            }
        )
    bar.close()
    return runs


def _report(
    config: EvalConfig, sampling: SamplingConfig, endpoint: _Endpoint, runs: list[dict[str, Any]], *, wall_s: float
) -> dict[str, Any]:
    """``report.json`` in ``run_eval``'s format: the settings, the runs and each prompt's replies, decoded."""
    outputs, decode = endpoint.outputs, endpoint.tokenizer.decode
    return {
        "format": "specdraft.eval_report",
        "format_version": 1,
        "target": {"name": config.target, "endpoint": endpoint.url, "served_model": endpoint.model},
        "config": asdict(config),
        "sampling": asdict(sampling),
        "num_prompts": len(endpoint.prompts),
        "wall_s": wall_s,
        "runs": runs,
        "prompts": [
            {
                **p.to_json(),
                "prompt_tokens": len(endpoint.token_ids[i]),
                "outputs": {
                    runs[0]["drafter"]: {
                        str(c): {"tokens": outputs[c][i], "text": decode(outputs[c][i], skip_special_tokens=True)}
                        for c in config.concurrency
                    }
                },
            }
            for i, p in enumerate(endpoint.prompts)
        ],
    }
