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
import re

import pytest
from sweep3_cases import CASES, Sweep3, build_sweep3
from sweep_cases import run_in_process


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def sweep3(tmp_path_factory, tiny_target_factory) -> Sweep3:
    return build_sweep3(
        tmp_path_factory.mktemp("sweep3"),
        run_in_process,
        target=tiny_target_factory("llama", num_layers=4),
        target_b=tiny_target_factory("llama", num_layers=4, seed=1),
    )


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
    damaged = {
        "a JSON list": [1, 2],
        "not JSON": '{"sample_ids": ["a", ',
        "strings for ids": {**good, "completions": [["x"], [3]]},
        "ids past the vocabulary": {**good, "completions": [[1, 10], [3]]},
        "booleans for ids": {**good, "completions": [[True], [3]]},
        "one completion short": {**good, "completions": [[1]]},
        "completions a string": {**good, "completions": "12"},
    }
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
    for damaged in (
        [1, 2],
        {**good, "slots": "output:1"},
        {**good, "samples": 7},
        {**good, "dataset": "data"},
        {**good, "count": True},
        {**good, "slots": ["output:1"]},
        "{not json",
    ):
        (tmp_path / "s" / "manifest.json").write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
        with pytest.raises(SpecdraftError, match=r"manifest.json is damaged .*extract into a new directory \(`specdraft extract --out "):
            store.read_manifest()
    store.path("a").mkdir()
    with pytest.raises(SpecdraftError, match=r"a.safetensors is a directory, not the stored sample 'a'"):
        store.get("a")


def test_a_damaged_prepared_manifest_or_a_token_past_the_vocabulary_is_one_clear_error(tmp_path):
    """A prepared manifest of the wrong shape failed its first reader with a traceback (a JSON list: AttributeError; a
    string target: ValueError), and a token id past the manifest's vocab_size failed extract in the embedding
    (IndexError); each is refused where the dataset is read, naming the file, and for a token its row and value."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specdraft.data.dataset import PreparedDataset, write_prepared
    from specdraft.errors import SpecdraftError

    rows = [{"sample_id": s, "source": "x", "input_ids": ids, "loss_mask": [1] * len(ids)} for s, ids in (("a", [1, 2]), ("b", [3, 4, 5]))]
    data = write_prepared(tmp_path / "ds", rows, target_info={"name": "t"}, config={}, stats={}, vocab_size=8)
    manifest = json.loads((data / "manifest.json").read_text())
    for damaged in (
        [],
        {**manifest, "target": "smollm2"},
        {**manifest, "vocab_size": "8"},
        {**manifest, "vocab_size": True},
        {**manifest, "checksums": [1]},
        {**manifest, "vocab_size": 0},
    ):
        (data / "manifest.json").write_text(json.dumps(damaged))
        with pytest.raises(SpecdraftError, match=r"manifest.json is damaged \(.*\); rerun `specdraft prepare`"):
            PreparedDataset(data)
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert len(PreparedDataset(data)) == 2
    table = pq.read_table(data / "data.parquet")
    for bad in (8, -1, 10**6):
        ids = [[1, 2], [3, bad, 5]]
        pq.write_table(table.set_column(2, "input_ids", pa.array(ids, pa.list_(pa.int32()))), data / "data.parquet")
        with pytest.raises(
            SpecdraftError,
            match=rf"data.parquet: row 1 \(sample_id 'b'\) holds token id {bad} at position 1, "
            r"outside the vocabulary of 8",
        ):
            PreparedDataset(data)


def test_a_damaged_split_record_is_refused_naming_its_field(tmp_path):
    """read_split checked only the format and validation_ids, so a resume failed with a traceback on a val_fraction
    string (TypeError) or a missing seed (KeyError); every field the resume reads is checked, with its type."""
    from specdraft.errors import SpecdraftError
    from specdraft.train.split import read_split

    path = tmp_path / "split.json"
    good = {"format": "specdraft.split", "val_fraction": 0.2, "seed": 0, "hash": "ab", "validation_ids": ["a"], "validation_groups": ["g"]}
    path.write_text(json.dumps(good))
    assert read_split(path) == good
    damaged = [
        ({"seed": None}, "has no 'seed'"),
        ({"val_fraction": "0.2"}, "has 'val_fraction' \"0.2\""),
        ({"val_fraction": 1}, "not a number in \\[0, 1\\)"),
        ({"seed": 1.5}, "not an integer"),
        ({"seed": True}, "not an integer"),
        ({"validation_ids": [1]}, "not a list of sample ids"),
        ({"validation_groups": "g"}, "not a list of conversation groups"),
        ({"hash": [1]}, "not a string"),
    ]
    for edit, message in damaged:
        path.write_text(json.dumps({k: v for k, v in {**good, **edit}.items() if v is not None}))
        with pytest.raises(SpecdraftError, match=rf"split.json .*{message}.*; delete it to recompute the split"):
            read_split(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k not in ("hash", "validation_groups")}))
    assert read_split(path)["seed"] == 0  # records written before those fields: still read


def test_a_metrics_line_that_is_no_record_is_refused_naming_it(tmp_path):
    """truncate_after assumed every JSON line is an object: a JSON list (AttributeError) or a string step (TypeError)
    failed the resume with a traceback."""
    from specdraft.errors import SpecdraftError
    from specdraft.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    for line in ("[1, 2]", '"text"', '{"step": "3"}', '{"step": true}', "null"):
        path.write_text(f'{{"step": 1}}\n{line}\n{{"step": 3}}\n')
        with pytest.raises(SpecdraftError, match=rf"metrics.jsonl line 2 \({re.escape(line)}\) is not a record .*delete or repair"):
            MetricsLog(path).truncate_after(2)
        assert path.read_text() == f'{{"step": 1}}\n{line}\n{{"step": 3}}\n'  # nothing dropped by the refusal
    path.write_text('{"step": 1}\n{"split": "meta"}\n{"step": 3}\n')
    MetricsLog(path).truncate_after(2)
    assert path.read_text() == '{"step": 1}\n{"split": "meta"}\n'


def test_a_directory_or_a_file_in_the_way_is_one_line_naming_the_path(tmp_path):
    """os_error_message mapped no EISDIR, so a directory where a run writes a file (config.resolved.yaml) was a
    traceback from every command; ENOTDIR (a file where a directory is expected) likewise."""
    from specdraft.errors import os_error_message

    (tmp_path / "a-file").write_text("")
    for path, words in (
        (tmp_path, "a directory is where a file is expected"),
        (tmp_path / "a-file" / "x", "a file is where a directory is expected"),
    ):
        with pytest.raises(OSError) as info:
            path.read_text()
        message = os_error_message(info.value)
        assert message and str(tmp_path) in message and words in message and "move it aside" in message
    assert os_error_message(RuntimeError("x")) is None  # no OSError in the chain: a bug keeps its traceback


def test_an_incomplete_latest_checkpoint_is_refused_before_training_not_skipped(tmp_path):
    """A checkpoint without trainer_state.json (written last: no write of ours leaves one) was skipped by the resume,
    which trained its steps again and then could not replace it; now the resume starts from it, and refuses it."""
    from specdraft.errors import SpecdraftError
    from specdraft.train import checkpoint_files as ckpt

    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4, 10):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / "model.safetensors").write_bytes(b"w")
    (root / ".step-12.tmp").mkdir()
    assert ckpt.latest_checkpoint(tmp_path / "run") == root / "step-10"  # by number, not by name; debris is no checkpoint
    with pytest.raises(
        SpecdraftError,
        match=r"step-10 is not a complete checkpoint: its trainer_state.json, written last, is missing; "
        r"delete that checkpoint directory to resume from an older one",
    ):
        ckpt.read_state(root / "step-10")
    assert (root / "step-10" / "model.safetensors").read_bytes() == b"w"
    assert ckpt.latest_checkpoint(tmp_path / "elsewhere") is None
