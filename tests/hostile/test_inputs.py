"""Hostile inputs (issue 17, items 3-7): each case failed silently, exposed something or crashed before.

Fast unit-level forms of the sweep in ``sweep_cases.py`` (run by ``test_sweep.py`` and ``benchmarks/hostile_sweep.py``): NaN/inf settings, a
diverging run, NaN drafters, loose drafter configs, pickle targets, exposed servers, moved or
damaged stores, duplicated delivery logs, signals, oversized and non-UTF-8 input.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

from specdraft.errors import SpecdraftError

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


# ----- 3. finite or stop ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, values",
    [
        ("specdraft.train.config:TrainConfig", {"grad_clip": NAN}),
        ("specdraft.train.config:TrainConfig", {"weight_decay": NAN}),
        ("specdraft.train.config:TrainConfig", {"max_time": INF}),
        ("specdraft.models.dspark.config:DSparkConfig", {"ce_weight": NAN}),
        ("specdraft.models.dspark.config:DSparkConfig", {"confidence_temperatures": [1.0] * 6 + [NAN]}),
        ("specdraft.decode.config:SamplingConfig", {"temperature": NAN}),
    ],
)
def test_configs_reject_non_finite_floats(where, values):
    import importlib

    module, name = where.split(":")
    with pytest.raises(SpecdraftError, match=f"{next(iter(values))} must be a finite number, got (nan|inf)"):
        getattr(importlib.import_module(module), name)(**values)


def test_recipe_strings_nan_are_refused_too():
    from specdraft.train.config import resolve_config

    with pytest.raises(SpecdraftError, match="weight_decay must be a finite number"):
        resolve_config(None, {"weight_decay": "nan"})


@pytest.mark.parametrize(
    "where,values,message",
    [
        (
            "specdraft.models.dflash.config:DFlashConfig",
            {"train_draft_head": "maybe"},
            "train_draft_head must be true or false, got 'maybe'",
        ),
        ("specdraft.models.dflash.config:DFlashConfig", {"dpace_alpha": "half"}, "dpace_alpha must be a number, got 'half'"),
        ("specdraft.models.dflash.config:DFlashConfig", {"max_anchors": 6.5}, "max_anchors must be an integer, got 6.5"),
        ("specdraft.models.dspark.config:DSparkConfig", {"confidence_head": "yes please"}, "confidence_head must be true or false"),
        (
            "specdraft.models.dspark.config:DSparkConfig",
            {"confidence_temperatures": [1.0, "x"]},
            "confidence_temperatures must be a list of numbers",
        ),
        ("specdraft.train.config:TrainConfig", {"lr": "fast"}, "lr must be a number, got 'fast'"),
    ],
)
def test_configs_reject_values_of_the_wrong_type(where, values, message):
    """A recipe's or ``--model key=value``'s YAML can give any type: the field is named, not a bare TypeError
    (or, for a bool, silently truthy)."""
    import importlib

    module, name = where.split(":")
    with pytest.raises(SpecdraftError, match=message):
        getattr(importlib.import_module(module), name)(**values)


POISON_TOKEN = 10_000  # no toy sample holds it: the test's patched forward gives a batch holding it a NaN loss


class _PoisonedStore:
    """A toy store whose sample ``bad`` is marked (its token ids are ``POISON_TOKEN``), so the step that reads it diverges
    (NaN hidden states no longer reach a step: they are refused when collated, tests/hostile/test_degenerate_inputs.py)."""

    def __init__(self, inner, bad: int):
        self.inner, self.bad = inner, bad

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        item = dict(self.inner[i])
        if i == self.bad:
            item["token_ids"] = torch.full_like(item["token_ids"], POISON_TOKEN)
        return item


def test_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from specdraft.train import checkpoint_files as ckpt
    from specdraft.train.batches import DataPlan
    from specdraft.train.split import dataset_split
    from specdraft.train.trainer import train
    from test_train_toy import ToyDrafter, ToyStore, ToyTarget, toy_config

    forward = ToyDrafter.training_forward

    def diverging(self, batch):
        out = forward(self, batch)
        if bool((batch.token_ids == POISON_TOKEN).any()):
            out.loss = out.loss * NAN
        return out

    monkeypatch.setattr(ToyDrafter, "training_forward", diverging)
    cfg = toy_config(tmp_path / "run", checkpoint_interval=2, eval_interval=0)
    store = ToyStore()
    split = dataset_split(store, val_fraction=cfg.val_fraction, seed=cfg.split_seed)
    plan = DataPlan.build(
        store.sample_ids,
        store.lengths(),
        split=split,
        pack_tokens=cfg.pack_tokens,
        batch_rows=cfg.batch_rows,
        seed=cfg.seed,
        world_size=1,
        rank=0,
    )
    poisoned = plan.train_rows(2)[0][0]  # first read by step 3, after the step-2 checkpoint
    bad_step = 1 + next(s for s in range(cfg.max_steps) if any(poisoned in row for row in plan.train_rows(s)))
    with pytest.raises(SpecdraftError, match=rf"training stopped at step {bad_step}: the loss is nan.*last good checkpoint"):
        train(cfg, target=ToyTarget(), dataset=_PoisonedStore(store, poisoned))
    assert not (tmp_path / "run" / "final").exists()
    assert ckpt.latest_checkpoint(tmp_path / "run").name == f"step-{bad_step - 1 - (bad_step - 1) % 2}"
    for directory in (tmp_path / "run" / "checkpoints").iterdir():
        assert all(torch.isfinite(t).all() for t in load_file(str(directory / "model.safetensors")).values())


def _dspark(target, **overrides):
    from specdraft.models import METHODS

    spec = METHODS.get("dspark")
    torch.manual_seed(0)
    config = spec.config_cls(**{"block_size": 4, "num_layers": 1, "markov_rank": 8, **overrides})
    return spec.build(config, target, counts=torch.ones(target.vocab_size, dtype=torch.int64)).eval()


@pytest.fixture(scope="module")
def saved_dspark(tmp_path_factory, target):
    directory = tmp_path_factory.mktemp("dspark") / "drafter"
    _dspark(target).save_pretrained(directory)
    return directory


def _edited(saved: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(saved, copy)
    cfg = json.loads((copy / "config.json").read_text())
    edit(cfg)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def _load(directory, target):
    from specdraft.models import METHODS

    return METHODS.get("dspark").model_cls.from_pretrained(directory, target=target)


def test_drafter_with_non_finite_weights_is_refused(saved_dspark, tmp_path, target):
    import json

    from safetensors.torch import load_file

    from specdraft.models.common.checkpoint import write_checkpoint

    broken = tmp_path / "nan"
    shutil.copytree(saved_dspark, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], NAN)
    write_checkpoint(broken, json.loads((broken / "config.json").read_text()), tensors)  # checksum matches: the NaN check must refuse it
    with pytest.raises(SpecdraftError, match=rf"tensor '{name}' holds NaN/inf values"):
        _load(broken, target)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_non_finite_logits_is_a_clean_error(temperature):
    from specdraft.models.common.sampling import sample_token

    with pytest.raises(SpecdraftError, match="non-finite logits"):
        sample_token(torch.tensor([0.5, NAN, 1.0]), temperature=temperature)
    token, _ = sample_token(torch.tensor([-INF, 2.0, -INF]), temperature=temperature)  # -inf: outside a draft vocabulary
    assert int(token) == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_chain_with_a_non_finite_step_is_refused(temperature):
    """A chain drafter's NaN step is refused whatever the temperature: at T=0 once the chain is drawn (the check runs
    once per chain there), at T > 0 at that step, before ``multinomial`` could crash on it."""
    from specdraft.models.common.sampling import Chain

    chain = Chain(temperature=temperature, generator=torch.Generator().manual_seed(0))
    chain.draw(torch.tensor([0.5, 3.0, -INF]))
    with pytest.raises(SpecdraftError, match="non-finite logits"):
        chain.draw(torch.tensor([0.5, NAN, 1.0]))
        chain.draw(torch.tensor([2.0, 0.5, 1.0]))
        chain.result()


def test_a_chain_draws_what_per_step_sampling_draws():
    """``Chain`` is the per-step draw with a deferred check: the same tokens and distributions, at T=0 argmaxes with
    no tables, at T > 0 the same generator stream (``probs_of`` maps each distribution back to the vocabulary)."""
    from specdraft.models.common.sampling import Chain, sample_token

    steps = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    greedy = Chain(temperature=0.0)
    for row in steps:
        greedy.draw(row)
    tokens, probs = greedy.result()
    assert tokens.tolist() == steps.argmax(-1).tolist() and probs is None
    chain, gen = Chain(temperature=0.7, generator=torch.Generator().manual_seed(2)), torch.Generator().manual_seed(2)
    for row in steps:
        chain.draw(row, probs_of=lambda p: 2 * p)
    tokens, probs = chain.result()
    expected = [sample_token(row, temperature=0.7, generator=gen) for row in steps]
    assert tokens.tolist() == [int(t) for t, _ in expected]
    assert torch.equal(probs, 2 * torch.stack([p for _, p in expected]))


# ----- 6. strict drafter configs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c["specdraft"]["config"].pop("block_size"), "block_size"),
        (lambda c: c["specdraft"]["config"].update(block_size=3), "block_size"),
        (lambda c: c["specdraft"]["target"].pop("fingerprint"), "fingerprint"),
        (lambda c: c["specdraft"].update(method="dflash"), "specdraft.method"),
        (lambda c: c.update(markov_rank=4), "markov_rank"),
        (lambda c: (c.pop("specdraft"), c.pop("block_size")), "block_size"),
        (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=7), "speculative_tokens"),
    ],
    ids=["missing", "contradicts-top-level", "no-fingerprint", "other-method", "top-level-markov", "speculators-missing", "tokens"],
)
def test_missing_or_contradictory_config_fields_are_named(saved_dspark, tmp_path, target, edit, field):
    with pytest.raises(SpecdraftError, match=field):
        _load(_edited(saved_dspark, tmp_path, edit), target)


def test_speculators_checkpoint_without_specdraft_block_still_loads_and_checks_the_verifier(saved_dspark, tmp_path, target):
    plain = _edited(saved_dspark, tmp_path, lambda c: c.pop("specdraft"))
    model = _load(plain, target)
    assert model.config.block_size == 4
    other = tmp_path / "other"
    shutil.copytree(plain, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match=r"trained for a \['Qwen3ForCausalLM'\] verifier"):
        _load(other, target)


def test_shipped_reference_drafter_config_reads_strictly():
    from specdraft.models.common import checkpoint as ckpt
    from specdraft.models.dspark.model import DSparkDrafter
    from specdraft.reference import reference_drafter

    directory = reference_drafter("smollm2-135m")  # tests/test_reference.py loads and decodes it in full
    config, verifier = DSparkDrafter.read_config(ckpt.read_checkpoint(directory)[0], where=str(directory))
    assert config.block_size == 7 and verifier["fingerprint"]


# ----- 5. safetensors only ------------------------------------------------------------------------


def test_pickle_target_is_refused_with_the_conversion(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file

    from specdraft.targets import load_target

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_llama_dir, pickled)
    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").rename(pickled / "unrelated.safetensors")  # any *.safetensors beside the pickle
    with pytest.raises(SpecdraftError, match=r"pickle weights \(pytorch_model.bin\).*save_pretrained"):
        load_target(str(pickled))


# ----- 4. nothing listens beyond what the user asked ----------------------------------------------


def test_serve_on_a_network_address_needs_a_token():
    from specdraft.integrations.vllm.serve import ServeConfig

    with pytest.raises(SpecdraftError, match="--host 0.0.0.0 is reachable from other machines: pass --token"):
        ServeConfig(drafter="d", host="0.0.0.0")
    assert ServeConfig(drafter="d", host="0.0.0.0", token="s3cret").token == "s3cret"
    ServeConfig(drafter="d", host="127.0.0.1")


def test_mooncake_engine_exposure_is_reported_and_nothing_else_listens_widely(master, caplog):
    pytest.importorskip("mooncake.store")
    from specdraft.integrations.mooncake.client import MooncakeClient, MooncakeClientConfig
    from specdraft.utils.net import listening_sockets, wildcard_listeners

    master_pid = master.state["pid"]
    assert listening_sockets(master_pid) and all(addr == "127.0.0.1" for addr, _ in listening_sockets(master_pid))
    before = set(wildcard_listeners())
    client = MooncakeClient(MooncakeClientConfig(master=master.address, segment_mb=16, buffer_mb=16))
    try:
        exposed = sorted(set(wildcard_listeners()) - before)
        # mooncake-transfer-engine 0.3.13 binds 0.0.0.0/:: unconditionally (see client.py): never silently
        assert client.exposed_ports == exposed
        if exposed:
            assert any("listens on all interfaces" in r.message and str(exposed[0]) in r.message for r in caplog.records)
    finally:
        client.close()


# ----- 7. smaller -----------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    from test_extract import make_dataset, random_llama_target, run

    target = random_llama_target()
    data = make_dataset(tmp_path / "data", target)
    run(target, data, tmp_path / "hs")
    return tmp_path / "data", tmp_path / "hs"


def _offline(data, dataset=None):
    from specdraft.hidden_states.data_modes import SourceOptions, open_offline

    return open_offline(SourceOptions(data=str(data), dataset=dataset, producers=[], store=None, slots=None))


def test_moved_store_reads_with_dataset_and_the_error_says_so(store, tmp_path):
    data, hs = store
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(str(data), moved / "data")
    shutil.move(str(hs), moved / "hs")
    with pytest.raises(SpecdraftError, match="no longer exists.*--dataset"):
        _offline(moved / "hs")
    assert len(_offline(moved / "hs", str(moved / "data"))) == 5


def test_deleted_sample_of_a_complete_store_is_an_error(store):
    data, hs = store
    files = sorted(p for p in hs.iterdir() if p.suffix == ".safetensors")
    victim = unquote(files[1].stem)
    files[1].unlink()
    fix = f"rerun `specdraft extract --dataset {data} --out {hs}`"
    with pytest.raises(SpecdraftError, match=f"1 bad sample.*{victim!r} is listed in the store manifest but missing.*{re.escape(fix)}"):
        _offline(hs)
    manifest = json.loads((hs / "manifest.json").read_text())
    del manifest["samples"]  # a store written before manifests listed their samples: the count still tells which
    (hs / "manifest.json").write_text(json.dumps(manifest))
    files[3].write_bytes(files[3].read_bytes()[:-64])
    with pytest.raises(SpecdraftError) as info:  # one check reports both: the counted sample gone and the damaged one
        _offline(hs)
    assert re.search(
        f"2 bad sample.*{victim!r} is missing \\(the store manifest records 5 complete samples but 4 are stored\\)", str(info.value)
    )
    assert f"{files[3].name} is truncated or damaged" in str(info.value) and fix in str(info.value)


def test_quickstart_budgets_must_be_meaningful():
    from specdraft.quickstart import QuickstartConfig

    with pytest.raises(SpecdraftError, match="--eval-reserve must be >= 0"):
        QuickstartConfig(eval_reserve=-100)
    with pytest.raises(SpecdraftError, match="--data-budget must be > 0"):
        QuickstartConfig(data_budget=0)


class _LoggingStore:
    """Appends each read sample id to ``OUT/delivered.jsonl``, as streaming sources do."""

    def __init__(self, inner, log: Path):
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        item = self.inner[i]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write(json.dumps({"sample_id": item["sample_id"]}) + "\n")
        return item


def test_resume_does_not_list_samples_twice_in_the_delivery_log(tmp_path):
    from specdraft.train.trainer import train
    from test_train_toy import ToyStore, ToyTarget, toy_config

    def run(out):
        return train(toy_config(out, max_steps=8), target=ToyTarget(), dataset=_LoggingStore(ToyStore(), out / "delivered.jsonl"))

    run(tmp_path / "ref")
    out = tmp_path / "run"
    run(out)
    shutil.rmtree(out / "checkpoints" / "step-8")  # as if killed just before the step-8 checkpoint: resumes at 4
    shutil.rmtree(out / "final")
    assert run(out).completed
    assert (out / "delivered.jsonl").read_text() == (tmp_path / "ref" / "delivered.jsonl").read_text()


def test_sigterm_exits_143(tmp_path, monkeypatch):
    from specdraft.cli.main import main
    from specdraft.train import trainer
    from test_train_toy import SignalAfterReads, ToyStore, ToyTarget

    real_train = trainer.train
    monkeypatch.setattr(trainer, "train", lambda cfg: real_train(cfg, target=ToyTarget(), dataset=SignalAfterReads(ToyStore(), 5)))
    code = main(
        [
            "train",
            "--method",
            "toy",
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "12",
            "--pack-tokens",
            "48",
            "--dtype",
            "fp32",
            "--num-threads",
            "1",
        ]
    )
    assert code == 128 + signal.SIGTERM


def test_over_long_line_is_skipped_before_tokenizing(tmp_path, tiny_llama_dir, monkeypatch):
    from specdraft.data import prepare as prepare_module
    from specdraft.data.prepare import PrepareConfig, prepare

    rendered = []
    real = prepare_module.render_with_mask
    monkeypatch.setattr(
        prepare_module, "render_with_mask", lambda tok, messages, eot: rendered.append(messages) or real(tok, messages, eot)
    )
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x " * 500_000}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = prepare(
        PrepareConfig(out=str(tmp_path / "out"), target=str(tiny_llama_dir), data=str(tmp_path / "in.jsonl"), max_length=256),
        progress=False,
    )
    assert summary["skipped"] == {"too_long": 1} and summary["kept"] == 1
    assert len(rendered) == 1  # only the short row reached the tokenizer


def test_non_utf8_input_names_the_line(tmp_path):
    from specdraft.data.sources import iter_json_values

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": "caf\xe9"}\n')
    with pytest.raises(SpecdraftError, match=r"bad.jsonl:3: not UTF-8 \(byte 0xe9 at column 11"):
        list(iter_json_values(path))


def test_sigterm_stops_the_private_vllm_server(tmp_path):
    """SIGTERM to a command that started a vLLM server (its own session) stops the server too: the
    default action ended specdraft at once and left the server running with its memory and cores."""
    script = tmp_path / "run.py"
    script.write_text(f"""
import os, signal, sys
from specdraft.cli import prepare as cli_prepare
from specdraft.cli.main import main
from specdraft.integrations.vllm.engine import VllmServer

def fake_prepare(args):
    server = VllmServer("unused", python=sys.executable)
    server.command = lambda: [sys.executable, "-c", "import time; time.sleep(600)"]
    server._wait_healthy = lambda: None
    with server:
        open({str(tmp_path / "pid")!r}, "w").write(str(server.process.pid))
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()

cli_prepare.run = fake_prepare
sys.exit(main(["prepare", "--data", "x", "--out", {str(tmp_path / "out")!r}]))
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "terminated; rerun the same command to resume" in proc.stderr
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
