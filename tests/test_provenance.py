"""``provenance.json`` in every run directory (train, eval, quickstart): code, command, config, inputs, machine."""

from __future__ import annotations

import hashlib
import http.server
import importlib.metadata
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specdraft.utils.provenance import PROVENANCE_FILE, choices_in, input_record, write_provenance

FIELDS = {
    "format",
    "format_version",
    "written",
    "specdraft",
    "python",
    "packages",
    "command",
    "cwd",
    "config",
    "target",
    "inputs",
    "machine",
    "measured",
}


def read(run: Path) -> dict:
    record = json.loads((run / PROVENANCE_FILE).read_text())
    assert set(record) == FIELDS and record["format"] == "specdraft.provenance"
    assert record["specdraft"]["version"] == importlib.metadata.version("specdraft")
    assert record["packages"]["torch"] == importlib.metadata.version("torch")
    assert {"model", "features", "cores_available"} <= set(record["machine"]["cpu"])
    return record


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_inputs_are_named_by_their_manifest_digest(tmp_path):
    dataset = tmp_path / "data"
    dataset.mkdir()
    (dataset / "manifest.json").write_text('{"format": "x"}')
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("{}\n")
    assert input_record(dataset) == {"path": str(dataset), "manifest": "manifest.json", "sha256": sha256(dataset / "manifest.json")}
    assert input_record(drafter)["sha256"] == sha256(drafter / "config.json")
    assert input_record(prompts) == {"path": str(prompts), "sha256": sha256(prompts)}
    assert input_record("http://host:1") == {"path": "http://host:1", "sha256": None}

    path = write_provenance(
        tmp_path / "run",
        config={"a": Path("/x"), "b": (1, 2)},
        inputs=[dataset, None, "", str(dataset), prompts],
        measured={"threads": 2, "threads_source": "cached", "threads_seconds": {"1": 0.2, "2": 0.1}, "other": 5},
    )
    record = read(path.parent)
    assert record["config"] == {"a": "/x", "b": [1, 2]}
    assert [i["path"] for i in record["inputs"]] == [str(dataset), str(prompts)]  # empty ones skipped, duplicates once
    assert record["command"] == sys.argv
    assert record["measured"] == {"threads": {"value": 2, "source": "cached", "seconds": {"1": 0.2, "2": 0.1}}}


def test_choices_are_found_at_any_depth_and_nothing_else_is_kept():
    facts = {
        "runs": [{"x": 1}],
        "target_forward_path": {"forward_path": "eager", "forward_path_source": "flag", "forward_path_seconds": {}},
        "drafters": {
            "d": {
                "draft_dtype": "fp32",
                "draft_dtype_source": "measured",
                "draft_dtype_seconds": {"fp32": 0.1},
                "draft_dtype_requested": "auto",
            }
        },
        "num_prompts": 3,
    }
    assert choices_in(facts) == {
        "target_forward_path": {"forward_path": {"value": "eager", "source": "flag", "seconds": {}}},
        "drafters": {"d": {"draft_dtype": {"value": "fp32", "source": "measured", "seconds": {"fp32": 0.1}}}},
    }


def test_train_run_records_its_provenance(tmp_path):
    from specdraft.train.trainer import train
    from test_train_toy import ToyStore, ToyTarget, toy_config

    out = tmp_path / "run"
    train(toy_config(out, max_steps=2, eval_interval=0, checkpoint_interval=0), target=ToyTarget(), dataset=ToyStore())
    record = read(out)
    assert record["config"]["method"] == "toy" and record["config"]["max_steps"] == 2 and record["config"]["out"] == str(out)
    assert record["target"]["fingerprint"] == "toyfp0001"
    measured = record["measured"]
    assert measured["stage"] == "train" and measured["threads"] == {"value": 1, "source": "flag", "seconds": {}}
    assert measured["compute_dtype"]["value"] == "fp32" and measured["forward_path"]["value"]


def test_eval_run_records_its_provenance_and_reruns_over_it(tmp_path, tiny_target):
    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.runner import run_eval

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count: one two three one two three", "domain": "repeat"}) + "\n")
    out = tmp_path / "eval"
    config = EvalConfig(out=str(out), prompts=str(prompts), drafters=["ngram"], max_new_tokens=6, threads=1, plots=False)
    run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    run_eval(config, SamplingConfig(), target=tiny_target, progress=False)  # the directory, provenance included, is replaced
    record = read(out)
    assert record["config"]["eval"]["drafters"] == ["ngram"] and record["config"]["sampling"]["temperature"] == 0.0
    assert record["target"]["fingerprint"] == tiny_target.fingerprint
    assert record["inputs"] == [{"path": str(prompts), "sha256": sha256(prompts)}]
    assert record["measured"]["threads"] == {"value": 1, "source": "flag", "seconds": {}}
    assert record["measured"]["target_forward_path"]["forward_path"]["source"]


TINY_RECIPE = """\
method: dspark
model: {num_layers: 1, block_size: 4, markov_rank: 16, max_anchors: 8, intermediate_size: 64}
pack_tokens: 256
val_fraction: 0.3
checkpoint_interval: 0
dtype: fp32
"""
#: A warning as Python prints it (``-W default``): ``FILE:LINE: CategoryWarning: message``.
WARNING_LINE = re.compile(r"^\S+:\d+: \w*Warning: ", re.M)


@pytest.mark.slow
def test_quickstart_records_provenance_in_every_run_directory_and_prints_no_warnings(tiny_llama_dir, tmp_path):
    """The whole pipeline in a fresh process with every warning shown once (``-W default``, as a user's log would show
    deprecations): none may appear, and the run, its training and its comparison each record their provenance."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    run = tmp_path / "run"
    argv = [
        "quickstart",
        "--out",
        str(run),
        "--target",
        str(tiny_llama_dir),
        "--recipe",
        str(recipe),
        "--samples",
        "6",
        "--max-new-tokens",
        "8",
        "--regen-batch-size",
        "6",
        "--budget",
        "1.5",
        "--data-budget",
        "0.3",
        "--epochs",
        "2",
        "--eval-max-new-tokens",
        "6",
        "--threads",
        "1",
        "--engine",
        "hf",
    ]
    done = subprocess.run(
        [sys.executable, "-W", "default", "-m", "specdraft.cli.main", *argv], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = WARNING_LINE.findall(done.stderr)
    assert not warnings, "warnings in the quickstart's log:\n" + "\n".join(
        line for line in done.stderr.splitlines() if WARNING_LINE.match(line + "\n")
    )

    top = read(run)
    assert top["command"][1:] == argv and top["config"]["budget"] == 1.5 and top["config"]["recipe"] == str(recipe)
    assert [i["path"] for i in top["inputs"]] == [str(recipe), str(run / "data"), str(run / "hidden_states")]
    assert [i["sha256"] for i in top["inputs"]] == [
        sha256(recipe),
        sha256(run / "data" / "manifest.json"),
        sha256(run / "hidden_states" / "manifest.json"),
    ]
    assert top["measured"]["train"]["threads"]["value"] == 1 and top["measured"]["train"]["forward_path"]["source"]
    trained = read(run / "train")
    assert trained["inputs"][0]["sha256"] == sha256(run / "hidden_states" / "manifest.json")
    assert trained["config"]["max_steps"] == json.loads((run / "quickstart.json").read_text())["stages"]["train"]["steps"]
    evaluated = read(run / "eval")
    assert str(run / "train" / "final") in [i["path"] for i in evaluated["inputs"]]
    assert evaluated["target"]["fingerprint"] == trained["target"]["fingerprint"] == top["target"]["fingerprint"]


class _FakeVllm(http.server.BaseHTTPRequestHandler):
    """A vLLM server as ``eval --endpoint`` sees it: one served model, completions that answer ``max_tokens`` tokens,
    and speculative-decoding counters that count one drafting round per request."""

    requests = 0

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._answer(json.dumps({"data": [{"id": "served"}]}))
        else:
            self._answer(f"vllm:spec_decode_num_drafts_total {_FakeVllm.requests}\n")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeVllm.requests += 1
        self._answer(json.dumps({"choices": [{"token_ids": [5] * body["max_tokens"]}]}))

    def _answer(self, text: str) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args) -> None:
        pass


def test_endpoint_eval_records_its_provenance(tmp_path, tiny_llama_dir):
    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.integrations.vllm.endpoint_eval import run_endpoint_eval

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two three", "domain": "a"}) + "\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    out = tmp_path / "eval"
    try:
        config = EvalConfig(out=str(out), endpoint=url, target=str(tiny_llama_dir), prompts=str(prompts), max_new_tokens=4, plots=False)
        report = run_endpoint_eval(config, SamplingConfig(), progress=False)
    finally:
        server.shutdown()
    assert report["runs"][0]["overall"]["output_tokens"] == 4
    record = read(out)
    assert record["config"]["eval"]["endpoint"] == url and record["config"]["sampling"]["temperature"] == 0.0
    assert record["target"] == {"name": str(tiny_llama_dir), "endpoint": url, "served_model": "served"}
    assert record["inputs"] == [{"path": str(prompts), "sha256": sha256(prompts)}]
    assert record["measured"] == {}  # the server chose its own settings: this run measured nothing
