"""The hostile-input sweep's cases (issues 17 and 27), one list for ``test_sweep.py`` and ``benchmarks/hostile_sweep.py``.

The fixture is what a new user would have: a tiny random Llama with the embedded tokenizer, 40 short
conversations, ``prepare`` -> ``extract`` (dspark layers) -> a 4-step dspark ``train``. A case gets a
``Runner`` (the CLI in this process for the tests, a subprocess per command for the benchmark) and
returns what it saw; the properties every run must keep are checked here too, so the tests and the
benchmark judge alike: exit code 0 or 2 (or the command's documented codes), no traceback, inputs
unchanged, and an output either absent or complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conftest import build_tiny_target_dir

MODEL = "num_layers=1,block_size=4,markov_rank=16,max_anchors=8,intermediate_size=64"
TRAIN = [
    "--method",
    "dspark",
    "--model",
    MODEL,
    "--pack-tokens",
    "128",
    "--eval-interval",
    "0",
    "--val-fraction",
    "0",
    "--dtype",
    "fp32",
    "--num-threads",
    "1",
]
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "about",
    "rivers",
    "and",
    "stones",
]


# ----- running a command ------------------------------------------------------------------------------


@dataclass
class Result:
    """One command's outcome: ``code`` is the exit code, or ``"overtime"`` when the runner stopped a command
    that had accepted its input and was still working; ``crash`` holds a traceback that escaped or was logged."""

    args: list[str]
    code: int | str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    crash: str = ""

    @property
    def error_line(self) -> str:
        """The CLI's whole one-line error, or "" (``message`` cuts it at 300 characters, for tables)."""
        return next((line.strip() for line in self.stderr.splitlines() if ": error:" in line), "")

    @property
    def message(self) -> str:
        """The CLI's error line, else the last line of stderr or stdout."""
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        for line in lines:
            if ": error:" in line:
                return line[:300]
        out = [line.strip() for line in self.stdout.splitlines() if line.strip()]
        return (lines[-1] if lines else out[-1] if out else "")[:300]

    def clean_error(self, *words: str) -> bool:
        return self.code == 2 and ": error:" in self.message and all(w in self.message for w in words)


class Overtime(BaseException):
    """Raised by the in-process watchdog: a BaseException so the CLI's handlers let it through."""


class _ExcInfoRecords(logging.Handler):
    """Collects the tracebacks a command logs (``log.exception``): a user sees them on stderr like an uncaught one."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.tracebacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[0] is not None:
            self.tracebacks.append("".join(traceback.format_exception(*record.exc_info)))


class _SignalOnText(io.StringIO):
    """Captured stdout that sends this process SIGTERM once ``text`` is printed (a server's ready line): the
    command then stops as it would for a user's ``kill``, instead of serving until the watchdog."""

    def __init__(self, text: str | None):
        super().__init__()
        self.text, self.sent = text, False

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.text and not self.sent and self.text in self.getvalue():
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return n


def run_in_process(args: list[str], *, timeout: float = 60.0, stop_on: str | None = None) -> Result:
    """``specdraft.cli.main.main(args)`` with stdout/stderr captured and a watchdog.

    Signal handlers a command installs (train, serve-hidden-states) are restored afterwards, and a
    command still running after ``timeout`` seconds (one that accepted a large but valid value) is
    stopped with ``Overtime``; its outputs are then not judged, since the runner, not the command,
    cut it short. ``stop_on``: SIGTERM the command once its stdout shows this text. Log records go to the captured
    stderr as the CLI's would (its ``basicConfig`` binds only the first command of a process)."""
    from specdraft.cli.main import main

    out, err, logged = _SignalOnText(stop_on), io.StringIO(), _ExcInfoRecords()
    echo = logging.StreamHandler(err)
    echo.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def overtime(signum, frame):
        raise Overtime

    previous_alarm = signal.signal(signal.SIGALRM, overtime)
    logging.getLogger().addHandler(logged)
    logging.getLogger().addHandler(echo)
    started, code, crash = time.monotonic(), None, ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                code = main(args)
            except SystemExit as exc:  # argparse: 2 after a usage error, 0 after --help
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except Overtime:
        code = "overtime"
    except BaseException:
        crash, code = traceback.format_exc(), 1
    finally:
        signal.signal(signal.SIGALRM, previous_alarm)
        logging.getLogger().removeHandler(logged)
        logging.getLogger().removeHandler(echo)
        for s, handler in saved.items():
            signal.signal(s, handler)
    crash = crash or "\n".join(logged.tracebacks)
    return Result(list(args), code, out.getvalue(), err.getvalue(), round(time.monotonic() - started, 2), crash)


def run_subprocess(args: list[str], *, timeout: float = 180.0, cwd: Path | None = None) -> Result:
    """``python -m specdraft.cli.main ARGS`` in its own session, killed (``"overtime"``) after ``timeout`` seconds."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdraft.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = "overtime"
    crash = stderr if "Traceback (most recent call last)" in stderr else ""
    return Result(list(args), code, stdout, stderr, round(time.monotonic() - started, 2), crash)


Runner = Callable[[list[str]], Result]


# ----- the properties ----------------------------------------------------------------------------------


def tree_digest(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (and the names of empty directories): equal digests, unchanged inputs."""
    digest: dict[str, str] = {}
    for root in paths:
        root = Path(root)
        if root.is_file():
            digest[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        for p in sorted(root.rglob("*")):
            if p.is_file():
                digest[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif p.is_dir() and not any(p.iterdir()):
                digest[str(p)] = "dir"
    return digest


def output_problems(path: Path, kind: str) -> list[str]:
    """Why ``path`` is not "absent or complete" for a command writing ``kind``; [] when it is.

    Complete means what each reader of that kind checks: a prepared dataset opens, a hidden-state
    store verifies every sample its manifest lists, every training checkpoint's recorded checksums
    hold and its ``final`` drafter loads, a drafter's weights match its config, JSON reports parse.
    Debris an atomic write would leave beside ``path`` (``.NAME.*.tmp``, ``.NAME.*.old``) counts too."""
    from specdraft.errors import SpecdraftError

    path = Path(path)
    problems = [f"debris {p.name} beside {path.name}" for p in path.parent.glob(f".{path.name}.*")] if path.parent.is_dir() else []
    if not path.exists():
        return problems
    try:
        if kind == "prepared":
            from specdraft.data.dataset import PreparedDataset

            PreparedDataset(path)
        elif kind == "store":
            if (path / "manifest.json").is_file():
                from specdraft.hidden_states.dataset import HiddenStateDataset

                HiddenStateDataset(path, verify="full")
        elif kind == "run":
            from specdraft.models.common.checkpoint import read_checkpoint
            from specdraft.train import checkpoint_files as ckpt

            steps = path / ckpt.CHECKPOINTS
            for step in sorted(steps.iterdir()) if steps.is_dir() else []:
                ckpt.read_state(step)
            if (path / ckpt.FINAL).exists():
                read_checkpoint(path / ckpt.FINAL)
        elif kind == "drafter":
            from specdraft.models.common.checkpoint import read_checkpoint

            read_checkpoint(path)
        elif kind == "report":
            for report in path.glob("*.json"):
                json.loads(report.read_text())
        elif kind == "json":
            json.loads(path.read_text())
    except (SpecdraftError, OSError, ValueError) as exc:
        problems.append(f"{path} is not a complete {kind}: {exc}")
    return problems


def judge(
    result: Result,
    *,
    inputs_before: dict,
    inputs_after: dict,
    outputs: dict[Path, str] | None = None,
    outputs_before: dict[Path, dict] | None = None,
    codes: tuple = (0, 2),
) -> list[str]:
    """Every way ``result`` breaks the sweep's properties; [] when it keeps them all.

    ``outputs_before``: ``tree_digest`` of the outputs that existed before the run; one left unchanged is fine."""
    outputs, outputs_before = outputs or {}, outputs_before or {}
    problems = []
    if result.crash:
        problems.append("traceback:\n" + result.crash[-3000:])
    if "Traceback (most recent call last)" in result.stderr:
        problems.append("traceback on stderr:\n" + result.stderr[-3000:])
    if result.code not in (*codes, "overtime"):
        problems.append(f"exit code {result.code} (expected one of {codes}): {result.message}")
    if result.code == 2 and "usage: specdraft" not in result.stderr:  # argparse's own errors echo what the user typed
        from test_advice import untrue_advice  # issue 37: an error names only flags of the command run

        problems += [
            f"advises {flag}, not a flag of that command: {result.message}"
            for flag in untrue_advice(result.args, result.error_line or result.message)
        ]
    if inputs_after != inputs_before:
        changed = sorted(k for k in set(inputs_before) | set(inputs_after) if inputs_before.get(k) != inputs_after.get(k))
        problems.append(f"inputs changed: {changed[:8]}")
    if result.code != "overtime":
        for path, kind in outputs.items():
            if path not in outputs_before or tree_digest(path) != outputs_before[path]:
                problems += output_problems(path, kind)
    return problems


# ----- the fixture -------------------------------------------------------------------------------------


def conversations(n: int) -> str:
    rows = []
    for i in range(n):
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(6))
        a = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(12 + i % 9))
        rows.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
    return "\n".join(rows) + "\n"


@dataclass
class Pipeline:
    """The tiny pipeline's files under ``work``; ``fresh(name)`` is a new path for one command's output."""

    work: Path
    target: Path
    jsonl: Path
    data: Path
    hs: Path
    run: Path
    _n: list = field(default_factory=lambda: [0])

    @property
    def final(self) -> Path:
        return self.run / "final"

    @property
    def T(self) -> list[str]:
        return ["--target", str(self.target)]

    def inputs(self) -> dict[str, str]:
        """The pipeline's files, and the names beside them: nothing may be written into ``work`` itself."""
        listing = sorted(p.name for p in self.work.iterdir() if p.name != "cases")
        return {**tree_digest(self.target, self.jsonl, self.data, self.hs, self.run), str(self.work): json.dumps(listing)}

    def fresh(self, name: str) -> Path:
        self._n[0] += 1
        path = self.work / "cases" / f"{self._n[0]:04d}-{name}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def copy(self, source: Path, name: str) -> Path:
        path = self.fresh(name)
        shutil.copytree(source, path)
        return path

    def generate(self, drafter: Path) -> list[str]:
        return [
            "generate",
            *self.T,
            "--drafter",
            "dspark",
            "--drafter-path",
            str(drafter),
            "--prompt",
            "the quick brown fox",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
        ]


def build_pipeline(work: Path, run: Runner, target: Path | None = None) -> Pipeline:
    """Write the fixture under ``work`` (``target``: a tiny Llama already built, e.g. by the tests' session fixture)."""
    from specdraft.targets import resolve_target_dir

    work.mkdir(parents=True, exist_ok=True)
    if target is None:
        target = build_tiny_target_dir(work / "target", resolve_target_dir("smollm2-135m"), num_layers=4)
    p = Pipeline(work, target, work / "good.jsonl", work / "data", work / "hs", work / "run")
    p.jsonl.write_text(conversations(40))
    for args in (
        ["prepare", *p.T, "--data", str(p.jsonl), "--out", str(p.data), "--threads", "1"],
        ["extract", *p.T, "--dataset", str(p.data), "--out", str(p.hs), "--method", "dspark", "--threads", "1"],
        ["train", *p.T, *TRAIN, "--data", str(p.hs), "--out", str(p.run), "--max-steps", "4", "--checkpoint-interval", "2"],
    ):
        result = run(args)
        if result.code != 0:
            raise RuntimeError(
                f"fixture step failed: specdraft {' '.join(args)}: exit {result.code}\n{result.stderr[-2000:]}{result.crash}"
            )
    return p


# ----- file surgery the cases use -------------------------------------------------------------------------


def safetensors_layout(path: Path) -> tuple[int, dict]:
    """(offset of the data section, header) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8 : 8 + n])


def flip_mantissa_bit(path: Path) -> str:
    """Flip the lowest bit of one float32 in the middle of the largest tensor (a change that can never make NaN)."""
    start, header = safetensors_layout(path)
    name, info = max(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0]
    )
    lo, hi = info["data_offsets"]
    offset = start + lo + ((hi - lo) // 2) // 4 * 4
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return name


def poison(path: Path) -> None:
    """Every float tensor of a safetensors file set to NaN (the file itself stays well-formed)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2))


def nan_tensors(directory: Path) -> int:
    """How many float tensors of ``directory/model.safetensors`` hold NaN/inf (0 when there is no such file)."""
    if not (directory / "model.safetensors").is_file():
        return 0
    import torch
    from safetensors.torch import load_file

    return sum(
        1 for v in load_file(str(directory / "model.safetensors")).values() if v.is_floating_point() and not bool(torch.isfinite(v).all())
    )


def train_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("split") == "train")


# ----- the cases (issue 17's list, each a scenario with its own verdict) -------------------------------------


@dataclass
class Verdict:
    """What a case saw: ``ok`` when the scenario's own expectation held; ``problems`` break the sweep-wide properties."""

    result: Result | None
    ok: bool
    detail: str
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Case:
    name: str
    item: str  # issue 17's item number (sweep3_cases: the area)
    run: Callable[[Pipeline, Runner], Verdict]
    xfail: str = ""  # a known bug not fixed yet (where, what): the case is expected to fail until it is


def checked(
    p: Pipeline, run: Runner, args: list[str], outputs: dict[Path, str], extra_inputs: tuple[Path, ...] = ()
) -> tuple[Result, list[str]]:
    """Run ``args`` and judge it against the sweep's properties (pipeline inputs and ``extra_inputs`` unchanged; an
    output that existed before and was left unchanged is not judged: it is not what the command wrote)."""
    before = {**p.inputs(), **tree_digest(*extra_inputs)}
    outputs_before = {path: tree_digest(path) for path in outputs if Path(path).exists()}
    result = run(args)
    after = {**p.inputs(), **tree_digest(*extra_inputs)}
    return result, judge(result, inputs_before=before, inputs_after=after, outputs=outputs, outputs_before=outputs_before)


def _prepare_into_input_dir(p: Pipeline, run: Runner) -> Verdict:
    c = p.fresh("input-dir")
    c.mkdir()
    shutil.copy(p.jsonl, c / "good.jsonl")
    (c / "notes.txt").write_text("mine\n")
    r, problems = checked(p, run, ["prepare", *p.T, "--data", str(c / "good.jsonl"), "--out", str(c)], {}, (c,))
    return Verdict(r, r.clean_error(), "refused, nothing deleted", problems)


def _calibrate_into_foreign_dir(p: Pipeline, run: Runner) -> Verdict:
    c = p.fresh("foreign")
    c.mkdir()
    (c / "notes.txt").write_text("mine\n")
    r, problems = checked(p, run, ["calibrate", "--drafter", str(p.final), "--data", str(p.hs), "--out", str(c), *p.T], {}, (c,))
    return Verdict(r, r.clean_error(), "refused, notes.txt kept", problems)


def _resume_flipped_trainer_state(p: Pipeline, run: Runner) -> Verdict:
    from specdraft.train.checkpoint_files import latest_checkpoint

    c = p.copy(p.run, "flipped-state")
    tensor = flip_mantissa_bit(latest_checkpoint(c) / "trainer_state.safetensors")
    r = run(["train", *p.T, *TRAIN, "--data", str(p.hs), "--out", str(c), "--max-steps", "6", "--checkpoint-interval", "2"])
    return Verdict(r, r.clean_error("corrupt"), f"refused to resume from a flipped bit in {tensor}")


def _decode_flipped_final(p: Pipeline, run: Runner) -> Verdict:
    d = p.copy(p.final, "flipped-final")
    tensor = flip_mantissa_bit(d / "model.safetensors")
    r = run(p.generate(d))
    return Verdict(r, r.clean_error(), f"refused a flipped bit in {tensor}")


def _train_non_finite(flag: str, value: str) -> Callable[[Pipeline, Runner], Verdict]:
    def case(p: Pipeline, run: Runner) -> Verdict:
        out = p.fresh(f"train{flag}")
        r, problems = checked(
            p,
            run,
            ["train", *p.T, *TRAIN, "--data", str(p.hs), "--out", str(out), "--max-steps", "4", "--checkpoint-interval", "2", flag, value],
            {out: "run"},
        )
        nan = nan_tensors(out / "final")
        return Verdict(
            r, (r.code == 0 or r.clean_error()) and not nan, f"refused or trained to finite weights ({nan} NaN tensors)", problems
        )

    return case


def _decode_nan_drafter(p: Pipeline, run: Runner) -> Verdict:
    d = p.copy(p.final, "nan-drafter")
    poison(d / "model.safetensors")
    r = run(p.generate(d))
    return Verdict(r, r.clean_error(), "refused NaN weights")


def _serve_wide_without_token(p: Pipeline, run: Runner) -> Verdict:
    r = run(["serve", str(p.final), "--host", "0.0.0.0", *p.T])
    return Verdict(r, r.clean_error("--token"), "needs --token")


def _pickle_target(p: Pipeline, run: Runner) -> Verdict:
    import torch
    from safetensors.torch import load_file

    pickled = p.copy(p.target, "pickled-target")
    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").rename(pickled / "extra.safetensors")
    out = p.fresh("pickle-out")
    r, problems = checked(p, run, ["prepare", "--target", str(pickled), "--data", str(p.jsonl), "--out", str(out)], {out: "prepared"})
    return Verdict(r, r.clean_error("pickle"), "refused pickle weights", problems)


def _loose_drafter_config(edit: Callable[[dict], object]) -> Callable[[Pipeline, Runner], Verdict]:
    def case(p: Pipeline, run: Runner) -> Verdict:
        d = p.copy(p.final, "loose-config")
        edit_json(d / "config.json", edit)
        r = run(p.generate(d))
        return Verdict(r, r.clean_error(), "refused")

    return case


def _moved_store(p: Pipeline, run: Runner) -> Verdict:
    moved = p.fresh("moved")
    moved.mkdir()
    shutil.copytree(p.data, moved / "data")
    shutil.copytree(p.hs, moved / "hs")
    away = p.data.with_name("data.away")
    p.data.rename(away)
    try:
        r1 = run(["train", *p.T, *TRAIN, "--data", str(moved / "hs"), "--out", str(p.fresh("moved-run")), "--max-steps", "1"])
        r2 = run(
            [
                "train",
                *p.T,
                *TRAIN,
                "--data",
                str(moved / "hs"),
                "--dataset",
                str(moved / "data"),
                "--out",
                str(p.fresh("moved-run2")),
                "--max-steps",
                "1",
            ]
        )
    finally:
        away.rename(p.data)
    return Verdict(
        r1,
        r1.clean_error("--dataset") and r2.code == 0,
        "names --dataset, then trains with it",
        judge(r2, inputs_before={}, inputs_after={}),
    )


def _quickstart_budget(flags: list[str]) -> Callable[[Pipeline, Runner], Verdict]:
    def case(p: Pipeline, run: Runner) -> Verdict:
        r = run(["quickstart", "--out", str(p.fresh("quickstart")), *flags])
        return Verdict(r, r.clean_error(), "refused")

    return case


def _damaged_store(damage: Callable[[list[Path]], None], *, at_start: bool) -> Callable[[Pipeline, Runner], Verdict]:
    """Train on a damaged copy of the store: refused, before the first step when ``at_start`` (a missing sample:
    the default ``--verify quick`` lists them; a corrupt one is found when read, or up front with ``--verify full``)."""

    def case(p: Pipeline, run: Runner) -> Verdict:
        c = p.copy(p.hs, "damaged-store")
        damage(sorted(x for x in c.iterdir() if x.suffix == ".safetensors"))
        out = p.fresh("damaged-run")
        r = run(["train", *p.T, *TRAIN, "--data", str(c), "--out", str(out), "--max-steps", "40", "--checkpoint-interval", "0"])
        steps = train_steps(out)
        return Verdict(r, r.clean_error() and (steps == 0 or not at_start), f"refused (after {steps} steps)")

    return case


def _flip_byte(files: list[Path]) -> None:
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[-1].write_bytes(bytes(data))


def _long_line(p: Pipeline, run: Runner) -> Verdict:
    big = p.fresh("long-line.jsonl")
    big.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 400_000}]})
        + "\n"
        + conversations(2)
    )
    out = p.fresh("long-line-out")
    r, problems = checked(
        p, run, ["prepare", *p.T, "--data", str(big), "--out", str(out), "--max-length", "512"], {out: "prepared"}, (big,)
    )
    return Verdict(r, r.code == 0 and "too_long" in r.stdout + r.stderr, "skipped the 2 MB line", problems)


def _non_utf8(p: Pipeline, run: Runner) -> Verdict:
    bad = p.fresh("latin1.jsonl")
    bad.write_bytes(conversations(2).encode() + '{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'.encode("latin-1"))
    out = p.fresh("latin1-out")
    r, problems = checked(p, run, ["prepare", *p.T, "--data", str(bad), "--out", str(out)], {out: "prepared"}, (bad,))
    return Verdict(r, r.clean_error(":3:"), "names line 3", problems)


CASES: list[Case] = [
    Case("prepare --out = the input's directory", "1", _prepare_into_input_dir),
    Case("calibrate --out a directory with other files", "1", _calibrate_into_foreign_dir),
    Case("resume with a flipped bit in trainer_state", "2", _resume_flipped_trainer_state),
    Case("decode with a flipped bit in final/model.safetensors", "2", _decode_flipped_final),
    Case("train --grad-clip nan", "3", _train_non_finite("--grad-clip", "nan")),
    Case("train --weight-decay nan", "3", _train_non_finite("--weight-decay", "nan")),
    Case("train --lr 1e12", "3", _train_non_finite("--lr", "1e12")),
    Case("decode a drafter with NaN weights", "3", _decode_nan_drafter),
    Case("serve --host 0.0.0.0 without --token", "4", _serve_wide_without_token),
    Case("target dir: pytorch_model.bin beside extra.safetensors", "5", _pickle_target),
    Case("decode: no specdraft.config.block_size", "6", _loose_drafter_config(lambda c: c["specdraft"]["config"].pop("block_size"))),
    Case(
        "decode: specdraft block_size 3, top level 4", "6", _loose_drafter_config(lambda c: c["specdraft"]["config"].update(block_size=3))
    ),
    Case("decode: no specdraft.target.fingerprint", "6", _loose_drafter_config(lambda c: c["specdraft"]["target"].pop("fingerprint"))),
    Case("moved store, without and with --dataset", "7", _moved_store),
    Case("quickstart --eval-reserve -100", "7", _quickstart_budget(["--eval-reserve", "-100"])),
    Case("quickstart --budget 12 --data-budget 0", "7", _quickstart_budget(["--budget", "12", "--data-budget", "0"])),
    Case("train on a complete store with a sample deleted", "7", _damaged_store(lambda files: files[3].unlink(), at_start=True)),
    Case("train on a store with a corrupt sample", "7", _damaged_store(_flip_byte, at_start=False)),
    Case("prepare: one 2 MB line", "7", _long_line),
    Case("prepare: non-UTF-8 byte on line 3", "7", _non_utf8),
]
