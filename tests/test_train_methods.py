"""The trainer with the real drafters (eagle3, dflash, dflash2, dspark) on real hidden-state stores of a tiny target.

Pipeline per test module: a random 8-layer Llama target (vocab 128) -> a prepared dataset ->
``extract_hidden_states`` into file stores (DSpark/DFlash preset and EAGLE-3 preset) -> ``train``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.dataset import HiddenStateDataset
from specdraft.train.config import TrainConfig
from specdraft.train.trainer import train
from test_train_toy import SignalAfterReads

VOCAB, LAYERS = 128, 8
# Small shapes so that a step takes milliseconds; every method-specific code path still runs.
OVERRIDES = {
    "eagle3": {"ttt_steps": 2, "draft_vocab_size": 64, "intermediate_size": 64},
    "dflash": {"num_layers": 1, "block_size": 4, "max_anchors": 8, "intermediate_size": 64},
    "dflash2": {"num_layers": 1, "block_size": 4, "max_anchors": 8, "intermediate_size": 64, "selector_rank": 16, "selector_top_k": 8},
    "dspark": {"num_layers": 1, "block_size": 4, "max_anchors": 8, "markov_rank": 16, "intermediate_size": 64},
}


def tiny_target(fingerprint: str = "a" * 16):
    import transformers

    from specdraft.targets.base import Target

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return Target(name="tiny", path=Path("/nowhere"), model=model, tokenizer=None, fingerprint=fingerprint, tokenizer_hash="t" * 16)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(target, {preset: store dir}) with 16 samples of 10..33 tokens."""
    return build_stores(tmp_path_factory.mktemp("train-methods"))


def build_stores(root: Path, presets=("eagle3", "dspark")):
    """The ``stores`` fixture's target and stores under ``root`` (also what ``scripts/resume_across.py`` trains on)."""
    from specdraft.data.dataset import write_prepared
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    target = tiny_target()
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(16):
        n = int(torch.randint(10, 34, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        rows.append({"sample_id": f"s/{i}", "source": "t", "input_ids": ids, "loss_mask": [int(j >= n // 3) for j in range(n)]})
    data = write_prepared(root / "data", rows, target_info=target.describe(), config={}, stats={}, vocab_size=VOCAB)
    out = {}
    for preset in presets:
        out[preset] = root / f"hs-{preset}"
        extract_hidden_states(
            ExtractConfig(dataset=str(data), out=str(out[preset]), method=preset, dtype="float32"), target=target, progress=False
        )
    return target, out


def store_for(method: str, stores) -> Path:
    return stores[1]["eagle3" if method == "eagle3" else "dspark"]


def config(method, data, out, **kw) -> TrainConfig:
    values = dict(
        method=method,
        data=str(data),
        out=str(out),
        model=OVERRIDES[method],
        max_steps=4,
        pack_tokens=64,
        batch_rows=1,
        val_fraction=0.2,
        eval_interval=2,
        checkpoint_interval=2,
        keep_checkpoints=0,
        dtype="fp32",
        num_threads=1,
        seed=5,
    )
    values.update(kw)
    return TrainConfig(**values)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["eagle3", "dflash", "dflash2", "dspark", "dspark-draft-vocab"])
def test_kill_and_resume_gives_the_same_weights(case, stores, tmp_path):
    from specdraft.models import load_drafter

    target = stores[0]
    method = case.split("-")[0]
    data = store_for(method, stores)
    # draft-vocab: N chosen by coverage of the prepared dataset's token counts, the same on resume
    model = {**OVERRIDES[method], **({"draft_vocab_coverage": 0.9} if case.endswith("draft-vocab") else {})}
    ref = train(config(method, data, tmp_path / "ref", model=model), target=target)
    assert ref.completed and ref.step == 4

    out = tmp_path / "run"
    first = train(config(method, data, out, model=model), target=target, dataset=SignalAfterReads(HiddenStateDataset(data), 3))
    assert first.stopped_by == "signal" and 0 < first.step < 4
    second = train(config(method, data, out, model=model), target=target)
    assert second.completed
    a, b = load_file(str(ref.final / "model.safetensors")), load_file(str(out / "final/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the final drafter loads back (speculators format) and its trained weights are the ones the run ended with
    state = load_file(str(out / "checkpoints/step-4/trainer_state.safetensors"))
    drafter = load_drafter(out / "final", target=target)
    for name, tensor in drafter.state_dict().items():
        if f"model.drafter.{name}" in state:
            assert torch.equal(tensor, state[f"model.drafter.{name}"]), name
    if case.endswith("draft-vocab"):
        assert 1 < drafter.config.draft_vocab_size < VOCAB and "lm_head.weight" in a and "d2t" in a


@pytest.mark.slow
def test_bf16_autocast_and_metrics(stores, tmp_path):
    import json

    result = train(config("dspark", store_for("dspark", stores), tmp_path, max_steps=2, dtype="bf16", eval_interval=0), target=stores[0])
    assert result.completed
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["split"] == "train"]
    assert len(train_recs) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in train_recs)
    assert len(train_recs[0]["position_acc"]) == 4 and train_recs[0]["accept_len"] >= 1.0
    assert [r["step"] for r in recs if r["split"] == "val"] == [2]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_validation_logs_teacher_forced_and_decoded_tau(method, stores, tmp_path):
    """Each validation decodes the recorded validation prompts with the runtime; the final card carries both figures."""
    import json

    from specdraft.decode.config import DecodeConfig, SamplingConfig
    from specdraft.decode.runtime import decoder_for_target
    from specdraft.train.split import prompt_length

    target, data = stores[0], store_for(method, stores)
    result = train(
        config(method, data, tmp_path, max_steps=2, eval_interval=1, val_fraction=0.3, decode_prompts=2, decode_tokens=6), target=target
    )
    vals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"val"' in line]
    assert [r["step"] for r in vals] == [1, 2]
    last = vals[-1]
    assert last["tau_teacher_forced"] == last["accept_len"] and "uniform" in last["teacher_forced_anchors"]
    assert last["decoded"]["prompts"] == 2 and last["decoded"]["rounds"] > 0 and last["tau_decoded"] == last["decoded"]["tau"] >= 1.0
    split = json.loads((tmp_path / "split.json").read_text())
    assert len(split["decode_prompts"]) == 2 and set(split["decode_prompts"]) <= set(split["validation_ids"])

    # the logged figure is the runtime's: the same prompts decoded from final/ give the same tau
    prepared = HiddenStateDataset(data).prepared
    prompts = []
    for sid in split["decode_prompts"]:
        item = prepared[prepared.index_of(sid)]
        prompts.append(item["input_ids"][: prompt_length(item["loss_mask"])].tolist())
    decoder = decoder_for_target(
        target, config=DecodeConfig(drafter=method, drafter_path=str(result.final), max_new_tokens=6), sampling=SamplingConfig()
    )
    assert decoder.generate(prompts).metrics.tau == pytest.approx(last["tau_decoded"])
    card = (result.final / "MODEL_CARD.md").read_text()
    assert f"| teacher_forced | {last['tau_teacher_forced']:.3f} |" in card and f"| decoded | {last['tau_decoded']:.3f} |" in card
    assert split["hash"] in card

    off = train(config(method, data, tmp_path / "off", max_steps=1, eval_interval=0, val_fraction=0.3, decode_prompts=0), target=target)
    record = json.loads((tmp_path / "off/metrics.jsonl").read_text().splitlines()[-1])
    assert off.completed and record["split"] == "val" and "decoded" not in record and "tau_decoded" not in record


@pytest.mark.slow
def test_real_store_errors(stores, tmp_path):
    target = stores[0]
    with pytest.raises(SpecdraftError, match=r"holds layers \[output:1.*but this method reads \[input:2, input:4, input:5\]"):
        train(config("eagle3", stores[1]["dspark"], tmp_path / "a"), target=target)
    other = tiny_target(fingerprint="b" * 16)
    with pytest.raises(SpecdraftError, match=r"extracted from target 'tiny' \(fingerprint a+\), not 'tiny' \(fingerprint b+\)"):
        train(config("dspark", stores[1]["dspark"], tmp_path / "b"), target=other)
    empty = tmp_path / "empty"
    shutil.copytree(stores[1]["dspark"], empty)
    for f in empty.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(SpecdraftError, match="holds no samples"):
        train(config("dspark", empty, tmp_path / "c"), target=target)
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.slow
def test_ddp_two_gloo_processes_real_method(stores, tmp_path):
    """dspark under torchrun (2 gloo processes): gradients sync (ranks end with equal weights), rank 0 writes."""
    import json

    from torchrun import torchrun

    out = tmp_path / "run"
    cfg = config("dspark", store_for("dspark", stores), out, max_steps=2, eval_interval=0, checkpoint_interval=0).to_dict()
    torchrun(__file__, json.dumps(cfg), str(tmp_path))
    ranks = [load_file(str(tmp_path / f"weights-{r}.safetensors")) for r in range(2)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    final = load_file(str(out / "final/model.safetensors"))
    assert all(torch.equal(final[k], ranks[0][k]) for k in final if k in ranks[0])
    assert json.loads((out / "checkpoints/step-2/trainer_state.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_cli_recipe_with_overrides_on_a_target_directory(tiny_llama_dir, tiny_target, tmp_path, capsys):
    """`specdraft train --config dspark --target DIR ...`: recipe + flags, then the same command resumes."""
    import json

    from specdraft.cli.main import main
    from specdraft.data.dataset import write_prepared
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "sample_id": f"c/{i}",
            "source": "t",
            "input_ids": torch.randint(0, 1000, (20,), generator=g).tolist(),
            "loss_mask": [int(j >= 5) for j in range(20)],
        }
        for i in range(6)
    ]
    data = write_prepared(
        tmp_path / "data", rows, target_info=tiny_target.describe(), config={}, stats={}, vocab_size=tiny_target.vocab_size
    )
    store = tmp_path / "hs"
    extract_hidden_states(ExtractConfig(dataset=str(data), out=str(store), method="dspark", target=str(tiny_llama_dir)), progress=False)
    argv = [
        "train",
        "--config",
        "dspark",
        "--target",
        str(tiny_llama_dir),
        "--data",
        str(store),
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "2",
        "--pack-tokens",
        "40",
        "--val-fraction",
        "0",
        "--model",
        "num_layers=1,max_anchors=4,markov_rank=8,intermediate_size=64",
        "--num-threads",
        "1",
        "--dtype",
        "fp32",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completed"] and summary["step"] == 2
    import yaml

    resolved = yaml.safe_load((tmp_path / "run/config.resolved.yaml").read_text())
    assert resolved["model"]["num_layers"] == 1 and resolved["model"]["block_size"] == 7 and resolved["model"]["markov_rank"] == 8
    assert resolved["target"] == str(tiny_llama_dir) and resolved["lr"] == 6e-4
    assert main(argv) == 0  # the same command again: already complete, nothing retrained
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2


def _ddp_main(cfg_json: str, side_dir: str) -> None:
    """torchrun entry: train on the store named in the config with ``tiny_target()``, dump this rank's weights."""
    import json
    import os

    from safetensors.torch import save_file

    result = train(TrainConfig(**json.loads(cfg_json)), target=tiny_target())
    state = {k: v.contiguous() for k, v in result.drafter.state_dict().items()}
    save_file(state, str(Path(side_dir) / f"weights-{os.environ['RANK']}.safetensors"))


if __name__ == "__main__":
    import sys

    _ddp_main(sys.argv[1], sys.argv[2])
