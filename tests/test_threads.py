"""The CPU thread count (tuning/threads.py): measured where it matters, with injected timings so the decision
is tested on any machine; an explicit count always wins."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.tuning import threads
from specdraft.tuning.threads import resolve_threads, thread_candidates


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def inject(monkeypatch, seconds: dict[int, float], cores: int) -> list[int]:
    """Each probe 'takes' ``seconds[the thread count it ran at]``; returns the counts timed, in order."""
    timed: list[int] = []

    def fake_fastest_time(work, **kwargs):
        work()  # the real work runs; only its timing is injected
        timed.append(torch.get_num_threads())
        return seconds[timed[-1]]

    monkeypatch.setattr(threads, "fastest_time", fake_fastest_time)
    monkeypatch.setattr(threads, "available_cores", lambda: cores)
    return timed


@pytest.mark.parametrize("cores, expected", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (16, [1, 2, 4, 8, 16])])
def test_candidates_span_one_to_all_cores(cores, expected):
    assert thread_candidates(cores) == expected


@pytest.mark.parametrize(
    "seconds, expected",
    [
        ({1: 0.25, 2: 1.0, 4: 0.9}, 1),  # a busy shared CPU: one thread is 4x faster than all
        ({1: 1.0, 2: 0.6, 4: 0.3}, 4),  # an idle machine: all cores
        ({1: 1.0, 2: 0.97, 4: 1.0}, 4),  # within the margin of all cores: keep the default
    ],
)
def test_the_fastest_count_is_set_and_cached(tmp_path, monkeypatch, seconds, expected):
    timed = inject(monkeypatch, seconds, cores=4)
    work = []
    first = resolve_threads(0, "probe-threads", {"work": 1}, lambda: work.append(1), cache_dir=tmp_path)
    assert sorted(timed) == [1, 2, 4] and first.choice == str(expected) and not first.cached
    assert len(work) == 4  # one warm-up in all, then one timed call per count: a slow count is not paid for twice
    assert torch.get_num_threads() == expected
    torch.set_num_threads(3)  # the cache is keyed by the cores, not by the count set at the time
    again = resolve_threads(0, "probe-threads", {"work": 1}, lambda: None, cache_dir=tmp_path)
    assert again.cached and again.choice == str(expected) and len(timed) == 3 and torch.get_num_threads() == expected
    stored = json.loads(next((tmp_path / "measured").glob("probe-threads-*.json")).read_text())
    assert stored["machine"]["cores"] == 4 and "threads" not in stored["machine"] and stored["choice"] == str(expected)


def test_an_explicit_count_wins_and_is_not_measured(tmp_path, monkeypatch):
    timed = inject(monkeypatch, {1: 0.1, 2: 1.0}, cores=2)
    assert resolve_threads(2, "probe-threads", {}, lambda: None, cache_dir=tmp_path) is None
    assert torch.get_num_threads() == 2 and timed == []
    assert threads.threads_facts(2, None) == {"threads": 2, "threads_source": "flag"}


@pytest.mark.parametrize("one_thread_seconds, expected", [(0.1, 1), (5.0, 2)])
def test_training_steps_run_at_the_measured_count(tmp_path, monkeypatch, one_thread_seconds, expected):
    from specdraft.train.trainer import train
    from test_train_toy import ToyStore, ToyTarget, toy_config

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    inject(monkeypatch, {1: one_thread_seconds, 2: 1.0}, cores=2)
    result = train(toy_config(tmp_path / "run", num_threads=0, max_steps=2), target=ToyTarget(), dataset=ToyStore())
    assert result.threads == {"threads": expected, "threads_source": "measured", "threads_seconds": {"1": one_thread_seconds, "2": 1.0}}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["threads"] for r in records if r["split"] == "train"} == {expected}
    flagged = train(toy_config(tmp_path / "flag", num_threads=2, max_steps=1), target=ToyTarget(), dataset=ToyStore())
    assert flagged.threads == {"threads": 2, "threads_source": "flag"}


def test_eval_decodes_at_the_measured_count_and_reports_it(tmp_path, tiny_target, monkeypatch):
    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.runner import run_eval

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    timed = inject(monkeypatch, {1: 0.1, 2: 1.0}, cores=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello."}) + "\n")
    report = run_eval(
        EvalConfig(out=str(tmp_path / "e"), prompts=str(prompts), max_new_tokens=3, plots=False),
        SamplingConfig(),
        target=tiny_target,
        progress=False,
    )
    assert sorted(timed) == [1, 2] and torch.get_num_threads() == 1
    assert (report["threads"], report["threads_source"], report["threads_seconds"]) == (1, "measured", {"1": 0.1, "2": 1.0})
    assert "1 CPU threads (measured: 1 100.0 ms, 2 1000.0 ms)" in (tmp_path / "e" / "report.md").read_text()


@pytest.mark.parametrize("one_thread_seconds, expected", [(0.1, 1), (5.0, 2)])
def test_extraction_forwards_at_the_measured_count(tmp_path, monkeypatch, one_thread_seconds, expected):
    from test_extract import make_dataset, random_llama_target, run

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    timed = inject(monkeypatch, {1: one_thread_seconds, 2: 1.0}, cores=2)
    target = random_llama_target()
    summary = run(target, make_dataset(tmp_path / "data", target), tmp_path / "hs", batch_size=2)
    assert summary.samples_extracted == 5 and sorted(timed) == [1, 2] and torch.get_num_threads() == expected
    stored = json.loads(next((tmp_path / "cache" / "measured").glob("forward-threads-*.json")).read_text())
    assert stored["context"]["rows"] == 2 and stored["context"]["tokens"] == 8  # the median length 7, rounded up
    run(target, make_dataset(tmp_path / "data2", target), tmp_path / "hs2", batch_size=2, threads=2)  # a flag wins: nothing timed
    assert len(timed) == 2 and torch.get_num_threads() == 2
