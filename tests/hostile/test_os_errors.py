"""OS errors at the boundary (issue 27): a full disk, a read-only filesystem, a denied permission or too
many open files stop every command with one line (exit 2) naming the path and the fix, and a checkpoint
save that fails leaves the previous checkpoint intact and no half-written one a resume would pick up.

The disk-full and read-only cases run on a real small tmpfs (root only: skipped elsewhere)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from specdraft.cli.main import main
from specdraft.train import checkpoint_files as ckpt
from specdraft.train.trainer import train
from test_data_prepare import SHAREGPT_ROW
from test_train_methods import config as train_config
from test_train_methods import stores  # noqa: F401  (module fixture)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A small tmpfs at ``path`` (root can mount one in most sandboxes), unmounted on the way out."""
    path.mkdir(parents=True, exist_ok=True)
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode != 0
    ):
        pytest.skip("needs root and a mountable tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def test_disk_full_while_saving_a_checkpoint_keeps_the_last_one_and_resumes(stores, tmp_path):
    """safetensors reported a full disk as its own SafetensorError; now an OSError naming the file, and
    neither a half-written step-N nor a damaged previous checkpoint is left for the resume."""
    target, store = stores[0], stores[1]["dspark"]
    probe = train(train_config("dspark", store, tmp_path / "probe", max_steps=2, eval_interval=0), target=target)
    size = sum(p.stat().st_size for p in (probe.out / "checkpoints" / "step-2").iterdir())
    with tmpfs(tmp_path / "disk", f"{int(size * 1.6) // 4096 * 4096 + 8192}") as disk:
        out = disk / "run"  # room for the step-2 checkpoint (plus logs), not for step-4 beside it
        with pytest.raises(OSError) as info:
            train(train_config("dspark", store, out, eval_interval=0), target=target)
        assert info.value.errno == errno.ENOSPC and str(out / "checkpoints" / ".step-4.") in str(info.value.filename)
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-2"]  # no .tmp debris, no step-4
        assert ckpt.latest_checkpoint(out).name == "step-2"
        ckpt.read_state(out / "checkpoints" / "step-2")  # every checksum still verifies
        subprocess.run(["mount", "-o", f"remount,size={size * 4}", str(disk)], check=True)  # room again
        resumed = train(train_config("dspark", store, out, eval_interval=0), target=target)
        assert resumed.completed and ckpt.latest_checkpoint(out).name == "step-4"


@pytest.mark.parametrize("case", ["read-only", "disk-full"])
def test_prepare_onto_a_read_only_or_full_disk_is_one_line(case, tmp_path, tiny_llama_dir, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(SHAREGPT_ROW) + "\n")
    with tmpfs(tmp_path / "disk", "64k" if case == "disk-full" else "1m") as disk:
        if case == "read-only":
            _remount_read_only(disk)
        else:
            _fill(disk)
        rc = main(["prepare", "--data", str(data), "--out", str(disk / "ds"), "--target", str(tiny_llama_dir)])
        err = capsys.readouterr().err
        assert rc == 2, err
        line = err.strip().splitlines()[-1]
        assert line.startswith("specdraft prepare: error: ") and str(disk) in line
        assert ("read-only" in line) if case == "read-only" else ("disk is full" in line and "free space" in line)
        assert not (disk / "ds").exists()


def _fill(disk: Path) -> None:
    """Leave (almost) no free blocks on ``disk``."""
    with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


@pytest.mark.parametrize(
    "code, fix",
    [
        (errno.ENOSPC, "the disk is full"),
        (errno.EDQUOT, "quota"),
        (errno.EROFS, "read-only"),
        (errno.EACCES, "permission"),
        (errno.EPERM, "not permitted"),
        (errno.EMFILE, "ulimit -n"),
        (errno.ENFILE, "fs.file-max"),
    ],
)
def test_every_command_turns_machine_os_errors_into_one_line(code, fix, monkeypatch, capsys):
    """Raised anywhere in a command, also wrapped in another exception (a DataLoader worker's, a library's)."""
    import specdraft.cli.calibrate as command

    def fails(args):
        try:
            raise OSError(code, os.strerror(code), "/data/x.bin")
        except OSError as exc:
            raise RuntimeError("wrapped by a library") from exc

    monkeypatch.setattr(command, "run", fails)
    assert main(["calibrate", "--drafter", "d", "--data", "s"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"specdraft calibrate: error: /data/x.bin: {os.strerror(code)}; {err.split('; ', 1)[1]}" and fix in err


def test_other_os_errors_keep_their_traceback(monkeypatch):
    import specdraft.cli.calibrate as command

    def fails(args):
        raise OSError(errno.EIO, "Input/output error", "/data/x.bin")  # not the user's to fix with a path: a bug or hardware

    monkeypatch.setattr(command, "run", fails)
    with pytest.raises(OSError, match="Input/output error"):
        main(["calibrate", "--drafter", "d", "--data", "s"])


def test_a_denied_read_of_the_split_is_not_called_corrupt(tmp_path, monkeypatch):
    """read_split used to answer any OSError with "unreadable ...; delete it", advice that loses the split."""
    from specdraft.train.split import read_split

    path = tmp_path / "split.json"
    path.write_text("{}")
    real = Path.read_text

    def denied(self, *a, **kw):
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(PermissionError):
        read_split(path)


def test_a_failed_swap_puts_the_previous_directory_back(tmp_path, monkeypatch):
    """atomic_dir moved the old directory aside before renaming the new one in; if that rename failed the old
    content stayed a hidden .old sibling that the next run's debris sweep deletes."""
    from specdraft.utils.io import DirKind, atomic_dir

    kind = DirKind("thing", "marker", lambda p: True, frozenset({"marker"}))
    target = tmp_path / "out"
    target.mkdir()
    (target / "marker").write_text("old")
    real = os.replace

    def fails_into_place(src, dst):
        if Path(dst) == target and Path(src).name.endswith(".tmp"):  # the new directory into place; putting back works
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fails_into_place)
    with pytest.raises(OSError), atomic_dir(target, kind) as tmp:
        (tmp / "marker").write_text("new")
    assert (target / "marker").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_metrics_line_torn_by_a_full_disk_does_not_stop_the_resume(tmp_path):
    """The resume parsed every metrics.jsonl line, so the torn last line of a run the disk stopped was a JSONDecodeError."""
    from specdraft.errors import SpecdraftError
    from specdraft.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')
    MetricsLog(path).truncate_after(2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(SpecdraftError, match=rf"{path} line 2 is not a JSON record"):
        MetricsLog(path).truncate_after(2)
