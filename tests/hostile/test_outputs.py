"""One writer per output, every OS error a clear error before the work (issue 27).

Each case failed before its fix: two writers on one output both exit 0 and interleave; ``prepare --data D
--out D`` shrank D; ``eval``/``extract`` wrote into foreign directories; a read-only output was a traceback,
for eval and generate only after all decoding. The second writer here is the CLI in this process; the first
holds the lock from a small subprocess (``_Holder``), so the refusal is checked without a second model.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_integrity import _tree, run  # noqa: F401  (module fixture)

from specdraft.cli.main import main
from specdraft.errors import SpecdraftError
from specdraft.utils.lock import OutputLock, claim_output, lock_path, probe_writable
from test_extract_cli import write_chat_dataset
from test_train_methods import stores  # noqa: F401  (module fixture, used by ``run``)

TINY_MODEL = "num_layers=1,block_size=4,max_anchors=8,markov_rank=16,intermediate_size=64"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def dataset(tiny_target, tmp_path_factory) -> Path:
    """8 prepared samples for the tiny saved target."""
    texts = [f"question number {i}: what is {i} plus {i}?" for i in range(8)]
    return write_chat_dataset(tmp_path_factory.mktemp("outputs") / "data", tiny_target, texts)


@pytest.fixture(scope="module")
def store(dataset, tiny_target) -> Path:
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    out = dataset.parent / "hs"
    extract_hidden_states(
        ExtractConfig(dataset=str(dataset), out=str(out), method="dspark", dtype="float32"), target=tiny_target, progress=False
    )
    return out


@pytest.fixture
def no_target_load(monkeypatch):
    """Fail the test if a command loads a target: a refusal must come before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded: the output was checked only after the work started")

    monkeypatch.setattr("specdraft.targets.load_target", refuse)


class _Holder:
    """A first writer in another process: holds the lock on ``out`` until closed."""

    def __init__(self, out: Path, command: str = "specdraft first-writer"):
        code = (
            "import sys; from specdraft.utils.lock import OutputLock; l = OutputLock(sys.argv[1], command=sys.argv[2]); "
            "l.acquire(); print('held', flush=True); sys.stdin.read(); l.release()"
        )
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(out), command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout.readline().strip() == "held"

    def __enter__(self) -> _Holder:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _second_writer_refused(argv: list[str], out: Path, capsys) -> None:
    """Run ``argv`` while another process holds ``out``: refused at once, naming the holder; ``out`` unchanged."""
    before = _tree(out) if out.is_dir() else None
    with _Holder(out) as holder:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{out} is being written by pid {holder.proc.pid} on {socket.gethostname()} (specdraft first-writer" in err, err
        assert "since 20" in err and err.count("\n") == 1
    assert (_tree(out) if out.is_dir() else None) == before
    assert not lock_path(out).exists()  # the holder's clean release removed it


# ----- two writers, one output -------------------------------------------------------------------


def test_second_prepare_is_refused(dataset, tmp_path, tiny_llama_dir, capsys, no_target_load):
    out = tmp_path / "ds"
    shutil.copytree(dataset, out)
    _second_writer_refused(["prepare", "--data", str(dataset), "--out", str(out), "--target", str(tiny_llama_dir)], out, capsys)


def test_second_extract_is_refused(dataset, store, capsys, no_target_load):
    _second_writer_refused(["extract", "--dataset", str(dataset), "--out", str(store), "--method", "dspark"], store, capsys)


def test_second_train_is_refused(run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run[2], out)
    _second_writer_refused(["train", "--method", "dspark", "--data", str(run[1]), "--out", str(out)], out, capsys)


def test_second_eval_is_refused(tmp_path, capsys, no_target_load):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"format": "specdraft.eval_report"}))
    (out / "report.md").write_text("the first writer's report")
    _second_writer_refused(["eval", "--drafters", "ngram", "--out", str(out)], out, capsys)


def test_second_calibrate_is_refused(run, tmp_path, capsys):
    final = tmp_path / "final"
    shutil.copytree(run[2] / "final", final)
    _second_writer_refused(["calibrate", "--drafter", str(final), "--data", str(run[1])], final, capsys)


def test_second_quickstart_and_second_master_start_are_refused(tmp_path, capsys, no_target_load):
    (tmp_path / "qs").mkdir()
    _second_writer_refused(["quickstart", "--out", str(tmp_path / "qs")], tmp_path / "qs", capsys)
    _second_writer_refused(["store", "start", "--dir", str(tmp_path / "master"), "--port", "0"], tmp_path / "master", capsys)


@pytest.mark.slow
def test_two_train_processes_on_one_run(store, tiny_llama_dir, tmp_path):
    """The real race: the second ``specdraft train`` exits 2 at once; the first's run is its own alone."""
    out = tmp_path / "run"

    def start(seed: int) -> subprocess.Popen:
        argv = [
            sys.executable,
            "-m",
            "specdraft.cli.main",
            "train",
            "--method",
            "dspark",
            "--data",
            str(store),
            "--out",
            str(out),
            "--target",
            str(tiny_llama_dir),
            "--model",
            TINY_MODEL,
            "--max-steps",
            "3",
            "--pack-tokens",
            "64",
            "--batch-rows",
            "1",
            "--val-fraction",
            "0",
            "--eval-interval",
            "0",
            "--decode-prompts",
            "0",
            "--dtype",
            "fp32",
            "--num-threads",
            "1",
            "--seed",
            str(seed),
        ]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    first = start(1)
    deadline = time.monotonic() + 120
    while not lock_path(out).exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    second = start(2)
    _, err2 = second.communicate(timeout=120)
    out1, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1
    assert second.returncode == 2 and f"is being written by pid {first.pid}" in err2, err2
    assert json.loads(out1.strip().splitlines()[-1])["final"] == str(out / "final")
    assert "seed: 1" in (out / "config.resolved.yaml").read_text()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == sorted(set(steps)), steps  # one writer's steps, not two interleaved
    assert not lock_path(out).exists()


# ----- one ownership rule ------------------------------------------------------------------------


def test_prepare_refuses_its_input_as_output(dataset, tmp_path, tiny_llama_dir, capsys):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    before = _tree(data)
    rc = main(["prepare", "--data", str(data), "--out", str(data), "--max-samples", "4", "--target", str(tiny_llama_dir)])
    assert rc == 2 and f"input {data} is also the output {data}" in capsys.readouterr().err
    assert _tree(data) == before  # still 8 samples


def test_eval_refuses_a_directory_that_is_not_an_eval_run(tmp_path, capsys, no_target_load):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "report.md").write_text("my own report")
    assert main(["eval", "--drafters", "ngram", "--out", str(out)]) == 2
    assert f"{out} already exists and is not a specdraft eval run (it has no report.json)" in capsys.readouterr().err
    (out / "thesis.tex").write_text("years of work")
    assert main(["eval", "--drafters", "ngram", "--out", str(out)]) == 2
    assert "holds entries a specdraft eval run does not (thesis.tex); it would be replaced whole" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "my own report"


def test_extract_refuses_a_foreign_directory_and_an_input_inside(run, dataset, store, tmp_path, capsys, no_target_load):
    foreign = tmp_path / "run"
    shutil.copytree(run[2], foreign)
    before = _tree(foreign)
    assert main(["extract", "--dataset", str(dataset), "--out", str(foreign), "--method", "dspark"]) == 2
    assert "holds entries a hidden-state store does not (checkpoints, config.resolved.yaml" in capsys.readouterr().err
    assert _tree(foreign) == before
    shutil.copytree(store, tmp_path / "hs")
    inside = tmp_path / "hs" / "data.safetensors"  # a name a store may hold: the input rule, not the kind, refuses it
    shutil.copytree(dataset, inside)
    assert main(["extract", "--dataset", str(inside), "--out", str(inside.parent), "--method", "dspark"]) == 2
    assert f"input {inside} lies inside {inside.parent}, which this command writes into" in capsys.readouterr().err


def test_calibrate_in_place_keeps_the_old_drafter_until_the_new_is_complete(run, tmp_path, monkeypatch):
    from specdraft.models.common import checkpoint as drafter_ckpt
    from specdraft.train.calibrate import CalibrateConfig, calibrate

    target, store, reference = run
    final = tmp_path / "final"
    shutil.copytree(reference / "final", final)
    before = _tree(final)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies half-way through writing the new checkpoint

    monkeypatch.setattr(drafter_ckpt, "atomic_write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        calibrate(CalibrateConfig(drafter=str(final), data=str(store), val_fraction=0.5), target=target, progress=False)
    assert _tree(final) == before and sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no debris, no lock left


def test_lock_files_of_outputs_inside_are_no_foreign_entries(tmp_path):
    from specdraft.eval.report import PARITY_DIR
    from specdraft.utils.io import check_replaceable

    out = tmp_path / "parity"
    (out / "builtin-0").mkdir(parents=True)
    (out / "parity.json").write_text(json.dumps({"format": "specdraft.parity_report"}))
    (out / ".builtin-0.lock").write_text("{}")  # left by a killed sub-run
    check_replaceable(out, PARITY_DIR)
    (out / "holiday.jpg").write_text("x")
    with pytest.raises(SpecdraftError, match=r"holds entries a specdraft eval --parity run does not \(holiday.jpg\)"):
        check_replaceable(out, PARITY_DIR)


# ----- writable before the work ------------------------------------------------------------------


@pytest.fixture
def readonly(tmp_path) -> Path:
    """A read-only bind mount (root bypasses chmod); skipped where this sandbox cannot mount."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    (src / "existing").mkdir()
    ok = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode == 0
    if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(ro)])
        ok = False
    if not ok:
        pytest.skip("cannot make a read-only bind mount here (needs root)")
    yield ro
    subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("command", ["prepare", "extract", "eval", "train", "generate", "calibrate"])
def test_read_only_output_is_one_line_before_the_work(command, readonly, dataset, store, tiny_llama_dir, capsys, no_target_load):
    out = readonly / "out"
    argv = {
        "prepare": ["prepare", "--data", str(dataset), "--out", str(out), "--target", str(tiny_llama_dir)],
        "extract": ["extract", "--dataset", str(dataset), "--out", str(out), "--method", "dspark"],
        "eval": ["eval", "--drafters", "ngram", "--out", str(out)],
        "train": ["train", "--method", "dspark", "--data", str(store), "--out", str(out)],
        "generate": ["generate", "--prompt", "hi", "--target", str(tiny_llama_dir), "--metrics-out", str(out / "m.json")],
        "calibrate": ["calibrate", "--drafter", str(readonly / "existing"), "--data", str(store)],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    shown = readonly / "existing" if command == "calibrate" else out / "m.json" if command == "generate" else out
    assert (
        f"specdraft {command}: error: cannot write "
        f"--{'drafter' if command == 'calibrate' else 'metrics-out' if command == 'generate' else 'out'} {shown}: "
        "the filesystem is read-only: choose a path on a writable one" in err
    ), err
    assert err.count("\n") == 1


def test_a_full_disk_is_named_with_the_fix(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(
        SpecdraftError,
        match=r"cannot write --out .*: the disk is full: free space there or write to another filesystem, "
        r"then rerun the same command; nothing was done",
    ):
        probe_writable(tmp_path / "out")


# ----- the lock itself ---------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _holder_json(path: Path, **fields) -> None:
    now = time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"pid": 1, "host": socket.gethostname(), "command": "specdraft old", "started": now, "heartbeat": now, **fields})
    )


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    out = tmp_path / "out"
    _holder_json(lock_path(out), pid=_dead_pid())  # SIGKILLed: content left, flock gone
    with caplog.at_level(logging.WARNING), claim_output(out, None):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    assert "took over the lock of pid" in caplog.text and "which ended without releasing it" in caplog.text
    assert not lock_path(out).exists()


def test_a_locked_file_whose_holder_is_gone_is_removed(tmp_path, caplog):
    """Same host, flock still held (an orphaned child kept the descriptor), pid dead: stale."""
    out = tmp_path / "out"
    with _Holder(out):
        _holder_json(lock_path(out), pid=_dead_pid())  # rewritten in place: the holder's flock stays
        with caplog.at_level(logging.WARNING), claim_output(out, None):
            assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    assert "removing the stale lock of pid" in caplog.text and "is no longer running" in caplog.text


def test_another_hosts_lock_is_stale_only_when_its_heartbeat_is(tmp_path):
    out = tmp_path / "out"
    now = time.time()
    with _Holder(out):
        _holder_json(lock_path(out), host="node-7", pid=os.getpid(), heartbeat=now - 60)
        with pytest.raises(SpecdraftError, match=r"is being written by pid \d+ on node-7"):
            OutputLock(out, clock=lambda: now).acquire()
        stolen = OutputLock(out, clock=lambda: now + 1000)  # 1060 s without a heartbeat: the host is gone
        stolen.acquire()
        stolen.release()
    # where flock does not reach across hosts, an unlocked file with a fresh foreign heartbeat still refuses
    _holder_json(lock_path(out), host="node-7", heartbeat=now)
    with pytest.raises(SpecdraftError, match="on node-7"):
        OutputLock(out, clock=lambda: now + 10).acquire()


def test_heartbeat_reentrancy_and_ranks(tmp_path, monkeypatch):
    out = tmp_path / "out"
    ticks = iter(range(1000, 10**6))
    lock = OutputLock(out, clock=lambda: float(next(ticks)), heartbeat_s=0.01)
    lock.acquire()
    first = json.loads(lock_path(out).read_text())["heartbeat"]
    deadline = time.monotonic() + 10
    while json.loads(lock_path(out).read_text() or "{}").get("heartbeat", first) == first:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lock.release()
    with claim_output(out, None), claim_output(out, None):  # a nested claim in one process shares the lock
        assert lock_path(out).exists()
    assert not lock_path(out).exists()
    monkeypatch.setenv("RANK", "1")  # a torchrun job's other ranks: rank 0 holds the job's lock
    with claim_output(out, None):
        assert not lock_path(out).exists()
