"""The quickstart's served rows (``quickstart/served.py``): --served auto/on/off, the bench's measured reserve and the
decision it makes, and the two served stages with training and the vLLM bench injected (no vLLM runs here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specdraft.errors import SpecdraftError
from specdraft.quickstart import QuickstartConfig
from specdraft.quickstart.config import MIN_TRAIN_S
from specdraft.quickstart.report import served_table, training_table
from specdraft.quickstart.served import SERVED_SERVERS, find_served_python, served_bench_seconds, served_rows, size_served

#: A plain vLLM server as the probe measures one: its start (warm-up and stop included) and one request's seconds.
FIGURES = {"start_s": 40.0, "request_s": 3.65}


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    """The lookup's first place names a file that is not there: the only candidate, so no vLLM is found."""
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(tmp_path / "absent" / "python"))


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """A vLLM environment the lookup finds (nothing starts it: the stages' vLLM work is injected)."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(python))
    return python


def test_bench_seconds_count_each_server_start_and_every_request_of_every_level():
    request_s = FIGURES["request_s"]
    assert served_bench_seconds(FIGURES, prompts=5, concurrency=[1], servers=3) == pytest.approx(3 * (40 + 5 * request_s))
    # a level above the prompt count cycles prompts up to it; a slower machine's start and tokens cost more
    assert served_bench_seconds(FIGURES, prompts=5, concurrency=[1, 8], servers=3) == pytest.approx(3 * (40 + (5 + 8) * request_s))
    slow = {"start_s": 120.0, "request_s": 12.0}
    assert served_bench_seconds(slow, prompts=5, concurrency=[1], servers=3) > 3 * served_bench_seconds(
        FIGURES, prompts=5, concurrency=[1], servers=3
    )


def test_served_off_auto_and_on_resolve_against_the_vllm_lookup(no_vllm):
    assert find_served_python("off") == (None, "--served off")
    python, why = find_served_python("auto")
    assert python is None and "no vLLM environment found" in why and "SPECDRAFT_VLLM_PYTHON" in why
    with pytest.raises(SpecdraftError, match=r"--served on needs a vLLM environment.*SPECDRAFT_VLLM_PYTHON.*--served auto or off"):
        find_served_python("on")


def test_a_found_vllm_turns_auto_and_on_on(fake_vllm):
    assert find_served_python("auto") == (fake_vllm, "")
    assert find_served_python("on") == (fake_vllm, "")
    assert find_served_python("off")[0] is None


def test_served_on_without_vllm_is_refused_before_the_run_directory_is_made(no_vllm, tmp_path):
    from specdraft.quickstart.stages import _open_run

    with pytest.raises(SpecdraftError, match="--served on"):
        _open_run(QuickstartConfig(out=str(tmp_path / "run"), served="on"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("changes", "flag"), [({"served": "sometimes"}, "--served"), ({"served_concurrency": [0]}, "--served-concurrency")]
)
def test_bad_served_flags_are_refused_naming_the_flag(changes, flag):
    with pytest.raises(SpecdraftError, match=flag):
        QuickstartConfig(**changes)


@pytest.fixture
def five_prompts(monkeypatch):
    """The quick suite's prompts as 5 placeholders: only their count reaches the estimate (loading the suite takes
    seconds)."""
    monkeypatch.setattr("specdraft.eval.suites.load_prompts", lambda suite, path, limit: [object()] * 5)


def _sized(tiny_target, tmp_path, budget: float, served: str) -> dict:
    config = QuickstartConfig(out=str(tmp_path), target="tiny", budget=budget, served=served, eval_max_new_tokens=64)
    return size_served(config, tiny_target, tmp_path / "python", eval_reserve_s=120.0, spent_s=30.0, figures=FIGURES)


def test_the_measured_reserve_is_folded_into_the_budget_check(tiny_target, tmp_path, five_prompts):
    """The bench's reserve comes from the injected figures; a budget that holds it with the comparison's reserve and
    both drafters' least training keeps the rows, one that does not drops them in auto mode and is refused in on mode."""
    held = _sized(tiny_target, tmp_path, budget=20, served="auto")
    assert held["served"] and held["servers"] == SERVED_SERVERS == 3 and held["prompts"] == 5
    bench = held["bench_s"]
    assert bench == pytest.approx(served_bench_seconds(FIGURES, prompts=held["prompts"], concurrency=[1], servers=3), abs=0.1)
    # just enough: spent + comparison + bench + two drafters' least training
    enough = (30 + 120 + bench + 2 * MIN_TRAIN_S + 1) / 60
    assert _sized(tiny_target, tmp_path, budget=enough, served="on")["served"]
    short = (30 + 120 + bench + MIN_TRAIN_S + 1) / 60  # the comparison's drafter fits, the served rows do not
    skipped = _sized(tiny_target, tmp_path, budget=short, served="auto")
    assert not skipped["served"] and "served rows' reserve" in skipped["why"] and "--served off drops them" in skipped["why"]
    with pytest.raises(SpecdraftError, match=r"too small for a run.*served rows' reserve"):
        _sized(tiny_target, tmp_path, budget=short, served="on")


def test_a_slower_server_reserves_more(tiny_target, tmp_path, five_prompts):
    config = QuickstartConfig(out=str(tmp_path), target="tiny", budget=60)
    fast = size_served(config, tiny_target, tmp_path, eval_reserve_s=60, spent_s=0, figures=FIGURES)
    slow = size_served(config, tiny_target, tmp_path, eval_reserve_s=60, spent_s=0, figures={**FIGURES, "start_s": 90, "request_s": 7.0})
    assert slow["bench_s"] == pytest.approx(fast["bench_s"] + 3 * (50 + 5 * 3.35), abs=0.2)


LEVELS = [
    {"server": "plain", "concurrency": 1, "per_user_tok_s": 20.0, "speedup": 1.0, "spec": None},
    {
        "server": "ngram",
        "concurrency": 1,
        "per_user_tok_s": 22.0,
        "speedup": 1.1,
        "spec": {"tau": 1.3},
        "agreement": {"identical": 5, "compared": 5},
    },
    {
        "server": "dflash",
        "concurrency": 1,
        "per_user_tok_s": 30.0,
        "speedup": 1.5,
        "spec": {"tau": 2.25},
        "agreement": {"identical": 4, "compared": 5},
    },
]


def test_served_rows_and_their_table():
    rows = served_rows({"levels": LEVELS})
    assert [r["server"] for r in rows] == ["plain", "ngram", "dflash"]
    table = served_table(rows)
    assert "| plain | 1 | 20.0 | 1.00x | - | - |" in table
    assert "| dflash | 1 | 30.0 | 1.50x | 2.25 | 4/5 |" in table


def test_the_training_table_says_why_served_rows_were_skipped_or_what_they_reserved():
    assert "| served rows | skipped: --served off |" in training_table({}, served_skipped="--served off")
    stages = {
        "size-served": {"figures": FIGURES, "bench_s": 300.0, "servers": 3, "prompts": 5, "tokens": 64},
        "size-served-training": {"steps": 40},
        "train-served": {"steps": 40, "dtype": "fp32"},
    }
    table = training_table(stages)
    assert "| served reserve | 5.0 min: 3 servers x (start 40 s + 5 prompts x 3.6 s per 64-token request" in table
    assert "| served drafter | dflash, 40 steps done of 40 planned (fp32) |" in table


def _served_run(tiny_llama_dir, tmp_path, monkeypatch, budget: float = 30.0):
    """A run opened with the served rows on (a fake vLLM found), sized and planned as if the earlier stages had run."""
    from specdraft.quickstart import stages

    run = stages._open_run(
        QuickstartConfig(target=str(tiny_llama_dir), out=str(tmp_path / "run"), served="on", threads=1, budget=budget, max_anchors=5)
    )
    run.reserve_s, run.served_s = 60.0, 120.0
    run.journal.run("size-served-training", lambda: {"steps": 7, "seconds_per_step": 0.5})
    trained, benched = [], []

    def fake_train(cfg, target=None):
        trained.append(cfg)
        return SimpleNamespace(completed=True, stopped_by=None, step=cfg.max_steps, final=cfg.out + "/final", compute_dtype="fp32")

    def fake_bench(config):
        benched.append(config)
        return {"levels": LEVELS}

    monkeypatch.setattr("specdraft.train.trainer.train", fake_train)
    monkeypatch.setattr("specdraft.integrations.vllm.served_bench.run_served_bench", fake_bench)
    return stages, run, trained, benched


def test_served_stages_train_a_dflash_drafter_on_the_runs_states_and_bench_it(fake_vllm, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    stages, run, trained, benched = _served_run(tiny_llama_dir, tmp_path, monkeypatch)
    stages._train_served(run)
    stages._bench_served(run)
    (cfg,) = trained
    assert cfg.method == "dflash" and cfg.data == str(run.states) and cfg.out == str(run.out / "train-served")
    assert (cfg.max_steps, cfg.pack_tokens, cfg.epochs, cfg.model["max_anchors"], cfg.num_threads) == (7, 512, 6, 5, 1)
    (bench,) = benched
    assert bench.out == str(run.out / "served") and bench.baselines == ["ngram"] and bench.concurrency == [1]
    assert bench.drafters == [f"dflash={run.out / 'train-served' / 'final'}"]
    assert (bench.suite, bench.limit_per_domain, bench.max_new_tokens) == ("quick", 1, 64)
    journal = json.loads((run.out / "quickstart.json").read_text())["stages"]
    assert journal["train-served"]["steps"] == 7 and [r["server"] for r in journal["served"]["rows"]] == ["plain", "ngram", "dflash"]
    stages._close_run(run)
    out = capsys.readouterr().out
    assert "| dflash | 1 | 30.0 | 1.50x | 2.25 | 4/5 |" in out and str(run.out / "served" / "served.md") in out
    # a rerun skips both: they are journaled
    rerun = stages._open_run(run.config)
    rerun.reserve_s, rerun.served_s = run.reserve_s, run.served_s
    stages._train_served(rerun)
    stages._bench_served(rerun)
    assert len(trained) == len(benched) == 1


def test_a_bench_the_time_left_cannot_hold_is_skipped_and_said_why(fake_vllm, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    stages, run, trained, benched = _served_run(tiny_llama_dir, tmp_path, monkeypatch, budget=2.0)  # 2 min: less than 60 + 120 s
    stages._train_served(run)
    stages._bench_served(run)
    assert len(trained) == 1 and not benched
    why = run.journal.state["served_skipped"]
    assert "less than the bench's 2.0 min (measured)" in why and "served rows skipped" in capsys.readouterr().out
    assert "| served rows | skipped:" in training_table(run.journal.state["stages"], served_skipped=why)


def test_the_served_drafter_gets_half_of_trainings_time_and_the_other_drafter_the_rest(fake_vllm, tiny_llama_dir, tmp_path, monkeypatch):
    """``size-served-training`` plans the served drafter in half of what training gets after both reserves (its epochs
    cap may plan less), and keeps what its steps take from the comparison's drafter until it has trained."""
    from specdraft.train import budget

    stages, run, _, _ = _served_run(tiny_llama_dir, tmp_path, monkeypatch)
    del run.journal.state["stages"]["size-served-training"]
    run.journal.redoing = False
    budgets = []

    def fake_plan(cfg, budget_seconds, *, target=None, cap_at_epochs=False):
        budgets.append((cfg.method, budget_seconds, cap_at_epochs))
        return {"steps": 30, "seconds_per_step": 1.8}

    monkeypatch.setattr(budget, "steps_for_budget", fake_plan)
    training_s = run.seconds_left() - run.kept_s()
    stages._plan_served_training(run)
    ((method, share, capped),) = budgets
    assert method == "dflash" and capped and share == pytest.approx(training_s / 2, abs=1.0)
    assert run.served_train_s == pytest.approx(30 * 1.8 / budget.HEADROOM)


def test_a_served_drafter_the_time_left_gives_no_share_is_skipped(fake_vllm, tiny_llama_dir, tmp_path, monkeypatch):
    stages, run, _, _ = _served_run(tiny_llama_dir, tmp_path, monkeypatch, budget=2.0)  # 2 min: all of it kept by the reserves
    del run.journal.state["stages"]["size-served-training"]
    stages._plan_served_training(run)
    assert run.served_python is None and run.served_train_s == 0
    assert "its drafter's share of training is" in run.journal.state["served_skipped"]


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_failing_server_drops_the_rows_in_auto_mode_and_stops_the_run_in_on_mode(mode, fake_vllm, tiny_llama_dir, tmp_path, monkeypatch):
    import dataclasses

    stages, run, _, _ = _served_run(tiny_llama_dir, tmp_path, monkeypatch)
    run.config = dataclasses.replace(run.config, served=mode)
    stages._train_served(run)

    def failing(config):
        raise SpecdraftError("vLLM server exited with code 1 while starting\nlog tail")

    monkeypatch.setattr("specdraft.integrations.vllm.served_bench.run_served_bench", failing)
    if mode == "on":
        with pytest.raises(SpecdraftError, match="exited with code 1"):
            stages._bench_served(run)
    else:
        stages._bench_served(run)
        assert run.journal.state["served_skipped"] == "the served bench failed: vLLM server exited with code 1 while starting"
