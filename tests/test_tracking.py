"""``--report-to``: each tracker backend run in its local mode, its values read back and compared with ``metrics.jsonl``
(TensorBoard's event reader, MLflow's client on the run's SQLite store, W&B's offline run file, TrackIO's local store),
the eval summary mirrored once, and the one-line errors for an unknown tracker or a missing package."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from specdraft.decode.config import SamplingConfig
from specdraft.errors import SpecdraftError
from specdraft.eval.config import EvalConfig
from specdraft.eval.report import EVAL_DIR
from specdraft.eval.runner import run_eval
from specdraft.tracking import STATE_FILE, TRACKERS, TrackedRun, local_files, open_trackers, record_metrics
from specdraft.tracking.base import require
from specdraft.train.config import TrainConfig
from specdraft.train.trainer import train
from test_train_methods import build_stores
from test_train_methods import config as method_config
from test_train_toy import SignalAfterReads, ToyStore, ToyTarget, toy_config

TESTS = Path(__file__).parent


def jsonl(out: Path, split: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_hparams(logdir: Path) -> dict[str, object]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(logdir))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {key: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind")) for key, value in start.hparams.items()}


def mlflow_client(out: Path):
    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The ``noload`` loader strategy is deprecated")  # as tracking/mlflow.py
        client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
        client.search_experiments()  # the store opens on first use
    return client


def mlflow_history(out: Path, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow_client(out).get_metric_history(run_id, name))


def wandb_records(path: Path):
    """The protobuf records of a W&B offline run file: a 7-byte header (``:W&B``, magic, version), then LevelDB's log
    format: 32 KiB blocks of chunks, each a 7-byte header (CRC-32C, length, type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a record is complete
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def wandb_finished(path: Path, timeout: float = 60.0) -> list:
    """The records of an offline run file once its ``exit`` record is there: W&B's own process (wandb-core) writes the
    file, and on a loaded machine ``finish()`` was seen to return before its last records had landed."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_history(out: Path) -> tuple[list[dict], dict, list[str]]:
    """(history rows, config, run ids) of every offline attempt of the run under ``out/wandb``."""
    rows, config, ids = [], {}, []
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_finished(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
            elif kind == "run":
                ids.append(record.run.run_id)
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return rows, config, ids


def test_record_metrics_are_the_numbers_of_a_record_under_its_split():
    record = {
        "split": "val",
        "step": 7,
        "loss": 1.5,
        "dtype": "fp32",
        "non_finite_loss": True,
        "accept_len": None,
        "position_acc": [0.5, 0.25],
        "decoded": {"tau": 2.0, "position_acceptance": [0.75]},
        "threads": 2,
    }
    assert record_metrics(record) == {
        "val/loss": 1.5,
        "val/position_acc/1": 0.5,
        "val/position_acc/2": 0.25,
        "val/decoded/tau": 2.0,
        "val/decoded/position_acceptance/1": 0.75,
        "val/threads": 2.0,
    }


def test_report_to_names_registered_trackers_or_none():
    assert TRACKERS.names() == ["mlflow", "tensorboard", "trackio", "wandb"]
    assert TrainConfig().report_to == [] and TrainConfig(report_to=["none"]).report_to == []
    assert TrainConfig(report_to=["mlflow", "tensorboard", "mlflow"]).report_to == ["mlflow", "tensorboard"]
    choices = "none, mlflow, tensorboard, trackio, wandb"
    with pytest.raises(SpecdraftError, match=rf"--report-to: unknown tracker 'swanlab'; choose from {choices}"):
        TrainConfig(report_to=["swanlab"])
    with pytest.raises(SpecdraftError, match=r"unknown tracker 'none' \(alone: it means no tracker\)"):
        EvalConfig(out="x", report_to=["none", "wandb"])


@pytest.mark.parametrize("name", ["tensorboard", "mlflow", "wandb", "trackio"])
def test_missing_tracker_package_is_one_line_naming_the_extra(name, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, name, None)  # `import NAME` raises ImportError, find_spec finds nothing
    install = rf"install it with: pip install 'specdraft\[{name}\]'"
    with pytest.raises(SpecdraftError, match=rf"^--report-to {name} needs the '{name}' package \(not installed\); {install}$"):
        TrainConfig(report_to=[name])
    with pytest.raises(SpecdraftError, match=rf"^--report-to {name} needs the '{name}' package \(not installed\); {install}$"):
        open_trackers(["tensorboard", name], TrackedRun(tmp_path, job="train"))
    assert not list(tmp_path.iterdir())  # refused before any tracker run was made
    halted = rf"import of {name} halted"
    with pytest.raises(SpecdraftError, match=rf"^--report-to {name} needs the '{name}' package \({halted}.*\); {install}$") as caught:
        require(name, name)  # installed but failing to import: the import's own reason
    assert "\n" not in str(caught.value)


def test_a_method_run_mirrors_metrics_jsonl_to_tensorboard_and_mlflow(tmp_path):
    """A real DSpark run on a tiny random target: every number of every metrics.jsonl record (loss terms, per-position
    accuracy, both taus, tokens/s, lr, peak RSS) read back from TensorBoard's events and MLflow's store, same steps."""
    target, stores = build_stores(tmp_path, presets=("dspark",))
    out = tmp_path / "run"
    cfg = method_config("dspark", stores["dspark"], out, report_to=["tensorboard", "mlflow"], decode_prompts=1, decode_tokens=8)
    assert train(cfg, target=target).completed
    records = jsonl(out, "train") + jsonl(out, "val")
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for name, value in record_metrics(record).items():
            expected.setdefault(name, []).append((record["step"], value))
    for name in (
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "train/peak_rss_mb",
        "train/position_acc/1",
        "train/accept_len",
        "val/tau_teacher_forced",
        "val/tau_decoded",
        "val/loss",
    ):
        assert name in expected, name
    assert [step for step, _ in expected["train/loss"]] == [1, 2, 3, 4] and [s for s, _ in expected["val/tau_decoded"]] == [2, 4]

    scalars = tensorboard_scalars(out / "tensorboard")
    assert set(scalars) == set(expected)
    for name, points in expected.items():
        assert scalars[name] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], name  # float32 events
    hparams = tensorboard_hparams(out / "tensorboard")
    assert hparams["method"] == "dspark" and hparams["model.block_size"] == 4 and hparams["report_to"] == '["tensorboard", "mlflow"]'

    run_id = json.loads((out / STATE_FILE).read_text())["mlflow"]["run_id"]
    for name, points in expected.items():
        assert mlflow_history(out, run_id, name) == sorted(points), name  # float64: exact
    run = mlflow_client(out).get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["method"] == "dspark" and run.data.params["model.block_size"] == "4"


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path):
    """Stopped by a signal and rerun: one MLflow run and one TensorBoard logdir hold each step once, equal to the log."""
    out = tmp_path / "run"
    first = train(toy_config(out, report_to=["tensorboard", "mlflow"]), target=ToyTarget(), dataset=SignalAfterReads(ToyStore(), 30))
    assert first.stopped_by == "signal" and 0 < first.step < 12
    run_id = json.loads((out / STATE_FILE).read_text())["mlflow"]["run_id"]
    assert train(toy_config(out, report_to=["tensorboard", "mlflow"]), target=ToyTarget(), dataset=ToyStore()).completed
    assert json.loads((out / STATE_FILE).read_text())["mlflow"]["run_id"] == run_id
    losses = [(r["step"], r["loss"]) for r in jsonl(out, "train")]
    assert [step for step, _ in losses] == list(range(1, 13))
    assert mlflow_history(out, run_id, "train/loss") == losses
    assert tensorboard_scalars(out / "tensorboard")["train/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in losses]
    client = mlflow_client(out)
    assert [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("specdraft").experiment_id])] == [run_id]


def test_tensorboard_resume_drops_what_a_dead_attempt_logged_past_the_checkpoint(tmp_path):
    """As ``metrics.jsonl`` is cut back to the resumed checkpoint, the logdir's later events are purged."""
    with open_trackers(["tensorboard"], TrackedRun(tmp_path, job="train")) as trackers:
        for step in range(1, 7):
            trackers.write({"split": "train", "step": step, "loss": float(step)})
    with open_trackers(["tensorboard"], TrackedRun(tmp_path, job="train", start_step=4)) as trackers:
        for step in (5, 6):
            trackers.write({"split": "train", "step": step, "loss": -float(step)})
    assert tensorboard_scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, -5.0), (6, -6.0)]


def test_wandb_offline_run_holds_the_log_and_resumes_by_id(tmp_path, monkeypatch):
    for variable in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    out = tmp_path / "run"
    first = train(toy_config(out, report_to=["wandb"]), target=ToyTarget(), dataset=SignalAfterReads(ToyStore(), 30))
    assert first.stopped_by == "signal"
    time.sleep(1.1)  # W&B names an offline attempt's directory by the second it starts in: a toy resume is faster
    assert train(toy_config(out, report_to=["wandb"]), target=ToyTarget(), dataset=ToyStore()).completed
    rows, config, ids = wandb_history(out)
    run_id = json.loads((out / STATE_FILE).read_text())["wandb"]["id"]
    assert ids == [run_id, run_id]  # two offline attempts of one run, which `wandb sync` joins
    logged = {(row["_step"], row["train/loss"]) for row in rows if "train/loss" in row}
    assert sorted(logged) == [(r["step"], r["loss"]) for r in jsonl(out, "train")]
    val = [(row["_step"], row["val/accept_len"]) for row in rows if "val/accept_len" in row]
    assert val == [(r["step"], r["accept_len"]) for r in jsonl(out, "val")]
    assert config["method"] == "toy" and config["max_steps"] == 12


def test_trackio_local_store_holds_the_log(tmp_path):
    """TrackIO reads its store's place (``TRACKIO_DIR``) when it is imported, so the run and the read-back happen in a
    process of their own."""
    script = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
from test_train_toy import ToyStore, ToyTarget, toy_config
from specdraft.train.trainer import train
out = {str(tmp_path / "run")!r}
assert train(toy_config(out, report_to=["trackio"], max_steps=4, eval_interval=2), target=ToyTarget(), dataset=ToyStore()).completed
from trackio.sqlite_storage import SQLiteStorage
name = json.load(open(out + "/{STATE_FILE}"))["trackio"]["name"]
logs = SQLiteStorage.get_logs("specdraft", name)
print("READ BACK", json.dumps({{"name": name, "logs": logs, "config": SQLiteStorage.get_run_config("specdraft", name)}}))
"""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    for variable in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        env.pop(variable, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("READ BACK")).removeprefix("READ BACK"))
    assert found["name"].startswith("run-")
    logged = [(row["step"], row["train/loss"]) for row in found["logs"] if "train/loss" in row]
    assert logged == [(r["step"], r["loss"]) for r in jsonl(tmp_path / "run", "train")]
    assert found["config"]["method"] == "toy"


def test_eval_mirrors_its_summary_once_and_a_rerun_replaces_it(tmp_path, tiny_target):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": "repeat"}) + "\n" for p in ("one two one two one two", "a b a b a b")))
    out = tmp_path / "eval"
    config = EvalConfig(
        out=str(out),
        prompts=str(prompts),
        drafters=["ngram"],
        max_new_tokens=8,
        threads=1,
        plots=False,
        report_to=["mlflow", "tensorboard"],
    )
    report = run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    ngram = next(r for r in report["runs"] if r["drafter"] == "ngram")
    run_id = json.loads((out / STATE_FILE).read_text())["mlflow"]["run_id"]
    assert mlflow_history(out, run_id, "eval/ngram/c1/tau") == [(0, ngram["overall"]["tau"])]
    assert mlflow_history(out, run_id, "eval/ngram/c1/speedup") == [(0, ngram["speedup"])]
    tokens_per_s = ngram["overall"]["tokens_per_s"]
    assert tensorboard_scalars(out / "tensorboard")["eval/ngram/c1/tok_per_s"] == [(0, pytest.approx(tokens_per_s, rel=1e-6))]
    assert all(EVAL_DIR.holds(name) for name in local_files()) and all(EVAL_DIR.holds(p.name) for p in out.iterdir())
    run_eval(config, SamplingConfig(), target=tiny_target, progress=False)  # the directory, tracker files included, is replaced
    assert json.loads((out / STATE_FILE).read_text())["mlflow"]["run_id"] != run_id
