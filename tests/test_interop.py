"""Parity with the ``speculators`` 0.9.0 model classes, both directions, for all four families (EAGLE-3 also with
Eagle 3.1's normalisations).

speculators 0.9.0 pins transformers <= 5.19, so it lives in its own environment
(``.venv-interop``, made by ``scripts/bootstrap.sh``); the speculators side runs there in one
subprocess (``SPECULATORS_SIDE`` below) and exchanges safetensors files with this process:
  1. checkpoints saved by specdraft load in speculators and give the same logits;
  2. checkpoints saved by speculators load in specdraft and give the same logits.
Inputs: identical aux hidden states, tokens, positions and (DFlash/DSpark) fixed anchors; sdpa on CPU.
DFlash and DSpark run twice: with the full vocabulary (the frozen target head) and with a reduced
draft vocabulary (own lm_head [N, D], d2t/t2d, DSpark's markov_w2 onto N ids). DFlash2 (full vocabulary
only) also compares its selector: the unary top-k candidates and their scores given teacher-forced
predecessors, with random (non-identity) convolutions on both sides.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdraft.models import METHODS
from test_models_support import VOCAB, make_batch, make_target, single_thread

ROOT = Path(__file__).resolve().parents[1]
INTEROP_PYTHON = Path(os.environ.get("SPECDRAFT_INTEROP_PYTHON", ROOT / ".venv-interop/bin/python"))
ANCHORS = [3, 7, 12]
BLOCK = 4
DRAFT_VOCAB = 48
DSPARK = {"block_size": BLOCK, "num_layers": 2, "markov_rank": 16, "markov_head": "rnn"}
# case -> (method, our config overrides)
CASES = {
    "eagle3": ("eagle3", {"draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 3}),
    # Eagle 3.1's normalisations: the paper's per-layer feature norms, and speculators' eagle3 defaults
    "eagle3-fc-norm": ("eagle3", {"draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 3, "fc_norm": True, "norm_output": True}),
    "eagle3-norm-before-fc": ("eagle3", {"draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 3, "norm_before_fc": True, "norm_output": True}),
    "dflash": ("dflash", {"block_size": BLOCK, "num_layers": 2}),
    "dspark": ("dspark", DSPARK),
    "dflash2": ("dflash2", {"block_size": BLOCK, "num_layers": 2, "selector_rank": 16, "selector_top_k": 8}),
    "dflash-draft-vocab": ("dflash", {"block_size": BLOCK, "num_layers": 2, "draft_vocab_size": DRAFT_VOCAB}),
    "dspark-draft-vocab": ("dspark", {**DSPARK, "draft_vocab_size": DRAFT_VOCAB}),
}

pytestmark = [
    pytest.mark.interop,
    pytest.mark.slow,
    pytest.mark.skipif(not INTEROP_PYTHON.exists(), reason=f"speculators environment {INTEROP_PYTHON} not built (scripts/bootstrap.sh)"),
]

SPECULATORS_SIDE = r"""
import json, sys
from unittest import mock
import torch
torch.set_num_threads(1)
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.dflash import DFlashSpeculatorConfig
from speculators.models.dspark.config import DSparkSpeculatorConfig
from speculators.models.dflash2 import DFlash2SpeculatorConfig
import speculators.models.dflash.core as dflash_core

job = json.load(open(sys.argv[1]))

def load(directory):
    config = SpeculatorModelConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "sdpa"
    return SpeculatorModel.from_pretrained(directory, config=config).eval()

def eagle3_logits(model, x):
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(hidden_states=x["aux"], input_ids=x["input_ids"], document_ids=torch.zeros_like(x["input_ids"]),
              position_ids=x["position_ids"], ttt_steps=job["ttt_steps"])
    hook.remove()
    return {"logits": torch.stack(seen)}

def block_logits(model, x):
    anchors = x["anchors"]
    fixed = lambda loss_mask, n, b: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    with mock.patch.object(dflash_core, "select_anchors", fixed), torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(
            x["aux"], x["input_ids"], torch.ones_like(x["input_ids"]), x["last_hidden"],
            torch.zeros_like(x["input_ids"]), x["position_ids"], max_anchors=anchors.numel())
        out = {"logits": logits}
        if getattr(model, "markov_head", None) is not None:
            idx = (anchors[:, None] + torch.arange(model.block_size)).flatten()
            prev = x["input_ids"][0, idx].view(anchors.numel(), model.block_size)
            blocks = hidden.view(anchors.numel(), model.block_size, -1)
            emb = model.markov_head.prev_embeddings(prev)
            bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=blocks, prev_emb=emb)
            out["logits"] = logits + bias.view(1, -1, bias.shape[-1])
            out["confidence"] = model.confidence_head(torch.cat([blocks, emb], -1)).reshape(1, -1)
        if getattr(model, "candidate_selector", None) is not None:
            idx = (anchors[:, None] + torch.arange(model.block_size)).flatten()
            prev = model._predecessor_ids(x["input_ids"], idx)
            out["candidates"], out["selector_scores"] = model.candidate_selector.select(logits, hidden, prev.reshape(1, -1))
    return out

def random_vocab(model, tgt):
    t2d = torch.zeros(tgt["vocab"], dtype=torch.bool)
    t2d[torch.randperm(tgt["vocab"], generator=torch.Generator().manual_seed(0))[: tgt["draft_vocab"]]] = True
    ids = torch.nonzero(t2d).flatten()
    model.load_vocab_mappings(t2d, ids - torch.arange(ids.numel()))

def build(method, tgt, draft_vocab, flags):
    tlc = dict(vocab_size=tgt["vocab"], hidden_size=64, intermediate_size=128, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6)
    verifier = VerifierConfig(name_or_path=tgt["path"], architectures=["LlamaForCausalLM"])
    if method == "eagle3":
        layer = LlamaConfig(num_hidden_layers=1, **tlc)
        layer._attn_implementation = "sdpa"
        cfg = Eagle3SpeculatorConfig(
            transformer_layer_config=layer, draft_vocab_size=tgt["draft_vocab"], eagle_aux_hidden_state_layer_ids=tgt["eagle_ids"], **flags,
            speculators_config=SpeculatorsConfig(algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                                 default_proposal_method="greedy", verifier=verifier))
        cls = SpeculatorModel.registry["eagle3"]
        model = cls(cfg)
        random_vocab(model, tgt)
    else:
        layer = Qwen3Config(num_hidden_layers=2, **tlc)
        layer._attn_implementation = "sdpa"
        common = dict(transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=tgt["block"],
                      aux_hidden_state_layer_ids=tgt["dflash_ids"], mask_token_id=tgt["vocab"] - 1,
                      speculators_config=SpeculatorsConfig(algorithm=method, proposal_methods=[GreedyTokenProposalConfig(
                          speculative_tokens=tgt["block"] - (method in ("dflash", "dflash2")))],
                          default_proposal_method="greedy", verifier=verifier))
        if method == "dflash":
            cfg = DFlashSpeculatorConfig(**common)
        elif method == "dflash2":
            cfg = DFlash2SpeculatorConfig(**common, conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)
        else:
            cfg = DSparkSpeculatorConfig(**common, markov_rank=16, markov_head_type="gated")
        model = SpeculatorModel.registry[method](cfg)
        if draft_vocab != tgt["vocab"]:
            random_vocab(model, tgt)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("verifier_", "embed_tokens")):
                p.copy_(torch.randn_like(p) * 0.05 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.load_verifier_weights()
    return model.eval()

for spec in job["methods"].values():
    method = spec["method"]
    x = load_file(spec["inputs"])
    run = eagle3_logits if method == "eagle3" else block_logits
    save_file(run(load(spec["ours"]), x), spec["ours_out"])
    theirs = build(method, job["target"], spec["draft_vocab"], spec["flags"])
    theirs.save_pretrained(spec["theirs"])
    save_file(run(load(spec["theirs"]), x), spec["theirs_out"])
print("ok")
"""


def _our_outputs(model, batch, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        if model.method == "eagle3":
            steps = model.ttt_hidden(batch)
            return {"logits": torch.stack([model.lm_head(model.norm(h)) for h in steps])}
        hidden = model.forward_blocks(batch, anchors[None])
        if model.method == "dspark":
            prev = batch.token_ids[0, anchors[:, None] + torch.arange(BLOCK)]
            logits, conf = model.corrected_block(hidden[0], prev)
            return {"logits": logits.flatten(0, 1)[None], "confidence": conf.flatten()[None]}
        logits = model.lm_logits(hidden).flatten(1, 2)
        if model.method == "dflash2":  # predecessors x_{k-1}: the anchor for slots 0 and 1
            block = batch.token_ids[0, anchors[:, None] + torch.arange(BLOCK)]
            prev = torch.cat([block[:, :1], block[:, :-1]], 1).flatten()[None]
            candidates = logits.topk(model.config.selector_top_k, dim=-1).indices
            scores = model.candidate_selector.scores(logits, hidden.flatten(1, 2), prev, candidates)
            return {"logits": logits, "candidates": candidates, "selector_scores": scores}
        return {"logits": logits}


@pytest.fixture(scope="module")
def exchange(tmp_path_factory):
    """Run the speculators side once for all methods; yield what both sides computed."""
    tmp = tmp_path_factory.mktemp("interop")
    with single_thread():
        target = make_target()
        target.model.save_pretrained(tmp / "target")
        target.path = tmp / "target"
        anchors = torch.tensor(ANCHORS)
        job = {"ttt_steps": 3, "methods": {}}
        batches, ours = {}, {}
        for case, (method, overrides) in CASES.items():
            spec = METHODS.get(method)
            torch.manual_seed(0)
            model = spec.build(spec.config_cls(**overrides), target, counts=torch.arange(VOCAB, dtype=torch.int64))
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(0.05 * torch.randn_like(p))
            model.eval().save_pretrained(tmp / f"ours-{case}")
            batch = make_batch(target, method, count=1, length=18)
            batches[case], ours[case] = batch, model
            shifted = torch.roll(batch.token_ids, -1, dims=1)  # EAGLE-3: feature t pairs with token t+1
            inputs = {
                "aux": batch.aux_hidden.flatten(2).contiguous(),
                "input_ids": shifted if method == "eagle3" else batch.token_ids,
                "position_ids": batch.position_ids + (1 if method == "eagle3" else 0),
                "last_hidden": batch.last_hidden,
                "anchors": anchors,
            }
            save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp / f"in-{case}.safetensors"))
            job["methods"][case] = {
                "method": method,
                "draft_vocab": overrides.get("draft_vocab_size", VOCAB),
                "inputs": str(tmp / f"in-{case}.safetensors"),
                "ours": str(tmp / f"ours-{case}"),
                "ours_out": str(tmp / f"ours-{case}.out.safetensors"),
                "theirs": str(tmp / f"theirs-{case}"),
                "theirs_out": str(tmp / f"theirs-{case}.out.safetensors"),
                "flags": {k: v for k, v in overrides.items() if k in ("norm_before_fc", "fc_norm", "norm_output")},
            }
        job["target"] = {
            "path": str(tmp / "target"),
            "vocab": VOCAB,
            "draft_vocab": DRAFT_VOCAB,
            "block": BLOCK,
            "eagle_ids": [2, 4, 5],
            "dflash_ids": [2, 3, 4, 5, 6],
        }
        (tmp / "job.json").write_text(json.dumps(job))
        (tmp / "side.py").write_text(SPECULATORS_SIDE)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
        proc = subprocess.run(
            [str(INTEROP_PYTHON), str(tmp / "side.py"), str(tmp / "job.json")], capture_output=True, text=True, timeout=600, env=env
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        yield {"target": target, "job": job, "batches": batches, "ours": ours, "anchors": anchors}


def _compare(a: dict, b: dict, method: str) -> None:
    assert set(a) == set(b)
    for key in a:
        if method == "eagle3":  # step j at the last j+1 positions pairs with tokens past the row end
            for j in range(a[key].shape[0]):
                torch.testing.assert_close(a[key][j, :, : -(j + 1)], b[key][j, :, : -(j + 1)], atol=2e-4, rtol=2e-4)
        else:
            torch.testing.assert_close(a[key], b[key], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_our_checkpoint_matches_speculators(exchange, case):
    method = CASES[case][0]
    theirs = load_file(exchange["job"]["methods"][case]["ours_out"])
    mine = _our_outputs(exchange["ours"][case], exchange["batches"][case], exchange["anchors"])
    _compare(mine, theirs, method)
    assert mine["logits"].shape[-1] == exchange["job"]["methods"][case]["draft_vocab"]


@pytest.mark.parametrize("case", list(CASES))
def test_speculators_checkpoint_loads_here(exchange, case):
    method = CASES[case][0]
    directory = exchange["job"]["methods"][case]["theirs"]
    model = METHODS.get(method).model_cls.from_pretrained(directory, target=exchange["target"]).eval()
    theirs = load_file(exchange["job"]["methods"][case]["theirs_out"])
    _compare(_our_outputs(model, exchange["batches"][case], exchange["anchors"]), theirs, method)
    if case.endswith("draft-vocab"):  # speculators' random (non-frequency) selection survives the load
        assert model.config.draft_vocab_size == DRAFT_VOCAB and model.d2t.numel() == DRAFT_VOCAB
        assert model.draft_target_ids().tolist() != list(range(VOCAB - DRAFT_VOCAB, VOCAB))
    if method == "eagle3":
        assert model.config.layers == "input:2,input:4,input:5"
        assert {k: getattr(model.config, k) for k in ("norm_before_fc", "fc_norm", "norm_output")} == {
            k: CASES[case][1].get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output")
        }
    else:
        assert model.config.layers == "output:1,output:2,output:3,output:4,output:5"
