"""Issue 17's hostile-input sweep, as a new user would try it: every case a `specdraft` CLI subprocess.

    PYTHONPATH=src python benchmarks/hostile_sweep.py [--json hostile_sweep.json] [--keep DIR] [--long-line-mb 10]

It runs against whichever specdraft ``python -m specdraft.cli.main`` imports (set PYTHONPATH to a
checkout's ``src``), so the same script measures the old and the new code. Setup, in a temporary
directory: a tiny random Llama (hidden 64, 4 layers) with the embedded SmolLM2 tokenizer, 40 short
conversations, ``prepare`` -> ``extract`` (dspark layers) -> a 4-step dspark ``train``. Then each
case of the issue runs on a copy of what it needs and gets a verdict from what it left behind
(exit code, message, files, listening sockets). Prints a markdown table (case, command, exit code,
first line of the message, verdict) and writes the rows as JSON. A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "specdraft.cli.main"]
MODEL = "num_layers=1,block_size=4,markov_rank=16,max_anchors=8,intermediate_size=64"
TRAIN = ["--method", "dspark", "--model", MODEL, "--pack-tokens", "128", "--eval-interval", "0", "--val-fraction", "0",
         "--dtype", "fp32", "--num-threads", "1"]
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing about rivers and stones".split()


class Sweep:
    def __init__(self, work: Path):
        self.w = work
        self.rows: list[dict] = []
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)

    # -- running ------------------------------------------------------------------------------------

    def spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen, Path, Path]:
        out, err = self.logs / f"{name}.out", self.logs / f"{name}.err"
        proc = subprocess.Popen([*CLI, *args], stdout=open(out, "w"), stderr=open(err, "w"), cwd=self.w, start_new_session=True)
        return proc, out, err

    def run(self, name: str, args: list[str], timeout: float = 180.0) -> dict:
        """Run one CLI command; returns exit code (or 'running' when it had to be stopped), output, seconds, peak RSS."""
        proc, out, err = self.spawn(name, args)
        started = time.monotonic()
        status, usage, killed = None, None, False
        while status is None:
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, usage = st, ru
            elif time.monotonic() - started > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
            else:
                time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return {"code": f"running after {timeout:.0f} s (killed)" if killed else proc.returncode, "seconds": round(time.monotonic() - started, 1),
                "peak_mb": round(usage.ru_maxrss / 1024), "stdout": out.read_text(), "stderr": err.read_text(), "args": args}

    def record(self, case: str, item: str, result: dict | None, verdict: str, *, command: str | None = None, message: str | None = None) -> None:
        cmd = command if command is not None else "specdraft " + " ".join(result["args"])
        row = {"case": case, "item": item, "command": cmd.replace(str(self.w), "$W"),
               "exit": "-" if result is None else result["code"],
               "message": (message if message is not None else first_message(result)).replace(str(self.w), "$W"),
               "verdict": verdict}
        if result is not None:
            row["seconds"], row["peak_mb"] = result["seconds"], result["peak_mb"]
        self.rows.append(row)
        print(f"[sweep] {case}: exit {row['exit']} -> {verdict}", file=sys.stderr, flush=True)


def first_message(result: dict | None) -> str:
    """The CLI's error line, else a traceback's last line, else the last line of stdout."""
    if result is None:
        return ""
    err = [line for line in result["stderr"].splitlines() if line.strip()]
    for line in err:
        if ": error:" in line:
            return line.strip()[:220]
    if any(line.startswith("Traceback") for line in err):
        return ("traceback: " + err[-1].strip())[:220]
    out = [line for line in result["stdout"].splitlines() if line.strip()]
    return (out[-1].strip() if out else (err[-1].strip() if err else ""))[:220]


def clean_error(result: dict, *words: str) -> bool:
    msg = first_message(result)
    return result["code"] == 2 and ": error:" in msg and all(w in msg for w in words)


# -- fixtures -------------------------------------------------------------------------------------------


def build_target(out: Path) -> Path:
    import torch
    import transformers

    from specdraft.targets import resolve_target_dir

    tok_dir = resolve_target_dir("smollm2-135m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for f in tok_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def conversations(n: int) -> str:
    rows = []
    for i in range(n):
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(6))
        a = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(12 + i % 9))
        rows.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
    return "\n".join(rows) + "\n"


def safetensors_layout(path: Path) -> tuple[int, dict]:
    """(offset of the data section, header) of a safetensors file."""
    raw = path.read_bytes()[:8]
    (n,) = struct.unpack("<Q", raw)
    return 8 + n, json.loads(path.read_bytes()[8 : 8 + n])


def flip_mantissa_bit(path: Path) -> str:
    """Flip the lowest bit of one float32 in the middle of the largest tensor (a change that can never make NaN)."""
    start, header = safetensors_layout(path)
    name, info = max(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    lo, hi = info["data_offsets"]
    offset = start + lo + ((hi - lo) // 2) // 4 * 4
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return name


def edit_json(path: Path, edit) -> None:
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2))


def wildcard_ports(pid: int) -> list[str]:
    """Listening TCP sockets of ``pid`` bound to every interface, from /proc (what ``ss -ltnp`` shows).

    Like ``specdraft.utils.net.listening_sockets``, repeated here because the sweep must also run on
    checkouts that lack that module."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                addr, port = f[1].split(":")
                if set(addr) == {"0"}:
                    found.append(f"{'0.0.0.0' if table == 'tcp' else '[::]'}:{int(port, 16)}")
    return sorted(found)


def read_ready_line(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        text = path.read_text()
        if text.strip():
            return json.loads(text.splitlines()[0])
        time.sleep(0.2)
    return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the sweep ----------------------------------------------------------------------------------------


def sweep(s: Sweep, long_line_mb: float) -> None:
    w = s.w
    target = build_target(w / "target")
    (w / "good.jsonl").write_text(conversations(40))
    T = ["--target", str(target)]
    base = s.run("setup-prepare", ["prepare", *T, "--data", str(w / "good.jsonl"), "--out", str(w / "data")])
    s.run("setup-extract", ["extract", *T, "--dataset", str(w / "data"), "--out", str(w / "hs"), "--method", "dspark"])
    s.run("setup-train", ["train", *T, *TRAIN, "--data", str(w / "hs"), "--out", str(w / "run"), "--max-steps", "4",
                          "--checkpoint-interval", "2"])
    final = w / "run" / "final"
    if not (final / "model.safetensors").is_file():
        raise SystemExit(f"setup failed; see {s.logs}")
    generate = ["generate", *T, "--drafter", "dspark", "--prompt", "the quick brown fox", "--max-new-tokens", "8"]

    def drafter_copy(name: str) -> Path:
        path = w / name
        shutil.copytree(final, path)
        return path

    # 1. data loss
    c = w / "c1"
    c.mkdir()
    shutil.copy(w / "good.jsonl", c / "good.jsonl")
    (c / "notes.txt").write_text("mine\n")
    r = s.run("prepare-into-input-dir", ["prepare", *T, "--data", str(c / "good.jsonl"), "--out", str(c)])
    lost = [n for n in ("good.jsonl", "notes.txt") if not (c / n).exists()]
    s.record("prepare --out = the input's directory", "1", r, f"BUG: deleted {', '.join(lost)}" if lost else "safe: nothing deleted")
    c = w / "c1b"
    c.mkdir()
    (c / "notes.txt").write_text("mine\n")
    r = s.run("calibrate-into-foreign-dir", ["calibrate", "--drafter", str(final), "--data", str(w / "hs"), "--out", str(c), *T])
    s.record("calibrate --out a directory with other files", "1", r,
             "safe: nothing deleted" if (c / "notes.txt").exists() else "BUG: deleted notes.txt")

    # 2. checkpoint contents, flipped bytes
    step = sorted((w / "run" / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))[-1]
    state = step / "trainer_state.safetensors"
    _, header = safetensors_layout(state)
    frozen = sorted(k for k in header if "embed_tokens" in k or "verifier_" in k)
    sizes = f"trainer_state {state.stat().st_size / 1e6:.1f} MB, model {(step / 'model.safetensors').stat().st_size / 1e6:.1f} MB"
    s.record("checkpoint size", "2", None, f"BUG: trainer state holds target tensors {frozen}" if frozen else "ok: no target tensors",
             command=f"(inspect $W/run/checkpoints/{step.name})", message=sizes)
    c = w / "c2"
    shutil.copytree(w / "run", c)
    tensor = flip_mantissa_bit(c / "checkpoints" / step.name / "trainer_state.safetensors")
    r = s.run("resume-flipped-trainer-state", ["train", *T, *TRAIN, "--data", str(w / "hs"), "--out", str(c), "--max-steps", "6",
                                                "--checkpoint-interval", "2"])
    s.record(f"resume with a flipped bit in trainer_state ({tensor})", "2", r,
             "fixed: refused" if r["code"] == 2 else "BUG: resumed from corrupt state" if r["code"] == 0 else "crash")
    d = drafter_copy("c2-final")
    tensor = flip_mantissa_bit(d / "model.safetensors")
    r = s.run("decode-flipped-final", [*generate, "--drafter-path", str(d)])
    s.record(f"decode with a flipped bit in final/model.safetensors ({tensor})", "2", r,
             "fixed: refused" if r["code"] == 2 else "BUG: loaded and decoded" if r["code"] == 0 else "crash")

    # 3. finite or stop
    for flag, value in (("--grad-clip", "nan"), ("--weight-decay", "nan"), ("--lr", "1e12")):
        out = w / f"c3{flag}"
        r = s.run(f"train{flag}-{value}", ["train", *T, *TRAIN, "--data", str(w / "hs"), "--out", str(out), "--max-steps", "4",
                                           "--checkpoint-interval", "2", flag, value])
        nan = nan_tensors(out / "final")
        if r["code"] == 0:
            verdict = f"BUG: exit 0, {nan} final tensors NaN/inf" if nan else "trained to finite weights"
        else:
            verdict = ("fixed: refused, no NaN saved" if clean_error(r) and not nan else f"crash/NaN saved ({nan})")
        s.record(f"train {flag} {value}", "3", r, verdict)
    d = drafter_copy("c3-nan-drafter")
    poison(d / "model.safetensors")
    r = s.run("decode-nan-drafter", [*generate, "--drafter-path", str(d)])
    s.record("decode a drafter with NaN weights", "3", r,
             "fixed: clean error" if clean_error(r) else "BUG: traceback" if r["code"] == 1 else f"BUG: exit {r['code']}")

    # 4. network exposure
    r = s.run("serve-0.0.0.0", ["serve", str(final), "--host", "0.0.0.0", *T], timeout=60)
    s.record("serve --host 0.0.0.0 without --token", "4", r,
             "fixed: token required" if clean_error(r, "--token") else "BUG: no token required")
    mooncake_case(s, target)

    # 5. pickle targets
    pickled = w / "pickled-target"
    shutil.copytree(target, pickled)
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").rename(pickled / "extra.safetensors")
    r = s.run("pickle-target", ["prepare", "--target", str(pickled), "--data", str(w / "good.jsonl"), "--out", str(w / "c5")])
    s.record("target dir: pytorch_model.bin beside extra.safetensors", "5", r,
             "fixed: refused" if clean_error(r, "pickle") else "BUG: pickle loaded" if r["code"] == 0 else "refused (unclear)")

    # 6. loose drafter configs
    for name, edit in (
        ("no specdraft.config.block_size", lambda cfg: cfg["specdraft"]["config"].pop("block_size")),
        ("specdraft block_size 3, top level 4", lambda cfg: cfg["specdraft"]["config"].update(block_size=3)),
        ("no specdraft.target.fingerprint", lambda cfg: cfg["specdraft"]["target"].pop("fingerprint")),
    ):
        d = drafter_copy("c6-" + name.split()[1].replace(".", "-") + str(len(s.rows)))
        edit_json(d / "config.json", edit)
        r = s.run("decode-" + d.name, [*generate, "--drafter-path", str(d)])
        s.record(f"decode: {name}", "6", r, "fixed: refused" if clean_error(r) else "BUG: decoded" if r["code"] == 0 else "crash")

    # 7. smaller
    moved = w / "moved"
    moved.mkdir()
    shutil.copytree(w / "data", moved / "data")
    shutil.copytree(w / "hs", moved / "hs")
    (w / "data").rename(w / "data.away")
    try:
        r = s.run("moved-store", ["train", *T, *TRAIN, "--data", str(moved / "hs"), "--out", str(w / "c7a"), "--max-steps", "1"])
        s.record("moved store, no --dataset", "7", r, "clear: names --dataset" if clean_error(r, "--dataset") else "BUG: wrong advice")
        r = s.run("moved-store-dataset", ["train", *T, *TRAIN, "--data", str(moved / "hs"), "--dataset", str(moved / "data"),
                                          "--out", str(w / "c7a2"), "--max-steps", "1"])
        s.record("moved store, --dataset NEW", "7", r, "fixed: trains" if r["code"] == 0 else "BUG: --dataset ignored")
    finally:
        (w / "data.away").rename(w / "data")
    for name, flags in (("--eval-reserve -100", ["--eval-reserve", "-100"]), ("--budget 12 --data-budget 0", ["--budget", "12", "--data-budget", "0"])):
        r = s.run("quickstart" + flags[1], ["quickstart", "--out", str(w / ("c7q" + flags[1])), *flags], timeout=30)
        s.record(f"quickstart {name}", "7", r, "fixed: refused" if clean_error(r) else "BUG: accepted")
    c = w / "c7d"
    shutil.copytree(w / "hs", c)
    victim = sorted(p for p in c.iterdir() if p.suffix == ".safetensors")[3]
    victim.unlink()
    r = s.run("deleted-sample", ["train", *T, *TRAIN, "--data", str(c), "--out", str(w / "c7d-run"), "--max-steps", "1"])
    s.record("train on a complete store with a sample deleted", "7", r,
             "fixed: refused" if clean_error(r) else "BUG: skipped silently" if r["code"] == 0 else "crash")
    c = w / "c7e"
    shutil.copytree(w / "hs", c)
    victim = sorted(p for p in c.iterdir() if p.suffix == ".safetensors")[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = s.run("corrupt-sample", ["train", *T, *TRAIN, "--data", str(c), "--out", str(w / "c7e-run"), "--max-steps", "40",
                                 "--checkpoint-interval", "0"])
    steps = train_steps(w / "c7e-run")
    s.record("train on a store with a corrupt sample", "7", r,
             ("fixed: refused before training" if steps == 0 else f"late: found after {steps} steps") if r["code"] == 2
             else "BUG: trained on it" if r["code"] == 0 else "crash")
    delivery_case(s, target)
    sigterm_case(s, target)

    big = w / "long-line.jsonl"
    big.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "word " * int(long_line_mb * 2**20 / 5)}]}) + "\n"
                   + conversations(2))
    r = s.run("long-line", ["prepare", *T, "--data", str(big), "--out", str(w / "c7h"), "--max-length", "512"])
    extra = r["peak_mb"] - base["peak_mb"]
    skipped = "too_long" in r["stdout"] + r["stderr"]
    s.record(f"prepare: one {long_line_mb:g} MB line", "7", r,
             (f"{'fixed' if r['seconds'] < 2 * base['seconds'] and extra < 300 else 'BUG'}: skipped in {r['seconds']} s, "
              f"+{extra} MB over a small prepare") if r["code"] == 0 and skipped else "crash",
             message=f"{r['seconds']} s, peak {r['peak_mb']} MB (a 40-row prepare: {base['seconds']} s, {base['peak_mb']} MB)")
    bad = w / "latin1.jsonl"
    bad.write_bytes(conversations(2).encode() + '{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'.encode("latin-1"))
    r = s.run("non-utf8", ["prepare", *T, "--data", str(bad), "--out", str(w / "c7i")])
    s.record("prepare: non-UTF-8 byte on line 3", "7", r, "fixed: names the line" if clean_error(r, ":3:") else "BUG: no line number")


def nan_tensors(directory: Path) -> str:
    if not (directory / "model.safetensors").is_file():
        return ""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "model.safetensors"))
    bad = sum(1 for v in tensors.values() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    return f"{bad}/{len(tensors)}" if bad else ""


def poison(path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def train_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("split") == "train")


def mooncake_case(s: Sweep, target: Path) -> None:
    w = s.w
    r = s.run("mooncake-master", ["store", "start", "--dir", str(w / "mc"), "--port", "0"], timeout=60)
    if r["code"] != 0:
        s.record("Mooncake producer listeners", "4", r, "skipped: no Mooncake master")
        return
    state = json.loads((w / "mc" / "master.json").read_text())
    store = f"mooncake://{state['host']}:{state['port']}/sweep?admin={state['host']}:{state['metrics_port']}&segment_mb=0"
    proc, out, err = s.spawn("mooncake-producer", ["serve-hidden-states", "--target", str(target), "--backend", "mooncake",
                                                    "--store", store, "--port", "0", "--num-threads", "1"])
    try:
        ready = read_ready_line(out, proc)
        exposed = wildcard_ports(proc.pid) if ready else []
        master_wide = wildcard_ports(state["pid"])
        ss = shutil.which("ss")
        listing = subprocess.run([ss, "-ltnp"], capture_output=True, text=True).stdout if ss else "(ss not installed; read /proc/net/tcp*)"
        (s.logs / "mooncake-ss.txt").write_text(listing)
    finally:
        stop(proc)
        s.run("mooncake-stop", ["store", "stop", "--dir", str(w / "mc")], timeout=60)
    warned = "listens on all interfaces" in err.read_text()
    result = {"code": "-" if ready else "producer failed", "args": ["serve-hidden-states", "--backend", "mooncake", "..."],
              "stdout": "", "stderr": "", "seconds": 0, "peak_mb": 0}
    if not ready:
        verdict = "producer did not start"
    elif not exposed:
        verdict = "fixed: nothing on 0.0.0.0/[::]"
    else:
        verdict = ("engine limitation, warned: " if warned else "BUG, silent: ") + f"producer listens on {', '.join(exposed)}"
    s.record("Mooncake producer, local_hostname 127.0.0.1: listeners on 0.0.0.0/[::]", "4", result, verdict,
             command="specdraft serve-hidden-states --backend mooncake --store mooncake://127.0.0.1:PORT/sweep",
             message=f"producer wildcard sockets {exposed or 'none'}; master {master_wide or 'loopback only'}")


def delivery_case(s: Sweep, target: Path) -> None:
    w = s.w
    c = w / "c7f"
    proc, out, _ = s.spawn("file-producer", ["serve-hidden-states", "--target", str(target), "--backend", "file",
                                             "--store", str(c / "transport"), "--port", "0", "--num-threads", "1"])
    try:
        ready = read_ready_line(out, proc)
        if not ready:
            s.record("delivered.jsonl after a resume", "7", None, "skipped: producer did not start", command="", message="")
            return
        online = ["train", "--target", str(target), *TRAIN, "--data-mode", "online", "--dataset", str(w / "data"),
                  "--producers", ready["url"], "--store", str(c / "transport"), "--out", str(c / "run"), "--stream-dtype", "float32",
                  "--max-steps", "4", "--checkpoint-interval", "2"]
        s.run("online-first", online)
        shutil.rmtree(c / "run" / "checkpoints" / "step-4", ignore_errors=True)  # as if killed just before the step-4 checkpoint
        shutil.rmtree(c / "run" / "final", ignore_errors=True)
        r = s.run("online-resume", online)
    finally:
        stop(proc)
    log = c / "run" / "delivered.jsonl"
    ids = [json.loads(line)["sample_id"] for line in log.read_text().splitlines()] if log.is_file() else []
    twice = len(ids) - len(set(ids))
    s.record("delivered.jsonl after a resume from step 2 of 4", "7", r,
             f"BUG: {twice} samples listed twice" if twice else f"fixed: {len(ids)} deliveries, none twice" if r["code"] == 0 else "crash")


def sigterm_case(s: Sweep, target: Path) -> None:
    w = s.w
    args = ["train", "--target", str(target), *TRAIN, "--data", str(w / "hs"), "--out", str(w / "c7g"), "--max-steps", "100000",
            "--checkpoint-interval", "0"]
    proc, out, err = s.spawn("sigterm", args)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and train_steps(w / "c7g") < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    result = {"code": code, "args": args, "stdout": out.read_text(), "stderr": err.read_text(), "seconds": 0, "peak_mb": 0}
    s.record("SIGTERM during train", "7", result, "fixed: 143 (128 + SIGTERM)" if code == 143 else f"BUG: exit {code}, not 143",
             message=first_message(result) or "(no message)")


def markdown(rows: list[dict]) -> str:
    lines = ["| # | case | command | exit | first line of message | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        cmd = r["command"] if len(r["command"]) < 110 else r["command"][:107] + "..."
        cells = [r["item"], r["case"], f"`{cmd}`", str(r["exit"]), r["message"].replace("|", "\\|"), r["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="hostile_sweep.json", help="where to write the rows as JSON")
    parser.add_argument("--keep", default=None, help="work in this (new) directory and keep it, instead of a temporary one")
    parser.add_argument("--long-line-mb", type=float, default=10.0, help="size of the single over-long JSONL line")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hostile-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    s = Sweep(work)
    try:
        sweep(s, args.long_line_mb)
    finally:
        import specdraft

        table = markdown(s.rows)
        print(table)
        summary = {"specdraft": str(Path(specdraft.__file__).parent), "seconds": round(time.monotonic() - started, 1), "rows": s.rows}
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"\n{len(s.rows)} cases in {summary['seconds']} s against {summary['specdraft']}; rows in {args.json}", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
