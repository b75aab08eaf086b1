"""``specdraft store start|stop|status``: run the Mooncake master that multi-node hidden-state transfer uses."""

from __future__ import annotations

import argparse
import json

from specdraft.integrations.mooncake.master import MasterConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args

_ONLY_DIR = tuple(name for name in MasterConfig.__dataclass_fields__ if name != "dir")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "store",
        help="start, stop or inspect the Mooncake master (hidden-state transfer between nodes)",
        description="Manage a background mooncake_master whose pid, state and log files live in --dir. "
        "Producers and consumers reach it as mooncake://HOST:PORT/NAMESPACE.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("start", help="start the master in the background and wait until it accepts connections")
    add_dataclass_arguments(start, MasterConfig)
    start.set_defaults(func=run_start)
    stop = actions.add_parser("stop", help="stop the master recorded in --dir")
    add_dataclass_arguments(stop, MasterConfig, exclude=_ONLY_DIR)
    stop.set_defaults(func=run_stop)
    status = actions.add_parser("status", help="say whether the master in --dir runs (exit code 1 if not) and show its metrics")
    add_dataclass_arguments(status, MasterConfig, exclude=_ONLY_DIR)
    status.set_defaults(func=run_status)


def run_start(args: argparse.Namespace) -> int:
    from specdraft.integrations.mooncake.master import start_master

    state = start_master(dataclass_from_args(MasterConfig, args))
    print(
        f"mooncake master running: pid {state['pid']}, rpc {state['host']}:{state['port']}, "
        f"admin/metrics {state['host']}:{state['metrics_port']}, log {state['log']}"
    )
    print(f"use --out mooncake://{state['host']}:{state['port']}/NAMESPACE?admin={state['host']}:{state['metrics_port']}")
    return 0


def run_stop(args: argparse.Namespace) -> int:
    from specdraft.integrations.mooncake.master import stop_master

    config = dataclass_from_args(MasterConfig, args)
    state = stop_master(config.dir)
    print(f"stopped mooncake master pid {state['pid']}" if state else f"no mooncake master was running from {config.dir}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from specdraft.integrations.mooncake.master import master_status

    status = master_status(dataclass_from_args(MasterConfig, args).dir)
    if status["running"]:
        m = status["metrics"]
        print(
            f"running: pid {status['pid']}, rpc {status['host']}:{status['port']} "
            f"({'accepting' if status['accepting'] else 'NOT accepting'} connections), "
            f"admin/metrics {status['host']}:{status['metrics_port']}; "
            f"keys {m.get('master_key_count', float('nan')):.0f}, clients {m.get('master_active_clients', float('nan')):.0f}, "
            f"memory {m.get('master_allocated_bytes', 0) / 2**20:.1f}/{m.get('master_total_capacity_bytes', 0) / 2**20:.1f} MiB"
            if m
            else f"running: pid {status['pid']} (metrics unavailable; see {status['dir']}/master.log)"
        )
    else:
        print(f"not running (no live master recorded in {status['dir']})")
    print(json.dumps(status, sort_keys=True))
    return 0 if status["running"] else 1
