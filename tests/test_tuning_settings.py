"""``tuning.resolve_choices``, the one entry point that decides a stage's machine choices: with injected timings, the
path is timed first (fp32), the dtype on the chosen path, the thread count at the chosen dtype; each later probe is
keyed by the earlier choices; a cache answers the second time and a given value is never measured."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from specdraft.tuning import forward_path as fp
from specdraft.tuning import threads
from specdraft.tuning.settings import Choice, MachineSettings, TimedWork, resolve_choices


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_path_then_dtype_on_it_then_threads_at_that_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(fp, "applicable_paths", lambda model: ["eager", "prepacked"])
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    by_count = {1: 0.3, 2: 1.0}
    monkeypatch.setattr(threads, "fastest_time", lambda fn, **kw: (fn(), by_count[torch.get_num_threads()])[1])
    model = nn.Linear(4, 4)
    table = {("eager", "fp32"): 1.0, ("prepacked", "fp32"): 0.5, ("prepacked", "bf16"): 0.2}
    timed, runs = [], []

    def seconds_in(dtype: str) -> float:
        timed.append((fp.current_path(model), dtype))
        return table[timed[-1]]

    work = TimedWork("probe", {"case": 1}, seconds_in=seconds_in, run=runs.append, model=model)
    settings = resolve_choices("test", work, forward_path="auto", dtype="auto", threads=0, cache_dir=tmp_path)
    assert timed == [("eager", "fp32"), ("prepacked", "fp32"), ("prepacked", "fp32"), ("prepacked", "bf16")]
    assert settings.forward_path == Choice("prepacked", "measured", {"eager": 1.0, "prepacked": 0.5})
    assert settings.compute_dtype == Choice("bf16", "measured", {"fp32": 0.5, "bf16": 0.2})
    assert settings.threads == Choice(1, "measured", {"1": 0.3, "2": 1.0}) and torch.get_num_threads() == 1
    assert set(runs) == {"bf16"} and fp.current_path(model) == "prepacked"
    stored = {p.name.rsplit("-", 1)[0]: json.loads(p.read_text()) for p in (tmp_path / "measured").glob("*.json")}
    assert set(stored) == {"forward-path-probe", "probe-dtype", "probe-threads"}
    assert stored["probe-dtype"]["context"]["forward_path"] == "prepacked"
    assert stored["probe-threads"]["context"].items() >= {"forward_path": "prepacked", "dtype": "bf16", "case": 1}.items()

    # the second time every choice is read back from the cache: nothing is timed, whatever the work would take now
    timed.clear()
    table.update({("eager", "fp32"): 0.1, ("prepacked", "fp32"): 9.0})
    again = resolve_choices("test", work, forward_path="auto", dtype="auto", threads=0, cache_dir=tmp_path)
    assert timed == [] and [c.source for c in (again.forward_path, again.compute_dtype, again.threads)] == ["cached"] * 3
    assert (again.forward_path.value, again.compute_dtype.value, again.threads.value) == ("prepacked", "bf16", 1)


def test_given_values_are_used_as_given_and_unasked_choices_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    model = nn.Linear(4, 4)

    def never(*args):
        raise AssertionError("a given value was measured")

    work = TimedWork("probe", {}, seconds_in=never, run=never, model=model)
    settings = resolve_choices("test", work, forward_path="eager", dtype="fp32", threads=1)
    assert settings.forward_path == Choice("eager", "flag") and settings.compute_dtype == Choice("fp32", "flag")
    assert settings.threads == Choice(1, "flag") and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    only_dtype = resolve_choices("test", work, dtype="bf16")
    assert only_dtype.forward_path is None and only_dtype.threads is None and torch.get_num_threads() == 2
    assert not (tmp_path / "measured").exists()


DRAFT_SECONDS = {"fp32": 0.001, "bf16": 0.004}


def test_a_stage_block_names_the_engine_and_each_drafters_choices():
    settings = MachineSettings(
        "eval",
        forward_path=Choice("eager", "cached", {"eager": 0.002}),
        threads=Choice(2, "flag"),
        engine=Choice("hf", "no .venv-vllm: hf, the only engine here"),
        drafters={
            "dspark:ckpt": MachineSettings(
                "dspark:ckpt", draft_forward_path=Choice("eager", "only"), draft_dtype=Choice("fp32", "measured", DRAFT_SECONDS)
            ),
            "ngram": MachineSettings("ngram"),
        },
    )
    assert settings.describe() == (
        "eval machine settings:\n"
        "  forward path: eager (from cache: eager 2.0 ms)\n"
        "  threads: 2 (given)\n"
        "  engine: hf (no .venv-vllm: hf, the only engine here)\n"
        "  dspark:ckpt draft forward path: eager (the only one that applies)\n"
        "  dspark:ckpt draft dtype: fp32 (measured now: fp32 1.0 ms, bf16 4.0 ms)"
    )
    facts = settings.drafters["dspark:ckpt"].draft_dtype.facts("draft_dtype")
    assert facts == {"draft_dtype": "fp32", "draft_dtype_source": "measured", "draft_dtype_seconds": DRAFT_SECONDS}
    assert Choice.from_facts(facts, "draft_dtype") == settings.drafters["dspark:ckpt"].draft_dtype
    assert Choice(2, "flag").facts("threads") == {"threads": 2, "threads_source": "flag"}
