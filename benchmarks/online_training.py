"""Online hidden-state delivery on the embedded target: how fast samples reach a consumer, and
whether the trainer waits for them.

  delivery rows   samples/s and payload MB/s delivered to one consumer (requests -> producer
                  extracts -> transport -> verified read -> delete), for: in-process extraction
                  (no service, no transport), 1 producer writing to the file backend, 1 producer
                  writing to Mooncake over loopback TCP (the consumer holds the memory)
  trainer rows    ``specdraft train --data-mode online`` (1-layer DFlash drafter) with 1 and 2
                  producers through Mooncake: the logged fetch-time fraction (time the trainer
                  waited for samples / step time) and steps/s

Producers are separate processes (`specdraft serve-hidden-states`, 1 torch thread each). Prints a
table and one JSON object. Random token ids stand in for text (the cost depends on lengths only).

  .venv/bin/python benchmarks/online_training.py --samples 16 --tokens 256 --steps 8
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = "smollm2-135m"
DRAFTER = {"num_layers": 1, "block_size": 4, "max_anchors": 16}


class Producers:
    def __init__(self, count: int, backend: str, store: str, log_dir: Path, max_batch: int):
        self.procs, self.urls = [], []
        for i in range(count):
            cmd = [
                sys.executable,
                "-m",
                "specdraft.cli.main",
                "serve-hidden-states",
                "--target",
                TARGET,
                "--backend",
                backend,
                "--store",
                store,
                "--port",
                "0",
                "--num-threads",
                "1",
                "--max-batch",
                str(max_batch),
            ]
            log = open(log_dir / f"producer-{backend}-{count}-{i}.log", "w")  # noqa: SIM115 - the producer writes it until it exits
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True))
        for proc in self.procs:
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"a producer failed to start; see {log_dir}")
            self.urls.append(json.loads(line)["url"])

    def __enter__(self) -> Producers:
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(timeout=60)


def payload_bytes(item: dict) -> int:
    return sum(item[k].numel() * item[k].element_size() for k in ("hidden_states", "last_hidden", "token_ids"))


def bench_in_process(target, prepared, slots) -> dict:
    from specdraft.hidden_states.capture import HiddenStateCapture
    from specdraft.hidden_states.payload import HiddenStatePayload

    capture = HiddenStateCapture(target.model, slots)
    info = target.describe()
    start, nbytes = time.perf_counter(), 0
    for i in range(len(prepared)):
        row = prepared[i]
        hidden, last = capture([row["input_ids"]])[0]
        payload = HiddenStatePayload.create(
            sample_id=row["sample_id"], target_info=info, slots=slots, token_ids=row["input_ids"], hidden_states=hidden, last_hidden=last
        )
        nbytes += sum(
            getattr(payload, k).numel() * getattr(payload, k).element_size() for k in ("hidden_states", "last_hidden", "token_ids")
        )
    return _rate(len(prepared), nbytes, time.perf_counter() - start)


def bench_stream(options) -> dict:
    from specdraft.hidden_states.data_modes import DATA_MODES

    with DATA_MODES.get("online")(options) as source:
        start = time.perf_counter()
        source.start(range(len(source)))
        nbytes = sum(payload_bytes(source[i]) for i in range(len(source)))
        seconds = time.perf_counter() - start
    return _rate(len(source), nbytes, seconds)


def _rate(samples: int, nbytes: int, seconds: float) -> dict:
    return {
        "samples": samples,
        "seconds": round(seconds, 2),
        "samples_per_s": round(samples / seconds, 2),
        "MB_per_s": round(nbytes / seconds / 1e6, 2),
    }


def bench_trainer(target, prepared, store: str, urls: list[str], out: Path, args) -> dict:
    from specdraft.train.config import TrainConfig
    from specdraft.train.trainer import train

    cfg = TrainConfig(
        method="dflash",
        target=TARGET,
        out=str(out),
        model=DRAFTER,
        data_mode="online",
        dataset=str(prepared),
        producers=urls,
        store=store,
        prefetch=args.prefetch,
        pack_tokens=args.tokens * 2,
        batch_rows=1,
        max_steps=args.steps,
        val_fraction=0.0,
        eval_interval=0,
        checkpoint_interval=0,
        dtype="fp32",
        num_threads=1,
    )
    start = time.perf_counter()
    result = train(cfg, target=target)
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["split"] == "train"]

    def fraction(rs: list[dict]) -> float:
        return round(sum(r["fetch_fraction"] * r["seconds"] for r in rs) / max(sum(r["seconds"] for r in rs), 1e-9), 3)

    return {
        "producers": len(urls),
        "steps": result.step,
        "seconds": round(seconds, 2),
        "steps_per_s": round(result.step / seconds, 3),
        "fetch_fraction": fraction(train_records),
        "fetch_fraction_after_step_1": fraction(train_records[1:]),  # the first step waits for the pipeline to fill
        "first_step_s": round(train_records[0]["seconds"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16, help="samples per delivery measurement")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=8, help="training steps per trainer measurement")
    parser.add_argument("--prefetch", type=int, default=4, help="requests in flight")
    parser.add_argument("--max-batch", type=int, default=4, help="producer --max-batch")
    args = parser.parse_args()

    import torch

    from specdraft.data.dataset import write_prepared
    from specdraft.hidden_states.data_modes import SourceOptions
    from specdraft.hidden_states.layers import spread_output_slots
    from specdraft.integrations.mooncake.master import MooncakeMaster
    from specdraft.targets import load_target

    torch.set_num_threads(1)
    target = load_target(TARGET)
    slots = spread_output_slots(target.num_layers)
    tmp = Path(tempfile.mkdtemp(prefix="online-bench-"))
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "sample_id": f"b/{i}",
            "source": "bench",
            "input_ids": torch.randint(0, target.vocab_size, (args.tokens,), generator=g).tolist(),
            "loss_mask": [1] * args.tokens,
        }
        for i in range(args.samples)
    ]
    prepared_dir = write_prepared(tmp / "data", rows, target_info=target.describe(), config={}, stats={}, vocab_size=target.vocab_size)
    from specdraft.data.dataset import PreparedDataset

    prepared = PreparedDataset(prepared_dir)

    def options(urls, store):
        return SourceOptions(
            data=None, dataset=str(prepared_dir), producers=urls, store=store, slots=lambda n: slots, prefetch=args.prefetch
        )

    results: dict = {"delivery": {}, "trainer": []}
    results["delivery"]["in-process extraction"] = bench_in_process(target, prepared, slots)
    with Producers(1, "file", str(tmp / "transport"), tmp, args.max_batch) as producers:
        results["delivery"]["1 producer, file backend"] = bench_stream(options(producers.urls, str(tmp / "transport")))
    with MooncakeMaster(dir=str(tmp / "mooncake"), port=0) as master:
        admin = f"{master.state['host']}:{master.state['metrics_port']}"
        base = f"mooncake://{master.address}/bench?admin={admin}"
        with Producers(1, "mooncake", base + "&segment_mb=0", tmp, args.max_batch) as producers:
            results["delivery"]["1 producer, mooncake tcp"] = bench_stream(options(producers.urls, base + "&segment_mb=256"))
        for count in (1, 2):
            with Producers(count, "mooncake", base + "&segment_mb=0", tmp, args.max_batch) as producers:
                results["trainer"].append(
                    bench_trainer(target, prepared_dir, base + "&segment_mb=256", producers.urls, tmp / f"run-{count}", args)
                )
        results["keys_left_in_store"] = master.metrics().get("master_key_count")

    print(f"{'delivery':32} {'samples/s':>10} {'MB/s':>8}")
    for name, r in results["delivery"].items():
        print(f"{name:32} {r['samples_per_s']:>10} {r['MB_per_s']:>8}")
    print(f"{'trainer (mooncake)':32} {'steps/s':>10} {'fetch fraction':>15} {'after step 1':>13}")
    for r in results["trainer"]:
        print(
            f"{str(r['producers']) + ' producer(s)':32} {r['steps_per_s']:>10} {r['fetch_fraction']:>15} "
            f"{r['fetch_fraction_after_step_1']:>13}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
