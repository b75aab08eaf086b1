"""Cached and derived artifacts (issue 37, mechanism 1): each is verified on read, a damaged one is made again
with a logged reason, a cache that cannot be written is used from memory, and no build is waited on without bound.

The caches (``utils/cache.py``): measurements, SPS profiles, file digests, the streamed kernel's build stamp;
the converted embedded target (``targets/embedded.py``); a prepared dataset's token counts (``data/dataset.py``).
Every test points ``SPECDRAFT_CACHE`` / ``TORCH_EXTENSIONS_DIR`` at a temporary directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdraft.errors import SpecdraftError
from specdraft.tuning import streamed

REPO = Path(__file__).resolve().parents[2]


# ----- the streamed kernel's build: a stale lock, a live builder, a damaged library -------------------------------


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """An empty ``TORCH_EXTENSIONS_DIR``, the kernel's build directory in it, and ``streamed_ops`` unloaded (and reloaded
    for later tests)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    streamed.streamed_ops.cache_clear()
    monkeypatch.setattr(streamed, "_failure", [])
    yield tmp_path / "ext" / streamed.extension_name()
    streamed.streamed_ops.cache_clear()


def fake_load(calls: list):
    """``cpp_extension.load`` as torch runs it around a build (its ``FileBaton`` on ``<build dir>/lock``, waited on
    without bound where the file exists), with the compiler's work replaced by writing a small library file."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    def load(name, sources, build_directory=None, **kwargs):
        build_directory = build_directory or cpp_extension._get_build_directory(name, verbose=False)
        library = Path(build_directory) / f"{name}{cpp_extension.LIB_EXT}"
        calls.append(library.exists())  # whether a library was there to be imported
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            try:
                if not library.exists():
                    library.write_bytes(b"built library")
            finally:
                baton.release()
        else:
            baton.wait()
        return types.SimpleNamespace(__file__=str(library), streamed_linear=None)

    return load


def in_bounded_time(fn, seconds: float = 30.0):
    """``fn()``'s result, or a failure (not a hang) where it has not returned after ``seconds``."""
    result = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still waiting after {seconds} s"
    return result[0]


def test_a_stale_build_lock_left_by_a_killed_build_is_taken_over(extensions, monkeypatch, caplog):
    """kill -9 during the first build left torch's ``lock``; every later load waited on it forever, without a log line."""
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(calls))
    extensions.mkdir(parents=True)
    (extensions / "lock").write_text("")  # what the killed builder left
    with caplog.at_level(logging.INFO):
        ops = in_bounded_time(streamed.streamed_ops)
    assert ops is not None and calls == [False] and not (extensions / "lock").exists()
    assert f"taking over the stale build lock {extensions / 'lock'}" in caplog.text


@contextlib.contextmanager
def live_builder(build_dir: Path):
    """Another process's build in progress: it holds the build lock and torch's ``lock``."""
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").write_text("")
    with open(build_dir / streamed.BUILD_LOCK, "a+") as held:  # another open file: flock conflicts as across processes
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def test_a_build_that_does_not_finish_in_time_falls_back_to_another_forward_path(extensions, monkeypatch, caplog):
    from torch import nn
    from torch.utils import cpp_extension

    from specdraft.tuning import forward_path as fp

    monkeypatch.setattr(cpp_extension, "load", fake_load([]))
    monkeypatch.setattr(streamed, "BUILD_WAIT_S", 0.5)
    with live_builder(extensions), caplog.at_level(logging.INFO):
        assert in_bounded_time(streamed.streamed_ops) is None
        paths = fp.applicable_paths(nn.Sequential(nn.Linear(8, 8)))
    assert "prepacked" in paths and not [p for p in paths if "streamed" in p]
    assert "has been building it in" in streamed.build_failure()
    assert "waiting up to 0.5 s for the build of specdraft's streamed kernel" in caplog.text
    unavailable = [r for r in caplog.records if "'streamed' is unavailable" in r.getMessage()]
    assert len(unavailable) == 1 and unavailable[0].levelno == logging.WARNING


def test_a_kernel_library_that_does_not_match_its_build_stamp_is_rebuilt_not_imported(extensions, monkeypatch, caplog):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(calls))
    assert streamed.streamed_ops() is not None and calls == [False]  # built, and stamped
    streamed.streamed_ops.cache_clear()
    assert streamed.streamed_ops() is not None and calls == [False, True]  # the stamped library is imported as it is
    library = extensions / f"{streamed.extension_name()}{cpp_extension.LIB_EXT}"
    library.write_bytes(b"damaged library")
    streamed.streamed_ops.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert streamed.streamed_ops() is not None
    assert calls[-1] is False and library.read_bytes() == b"built library"  # removed before the load, built afresh
    assert f"rebuilding specdraft's streamed kernel: {library} has another sha256 than its build stamp" in caplog.text


@pytest.mark.slow
def test_generate_after_a_build_killed_mid_way_takes_the_lock_over_and_finishes(tmp_path, tiny_llama_dir):
    """The reported case end to end, with a real build: ``generate --drafter none`` on ``--forward-path auto``."""
    build_dir = tmp_path / "ext" / streamed.extension_name()
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "SPECDRAFT_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdraft.cli.main",
            "generate",
            "--target",
            str(tiny_llama_dir),
            "--prompt",
            "hi",
            "--drafter",
            "none",
            "--max-new-tokens",
            "4",
            "--threads",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"taking over the stale build lock {build_dir / 'lock'}" in run.stderr and "tok/s=" in run.stdout


# ----- per-machine caches: damaged, in the way, read-only ---------------------------------------------------------


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
        )
    ).eval()


def sps(model, cache: Path):
    from specdraft.decode.sps import load_or_measure_sps

    return load_or_measure_sps(model, fingerprint="abc", cache_dir=cache, max_tokens=2, context_tokens=8, repeats=1)


@pytest.fixture
def sps_calls(monkeypatch):
    from specdraft.decode import sps as sps_module

    calls, real = [], sps_module.measure_sps
    monkeypatch.setattr(sps_module, "STALE_FACTOR", 1e9)  # sub-millisecond timings of a tiny model: no staleness verdict
    monkeypatch.setattr(sps_module, "measure_sps", lambda *a, **kw: (len(kw["token_counts"]) > 1 and calls.append(1)) or real(*a, **kw))
    return calls  # whole profiles measured, not the spot checks of cached ones


def test_an_sps_cache_entry_that_is_a_directory_is_measured_again_and_kept_in_memory(tmp_path, sps_calls, caplog):
    """It was an IsADirectoryError traceback."""
    from specdraft.decode.sps import sps_cache_path

    model = tiny_model()
    path = sps_cache_path(
        tmp_path, fingerprint="abc", device=torch.device("cpu"), dtype=torch.float32, context_tokens=8, max_tokens=2, forward_path="eager"
    )
    path.mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        first = sps(model, tmp_path)
        again = sps(model, tmp_path)
    assert first == again and len(sps_calls) == 1 and path.is_dir()  # measured once: the second read is the one in memory
    assert f"not using the cached SPS profile {path}: it cannot be read (Is a directory)" in caplog.text
    assert f"cannot write the cached SPS profile {path} (Is a directory); it is kept in memory" in caplog.text


@pytest.mark.parametrize("damage", ["not JSON", "edited", "wrong type"])
def test_a_damaged_sps_or_measurement_entry_is_measured_again_with_a_warning(tmp_path, sps_calls, caplog, damage):
    from specdraft.tuning.measured import measured_choice

    def tamper(path: Path) -> None:
        entry = json.loads(path.read_text())
        if damage == "not JSON":
            path.write_text(path.read_text()[:40])
        elif damage == "edited":  # a figure changed, its checksum not
            if "steps_per_second" in entry:
                entry["steps_per_second"] = [1e9 for _ in entry["steps_per_second"]]
            else:
                entry["seconds"] = dict.fromkeys(entry["seconds"], 1e-09)
            path.write_text(json.dumps(entry))
        else:
            path.write_text(json.dumps([entry]))

    model = tiny_model()
    first = sps(model, tmp_path)
    timers = {"a": lambda: 1.0, "b": lambda: 2.0}
    assert measured_choice("probe", {}, timers, preferred="a", cache_dir=tmp_path).choice == "a"
    for path in [*(tmp_path / "sps").iterdir(), *(tmp_path / "measured").iterdir()]:
        tamper(path)
    with caplog.at_level(logging.WARNING):
        assert sps(model, tmp_path).tokens == first.tokens and len(sps_calls) == 2
        again = measured_choice("probe", {}, timers, preferred="a", cache_dir=tmp_path)
    assert not again.cached and again.seconds == {"a": 1.0, "b": 2.0}
    reason = {"not JSON": "it is not JSON", "edited": "its content does not match its entry_sha256", "wrong type": "it holds a JSON list"}[
        damage
    ]
    assert caplog.text.count(reason) == 2 and "not using the cached SPS profile" in caplog.text
    assert sps(model, tmp_path) and measured_choice("probe", {}, timers, preferred="a", cache_dir=tmp_path).cached  # rewritten


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` as a read-only directory: a read-only tmpfs for root (whom permissions do not stop), else mode 0555."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True).returncode != 0:
        pytest.skip("root without a mountable tmpfs")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_cache_costs_a_warning_not_the_command(tmp_path, sps_calls, caplog):
    """``--verify-policy scheduled`` profiled, then exited 2 on writing the profile, where the measured caches went on."""
    from specdraft.tuning.measured import measured_choice

    model = tiny_model()
    with read_only(tmp_path / "cache") as cache, caplog.at_level(logging.WARNING):
        table = sps(model, cache)
        assert sps(model, cache) == table and len(sps_calls) == 1
        timers = {"a": lambda: 1.0, "b": lambda: 2.0}
        assert not measured_choice("probe", {}, timers, preferred="a", cache_dir=cache).cached
        assert measured_choice("probe", {}, timers, preferred="a", cache_dir=cache).cached  # from memory
    assert caplog.text.count("it is kept in memory for this process only") == 2 and not list(cache.iterdir())


def test_a_policy_the_drafter_cannot_feed_is_refused_before_profiling(tmp_path, tiny_llama_dir, sps_calls, monkeypatch, capsys):
    """``generate --verify-policy scheduled`` without a calibrated drafter profiled the target's SPS first, then exited 2."""
    from specdraft.cli.main import main

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    argv = [
        "generate",
        "--target",
        str(tiny_llama_dir),
        "--prompt",
        "hi",
        "--drafter",
        "none",
        "--verify-policy",
        "scheduled",
        "--max-new-tokens",
        "2",
        "--forward-path",
        "eager",
    ]
    assert main(argv) == 2
    assert "needs draft confidences" in capsys.readouterr().err and not sps_calls


# ----- the converted embedded target ------------------------------------------------------------------------------


@pytest.fixture
def embedded(tmp_path, monkeypatch, tiny_llama_dir):
    """A temporary cache whose embedded target converts by copying the tiny Llama (counted), with digests of every
    weight file cached as the real target's 538 MB file is; yields the list of conversions."""
    from specdraft.targets import embedded as emb
    from specdraft.targets import identity

    conversions = []

    def convert(gguf_path: Path, out_dir: Path) -> None:
        conversions.append(out_dir)
        for path in tiny_llama_dir.iterdir():
            shutil.copy(path, out_dir / path.name)

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(emb, "convert_gguf", convert)
    monkeypatch.setattr(emb.EmbeddedTarget, "gguf_path", lambda self: tiny_llama_dir / "model.gguf")
    monkeypatch.setattr(identity, "_CACHE_MIN_BYTES", 0)
    return conversions


def _random_bytes(path: Path) -> None:
    """Overwrite 4 KiB in the middle with random bytes, keeping the size and (as a careful tamperer would) the mtime."""
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(stat.st_size // 2)
        f.write(os.urandom(4096))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


DAMAGE = {
    "random bytes": (lambda d: _random_bytes(d / "model.safetensors"), "model.safetensors differs from what was converted"),
    "truncated": (
        lambda d: os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2),
        "model.safetensors is .* bytes, not the .* it was converted to",
    ),
    "deleted": (lambda d: [p.unlink() for p in d.iterdir() if p.name != "specdraft_target.json"], "is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_converted_target_is_converted_again(embedded, caplog, damage):
    """Random bytes gave blank output, a truncated file a SafetensorError traceback, deleted files an error with no remedy."""
    from specdraft.targets import load_target
    from specdraft.targets.embedded import DEFAULT_TARGET, MARKER_FILE, embedded_dir

    first = load_target(DEFAULT_TARGET)
    weights = {name: tensor.clone() for name, tensor in first.model.state_dict().items()}  # the loaded ones map the file
    directory = embedded_dir(DEFAULT_TARGET)
    tamper, reason = DAMAGE[damage]
    tamper(directory)
    with caplog.at_level(logging.WARNING):
        again = load_target(DEFAULT_TARGET)
    assert len(embedded) == 2
    assert again.fingerprint == first.fingerprint == json.loads((directory / MARKER_FILE).read_text())["fingerprint"]
    for name, tensor in weights.items():
        assert torch.equal(tensor, again.model.state_dict()[name]), name
    assert re.search(f"the converted embedded target {directory} is damaged: .*{reason}.*; converting it again", caplog.text)
    assert sorted(p.name for p in directory.parent.iterdir()) == [f".{DEFAULT_TARGET}.lock", DEFAULT_TARGET]  # no debris
    assert load_target(DEFAULT_TARGET).fingerprint == first.fingerprint and len(embedded) == 2  # verified, not converted again


def test_a_truncated_local_target_is_one_error_naming_it(tmp_path, tiny_llama_dir):
    """A user's own target directory cannot be converted again: its damaged weights are an error, not a traceback."""
    from specdraft.targets import load_target

    target = tmp_path / "target"
    shutil.copytree(tiny_llama_dir, target)
    os.truncate(target / "model.safetensors", (target / "model.safetensors").stat().st_size // 2)
    with pytest.raises(SpecdraftError, match=f"cannot load target model {target}: .*"):
        load_target(str(target))


def test_a_conversion_held_by_a_live_process_past_the_timeout_is_refused_naming_it(embedded, monkeypatch):
    from specdraft.targets import embedded as emb

    monkeypatch.setattr(emb, "CONVERT_WAIT_S", 0.3)
    lock = emb.embedded_dir(emb.DEFAULT_TARGET).parent / f".{emb.DEFAULT_TARGET}.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        with pytest.raises(
            SpecdraftError,
            match=r"process 4242 has been converting embedded target smollm2-135m for over 0.3 s \(it holds "
            r".*\.smollm2-135m\.lock\); let it finish, or stop it, then rerun",
        ):
            emb.ensure_embedded(emb.DEFAULT_TARGET)
    assert not embedded


@pytest.mark.slow
def test_random_bytes_in_the_real_converted_target_are_converted_again_and_generate_agrees(tmp_path):
    """The reported case with the real GGUF target, in a temporary cache: blank output before."""
    env = {**os.environ, "SPECDRAFT_CACHE": str(tmp_path / "cache")}
    command = [
        sys.executable,
        "-m",
        "specdraft.cli.main",
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--drafter",
        "none",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--forward-path",
        "eager",
    ]
    before = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert before.returncode == 0, before.stderr[-3000:]
    _random_bytes(tmp_path / "cache" / "targets" / "smollm2-135m" / "model.safetensors")
    after = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert after.returncode == 0, after.stderr[-3000:]
    assert "model.safetensors differs from what was converted" in after.stderr and "converting it again" in after.stderr
    answer = before.stdout.split("drafter=")[0]
    assert answer.split("\n", 1)[1].strip() and after.stdout.split("drafter=")[0] == answer


# ----- the prepared dataset's token counts, and a target that changed since ---------------------------------------


def prepared(directory: Path):
    from specdraft.data.dataset import PreparedDataset, write_prepared

    rows = [{"sample_id": "a", "source": "s", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}]
    info = {"name": "tiny", "path": "/models/tiny", "fingerprint": "f" * 16, "tokenizer_hash": "t" * 16}
    return PreparedDataset(write_prepared(directory, rows, target_info=info, config={}, stats={}, vocab_size=8))


@pytest.mark.parametrize(
    "counts, rechecksummed, message",
    [
        (torch.tensor([0, 1, 1, -3, 0, 0, 0, 0]), False, r"is corrupt: its sha256 is not the .* manifest.json records"),
        (torch.tensor([0, 1, 1, -3, 0, 0, 0, 0]), True, r"holds 1 count\(s\) that are not non-negative integers \(token id 3: -3\)"),
        (torch.tensor([0.0, 1.0, float("nan"), 1.0, 0.0, 0.0, 0.0, 0.0]), True, r"not non-negative integers \(token id 2: nan\)"),
        (torch.tensor([0, 1, 1]), True, r"holds counts of shape \[3\], not one per id of the vocabulary of 8"),
    ],
)
def test_damaged_or_negative_token_counts_are_refused_naming_the_file(tmp_path, counts, rechecksummed, message):
    """Negative counts in token_counts.safetensors, which had no checksum, were accepted."""
    from specdraft.data.dataset import COUNTS_FILE, MANIFEST_FILE, PreparedDataset
    from specdraft.utils.io import sha256_file

    dataset = prepared(tmp_path / "d")
    path = tmp_path / "d" / COUNTS_FILE
    assert load_file(str(path))["counts"].tolist() == dataset.token_counts().tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    save_file({"counts": counts}, str(path))
    if rechecksummed:  # a tamperer who also updates the manifest
        manifest = json.loads((tmp_path / "d" / MANIFEST_FILE).read_text())
        manifest.setdefault("checksums", {})[COUNTS_FILE] = sha256_file(path)
        (tmp_path / "d" / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(SpecdraftError, match=f"{path}.*{message}.*rerun `specdraft prepare`"):
        PreparedDataset(tmp_path / "d").token_counts()


def test_a_target_changed_since_preparing_is_named_as_changed_not_as_another_target(tmp_path):
    """It read "prepared for target 'smollm2-135m' ... not 'smollm2-135m'"."""
    from specdraft.targets.base import Target

    dataset = prepared(tmp_path / "d")
    changed = Target(name="tiny", path=Path("/models/tiny"), model=None, tokenizer=None, fingerprint="0" * 16, tokenizer_hash="t" * 16)
    with pytest.raises(
        SpecdraftError,
        match=r"^target 'tiny' \(/models/tiny\) has changed since .*/d was prepared for it: fingerprint "
        r"ffffffffffffffff then, 0000000000000000 now\. Rerun `specdraft prepare --target tiny`",
    ):
        dataset.check_target(changed)
    other = Target(name="other", path=Path("/models/other"), model=None, tokenizer=None, fingerprint="0" * 16, tokenizer_hash="t" * 16)
    with pytest.raises(SpecdraftError, match=r"was prepared for target 'tiny' \(/models/tiny\), not 'other' \(/models/other\)"):
        dataset.check_target(other)
