"""One ownership and locking rule for every command that writes (issue 37, mechanism 2).

Each writer enters ``utils/lock.claim_output``: only an output of its own kind is replaced, and a lock covers the
output's whole tree, so a writer is refused while another holds an ancestor or a descendant of its output. The
bugs here failed before their fix: an in-place calibrate dropped the run's MODEL_CARD.md; ``calibrate --drafter
R/final`` ran beside ``train --out R``; ``export-speculators`` overwrote a user's directory, reused an export of a
store that had been re-extracted, wrote into its own store and died on an empty ``converted.json``; a lock path that
is a directory was reported without naming it. ``test_every_output_flag_is_claimed`` walks the real CLI parser, so a
new command with an output cannot skip the rule.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_integrity import _tree, run  # noqa: F401  (module fixture)
from test_outputs import _Holder

from specdraft.cli.main import build_parser, commands, main
from specdraft.utils.lock import claim_output, lock_path
from test_train_methods import stores  # noqa: F401  (module fixture, used by ``run``)

ROOT = Path(__file__).resolve().parents[2]
INTEROP_PYTHON = Path(os.environ.get("SPECDRAFT_INTEROP_PYTHON", ROOT / ".venv-interop/bin/python"))
needs_interop = pytest.mark.skipif(not INTEROP_PYTHON.exists(), reason=f"speculators environment {INTEROP_PYTHON} not built")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture
def no_target_load(monkeypatch):
    """Fail the test if a command loads a target: a refusal must come before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded: the output was checked only after the work started")

    monkeypatch.setattr("specdraft.targets.load_target", refuse)


def _prepared(directory: Path, target, samples: int) -> Path:
    from specdraft.data.dataset import write_prepared

    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "sample_id": f"c{i // 2}_{i % 2}",
            "source": "t:sharegpt",
            "input_ids": torch.randint(0, 1000, (16,), generator=g).tolist(),
            "loss_mask": [int(j >= 4) for j in range(16)],
        }
        for i in range(samples)
    ]
    return write_prepared(directory, rows, target_info=target.describe(), config={}, stats={}, vocab_size=target.vocab_size)


def _extract(data: Path, store: Path, target, **options) -> Path:
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    extract_hidden_states(
        ExtractConfig(dataset=str(data), out=str(store), method="dspark", dtype="float32", **options), target=target, progress=False
    )
    return store


@dataclass(frozen=True)
class Inputs:
    """What the writers read: a prepared dataset, its store and the tiny target's directory."""

    dataset: Path
    store: Path
    target: Path


@pytest.fixture(scope="module")
def inputs(tiny_target, tiny_llama_dir, tmp_path_factory) -> Inputs:
    root = tmp_path_factory.mktemp("ownership")
    data = _prepared(root / "data", tiny_target, 8)
    return Inputs(data, _extract(data, root / "hs", tiny_target), tiny_llama_dir)


# ----- bug: the model card of an in-place calibrate --------------------------------------------------


def test_calibrate_in_place_keeps_the_model_card(run, tmp_path):
    from specdraft.train.calibrate import CalibrateConfig, calibrate
    from specdraft.train.model_card import CALIBRATION_HEADING

    target, store, reference = run
    final = tmp_path / "run" / "final"
    shutil.copytree(reference, tmp_path / "run")
    card = (final / "MODEL_CARD.md").read_text()
    for _ in range(2):  # a recalibration replaces the section, it does not add another
        stats = calibrate(CalibrateConfig(drafter=str(final), data=str(store), val_fraction=0.5), target=target, progress=False)
    kept = (final / "MODEL_CARD.md").read_text()
    assert kept.startswith(card.rstrip("\n")) and kept.count(CALIBRATION_HEADING) == 1
    assert f"{stats['temperatures'][0]:.3f}" in kept and f"{stats['samples']} held-out samples" in kept
    out = tmp_path / "calibrated"  # a calibrated copy carries the card too
    calibrate(CalibrateConfig(drafter=str(final), data=str(store), out=str(out), val_fraction=0.5), target=target, progress=False)
    assert (out / "MODEL_CARD.md").read_text().count(CALIBRATION_HEADING) == 1


# ----- bug: nested writers -----------------------------------------------------------------------------


def test_calibrate_of_a_run_being_trained_is_refused_and_the_reverse(run, tmp_path, capsys):
    """``train --out R`` holds R, ``calibrate --drafter R/final`` claims R/final: two lock files, one tree."""
    _, store, reference = run
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    before = _tree(work)
    with _Holder(work, "specdraft train") as holder:
        assert main(["calibrate", "--drafter", str(work / "final"), "--data", str(store)]) == 2
        err = capsys.readouterr().err
        assert f"{work / 'final'} lies inside {work.resolve()}, which is being written by pid {holder.proc.pid}" in err, err
        assert f"lock {lock_path(work)}" in err and err.count("\n") == 1
    with _Holder(work / "final", "specdraft calibrate") as holder:
        assert main(["train", "--method", "dspark", "--data", str(store), "--out", str(work)]) == 2
        err = capsys.readouterr().err
        assert f"{work} holds {(work / 'final').resolve()}, which is being written by pid {holder.proc.pid}" in err, err
    assert _tree(work) == before


def test_a_process_nests_its_own_claims(tmp_path):
    """The quickstart holds its run directory while each stage claims its own inside it."""
    from specdraft.data.dataset import PREPARED_DIR

    qs = tmp_path / "qs"
    with (
        claim_output(qs, None),
        claim_output(qs / "data", PREPARED_DIR),
        claim_output(qs / "train", None),
        claim_output(qs / "train" / "final", None),
    ):
        assert lock_path(qs / "train" / "final").exists()
    assert not list(tmp_path.rglob(".*.lock"))


_RACER = """
import sys, time
from specdraft.errors import SpecdraftError
from specdraft.utils.lock import claim_output
out, start = sys.argv[1], float(sys.argv[2])
while time.time() < start:
    pass
try:
    with claim_output(out, None):
        print("claimed", flush=True)
        time.sleep(0.5)
except SpecdraftError:
    print("refused", flush=True)
"""


def test_two_writers_on_nested_paths_never_both_proceed(tmp_path):
    """Writers started at one instant on a directory and one inside it, eight pairs at once: at most one of each pair
    gets through (each takes its own lock before it looks for the other's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start = time.time() + 3.0
    pairs = [(tmp_path / f"w{i}", tmp_path / f"w{i}" / "run" / "final") for i in range(8)]
    procs = [
        [
            subprocess.Popen(
                [sys.executable, "-c", _RACER, str(path), str(start)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            for path in pair
        ]
        for pair in pairs
    ]
    verdicts = [[p.communicate(timeout=60)[0].strip() for p in pair] for pair in procs]
    assert all(verdict.count("claimed") <= 1 and set(verdict) <= {"claimed", "refused"} for verdict in verdicts), verdicts
    assert not list(tmp_path.rglob(".*.lock"))


def test_the_next_writer_clears_what_a_writer_killed_mid_swap_left(tmp_path, caplog):
    """``atomic_dir`` killed between its renames leaves no OUT, only ``.OUT.PID.old`` and ``.OUT.XXXXXXXX.tmp``: the next
    claim puts the previous content back before anything reads OUT, and removes the temporaries (a sibling output's
    are not its own)."""
    import logging

    from specdraft.eval.report import EVAL_DIR

    out = tmp_path / "eval"
    (tmp_path / ".eval.4242.old").mkdir()
    (tmp_path / ".eval.4242.old" / "report.json").write_text(json.dumps({"format": "specdraft.eval_report"}))
    (tmp_path / ".eval.k3x_9a0q.tmp").mkdir()
    (tmp_path / ".eval.v2.k3x_9a0q.tmp").mkdir()  # the temporary of an output named eval.v2
    with caplog.at_level(logging.INFO), claim_output(out, EVAL_DIR):
        assert json.loads((out / "report.json").read_text())["format"] == "specdraft.eval_report"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".eval.v2.k3x_9a0q.tmp", "eval"]
    assert "put back its previous content from .eval.4242.old" in caplog.text


# ----- bug: a lock path that is a directory -------------------------------------------------------------


def test_a_lock_path_that_is_a_directory_is_named_with_the_fix(tmp_path, capsys, no_target_load):
    out = tmp_path / "D"
    lock_path(out).mkdir()
    assert main(["eval", "--drafters", "ngram", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"its lock file {lock_path(out)} is a directory, not a lock specdraft wrote" in err, err
    assert "remove it if it is not yours" in err and err.count("\n") == 1


# ----- bugs: export-speculators ----------------------------------------------------------------------


def test_export_refuses_a_users_directory_and_its_own_store(inputs, tmp_path, capsys):
    mine = tmp_path / "mydir"
    mine.mkdir()
    (mine / "state.json").write_text('{"my": "state"}')  # a name an export holds: the marker, not the names, refuses it
    assert main(["export-speculators", "--store", str(inputs.store), "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"{mine} already exists and is not a speculators training-data export (it has no converted.json)" in err, err
    assert (mine / "state.json").read_text() == '{"my": "state"}'
    before = _tree(inputs.store)
    for out in (inputs.store, inputs.store.parent):  # its own store, or a directory holding it
        assert main(["export-speculators", "--store", str(inputs.store), "--out", str(out)]) == 2
        assert f"{out} already exists and holds entries a speculators training-data export does not" in capsys.readouterr().err
    assert _tree(inputs.store) == before


def _export(store: Path, out: Path) -> tuple[int, dict | None, str]:
    """``export-speculators`` in the speculators environment (it needs ``datasets``): exit code, facts, stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            str(INTEROP_PYTHON),
            "-m",
            "specdraft.cli.main",
            "export-speculators",
            "--store",
            str(store),
            "--out",
            str(out),
            "--val-fraction",
            "0.3",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    facts = json.loads(done.stdout[done.stdout.index("{\n") :]) if done.returncode == 0 else None
    return done.returncode, facts, done.stderr


def _rows(out: Path, facts: dict) -> int:
    files = sorted((out / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == facts["train_rows"] + facts["val_rows"]
    return len(files)


@pytest.fixture
def export_store(tiny_target, tmp_path) -> tuple[Path, Path]:
    """A prepared dataset of 12 samples and its store."""
    data = _prepared(tmp_path / "data", tiny_target, 12)
    return data, _extract(data, tmp_path / "hs", tiny_target)


@pytest.mark.interop
@needs_interop
def test_export_is_made_again_after_the_store_was_re_extracted(export_store, tiny_target, tmp_path):
    """A store re-extracted at the same path (``extract --restart``) is other data: the reuse key is its content."""
    data, store = export_store
    out = tmp_path / "export"
    code, facts, err = _export(store, out)
    assert code == 0 and _rows(out, facts) == 12, err
    _extract(data, store, tiny_target, restart=True, max_samples=6)
    code, facts, err = _export(store, out)
    assert code == 0 and _rows(out, facts) == 6, err  # 12 before the fix: the old export's rows
    assert "exported from other data or settings; exporting again" in err


@pytest.mark.slow
@pytest.mark.interop
@needs_interop
def test_an_unreadable_or_damaged_export_is_made_again_with_a_warning(export_store, tmp_path):
    """Verified on read: an empty ``converted.json`` (as a kill left it when it was written in place) or a damaged row
    is exported again with a WARNING, never a traceback; an intact export of the same store is reused."""
    store, out = export_store[1], tmp_path / "export"
    code, facts, err = _export(store, out)
    assert code == 0, err
    code, again, err = _export(store, out)
    assert code == 0 and again == facts and "exporting again" not in err, err
    (out / "converted.json").write_text("")
    code, again, err = _export(store, out)
    assert code == 0 and again == facts, err
    assert "converted.json is unreadable" in err and "exporting again" in err and "Traceback" not in err
    (out / "hidden_states" / "hs_3.safetensors").write_bytes(b"damaged")
    code, again, err = _export(store, out)
    assert code == 0 and again == facts and "hs_3.safetensors is not the file converted.json records; exporting again" in err, err


# ----- every command with an output ------------------------------------------------------------------

#: Flags named as outputs: ``--out``, ``--dir``, ``--store``, ``--output``, ``--dest`` and ``--*-out`` (``--metrics-out``).
OUTPUT_FLAG = re.compile(r"^--(?:[a-z0-9]+-)*(?:out|output|dir|dest|store)$")


@dataclass(frozen=True)
class Writer:
    """One way a command writes ``OUT``: ``argv(inputs, OUT)``. ``foreign_at``: where under ``OUT`` a user's file must stop
    it (the quickstart adds its entries beside a user's files in its run directory, but its stages refuse theirs);
    ``file``: ``OUT`` is a file; ``loads_target``: it loads its target before that refusal (the quickstart's stages)."""

    argv: Callable[[Inputs, Path], list[str]]
    foreign_at: str = "."
    file: bool = False
    loads_target: bool = False


WRITERS: dict[tuple[str, str], tuple[Writer, ...]] = {
    ("prepare", "--out"): (Writer(lambda i, out: ["prepare", "--data", str(i.dataset), "--out", str(out), "--target", str(i.target)]),),
    ("extract", "--out"): (Writer(lambda i, out: ["extract", "--dataset", str(i.dataset), "--out", str(out), "--method", "dspark"]),),
    ("store start", "--dir"): (Writer(lambda i, out: ["store", "start", "--dir", str(out), "--port", "0"]),),
    ("train", "--out"): (Writer(lambda i, out: ["train", "--method", "dspark", "--data", str(i.store), "--out", str(out)]),),
    ("generate", "--metrics-out"): (
        Writer(lambda i, out: ["generate", "--prompt", "hi", "--target", str(i.target), "--metrics-out", str(out)], file=True),
    ),
    ("eval", "--out"): (
        Writer(lambda i, out: ["eval", "--drafters", "ngram", "--out", str(out)]),
        Writer(lambda i, out: ["eval", "--endpoint", "http://127.0.0.1:9", "--drafters", "ngram", "--out", str(out)]),
        Writer(lambda i, out: ["eval", "--parity", "--drafters", str(i.store.parent / "final"), "--out", str(out)]),
    ),
    ("calibrate", "--out"): (
        Writer(lambda i, out: ["calibrate", "--drafter", str(i.store.parent / "final"), "--data", str(i.store), "--out", str(out)]),
        Writer(lambda i, out: ["calibrate", "--drafter", str(out), "--data", str(i.store)]),
    ),  # in place
    ("export-speculators", "--out"): (Writer(lambda i, out: ["export-speculators", "--store", str(i.store), "--out", str(out)]),),
    ("bench-serve", "--out"): (Writer(lambda i, out: ["bench-serve", "--target", str(i.target), "--out", str(out)]),),
    ("quickstart", "--out"): (
        Writer(
            lambda i, out: ["quickstart", "--out", str(out), "--target", str(i.target), "--samples", "4"],
            foreign_at="data",
            loads_target=True,
        ),
    ),
}

#: Output-named flags that name no output of the command, and why.
NOT_WRITERS = {
    ("store stop", "--dir"): "names the master to stop; it only removes the pid and state files its start recorded",
    ("store status", "--dir"): "reads the master's state",
    ("serve-hidden-states", "--store"): "a transport shared by design: several producers write it at once, each payload atomically "
    "under its own key, and the trainer reads and deletes them",
    ("train", "--store"): "online/hybrid training reads (and consumes) what producers write there",
    ("export-speculators", "--store"): "the store it reads (an input: refused as its --out)",
}

CASES = [pytest.param(key, n, id=f"{key[0]} {key[1]}" + (f" #{n}" if n else "")) for key, ways in WRITERS.items() for n in range(len(ways))]


def test_every_output_flag_is_claimed():
    """Every output-named flag of every command is listed here, so the tests below run it against the rule."""
    found = {
        (name, flag)
        for name, leaf in commands(build_parser()).items()
        for action in leaf._actions
        for flag in action.option_strings
        if OUTPUT_FLAG.match(flag)
    }
    missing = found - set(WRITERS) - set(NOT_WRITERS)
    assert not missing, (
        f"{sorted(missing)}: claim the output (utils/lock.claim_output, or claims_output on the command's library "
        "entry) and list it in WRITERS, or say in NOT_WRITERS why it is not an output"
    )
    assert not (set(WRITERS) | set(NOT_WRITERS)) - found, "listed flags the CLI no longer has"


@pytest.mark.parametrize("key, n", CASES)
def test_a_writer_refuses_an_output_that_is_not_its_own(key, n, inputs, tmp_path, capsys, request):
    writer = WRITERS[key][n]
    if not writer.loads_target:
        request.getfixturevalue("no_target_load")
    out = tmp_path / "out"
    victim = out if writer.file else out / writer.foreign_at / "thesis.tex"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_text("years of work")
    assert main(writer.argv(inputs, out)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    last = err.strip().splitlines()[-1]  # after any progress bar of a target's loading
    assert last.startswith(f"specdraft {key[0].split()[0]}: error: ") and f"{out}" in last, err
    assert victim.read_text() == "years of work"


@pytest.mark.parametrize("key, n", CASES)
def test_a_writer_is_refused_inside_or_around_another_writers_output(key, n, inputs, tmp_path, capsys, no_target_load):
    writer = WRITERS[key][n]
    work = tmp_path / "work"
    out = work / ("m.json" if writer.file else "out")
    with _Holder(work) as holder:
        assert main(writer.argv(inputs, out)) == 2
        err = capsys.readouterr().err
        assert f"{out} lies inside {work.resolve()}, which is being written by pid {holder.proc.pid}" in err, err
    if writer.file:
        return
    with _Holder(out / "inner") as holder:
        assert main(writer.argv(inputs, out)) == 2
        err = capsys.readouterr().err
        assert f"{out} holds {(out / 'inner').resolve()}, which is being written by pid {holder.proc.pid}" in err, err
    assert sorted(p.name for p in out.iterdir()) == [], "the refused writer left something behind"
