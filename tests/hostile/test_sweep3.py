"""Issue 37's own sweep (item 7) as tests: each case of ``sweep3_cases.CASES`` must end in its verdict.

The commands under test run in this process (``sweep_cases.run_in_process``); what must be a separate process is
one: a run killed with SIGKILL, a writer frozen beside another, a command with a private cache or another
environment (``sweep3_cases.spawn``). The same cases, every command a subprocess, with a table of verdicts:
``python benchmarks/hostile_sweep.py --cases sweep3`` (results in ``docs/results/hostile_sweep3.md``). A case
marked ``xfail`` names a known bug not fixed yet; it is expected to fail (strictly) until the fix lands.
"""

from __future__ import annotations

import json
import logging

import pytest

from sweep3_cases import CASES, Sweep3, build_sweep3
from sweep_cases import run_in_process


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def sweep3(tmp_path_factory, tiny_target_factory) -> Sweep3:
    return build_sweep3(tmp_path_factory.mktemp("sweep3"), run_in_process, target=tiny_target_factory("llama", num_layers=4),
                        target_b=tiny_target_factory("llama", num_layers=4, seed=1))


def _param(case):
    marks = [pytest.mark.xfail(reason=case.xfail, strict=True)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_sweep3_case(sweep3, case):
    verdict = case.run(sweep3, lambda args: run_in_process(args, timeout=180))
    if verdict.detail.startswith("skipped"):
        pytest.skip(verdict.detail)
    assert not verdict.problems, "\n".join(verdict.problems)
    assert verdict.ok, f"{case.name}: expected {verdict.detail}; got exit {verdict.result.code}: {verdict.result.message}"


def test_damaged_regeneration_work_is_generated_again(tmp_path, caplog):
    """A stored batch is reused only when it is what ``regenerate`` writes; a damaged one is regenerated with a warning
    (it failed the rerun with a traceback: a JSON list, strings for ids; or with ids out of range, on every rerun)."""
    from specdraft.data.regenerate import _load_batch

    path = tmp_path / "batch-000000.json"
    good = {"sample_ids": ["a", "b"], "completions": [[1, 2], [3]]}
    path.write_text(json.dumps(good))
    assert _load_batch(path, ["a", "b"], 10) == [[1, 2], [3]]
    assert _load_batch(path, ["a", "c"], 10) is None  # another batching: not this batch, and no warning
    assert _load_batch(tmp_path / "absent.json", ["a", "b"], 10) is None
    assert not caplog.records
    damaged = {"a JSON list": [1, 2], "not JSON": '{"sample_ids": ["a", ', "strings for ids": {**good, "completions": [["x"], [3]]},
               "ids past the vocabulary": {**good, "completions": [[1, 10], [3]]},
               "booleans for ids": {**good, "completions": [[True], [3]]},
               "one completion short": {**good, "completions": [[1]]}, "completions a string": {**good, "completions": "12"}}
    for what, content in damaged.items():
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with caplog.at_level(logging.WARNING, logger="specdraft.data.regenerate"):
            caplog.clear()
            assert _load_batch(path, ["a", "b"], 10) is None, what
        assert "generating that batch again" in caplog.text and str(path) in caplog.text, what


def test_a_damaged_store_manifest_or_a_directory_for_a_sample_is_one_clear_error(tmp_path):
    """A store manifest of the wrong shape failed its first reader with a traceback (a JSON list, slots as a string,
    samples as a number: AttributeError, TypeError), and so did a directory in a sample file's place (IsADirectoryError)."""
    from specdraft.errors import SpecdraftError
    from specdraft.hidden_states.backends.file import FileBackend

    store = FileBackend(tmp_path / "s")
    good = {"format": "specdraft.hidden_states", "slots": [{"side": "output", "layer": 1}], "samples": ["a"], "count": 1}
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(good))
    assert store.read_manifest() == good
    for damaged in ([1, 2], {**good, "slots": "output:1"}, {**good, "samples": 7}, {**good, "dataset": "data"}, {**good, "count": True},
                    {**good, "slots": ["output:1"]}, "{not json"):
        (tmp_path / "s" / "manifest.json").write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
        with pytest.raises(SpecdraftError, match=r"manifest.json is damaged .*extract into a new --out"):
            store.read_manifest()
    store.path("a").mkdir()
    with pytest.raises(SpecdraftError, match=r"a.safetensors is a directory, not the stored sample 'a'"):
        store.get("a")
