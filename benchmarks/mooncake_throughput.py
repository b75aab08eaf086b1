"""Mooncake throughput on loopback: put+get MB/s of hidden-state-sized blobs and payloads vs the file backend.

Layout: a master, a *holder* process that contributes the store memory (as a training node
would), and this process as a client with no memory of its own, so every put and every get
crosses TCP (loopback) between two processes.

  transport rows  raw blobs: ``bytes`` (put/get via the client's local buffer) vs ``registered``
                  (``put_arrays``/``get_into_arrays``: the engine reads/writes the caller's memory)
  backend rows    whole payloads (three tensors + manifest, checksums verified on get):
                  mooncake zero_copy=false / zero_copy=true vs the file backend (fsynced writes)

Prints a table and one JSON object.

  .venv/bin/python benchmarks/mooncake_throughput.py --sizes-mb 1,4,16 --total-mb 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HIDDEN = 2048  # D of a ~1B target; S = 3 slots, bfloat16
SLOTS = 3


def hold(master: str, segment_mb: int) -> None:
    """Holder process: contribute ``segment_mb`` of memory until stdin closes."""
    from specdraft.integrations.mooncake.client import MooncakeClient, MooncakeClientConfig

    client = MooncakeClient(MooncakeClientConfig(master=master, segment_mb=segment_mb, buffer_mb=16))
    print("ready", flush=True)
    sys.stdin.read()
    client.close()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_transport(client, size: int, reps: int, mode: str) -> dict:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    out = np.empty(size, np.uint8)
    put_s = get_s = 0.0
    for r in range(reps):
        key = f"bench/{mode}/{size}/{r}"
        if mode == "bytes":
            blob = data.tobytes()
            put_s += timed(lambda: client.put(key, blob))
            got = []
            get_s += timed(lambda: got.append(client.get(key)))
            assert got[0] == blob
        else:
            put_s += timed(lambda: client.put_arrays({key: data}))
            get_s += timed(lambda: client.get_into_arrays({key: out}))
            assert np.array_equal(out, data)
        client.remove([key], force=True)
    return _rates(size, reps, put_s, get_s)


def make_payload(size: int, seed: int):
    import torch

    from specdraft.hidden_states.layers import LayerSlot
    from specdraft.hidden_states.payload import HiddenStatePayload

    tokens = max(1, size // ((SLOTS + 1) * HIDDEN * 2 + 8))
    g = torch.Generator().manual_seed(seed)
    return HiddenStatePayload.create(
        sample_id=f"p{seed}",
        target_info={"name": "bench", "fingerprint": "f", "tokenizer_hash": "t", "num_layers": 16, "hidden_size": HIDDEN},
        slots=[LayerSlot(i, "output") for i in range(SLOTS)],
        token_ids=torch.randint(0, 1000, (tokens,), generator=g),
        hidden_states=torch.randn(tokens, SLOTS, HIDDEN, generator=g),
        last_hidden=torch.randn(tokens, HIDDEN, generator=g),
    )


def bench_backend(backend, size: int, reps: int) -> dict:
    payload = make_payload(size, 0)
    nbytes = sum(getattr(payload, k).numel() * getattr(payload, k).element_size() for k in ("hidden_states", "token_ids", "last_hidden"))
    put_s = get_s = 0.0
    for _ in range(reps):
        key = payload.sample_id
        put_s += timed(lambda: backend.put(key, payload))
        get_s += timed(lambda: backend.get(key))
        backend.delete(key)
    return _rates(nbytes, reps, put_s, get_s)


def _rates(size: int, reps: int, put_s: float, get_s: float) -> dict:
    mb = size * reps / 1e6
    return {
        "bytes": size,
        "reps": reps,
        "put_MBps": round(mb / put_s, 1),
        "get_MBps": round(mb / get_s, 1),
        "put_get_MBps": round(mb / (put_s + get_s), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,4,16", help="blob/payload sizes in MB, comma-separated (default: %(default)s)")
    parser.add_argument(
        "--total-mb", type=float, default=64, help="data moved per size and mode; sets the repetitions (default: %(default)s)"
    )
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    parser.add_argument("--hold", nargs=2, metavar=("MASTER", "SEGMENT_MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        hold(args.hold[0], int(args.hold[1]))
        return

    from specdraft.hidden_states.backends.file import FileBackend
    from specdraft.integrations.mooncake.backend import MooncakeBackend
    from specdraft.integrations.mooncake.client import MooncakeClient, MooncakeClientConfig
    from specdraft.integrations.mooncake.master import MooncakeMaster

    sizes = [int(float(s) * 1e6) for s in args.sizes_mb.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="specdraft-mooncake-bench-") as tmp, MooncakeMaster(dir=f"{tmp}/master", port=0) as master:
        holder = subprocess.Popen(
            [sys.executable, __file__, "--hold", master.address, str(max(256, 4 * max(sizes) >> 20))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout.readline().strip() == "ready"
            # buffer_mb must hold the largest blob for the byte-copy path
            client = MooncakeClient(MooncakeClientConfig(master=master.address, segment_mb=0, buffer_mb=(4 * max(sizes) >> 20) + 1))
            backends = {
                "mooncake bytes": MooncakeBackend(f"mooncake://{master.address}/bench", client=client, zero_copy=False),
                "mooncake zero_copy": MooncakeBackend(f"mooncake://{master.address}/bench", client=client, zero_copy=True),
                "file (fsync)": FileBackend(f"{tmp}/files"),
            }
            for size in sizes:
                reps = max(3, int(args.total_mb * 1e6 / size))
                for mode in ("bytes", "registered"):
                    bench_transport(client, size, 1, mode)  # warm-up
                    rows.append({"layer": "transport", "mode": mode, **bench_transport(client, size, reps, mode)})
                for name, backend in backends.items():
                    bench_backend(backend, size, 1)
                    rows.append({"layer": "backend", "mode": name, **bench_backend(backend, size, reps)})
            client.close()
        finally:
            holder.stdin.close()
            holder.wait(timeout=60)

    print(f"{'layer':<10} {'mode':<20} {'MB':>6} {'reps':>5} {'put MB/s':>9} {'get MB/s':>9} {'put+get MB/s':>13}")
    for r in rows:
        print(
            f"{r['layer']:<10} {r['mode']:<20} {r['bytes'] / 1e6:>6.1f} {r['reps']:>5} {r['put_MBps']:>9} {r['get_MBps']:>9} "
            f"{r['put_get_MBps']:>13}"
        )
    result = {"protocol": "tcp (loopback, two processes)", "hidden_size": HIDDEN, "slots": SLOTS, "dtype": "bfloat16", "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
