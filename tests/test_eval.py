import dataclasses
import json

import pytest

from specdraft.cli.main import main
from specdraft.decode.config import SamplingConfig
from specdraft.errors import SpecdraftError
from specdraft.eval.config import EvalConfig
from specdraft.eval.runner import resolve_drafter, run_eval


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "Count: one two three one two three one two", "domain": "repeat"},
        {"prompt": "Say hello.", "domain": "chat"},
        {"prompt": "List colours: red green blue red green blue", "domain": "repeat"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_compares_drafter_with_autoregressive(tmp_path, tiny_target):
    out = tmp_path / "eval"
    config = EvalConfig(
        out=str(out), prompts=str(_prompt_file(tmp_path)), drafters=["ngram"], max_new_tokens=12, concurrency=[1, 2], threads=1
    )
    report = run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    runs = {(r["drafter"], r["concurrency"]): r for r in report["runs"]}
    assert set(runs) == {("autoregressive", 1), ("autoregressive", 2), ("ngram", 1), ("ngram", 2)}
    for run in runs.values():
        assert run["identical_to_autoregressive"] == 3  # greedy verification is exact
        assert set(run["per_domain"]) == {"repeat", "chat"}
        assert run["overall"]["requests"] == 3
    assert runs[("autoregressive", 1)]["overall"]["tau"] == pytest.approx(1.0)
    assert runs[("ngram", 1)]["overall"]["tau"] >= 1.0
    assert runs[("ngram", 1)]["speedup"] > 0
    prompt = report["prompts"][0]
    assert prompt["outputs"]["ngram"]["1"]["tokens"] == prompt["outputs"]["autoregressive"]["1"]["tokens"]
    assert isinstance(prompt["outputs"]["ngram"]["2"]["text"], str)
    for name in ("report.json", "report.md", "tau_per_domain.png", "position_acceptance.png", "throughput_vs_concurrency.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "report.json").read_text())["num_prompts"] == 3
    assert "| ngram | 1 |" in (out / "report.md").read_text()


def test_eval_max_time_keeps_whole_batches_and_says_so(tmp_path, tiny_target, monkeypatch):
    import specdraft.eval.runner as runner

    class Clock:  # every reading of the runner's clock is 10 s later: one batch "takes" 10-20 s
        now = 0.0

        @classmethod
        def perf_counter(cls):
            cls.now += 10.0
            return cls.now

    monkeypatch.setattr(runner, "time", Clock)
    out = tmp_path / "eval"
    config = EvalConfig(
        out=str(out),
        prompts=str(_prompt_file(tmp_path)),
        drafters=["ngram"],
        max_new_tokens=6,
        concurrency=[1, 2],
        threads=1,
        plots=False,
        max_time=30,
    )
    report = run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    # batch 1 ends at 10 s; batch 2 would end at ~40 s > 30 s: not started, nor is concurrency 2
    assert report["cut_by_time"] and report["num_prompts"] == 1 and report["prompts_planned"] == 3
    assert {(r["drafter"], r["concurrency"]) for r in report["runs"]} == {("autoregressive", 1), ("ngram", 1)}
    assert all(r["identical_to_autoregressive"] == 1 and r["overall"]["requests"] == 1 for r in report["runs"])
    assert [set(p["outputs"]) for p in report["prompts"]] == [{"autoregressive", "ngram"}]
    assert "1 of 3 prompts (--max-time reached)" in (out / "report.md").read_text()

    unlimited = run_eval(
        dataclasses.replace(config, max_time=0, out=str(tmp_path / "all")), SamplingConfig(), target=tiny_target, progress=False
    )
    assert not unlimited["cut_by_time"] and unlimited["num_prompts"] == 3 and len(unlimited["runs"]) == 4


def test_eval_decoders_take_turns_and_tpot_is_the_median_over_batches(tmp_path, tiny_target, monkeypatch):
    """No decoder always runs after the same other one, and one stalled batch does not move the
    reported time per output token, nor its ratio to autoregressive decoding (the draft gate's floor
    line): that is the median of per-batch ratios, each against autoregressive decoding of the same
    prompts. Here prompts cost 1, 2 and 3 per token, autoregressive decoding stalls on the third and
    ngram on the second: the ratio of the two medians would be 3.06 / 2 = 1.53."""
    from specdraft.decode.runtime import SpeculativeDecoder

    generate = SpeculativeDecoder.generate
    calls = []
    injected = {"NoDraftProposer": iter([1.0, 2.0, 100.0]), "NgramProposer": iter([1.02, 6.0, 3.06])}

    def timed(self, prompts):
        result = generate(self, prompts)
        name = type(self.proposer).__name__
        calls.append(name)
        if len(calls) > 2:  # after the two warm-ups: a batch's time per output token is what the test says
            m = result.metrics
            m.ttft_s, m.wall_s = 0.0, next(injected[name]) * (m.output_tokens - m.requests)
        return result

    monkeypatch.setattr(SpeculativeDecoder, "generate", timed)
    out = tmp_path / "eval"
    config = EvalConfig(
        out=str(out), prompts=str(_prompt_file(tmp_path)), drafters=["ngram"], max_new_tokens=6, concurrency=[1], threads=1, plots=False
    )
    report = run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    firsts = calls[2::2]
    assert firsts == ["NgramProposer", "NoDraftProposer", "NgramProposer"]  # the order rotates batch by batch
    runs = {r["drafter"]: r for r in report["runs"]}
    assert runs["autoregressive"]["median_tpot_s"] == pytest.approx(2.0)  # the mean would be 34
    assert runs["ngram"]["tpot_vs_autoregressive"] == pytest.approx(1.02)
    assert runs["ngram"]["batch_tpot_s"] == pytest.approx([1.02, 6.0, 3.06])
    assert "| 2000.0 | 1.000 |" in (out / "report.md").read_text()


def test_report_states_the_draft_gate_floor():
    from specdraft.eval.report import gate_floor_lines

    def run(name: str, drafting: float, ratio: float, batches: list[float] | None = None) -> dict:
        overall = {
            "tau": 1.0,
            "acceptance_rate": 0.0,
            "drafted": 0,
            "rounds": 1,
            "drafting_fraction": drafting,
            "tokens_per_s": 1.0,
            "mean_ttft_s": 0.1,
            "time_per_output_token_s": 0.05,
        }
        return {
            "drafter": name,
            "concurrency": 1,
            "overall": overall,
            "speedup": 1.0,
            "identical_to_autoregressive": 1,
            "median_tpot_s": 0.05 * ratio,
            "tpot_vs_autoregressive": ratio,
            "batch_tpot_s": batches or [],
        }

    spread = [0.94, 1.0, 1.02, 1.04, 1.10]  # per-batch ratios to the autoregressive batches below (all 0.05 s per token)
    lines = gate_floor_lines(
        {
            "runs": [
                run("autoregressive", 1.0, 1.0, [0.05] * 5),
                run("full", 1.0, 1.5),
                run("gated", 0.01, 1.012),
                run("slow", 0.02, 1.05),
                run("noisy", 0.01, 1.02, [0.05 * x for x in spread]),
            ]
        }
    )
    assert lines[1:] == [
        "- draft gate floor, gated (c=1): drafted in 1% of steps, median TPOT +1.2% vs autoregressive (within the 3% floor)",
        "- draft gate floor, slow (c=1): drafted in 2% of steps, median TPOT +5.0% vs autoregressive (OVER the 3% floor)",
        "- draft gate floor, noisy (c=1): drafted in 1% of steps, median TPOT +2.0% vs autoregressive (within the 3% floor; "
        "middle half of 5 batches -3.0% to +7.0%)",
    ]


def test_eval_sampling_reports_no_identity_check(tmp_path, tiny_target):
    config = EvalConfig(out=str(tmp_path / "e"), prompts=str(_prompt_file(tmp_path)), max_new_tokens=6, plots=False, threads=1)
    report = run_eval(config, SamplingConfig(temperature=0.8, top_p=0.9), target=tiny_target, progress=False)
    assert all(r["identical_to_autoregressive"] is None for r in report["runs"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"concurrency": [0]}, "concurrency"),
        ({"drafters": []}, "at least one drafter"),
        ({"max_new_tokens": 0}, "max-new-tokens"),
        ({"max_time": -1}, "--max-time must be >= 0 seconds, got -1"),
    ],
)
def test_eval_config_rejects_bad_values(kwargs, message):
    with pytest.raises(SpecdraftError, match=message):
        EvalConfig(out="x", **kwargs)


def test_drafter_must_be_ngram_reference_or_checkpoint(tmp_path):
    with pytest.raises(SpecdraftError, match="neither 'ngram', 'suffix', 'reference' nor a checkpoint"):
        resolve_drafter(str(tmp_path / "missing"), num_draft_tokens=4, max_new_tokens=8, seed=0)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    with pytest.raises(SpecdraftError, match="speculators_model_type"):
        resolve_drafter(str(tmp_path / "ckpt"), num_draft_tokens=4, max_new_tokens=8, seed=0)
    with pytest.raises(SpecdraftError, match="no reference drafter ships for target 'tiny'.*smollm2-135m"):
        resolve_drafter("reference@scheduled", num_draft_tokens=4, max_new_tokens=8, seed=0, target="tiny")


def test_eval_cli_errors_are_clear(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["eval", "--out", str(tmp_path / "o"), "--prompts", str(empty), "--target", "/nonexistent/model"]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert main(["eval", "--out", str(tmp_path / "o"), "--temperature", "-1"]) == 2
    assert "temperature must be 0 (greedy) or at least 0.001, got -1" in capsys.readouterr().err


def test_drafter_policy_suffix(tmp_path):
    spec = resolve_drafter("ngram@full", num_draft_tokens=4, max_new_tokens=8, seed=0)
    assert spec.label == "ngram@full" and spec.verify_policy == "full"
    with pytest.raises(SpecdraftError, match="unknown verify policy"):
        resolve_drafter("ngram@sometimes", num_draft_tokens=4, max_new_tokens=8, seed=0)


def test_verify_length_histogram_from_position_counts():
    from specdraft.eval.report import verify_length_histogram

    # 5 rounds: two verified 0 drafts, one verified 1, two verified 3
    metrics = {"rounds": 5, "position_drafted": [3, 2, 2]}
    assert verify_length_histogram(metrics) == [2, 1, 0, 2]


def test_report_tables_per_domain_speedup_and_verify_length():
    from specdraft.eval.report import render_tables

    def metrics(tok_s: float, rounds: int = 0, drafted: int = 0, tau: float = 1.0) -> dict:
        return {
            "tau": tau,
            "acceptance_rate": 0.5,
            "drafted": drafted,
            "rounds": rounds,
            "drafting_fraction": 1.0,
            "tokens_per_s": tok_s,
            "mean_ttft_s": 0.1,
            "time_per_output_token_s": 1 / tok_s,
            "position_drafted": [rounds, 0],
            "plain_steps": 0,
        }

    def run(name: str, overall: dict, per_domain: dict) -> dict:
        return {
            "drafter": name,
            "concurrency": 1,
            "overall": overall,
            "per_domain": per_domain,
            "speedup": 1.0,
            "identical_to_autoregressive": 2,
        }

    report = {
        "num_prompts": 2,
        "target": {"name": "t"},
        "config": {"max_new_tokens": 8, "concurrency": [1]},
        "sampling": {"temperature": 0.0},
        "runs": [
            run("autoregressive", metrics(10), {"math": metrics(10), "code": metrics(20)}),
            run("d", metrics(15, 4, 6), {"math": metrics(15, 4, 6, tau=2.0), "code": metrics(20)}),
        ],
    }
    text = render_tables(report)
    tau, speed, verify = (text.split(title)[1].split("\n\n")[1] for title in ("tau per domain", "speed-up over", "mean verify length"))
    assert "| d | -" in tau and "| 2.00 |" in tau  # code had no drafting round: no tau
    assert "| d | 1.00x | 1.50x |" in speed  # columns are sorted: code, math
    assert "| d | - | 1.50 |" in verify


def test_parity_compares_tokens_per_round_and_flags_gaps_above_3_percent():
    """Tau is committed tokens per verification round on both sides. The per-position rates of the two sides
    differ at the ends of replies even when every round matched (figures of a measured 2-layer DFlash case:
    vLLM drafts past max_new_tokens and counts what it accepts there, the runtime does not draft there), so
    they are reported, not compared. A served side that needs 5% more rounds is flagged, 2% is not."""
    from specdraft.integrations.vllm.parity import compare_sides, parity_summary, positional_tau, round_tau

    prompt = {"outputs": {"autoregressive": {"1": {"tokens": [1, 2]}}, "endpoint:target": {"1": {"tokens": [1, 2]}}}}
    local = {
        "requests": 12,
        "output_tokens": 768,
        "rounds": 207,
        "position_drafted": [206, 197, 194],
        "position_accepted": [196, 183, 170],
        "position_acceptance": [0.95, 0.93, 0.88],
    }
    assert round_tau(local) == pytest.approx(756 / 207) and positional_tau(local) == pytest.approx(3.757, abs=1e-3)

    def served(rounds: int, accepted: list[int]) -> dict:
        overall = {
            "requests": 12,
            "output_tokens": 768,
            "rounds": rounds,
            "position_drafted": [rounds] * 3,
            "position_accepted": accepted,
            "position_acceptance": [a / rounds for a in accepted],
        }
        return {"runs": [{"drafter": "endpoint:target", "overall": overall}], "prompts": [prompt]}

    builtin = {"runs": [{"drafter": "autoregressive"}, {"drafter": "dflash:d@full", "overall": local}], "prompts": [prompt]}
    same = compare_sides(builtin, served(207, [197, 192, 172]), "d")  # positional 3.710 (-1.2%), every round the same
    close = compare_sides(builtin, served(211, [197, 188, 160]), "d")  # 4 rounds more: -1.9%
    far = compare_sides(builtin, served(218, [190, 180, 150]), "d")  # 11 rounds more: -5.0%
    assert same["gap"] == 0.0 and same["served"]["positional_tau"] == pytest.approx(3.710, abs=1e-3)
    assert not same["flagged"] and not close["flagged"] and far["flagged"] and far["gap"] == pytest.approx(207 / 218 - 1)
    assert close["served_identical_to_autoregressive"] == 1
    text = parity_summary({"gap_threshold": 0.03, "drafters": [same, far]})
    assert "| dflash:d@full | 1 | 3.652 (207) | 3.652 (207) | +0.0% | 3.757 / 3.710 | 1/1 | ok |" in text and "| **GAP** |" in text
    assert "parity gap: dflash:d@full accepts -5.0% when served by vLLM" in text


def test_parity_refuses_what_it_cannot_compare(tmp_path):
    from specdraft.eval.config import EvalConfig
    from specdraft.integrations.vllm.parity import run_parity_eval

    with pytest.raises(SpecdraftError, match="'ngram' is not a checkpoint directory"):
        run_parity_eval(EvalConfig(out=str(tmp_path), drafters=["ngram"], parity=True))
    ckpt = tmp_path / "d"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(SpecdraftError, match="compares the one drafter that server serves"):
        run_parity_eval(
            EvalConfig(out=str(tmp_path / "parity"), drafters=[str(ckpt), str(ckpt)], parity=True, endpoint="http://127.0.0.1:1")
        )


@pytest.mark.parametrize(
    "draft_dtype, bf16_seconds, expected, source",
    [
        ("auto", 13.0, "fp32", "measured"),  # bf16 is the slow one here: the report says fp32, measured
        ("auto", 0.2, "bf16", "measured"),
        ("bf16", 13.0, "bf16", "flag"),  # a flag wins and is not measured
    ],
)
def test_eval_report_records_the_resolved_draft_dtype(tmp_path, tiny_target, monkeypatch, draft_dtype, bf16_seconds, expected, source):
    import torch

    from specdraft.decode.proposers.drafters import DrafterProposer
    from specdraft.models import METHODS

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(DrafterProposer, "round_seconds", lambda self, dtype, **kw: {"fp32": 1.0, "bf16": bf16_seconds}[dtype])
    spec = METHODS.get("dspark")
    torch.manual_seed(0)
    drafter = spec.build(
        spec.config_cls(block_size=4, num_layers=1, markov_rank=16),
        tiny_target,
        counts=torch.arange(tiny_target.vocab_size, dtype=torch.int64),
    )
    drafter.save_pretrained(tmp_path / "ckpt")
    config = EvalConfig(
        out=str(tmp_path / "eval"),
        prompts=str(_prompt_file(tmp_path)),
        drafters=[str(tmp_path / "ckpt")],
        max_new_tokens=4,
        limit_per_domain=1,
        plots=False,
        threads=1,
        draft_dtype=draft_dtype,
    )
    run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    entry = report["drafters"]["dspark:ckpt"]
    assert entry["draft_dtype"] == expected and entry["draft_dtype_source"] == source and entry["draft_dtype_requested"] == draft_dtype
    assert entry.get("draft_dtype_seconds") == ({"fp32": 1.0, "bf16": bf16_seconds} if source == "measured" else None)
    assert report["drafters"]["autoregressive"]["draft_dtype"] is None
    assert report["threads"] == 1 and report["threads_source"] == "flag"
    # the forward paths: the drafter's fp32 round tied on both (injected), so the preferred eager; the target's measured
    assert (entry["draft_forward_path"], entry["draft_forward_path_source"]) == ("eager", "measured")
    from specdraft.tuning.forward_path import applicable_paths

    assert entry["draft_forward_path_seconds"] == dict.fromkeys(applicable_paths(drafter), 1.0)
    assert report["target_forward_path"]["forward_path_source"] == "measured"

    assert set(report["target_forward_path"]["forward_path_seconds"]) == set(applicable_paths(tiny_target.model)) >= {"eager", "prepacked"}
    md = (tmp_path / "eval" / "report.md").read_text()
    assert f"dspark:ckpt drafts in {expected} ({source}" in md and "; forward path eager (measured: eager 1000.0 ms/round" in md
    assert f"target forward {report['target_forward_path']['forward_path']} (measured: eager " in md
