"""The seed's cluster on one machine: every host a Linux network namespace on a private bridge.

Hosts (one namespace each, addresses on ``SUBNET.0/24``, a bridge with no address in the root
namespace and no default route anywhere, so nothing can reach or be reached from outside):

  master      .1    ``specdraft store start`` (mooncake_master) + ``mooncake_client``, the memory
                    holder: every object lives there, so keys a run leaves behind stay countable
                    after its processes exit
  producer-K  .1K   ``specdraft serve-hidden-states`` (HF engine, a tiny random Llama), segment_mb=0
  trainer-R   .2R   ``torchrun`` node R of one 2-node job (static rendezvous on trainer-0, gloo),
                    ``specdraft train --data-mode online``, segment_mb=0

Key flow (the seed's): a trainer rank POSTs /extract to a producer, the producer runs the target
and puts the payload into the holder's memory, replies with the key; the rank reads it through
the master from the holder, verifies it and deletes it.

Scenarios (``--scenario`` a comma-separated list, run in order on one cluster; ``steady`` runs
first whenever another one is asked for, as the fault-free reference for the final weights):

  steady           one epoch, no fault
  join-leave       a third producer (started idle) is added to the trainers' producer list after a
                   eighth of the epoch; producer-0 is removed from it at half, then stopped (SIGTERM)
  producer-killed  SIGKILL of every process in producer-1's namespace after a third of the epoch
  trainer-killed   SIGKILL of every process in trainer-1's namespace after the first checkpoint;
                   the same two torchrun commands are rerun and resume from the last checkpoint
  master-restart   the master host (mooncake_master and the holder) is killed after the first
                   checkpoint and started again; every object and client registration is lost, so
                   the producers are restarted and the job is rerun, resuming from its last checkpoint

``--parallel fsdp``: every scenario's training job shards the drafter over its two hosts with FSDP2 instead of
replicating it (DDP), so ``trainer-killed`` shows a sharded run resumed across hosts.

``sequence-parallel`` (after the others; its data is an offline store that ``specdraft extract`` makes from the
dataset, read by both trainer hosts from the shared filesystem): ``train --sequence-parallel 2`` as one torchrun job
over the two trainer hosts, each sample split in two, one half per host; the same training in one process; then the
two-host job again, trainer-1 killed after its first checkpoint and the same commands rerun. Recorded: the per-step
losses' and final weights' largest difference against one process (float32 rounding: the all-gathered attention
and the all-reduced loss sum in another order), and the resumed run's against the uninterrupted one (0: bit for bit).

``--throughput 1,2,3``: afterwards, one consumer on trainer-0's host requests every sample once
from 1, 2, 3 producers (samples/s, payload MB/s, each producer's busy fraction from its /health),
then the same with every process in one namespace on 127.0.0.1 (the loopback layout of the docs).

For each scenario the delivery logs of both ranks are compared with the data plan (a pure
function of seed, ids and lengths): samples expected / delivered / duplicated / lost; deliveries
after the checkpoint a restart resumed from are counted as ``redelivered`` (their work was lost
with the killed run); store keys left; the final weights against ``steady``'s. Writes
``OUT/summary.json`` and removes every namespace, veth and the bridge it made, also on failure.

  sudo bash scripts/cluster.sh --scenario steady,producer-killed --out runs/cluster
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import queue
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MASTER_PORT, METRICS_PORT, PRODUCER_PORT, RDZV_PORT = 50051, 9003, 8700, 29500
STORE_NAMESPACE = "cluster"
DRAFTER = "num_layers=1,block_size=4,max_anchors=8,intermediate_size=64"
TRAIN = dict(pack_tokens=32, batch_rows=1, seed=1, checkpoint_interval=2)
_T0 = time.monotonic()
_LOG: list[str] = []


def say(message: str) -> None:
    line = f"[cluster {time.monotonic() - _T0:7.1f}s] {message}"
    _LOG.append(line)
    print(line, flush=True)


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


@dataclass
class Host:
    name: str
    role: str
    ns: str
    address: str
    veth: str
    port: int = PRODUCER_PORT  # a producer's HTTP port


class Netns:
    """Namespaces joined by one bridge; ``close`` kills what runs in them and removes them all."""

    def __init__(self, prefix: str, subnet: str):
        self.prefix, self.subnet = prefix, subnet
        self.bridge = f"{prefix}br"
        self.hosts: dict[str, Host] = {}
        self.commands: list[dict] = []
        self.secrets: list[str] = []  # not written to the summary's command lines
        ip("link", "add", self.bridge, "type", "bridge")
        ip("link", "set", self.bridge, "up")

    def add(self, name: str, role: str, index: int) -> Host:
        host = Host(name, role, f"{self.prefix}-{name}", f"{self.subnet}.{index}", f"{self.prefix}v{index}")
        self.hosts[name] = host  # recorded first, so close() removes a half-made host too
        ip("netns", "add", host.ns)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        ip("link", "set", host.veth, "master", self.bridge, "up")
        ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.ns, "link", "set", "eth0", "up")
        ip("-n", host.ns, "link", "set", "lo", "up")
        return host

    def spawn(self, host: Host, argv: list[str], log: Path, *, stdout: int | None = None, env: dict | None = None) -> subprocess.Popen:
        command = shlex.join(argv)
        for secret in self.secrets:
            command = command.replace(secret, "$SECRET")
        self.commands.append({"host": host.name, "command": command})
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            return subprocess.Popen(
                ["ip", "netns", "exec", host.ns, *argv],
                stdin=subprocess.DEVNULL,
                stdout=stdout or f,
                stderr=f,
                env=env,
                start_new_session=True,
            )

    def run(self, host: Host, argv: list[str], *, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.ns, *argv], capture_output=True, text=True, timeout=timeout)

    def pids(self, host: Host) -> list[int]:
        try:
            return [int(p) for p in ip("netns", "pids", host.ns).split()]
        except subprocess.CalledProcessError:
            return []

    def kill(self, host: Host) -> int:
        """SIGKILL every process in the host's namespace (a machine losing power); returns how many."""
        killed: set[int] = set()
        deadline = time.monotonic() + 10
        while (pids := self.pids(host)) and time.monotonic() < deadline:  # again: a parent may fork as it dies
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return len(killed)

    def close(self) -> None:
        for host in self.hosts.values():
            self.kill(host)
            # the root side first: a namespace outlives `ip netns del` while anything still refers to it
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        left = [
            line.split()[0]
            for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith(self.prefix + "-")
        ]
        left += re.findall(
            rf"^\d+: ({self.prefix}\w+)[@:]", subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout, re.M
        )
        say(f"removed {len(self.hosts)} namespaces and bridge {self.bridge}" + (f"; LEFT OVER: {left}" if left else ""))


# -- listeners: nothing of this run may listen in the root namespace ----------------------------


def root_listeners() -> list[dict]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            found.append(
                {
                    "local": parts[3],
                    "pids": [int(p) for p in re.findall(r"pid=(\d+)", line)],
                    "process": ",".join(re.findall(r'\("([^"]+)"', line)),
                }
            )
    return found


def descendants(root: int) -> set[int]:
    children = collections.defaultdict(set)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children[int(fields[1])].add(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    seen, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


class ListenerWatch:
    """Samples ``ss -ltnp`` of the root namespace; a listener owned by this run's process tree is a violation."""

    def __init__(self) -> None:
        self.before = {l["local"] for l in root_listeners()}
        self.samples = 0
        self.ours: list[dict] = []
        self.others_new: set[str] = set()

    def sample(self) -> None:
        ours = descendants(os.getpid())
        self.samples += 1
        for l in root_listeners():
            if set(l["pids"]) & ours:
                self.ours.append(l)
            elif l["local"] not in self.before:
                self.others_new.add(f"{l['local']} {l['process']}")

    def report(self) -> dict:
        return {
            "root_namespace_samples": self.samples,
            "root_namespace_listeners_of_this_run": self.ours,
            "root_namespace_new_listeners_of_other_processes": sorted(self.others_new),
        }


# -- the cluster ------------------------------------------------------------------------------


class Cluster:
    def __init__(self, net: Netns, out: Path, args: argparse.Namespace, layout: str = "namespaces"):
        self.net, self.out, self.args, self.layout = net, out, args, layout
        self.token = secrets.token_hex(16)
        net.secrets.append(self.token)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if layout == "namespaces":
            self.master = net.add("master", "mooncake master + memory holder (mooncake_client)", 1)
            self.producers = [net.add(f"producer-{k}", "producer (serve-hidden-states, hf)", 11 + k) for k in range(args.producers)]
            self.trainers = [net.add(f"trainer-{r}", f"trainer rank {r} (torchrun node {r})", 21 + r) for r in range(2)]
            self.producer_list = out / "producers.txt"  # on a real cluster: a file every trainer node sees
        else:  # every process in one namespace on 127.0.0.1: the loopback runs of the docs, for comparison
            base = net.add("loopback", "every process of the loopback layout, on 127.0.0.1", 2)

            def alias(name: str, role: str, port: int = PRODUCER_PORT) -> Host:
                return dataclasses.replace(base, name=name, role=role, address="127.0.0.1", port=port)

            self.master = alias("lo-master", "mooncake master + memory holder")
            self.producers = [alias(f"lo-producer-{k}", "producer", PRODUCER_PORT + k) for k in range(3)]
            self.trainers = [alias("lo-consumer", "consumer")]
            self.producer_list = out / "producers-loopback.txt"
        self.list_producers(self.producers)
        self.producer_procs: dict[str, subprocess.Popen] = {}
        self.holder: subprocess.Popen | None = None
        self.listeners = ListenerWatch()
        self.namespace_listeners: dict[str, list[str]] = {}

    # locations and commands
    @property
    def admin(self) -> str:
        return f"{self.master.address}:{METRICS_PORT}"

    def store(self, host: Host) -> str:
        extra = "&buffer_mb=8" if host in self.trainers else ""
        return f"mooncake://{self.master.address}:{MASTER_PORT}/{STORE_NAMESPACE}?admin={self.admin}&segment_mb=0{extra}"

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "specdraft.cli.main", *args]

    # master and holder
    @property
    def master_dir(self) -> Path:
        """The master's own state directory (``store start`` keeps nothing else there), beside the host's logs."""
        return self.out / "hosts" / self.master.name / "store"

    def start_master(self) -> None:
        argv = self.cli(
            "store",
            "start",
            "--host",
            self.master.address,
            "--port",
            str(MASTER_PORT),
            "--metrics-port",
            str(METRICS_PORT),
            "--dir",
            str(self.master_dir),
            "--lease-ttl-ms",
            "500",
            "--put-discard-timeout-s",
            "2",
            "--put-release-timeout-s",
            "3",
        )
        proc = self.net.spawn(self.master, argv, self.out / "hosts" / self.master.name / "store-start.log", env=self.env)
        if proc.wait(timeout=120) != 0:
            raise SystemExit(f"`specdraft store start` failed; see {self.out / 'hosts' / self.master.name}")
        from specdraft.integrations.mooncake.master import master_command

        holder = Path(master_command()[0]).with_name("mooncake_client")
        argv = [
            str(holder),
            f"--host={self.master.address}",
            "--metadata_server=P2PHANDSHAKE",
            f"--global_segment_size={self.args.holder_mb}MB",
            f"--master_server_address={self.master.address}:{MASTER_PORT}",
            "--protocol=tcp",
        ]
        self.holder = self.net.spawn(self.master, argv, self.out / "hosts" / self.master.name / "holder.log", env=self.env)
        self.wait_for(lambda: self.metrics().get("master_total_capacity_bytes", 0) > 0, 60, "the memory holder to register")
        say(f"master {self.master.address}:{MASTER_PORT} and a {self.args.holder_mb} MB holder up")

    def stop_master(self) -> None:
        self.net.run(self.master, self.cli("store", "stop", "--dir", str(self.master_dir)), timeout=60)

    def metrics(self) -> dict:
        code = (
            "import json; from specdraft.integrations.mooncake.master import read_metrics; "
            f"print(json.dumps(read_metrics({self.master.address!r}, {METRICS_PORT})))"
        )
        done = subprocess.run(
            ["ip", "netns", "exec", self.master.ns, sys.executable, "-c", code], capture_output=True, text=True, env=self.env, timeout=30
        )
        return json.loads(done.stdout or "{}")

    @staticmethod
    def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.2)

    # producers
    def start_producers(self, hosts: list[Host]) -> None:
        ready: dict[str, queue.Queue] = {}
        for host in hosts:
            argv = self.cli(
                "serve-hidden-states",
                "--target",
                str(self.args.target_dir),
                "--backend",
                "mooncake",
                "--store",
                self.store(host),
                "--host",
                host.address,
                "--port",
                str(host.port),
                "--token",
                self.token,
                "--num-threads",
                "1",
                "--max-batch",
                "1",
            )
            proc = self.net.spawn(host, argv, self.out / f"hosts/{host.name}/producer.log", stdout=subprocess.PIPE, env=self.env)
            self.producer_procs[host.name] = proc
            ready[host.name] = q = queue.Queue()
            threading.Thread(target=lambda p=proc, q=q: q.put(p.stdout.readline()), daemon=True).start()
        for host in hosts:
            try:
                line = ready[host.name].get(timeout=180)
            except queue.Empty:
                line = b""
            if not line:
                raise SystemExit(f"producer {host.name} did not start; see {self.out}/hosts/{host.name}/producer.log")
            say(f"{host.name} serving at {json.loads(line)['url']}")

    def producer_host(self, k: int) -> Host:
        """Producer host ``k``, made on first use when it is one beyond those the cluster started with."""
        if k < len(self.producers):
            return self.producers[k]
        name = f"producer-{k}"
        return self.net.hosts.get(name) or self.net.add(name, "producer (serve-hidden-states, hf), added mid-run", 11 + k)

    def ensure_producers(self) -> None:
        """Restart the producers an earlier scenario killed or stopped."""
        gone = [h for h in self.producers if h.name not in self.producer_procs or self.producer_procs[h.name].poll() is not None]
        if gone:
            self.start_producers(gone)

    @staticmethod
    def url(host: Host) -> str:
        return f"http://{host.address}:{host.port}"

    def list_producers(self, hosts: list[Host]) -> None:
        """The trainers' ``--producers @FILE``: rewritten atomically, reread by them every 2 s."""
        tmp = self.producer_list.with_suffix(".tmp")
        tmp.write_text("".join(self.url(h) + "\n" for h in hosts))
        tmp.rename(self.producer_list)

    def producer_health(self, host: Host) -> dict:
        code = (
            "import json, sys, urllib.request as u; "
            "r = u.Request(sys.argv[1] + '/health', headers={'Authorization': 'Bearer ' + sys.argv[2]}); "
            "print(u.urlopen(r, timeout=10).read().decode())"
        )
        done = self.net.run(host, [sys.executable, "-c", code, self.url(host), self.token])
        return json.loads(done.stdout or "{}")

    # the training job
    def train_argv(self, rank: int, run: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={rank}",
            f"--master-addr={self.trainers[0].address}",
            f"--master-port={RDZV_PORT}",
            "-m",
            "specdraft.cli.main",
            "train",
            "--method",
            "dflash",
            "--target",
            str(self.args.target_dir),
            "--out",
            str(run),
            "--data-mode",
            "online",
            "--dataset",
            str(self.args.dataset),
            "--producers",
            "@" + str(self.producer_list),
            "--producer-token",
            self.token,
            "--store",
            self.store(self.trainers[rank]),
            "--stream-dtype",
            "float32",
            "--prefetch",
            "4",
            "--model",
            DRAFTER,
            "--pack-tokens",
            str(TRAIN["pack_tokens"]),
            "--batch-rows",
            str(TRAIN["batch_rows"]),
            "--val-fraction",
            "0",
            "--eval-interval",
            "0",
            "--checkpoint-interval",
            str(TRAIN["checkpoint_interval"]),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--num-threads",
            "1",
            "--seed",
            str(TRAIN["seed"]),
            "--request-timeout",
            "60",
            "--parallel",
            self.args.parallel,
        ]

    def train_job(
        self,
        run: Path,
        attempt: int,
        watch: Callable[[], None] | None = None,
        timeout: float = 400,
        argv: Callable[[int, Path], list[str]] | None = None,
    ) -> list[int]:
        argv = argv or self.train_argv
        procs = [
            self.net.spawn(t, argv(r, run), self.out / f"hosts/{t.name}/train-{run.name}-{attempt}.log", env=self.env)
            for r, t in enumerate(self.trainers)
        ]
        deadline = time.monotonic() + timeout
        last_ss, failed_at = 0.0, None
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                for t in self.trainers:
                    self.net.kill(t)
                raise SystemExit(f"the training job {run.name} did not finish within {timeout:g} s")
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 30:
                say(f"{run.name}: a rank failed 30 s ago and its peer still runs; killing the trainer hosts")
                for t in self.trainers:
                    self.net.kill(t)
            if watch is not None:
                watch()
            if time.monotonic() - last_ss > 2.0:
                self.listeners.sample()
                if not self.namespace_listeners and any(delivered(run)):  # every process is up and serving
                    self.snapshot_namespace_listeners()
                last_ss = time.monotonic()
            time.sleep(0.02)
        return [p.returncode for p in procs]

    def snapshot_namespace_listeners(self) -> None:
        for host in self.net.hosts.values():
            out = self.net.run(host, ["ss", "-ltnH"]).stdout
            self.namespace_listeners[host.name] = sorted({line.split()[3] for line in out.splitlines() if len(line.split()) >= 4})

    def close_producer(self, host: Host) -> None:
        proc = self.producer_procs.pop(host.name)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    def close_producers(self) -> None:
        for proc in self.producer_procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.producer_procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


# -- what a run delivered ---------------------------------------------------------------------


def _plan(args: argparse.Namespace, rank: int):
    """Rank ``rank``'s ``DataPlan``, exactly as the trainer computes it."""
    from specdraft.data.dataset import PreparedDataset
    from specdraft.train.batches import DataPlan
    from specdraft.train.split import SplitKey, compute_split

    prepared = PreparedDataset(args.dataset)
    ids = [str(sid) for sid in prepared.sample_ids]
    split = compute_split(ids, [SplitKey(sid, sid) for sid in ids], val_fraction=0.0, seed=0)  # TRAIN holds nothing out
    return DataPlan.build(
        ids,
        [int(n) for n in prepared.lengths()],
        split=split,
        pack_tokens=TRAIN["pack_tokens"],
        batch_rows=TRAIN["batch_rows"],
        seed=TRAIN["seed"],
        world_size=2,
        rank=rank,
    )


def plan_order(args: argparse.Namespace) -> list[list[str]]:
    """Per rank, the sample ids its steps read, in order."""
    plans = [_plan(args, rank) for rank in range(2)]
    return [[p.sample_ids[i] for step in range(p.total_steps(1)) for row in p.train_rows(step) for i in row] for p in plans]


def steps_samples(args: argparse.Namespace, rank: int, steps: int) -> int:
    """How many samples rank ``rank`` reads in its first ``steps`` steps."""
    plan = _plan(args, rank)
    return sum(len(row) for step in range(steps) for row in plan.train_rows(step))


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def delivered(run: Path) -> list[list[dict]]:
    from specdraft.train.batches import delivery_log_name

    return [read_log(run / delivery_log_name(rank, 2)) for rank in range(2)]


def set_aside_logs(run: Path, attempt: int) -> list[list[dict]]:
    """Move the delivery logs of a failed attempt out of the run directory (the rerun starts new ones)."""
    from specdraft.train.batches import delivery_log_name

    logs = delivered(run)
    for rank in range(2):
        path = run / delivery_log_name(rank, 2)
        if path.is_file():
            path.rename(run.parent / f"{run.name}.attempt{attempt}.{path.name}")
    return logs


def latest_step(run: Path) -> int:
    from specdraft.train.checkpoint_files import list_checkpoints

    found = list_checkpoints(run)
    return found[-1][0] if found else 0


def fetch_fraction(records: list[dict]) -> float | None:
    """Seconds the rank waited for samples / seconds from its first request to its last delivery."""
    if not records:
        return None
    span = records[-1]["at"] - records[0]["at"] + records[0]["wait_s"]
    return round(sum(r["wait_s"] for r in records) / max(span, 1e-9), 3)


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted((run / "final").glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def weight_diff(a: dict, b: dict) -> float | None:
    if not a or not b or a.keys() != b.keys():
        return None
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def account(args: argparse.Namespace, attempts: list[tuple[list[list[dict]], int]]) -> dict:
    """Reconcile the delivery logs of each attempt with the plan.

    ``attempts``: (per-rank logs, step the *next* attempt resumed from) for every failed attempt,
    then (logs of the final attempt, 0). Of a failed attempt only the samples of steps before the
    resume step count; the rest were read again after the restart (``redelivered``).
    """
    expected = plan_order(args)
    effective: list[list[str]] = [[], []]
    redelivered = 0
    for logs, resumed_at in attempts[:-1]:
        for rank in range(2):
            keep = steps_samples(args, rank, resumed_at)
            ids = [r["sample_id"] for r in logs[rank]]
            effective[rank] = ids[:keep]
            redelivered += max(0, len(ids) - keep)
    final_logs = attempts[-1][0]
    for rank in range(2):
        effective[rank] = effective[rank] + [r["sample_id"] for r in final_logs[rank]]
    everything = [sid for rank in effective for sid in rank]
    counts = collections.Counter(everything)
    wanted = {sid for rank in expected for sid in rank}
    return {
        "samples_expected": sum(map(len, expected)),
        "delivered": len(everything),
        "duplicated": sum(n - 1 for n in counts.values() if n > 1),
        "lost": len(wanted - set(counts)),
        "unexpected": len(set(counts) - wanted),
        "each_rank_in_plan_order": [effective[r] == expected[r] for r in range(2)],
        "redelivered_after_restart": redelivered,
        "fetch_fraction_per_rank": [fetch_fraction(final_logs[r]) for r in range(2)],
    }


def settled_key_count(cluster: Cluster, settle_s: float = 15.0) -> float | None:
    """The master's key count once it reaches 0, or what it still reports after ``settle_s``: deletes are synchronous,
    but the master's metrics endpoint can report a count from before the last ones (a run once read 3 keys that a
    rerun of the same scenario did not leave), so a leak is what stays past the settling time."""
    deadline = time.monotonic() + settle_s
    while True:
        time.sleep(1.0)
        keys = cluster.metrics().get("master_key_count")
        if not keys or time.monotonic() > deadline:
            return keys


def count_in_logs(cluster: Cluster, run: Path, pattern: str) -> int:
    n = 0
    for t in cluster.trainers:
        for log in (cluster.out / "hosts" / t.name).glob(f"train-{run.name}-*.log"):
            n += len(re.findall(pattern, log.read_text(errors="replace")))
    return n


# -- scenarios --------------------------------------------------------------------------------


def scenario_steady(cluster: Cluster, run: Path) -> dict:
    rcs = cluster.train_job(run, 0)
    return {"attempts": [(delivered(run), 0)], "return_codes": [rcs], "faults": []}


def scenario_producer_killed(cluster: Cluster, run: Path) -> dict:
    victim = cluster.producers[-1]
    total = sum(map(len, plan_order(cluster.args)))
    faults: list[str] = []

    def watch() -> None:
        if not faults and sum(map(len, delivered(run))) >= total // 3:
            n = cluster.net.kill(victim)
            faults.append(
                f"FAULT: SIGKILL of all {n} processes in {victim.ns} ({victim.name}, {victim.address}) after "
                f"{sum(map(len, delivered(run)))} of {total} deliveries"
            )
            say(faults[-1])

    rcs = cluster.train_job(run, 0, watch)
    retries = count_in_logs(cluster, run, r"sending sample .* to another producer")
    return {"attempts": [(delivered(run), 0)], "return_codes": [rcs], "faults": faults, "requests_sent_elsewhere": retries}


def scenario_join_leave(cluster: Cluster, run: Path) -> dict:
    """A third producer joins after an eighth of the epoch; producer-0 leaves cleanly at half of it."""
    joiner, leaver = cluster.producer_host(2), cluster.producers[0]
    cluster.start_producers([joiner])  # up and idle: it joins when it is listed
    total = sum(map(len, plan_order(cluster.args)))
    events: list[str] = []
    leaving: list[threading.Thread] = []
    joined: list[float] = []
    late: list[int] = []  # requests the leaver got after it was unlisted (those in flight: at most the ranks' prefetch)

    def leave() -> None:
        at_unlisting = cluster.producer_health(leaver).get("requests", 0)
        time.sleep(3 * 2.0)  # a few list rereads: no trainer sends it new requests any more
        late.append(cluster.producer_health(leaver).get("requests", 0) - at_unlisting)
        cluster.producer_procs[leaver.name].send_signal(signal.SIGTERM)  # finishes what it has queued
        cluster.producer_procs[leaver.name].wait(timeout=60)
        events.append(f"LEAVE: {leaver.name} ({leaver.address}) stopped with SIGTERM; it got {late[0]} request(s) after it was unlisted")
        say(events[-1])

    def watch() -> None:
        n = sum(map(len, delivered(run)))
        if not events and n >= total // 8:
            cluster.list_producers([leaver, cluster.producers[1], joiner])
            joined.append(time.monotonic())
            events.append(f"JOIN: {joiner.name} ({joiner.address}) listed in {cluster.producer_list.name} after {n} of {total} deliveries")
            say(events[-1])
        elif len(events) == 1 and n >= total // 2 and time.monotonic() - joined[0] > 2 * 2.0:
            cluster.list_producers([cluster.producers[1], joiner])
            events.append(f"LEAVE: {leaver.name} ({leaver.address}) unlisted after {n} of {total} deliveries")
            say(events[-1])
            leaving.append(threading.Thread(target=leave))
            leaving[0].start()

    rcs = cluster.train_job(run, 0, watch)
    for t in leaving:
        t.join()
    served = cluster.producer_health(joiner).get("requests", 0)
    cluster.close_producer(joiner)
    cluster.list_producers(cluster.producers)
    return {
        "attempts": [(delivered(run), 0)],
        "return_codes": [rcs],
        "faults": events,
        "requests_served_by_joiner": served,
        "requests_to_leaver_after_unlisting": late[0] if late else None,
        "joined_lines": count_in_logs(cluster, run, r"producer \S+ joined"),
        "left_lines": count_in_logs(cluster, run, r"producer \S+ left"),
    }


def _fault_then_resume(cluster: Cluster, run: Path, inject: Callable[[], str], recover: Callable[[], None]) -> dict:
    faults: list[str] = []

    def watch() -> None:
        if not faults and latest_step(run) >= TRAIN["checkpoint_interval"]:
            faults.append(inject())
            say(faults[-1])

    rcs_first = cluster.train_job(run, 0, watch)
    if not faults:
        raise SystemExit(f"{run.name}: the job finished before the fault was injected; use more --samples")
    for t in cluster.trainers:  # a rank blocked on its dead peer ends with its host
        cluster.net.kill(t)
    resumed_at = latest_step(run)
    first = set_aside_logs(run, 0)
    recover()
    say(f"{run.name}: rerunning the same torchrun commands; the job resumes from step {resumed_at}")
    rcs = cluster.train_job(run, 1)
    return {
        "attempts": [(first, resumed_at), (delivered(run), 0)],
        "return_codes": [rcs_first, rcs],
        "faults": faults,
        "resumed_from_step": resumed_at,
    }


def scenario_trainer_killed(cluster: Cluster, run: Path) -> dict:
    victim = cluster.trainers[1]

    def inject() -> str:
        n = cluster.net.kill(victim)
        return (
            f"FAULT: SIGKILL of all {n} processes in {victim.ns} ({victim.name}, {victim.address}) after checkpoint step {latest_step(run)}"
        )

    return _fault_then_resume(cluster, run, inject, lambda: None)


def scenario_master_restart(cluster: Cluster, run: Path) -> dict:
    def inject() -> str:
        step = latest_step(run)
        n = cluster.net.kill(cluster.master)  # the master host goes down: mooncake_master and the holder
        cluster.start_master()
        return (
            f"FAULT: SIGKILL of all {n} processes in {cluster.master.ns} (mooncake_master and the holder) after checkpoint "
            f"step {step}, then `specdraft store start` and a new holder"
        )

    def recover() -> None:
        # what the user must do: the new master knows no client, so restart every producer, then rerun training
        cluster.close_producers()
        cluster.start_producers(cluster.producers)

    return _fault_then_resume(cluster, run, inject, recover)


def offline_store(cluster: Cluster) -> Path:
    """The dataset's hidden states as a file store (``specdraft extract``, once): sequence parallelism reads an
    offline store, which every trainer host reads from the shared filesystem."""
    store = cluster.out / "inputs/store"
    if not (store / "manifest.json").exists():
        argv = [sys.executable, "-m", "specdraft.cli.main", "extract", "--target", str(cluster.args.target_dir)]
        argv += ["--dataset", str(cluster.args.dataset), "--out", str(store), "--method", "dflash", "--target-dtype", "float32"]
        done = subprocess.run(argv, capture_output=True, text=True, env=cluster.env, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"extract failed: {done.stderr[-2000:]}")
    return store


def offline_train_argv(cluster: Cluster, store: Path, run: Path, sequence: int, rank: int | None) -> list[str]:
    """One trainer process (``rank`` None: alone, no torchrun) or node ``rank`` of the 2-host job, on ``store``."""
    launch = [sys.executable, "-m"]
    if rank is not None:
        launch += ["torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}"]
        launch += [f"--master-addr={cluster.trainers[0].address}", f"--master-port={RDZV_PORT}", "-m"]
    return [
        *launch,
        *["specdraft.cli.main", "train", "--method", "dflash", "--data", str(store), "--out", str(run)],
        *["--model", DRAFTER, "--pack-tokens", str(TRAIN["pack_tokens"]), "--batch-rows", str(TRAIN["batch_rows"])],
        *["--val-fraction", "0", "--eval-interval", "0", "--checkpoint-interval", str(TRAIN["checkpoint_interval"])],
        *["--dtype", "fp32", "--device", "cpu", "--num-threads", "1", "--seed", str(TRAIN["seed"])],
        *["--sequence-parallel", str(sequence)],
    ]


def train_losses(run: Path) -> list[float]:
    """The per-step training losses rank 0 logged (``metrics.jsonl`` records with a ``loss``)."""
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r["loss"] for r in records if r.get("split") == "train" and "loss" in r]


def sequence_parallel(cluster: Cluster) -> dict:
    """``train --sequence-parallel 2`` over the two trainer hosts: each sample split in two, one half per host,
    against one process training the same store; then trainer-1 is killed after a checkpoint and the same two
    commands resume the job, which must end bit-identical to the uninterrupted two-host run."""
    store = offline_store(cluster)
    runs = cluster.out / "runs" / "sequence-parallel"
    alone, split, resumed = runs / "one-process", runs / "two-hosts", runs / "two-hosts-resumed"
    host = cluster.trainers[0]
    started = time.monotonic()
    proc = cluster.net.spawn(
        host, offline_train_argv(cluster, store, alone, 1, None), cluster.out / f"hosts/{host.name}/train-sp-alone.log", env=cluster.env
    )
    rc_alone = proc.wait(timeout=400)

    def argv(rank: int, run: Path) -> list[str]:
        return offline_train_argv(cluster, store, run, 2, rank)

    rcs = cluster.train_job(split, 0, argv=argv)
    faults: list[str] = []
    victim = cluster.trainers[1]

    def watch() -> None:
        if not faults and latest_step(resumed) >= TRAIN["checkpoint_interval"]:
            n = cluster.net.kill(victim)
            faults.append(
                f"FAULT: SIGKILL of all {n} processes in {victim.ns} ({victim.name}) after checkpoint step {latest_step(resumed)}"
            )
            say(faults[-1])

    rcs_killed = cluster.train_job(resumed, 0, watch, argv=argv)
    for t in cluster.trainers:
        cluster.net.kill(t)
    resumed_at = latest_step(resumed)
    rcs_resumed = cluster.train_job(resumed, 1, argv=argv)
    losses = [train_losses(alone), train_losses(split)]
    return {
        "wall_s": round(time.monotonic() - started, 1),
        "return_codes": {"one_process": rc_alone, "two_hosts": rcs, "killed": rcs_killed, "resumed": rcs_resumed},
        "completed": all((r / "final").is_dir() for r in (alone, split, resumed)),
        "steps": [len(x) for x in losses],
        "loss_max_abs_diff_vs_one_process": max((abs(a - b) for a, b in zip(*losses)), default=None),
        "final_weights_max_abs_diff_vs_one_process": weight_diff(final_weights(alone), final_weights(split)),
        "faults": faults,
        "resumed_from_step": resumed_at,
        "resumed_final_weights_max_abs_diff_vs_uninterrupted": weight_diff(final_weights(split), final_weights(resumed)),
    }


SCENARIOS: dict[str, Callable[[Cluster, Path], dict]] = {
    "steady": scenario_steady,
    "join-leave": scenario_join_leave,
    "producer-killed": scenario_producer_killed,
    "trainer-killed": scenario_trainer_killed,
    "master-restart": scenario_master_restart,
}


# -- throughput -------------------------------------------------------------------------------


def consume(argv: list[str]) -> None:
    """Consumer process of a throughput measurement: request every sample once (prefetching), verify,
    delete; print samples/s, payload MB/s and each producer's busy seconds during the run as JSON."""
    parser = argparse.ArgumentParser(prog="cluster.py consume")
    for name in ("--dataset", "--producers", "--store", "--token"):
        parser.add_argument(name, required=True)
    parser.add_argument("--prefetch", type=int, default=8)
    args = parser.parse_args(argv)
    from specdraft.cli.main import load_plugins
    from specdraft.hidden_states.data_modes import DATA_MODES, SourceOptions
    from specdraft.hidden_states.layers import spread_output_slots

    load_plugins()  # the mooncake backend registers from above

    urls = args.producers.split(",")
    options = SourceOptions(
        data=None,
        dataset=args.dataset,
        producers=urls,
        store=args.store,
        slots=spread_output_slots,
        dtype="float32",
        prefetch=args.prefetch,
        token=args.token,
    )
    with DATA_MODES.get("online")(options) as source:
        source[0]  # connections and the first transfer of each kind are not what is measured
        busy = {u: source.client.health(u)["busy_s"] for u in urls}
        started = time.perf_counter()
        source.start(range(1, len(source)))
        nbytes = 0
        for i in range(1, len(source)):
            item = source[i]
            nbytes += sum(item[k].numel() * item[k].element_size() for k in ("hidden_states", "last_hidden", "token_ids"))
        seconds = time.perf_counter() - started
        busy = {u: source.client.health(u)["busy_s"] - busy[u] for u in urls}
    n = len(source) - 1
    print(
        json.dumps(
            {
                "samples": n,
                "seconds": round(seconds, 2),
                "samples_per_s": round(n / seconds, 1),
                "MB_per_s": round(nbytes / seconds / 1e6, 2),
                "ms_per_sample": round(1000 * seconds / n, 1),
                "producer_utilisation": [round(b / seconds, 2) for b in busy.values()],
            }
        )
    )


def throughput(cluster: Cluster, counts: list[int]) -> list[dict]:
    """Delivery to one consumer (trainer-0's host, or the loopback namespace) from 1, 2, 3 producers."""
    rows = []
    for count in counts:
        hosts = [cluster.producer_host(k) for k in range(count)]
        missing = [h for h in hosts if h.name not in cluster.producer_procs or cluster.producer_procs[h.name].poll() is not None]
        if missing:
            cluster.start_producers(missing)
        consumer = cluster.trainers[0]
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "consume",
            "--dataset",
            str(cluster.args.dataset),
            "--producers",
            ",".join(cluster.url(h) for h in hosts),
            "--store",
            cluster.store(consumer),
            "--token",
            cluster.token,
        ]
        log = cluster.out / "hosts" / consumer.name / f"throughput-{count}.log"
        proc = cluster.net.spawn(consumer, argv, log, stdout=subprocess.PIPE, env=cluster.env)
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"the throughput consumer failed; see {log}")
        rows.append({"layout": cluster.layout, "producers": count, **json.loads(out.decode().strip().splitlines()[-1])})
        say(f"throughput {json.dumps(rows[-1])}")
    return rows


# -- main -------------------------------------------------------------------------------------


def build_inputs(args: argparse.Namespace) -> None:
    """A tiny random Llama target (the SmolLM2 tokenizer) and a prepared dataset of random token ids."""
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_target_dir
    from specdraft.data.dataset import write_prepared
    from specdraft.targets import load_target, resolve_target_dir

    args.target_dir = build_tiny_target_dir(args.out / "inputs/target", resolve_target_dir("smollm2-135m"))
    target = load_target(str(args.target_dir))
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(args.samples):
        n = int(torch.randint(8, 24, (1,), generator=g))
        rows.append(
            {
                "sample_id": f"c/{i}",
                "source": "cluster",
                "input_ids": torch.randint(0, target.vocab_size, (n,), generator=g).tolist(),
                "loss_mask": [int(j >= 2) for j in range(n)],
            }
        )
    args.dataset = write_prepared(
        args.out / "inputs/data", rows, target_info=target.describe(), config={}, stats={}, vocab_size=target.vocab_size
    )


def free_subnet() -> str:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    for third in range(os.getpid() % 200 + 20, 256):
        subnet = f"10.213.{third}"
        if subnet + "." not in used:
            return subnet
    raise SystemExit("no free 10.213.X.0/24 subnet")


def main() -> None:
    if sys.argv[1:2] == ["consume"]:
        return consume(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="steady", help=f"comma-separated: {', '.join(SCENARIOS)}, sequence-parallel")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default=f"sdc{os.getpid() % 10000}", help="name prefix of the namespaces, veths and bridge")
    parser.add_argument("--samples", type=int, default=96, help="dataset size (one epoch; the faults need a run of some seconds)")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--holder-mb", type=int, default=128)
    parser.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="the training job's strategy across its two hosts (`train --parallel`); every scenario, steady included, uses it",
    )
    parser.add_argument(
        "--throughput",
        default="",
        help="also measure delivery from this many producers, e.g. 1,2,3, "
        "across the namespaces and with every process in one namespace on 127.0.0.1",
    )
    args = parser.parse_args()
    names = [s.strip() for s in args.scenario.split(",") if s.strip()]
    with_sequence_parallel = "sequence-parallel" in names
    names = [n for n in names if n != "sequence-parallel"]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not (names or with_sequence_parallel):
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if "steady" in names:
        names.remove("steady")
    names.insert(0, "steady")  # the fault-free reference
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        raise SystemExit("scripts/cluster.sh needs root and `ip netns` (iproute2)")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    build_inputs(args)
    summary: dict = {"command": shlex.join(sys.argv), "scenarios": {}}
    net = Netns(args.prefix, free_subnet())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))  # unwinds to the finally below
    try:
        cluster = Cluster(net, args.out, args)
        summary["hosts"] = [asdict(h) for h in net.hosts.values()]
        summary["routes"] = {h.name: net.run(h, ["ip", "route"]).stdout.strip() for h in net.hosts.values()}
        cluster.start_master()
        cluster.start_producers(cluster.producers)
        reference = None
        for name in names:
            run = args.out / "runs" / name
            cluster.ensure_producers()
            say(f"scenario {name}: start")
            t = time.monotonic()
            result = SCENARIOS[name](cluster, run)
            wall = time.monotonic() - t
            keys = settled_key_count(cluster)
            weights = final_weights(run)
            if name == "steady":
                reference = weights
            record = {
                "wall_s": round(wall, 1),
                **account(args, result.pop("attempts")),
                "store_keys_left": keys,
                "completed": (run / "final").is_dir(),
                "final_weights_max_abs_diff_vs_steady": weight_diff(weights, reference),
                **result,
            }
            summary["scenarios"][name] = record
            say(f"scenario {name}: {json.dumps(record)}")
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        if with_sequence_parallel:
            say("scenario sequence-parallel: start")
            summary["sequence_parallel"] = sequence_parallel(cluster)
            say(f"scenario sequence-parallel: {json.dumps(summary['sequence_parallel'])}")
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        counts = [int(c) for c in args.throughput.split(",") if c.strip()]
        if counts:
            summary["throughput"] = throughput(cluster, counts)
        cluster.close_producers()
        if counts:
            loopback = Cluster(net, args.out, args, layout="loopback")
            try:
                loopback.start_master()
                summary["throughput"] += throughput(loopback, counts)
            finally:
                loopback.close_producers()
                loopback.stop_master()
        summary["hosts"] = [asdict(h) for h in net.hosts.values()]  # with any that joined
        summary["listening"] = {**cluster.listeners.report(), "inside_namespaces": cluster.namespace_listeners}
        summary["commands"] = net.commands
    finally:
        try:
            if "cluster" in locals():
                cluster.stop_master()
        finally:
            net.close()
        summary["wall_s"] = round(time.monotonic() - started, 1)
        summary["log"] = _LOG
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
