"""Served acceptance equals measured acceptance: what vLLM 0.32 makes of specdraft checkpoints.

The vLLM side runs in ``.venv-vllm`` as a subprocess (vLLM pins its own torch/transformers):
  * vLLM's speculators config translation of our DFlash and DSpark fields (attention causality,
    anchor convention, layer ids, heads);
  * the vLLM-CPU grouped k_norm kernel and specdraft's correction (``integrations/vllm/plugin.py``);
  * vLLM's DSpark model built by vLLM's own loader from the shipped reference drafter, drafting as
    vLLM's GPU DSpark runtime does, against specdraft's drafts and confidences;
  * vLLM's DFlash2 model built the same way from a specdraft DFlash2 checkpoint, its selector walk written
    in torch (tests/vllm_dflash2_side.py), against specdraft's drafts and selector scores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdraft.integrations.vllm.engine import CPU_ENV_DEFAULTS
from specdraft.models.dflash.config import DFlashConfig
from specdraft.models.eagle3.config import Eagle3Config

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("SPECDRAFT_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM environment {VLLM_PYTHON} not built (scripts/bootstrap.sh)")


def run_vllm(args: list[str], *, timeout: float = 900) -> str:
    """Run ``.venv-vllm/bin/python args`` with this checkout's specdraft first on the path; its stdout."""
    env = {**CPU_ENV_DEFAULTS, **os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    done = subprocess.run([str(VLLM_PYTHON), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


TRANSLATION_SIDE = r"""
import json, sys
import torch
from vllm import _custom_ops as ops
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model, dflash_has_any_non_causal
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

out = {}
for name in sys.argv[1:]:
    hf = SpeculatorsConfig.from_pretrained(name)
    out[name] = {"non_causal": dflash_has_any_non_causal(hf), "dflash_config": getattr(hf, "dflash_config", None),
                 **{k: getattr(hf, k, None) for k in ("architectures", "sample_from_anchor", "dspark_bonus_anchor", "target_layer_ids",
                    "eagle_aux_hidden_state_layer_ids", "markov_rank", "markov_head_type", "block_size", "mask_token_id",
                    "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size")}}

# vLLM-CPU's grouped k_norm (DFlashQwen3Model._normalize_context_k) with and without specdraft's correction.
torch.manual_seed(0)
fake = type("Fake", (), {"_k_norm_weights": torch.randn(2, 32) + 1, "_rms_norm_eps": 1e-6})()
keys = torch.randn(2, 5, 2, 32)
per_layer = torch.stack([keys[i] * torch.rsqrt(keys[i].pow(2).mean(-1, keepdim=True) + 1e-6) * fake._k_norm_weights[i] for i in range(2)])
with_layer0 = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6) * fake._k_norm_weights[0]
stock = DFlashQwen3Model._normalize_context_k(fake, keys)
from specdraft.integrations.vllm.plugin import install
patched = install()
fixed = DFlashQwen3Model._normalize_context_k(fake, keys)
out["k_norm"] = {"patched": patched, "stock_vs_layer0": float((stock - with_layer0).abs().max()),
                 "stock_vs_per_layer": float((stock - per_layer).abs().max()), "fixed_vs_per_layer": float((fixed - per_layer).abs().max())}
print(json.dumps(out))
"""


def test_vllm_reads_block_drafters_as_trained_and_cpu_k_norm_is_corrected(tmp_path, target):
    """vLLM's translation of our checkpoints: DFlash non-causal (``sliding_window_non_causal`` true), DSpark
    anchor-as-first-prediction with aux ids - 1 as its target layers and our head fields; and vLLM-CPU's
    grouped k_norm uses layer 0's weight for every layer until specdraft's plugin corrects it."""
    from specdraft.models import METHODS

    dirs = {}
    for method, extra in (("dflash", {}), ("dspark", {"markov_rank": 16, "draft_vocab_size": 48})):
        torch.manual_seed(0)
        config = METHODS.get(method).config_cls(layers="output:1,output:3,output:5", num_layers=2, block_size=4, **extra)
        model = METHODS.get(method).build(config, target, counts=torch.arange(target.vocab_size))
        model.save_pretrained(tmp_path / method)
        dirs[method] = str(tmp_path / method)
    out = json.loads(run_vllm(["-c", TRANSLATION_SIDE, *dirs.values()], timeout=300).strip().splitlines()[-1])

    dflash, dspark = out[dirs["dflash"]], out[dirs["dspark"]]
    assert dflash["non_causal"] is True and dflash["dflash_config"]["causal"] is False, dflash
    assert dflash["dflash_config"]["target_layer_ids"] == [1, 3, 5] and dflash["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert dflash["dflash_config"]["sample_from_anchor"] is False
    assert dspark["non_causal"] is True and dspark["architectures"] == ["Qwen3DSparkModel"]
    assert (dspark["sample_from_anchor"], dspark["dspark_bonus_anchor"]) == (True, False)  # the anchor slot is a prediction
    assert dspark["target_layer_ids"] == [1, 3, 5] and dspark["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert (dspark["markov_rank"], dspark["markov_head_type"], dspark["block_size"], dspark["draft_vocab_size"]) == (16, "vanilla", 4, 48)
    assert dspark["enable_confidence_head"] is True and dspark["confidence_head_with_markov"] is True

    k_norm = out["k_norm"]
    assert "DFlashQwen3Model._normalize_context_k" in k_norm["patched"]
    assert k_norm["stock_vs_layer0"] < 1e-5 < 0.1 < k_norm["stock_vs_per_layer"], k_norm  # the vLLM-CPU defect
    assert k_norm["fixed_vs_per_layer"] < 1e-5, k_norm


@pytest.mark.parametrize("corrections, expected", [("on", "_normalize_context_k_per_layer"), ("off", "_normalize_context_k")])
def test_the_spawned_vllm_engine_loads_the_corrections(corrections, expected, monkeypatch):
    """vLLM-CPU spawns its engine core, so the correction must arrive through vLLM's general-plugin entry point,
    not a patch in the server process (which left served DFlash drafters on stock vLLM: served tau 3.613 vs
    built-in 3.757 for a 2-layer drafter with distinct k_norms, the same with the 'correction' on or off)."""
    monkeypatch.setenv("SPECDRAFT_VLLM_CORRECTIONS", corrections)
    out = json.loads(run_vllm([str(ROOT / "tests/vllm_plugin_side.py")], timeout=600).strip().splitlines()[-1])
    assert out["engine_k_norm"] == expected, out


@pytest.mark.slow
def test_vllm_dspark_model_loads_the_reference_drafter_and_drafts_as_specdraft(smollm2_dir, tmp_path):
    """vLLM's own loader builds its DSpark model from the shipped reference drafter (every tensor used, none
    missing), and vLLM's modules, driven as its GPU DSpark runtime drives them, draft what specdraft drafts
    on 20 blocks, with the same (uncalibrated) confidences; vLLM does not apply the calibration."""
    from specdraft.eval.suites import SUITES
    from specdraft.models.common.drafter import load_drafter
    from specdraft.reference import reference_drafter
    from specdraft.targets import load_target

    target = load_target("smollm2-135m")
    path = reference_drafter("smollm2-135m")
    drafter = load_drafter(path, target=target)
    calibrated = drafter.config.confidence_temperatures
    assert calibrated, "the reference drafter is calibrated"
    drafter.config = dataclasses.replace(drafter.config, confidence_temperatures=[])  # vLLM uses sigmoid(c_k) as is
    prompt = next(p for p in SUITES.get("math")() if p.domain == "math").token_ids(target.tokenizer)
    with torch.no_grad():
        sequence = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0]
        states = target.model(sequence[None], output_hidden_states=True).hidden_states
    features = torch.stack([states[s.hf_index(target.num_layers)][0] for s in drafter.config.slots()], 1)  # [T, S, D]
    anchors = torch.arange(len(prompt) - 4, len(prompt) + 16)  # 20 blocks, in the prompt and in the reply
    ours = [
        drafter.draft_block(
            drafter.new_cache(),
            anchor_token=int(sequence[p]),
            anchor_position=int(p),
            context_features=features[:p],
            context_positions=torch.arange(p),
        )
        for p in anchors.tolist()
    ]
    save_file(
        {"features": features.flatten(1).contiguous(), "tokens": sequence.contiguous(), "anchors": anchors}, tmp_path / "blocks.safetensors"
    )

    run_vllm(
        [
            str(ROOT / "tests/vllm_dspark_side.py"),
            str(smollm2_dir),
            str(path),
            str(tmp_path / "blocks.safetensors"),
            str(tmp_path / "vllm.json"),
        ]
    )
    got = json.loads((tmp_path / "vllm.json").read_text())
    drafts = torch.tensor(got["drafts"])
    expected = torch.stack([o.tokens for o in ours])
    conf_diff = (torch.tensor(got["confidences"]) - torch.stack([o.confidences for o in ours])).abs().max().item()
    print(
        f"\nvLLM DSpark load: {got['checkpoint_tensors']} checkpoint tensors, {got['loaded_parameters']} vLLM parameters loaded "
        f"of {got['model_parameters']}; skipped {got['skipped']}, unexpected {got['unexpected']}, not from the checkpoint {got['missing']}"
    )
    print(
        f"blocks compared: {len(anchors)} x {drafts.shape[1]} drafts, identical {int((drafts == expected).sum())}/{drafts.numel()}, "
        f"max |confidence difference| {conf_diff:.2e}"
    )
    assert got["unexpected"] == [] and got["skipped"] == ["t2d"]
    # Not in the checkpoint: the embedding (vLLM shares the target's, load_dspark_model) and vLLM's unused
    # mask_embedding placeholder (DSpark embeds MASK slots through the vocabulary row mask_token_id).
    assert got["missing"] == ["model.embed_tokens.weight", "model.mask_embedding"]
    assert got["causal"] == [False, False] and (got["sample_from_anchor"], got["bonus_anchor"]) == (True, False)
    assert got["num_speculative_tokens"] == drafter.config.block_size == drafts.shape[1]
    assert torch.equal(drafts, expected), (drafts, expected)
    assert conf_diff < 1e-4
    # Stock vLLM-CPU (no k_norm correction) drafts differently with this 2-layer drafter: the correction matters.
    stock = torch.tensor(got["stock_drafts"])
    stock_diff = (torch.tensor(got["stock_confidences"]) - torch.stack([o.confidences for o in ours])).abs().max().item()
    print(
        f"stock vLLM-CPU k_norm: identical {int((stock == expected).sum())}/{stock.numel()}, max |confidence difference| {stock_diff:.2e}"
    )
    assert stock_diff > 1e-3


#: case -> (method, config of a drafter with 3 draft tokens per round)
PARITY_DRAFTERS = {
    # EAGLE-3 learns the target's distribution (soft targets), and over the full 49k vocabulary the tiny random
    # target's is nearly uniform (9.98 of at most 10.80 nats, median top-2 logit margin 0.20): 300 steps reach 0.86
    # accuracy at ~1 s each. On the draft vocabulary of its replies (121 tokens: 3.31 nats, margin 1.09) it reaches
    # 0.99 in 100 steps at ~0.1 s each, and vLLM maps the draft ids through d2t.
    "eagle3": ("eagle3", lambda: Eagle3Config(layers="input:1,input:3,input:4", draft_vocab_coverage=1.0, ttt_steps=3)),
    # 8 anchors per reply and step keep training cheap (the head over the 49k-token vocabulary dominates)
    "dflash-1": ("dflash", lambda: DFlashConfig(layers="output:1,output:3", num_layers=1, block_size=4, max_anchors=8)),
    "dflash-2": ("dflash", lambda: DFlashConfig(layers="output:1,output:3", num_layers=2, block_size=4, max_anchors=8)),
}
PARITY_PROMPTS = [("Name three colours.", "a"), ("Count to five.", "b"), ("Say hi.", "b"), ("Tell me about the sea.", "a")]
PARITY_TOKENS = 32


def trained_parity_drafter(
    case: str, target, out: Path, *, steps: int = 300, prompts: list[str] | None = None, new_tokens: int = PARITY_TOKENS, init=None
) -> Path:
    """A drafter trained (300 steps) on the target's greedy replies (``new_tokens`` each) to ``prompts`` (default
    PARITY_PROMPTS), saved to ``out``: its acceptance is far above zero, so served and built-in acceptance can be
    told apart (fewer ``steps``: partly trained, partial acceptance). ``init`` see ``overfit_drafter``."""
    from test_vllm import overfit_drafter

    if not (out / "config.json").is_file():
        method, make_config = PARITY_DRAFTERS[case]
        chats = [
            target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)
            for text in prompts or [text for text, _ in PARITY_PROMPTS]
        ]
        overfit_drafter(
            method, make_config(), target, chats, new_tokens=new_tokens, steps=steps, min_accuracy=0.9 if steps >= 300 else 0.0, init=init
        ).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def parity_target(smollm2_dir, tmp_path_factory):
    from test_vllm import varied_tiny_target

    return varied_tiny_target(tmp_path_factory.mktemp("parity") / "target", smollm2_dir)


#: Each case trains 300 steps and starts a vLLM server (about a minute each on 2 quiet cores);
#: SPECDRAFT_PARITY_CASES (comma-separated) runs a subset.
PARITY_CASES = [c for c in os.environ.get("SPECDRAFT_PARITY_CASES", ",".join(PARITY_DRAFTERS)).split(",") if c]


def test_parity_serves_in_the_builtin_dtype_unless_told_otherwise():
    from specdraft.integrations.vllm.parity import served_engine_args

    assert served_engine_args("--enforce-eager --max-model-len 256", "float32") == "--dtype float32 --enforce-eager --max-model-len 256"
    assert served_engine_args("", "bfloat16") == "--dtype bfloat16"
    for given in ("--dtype bfloat16 --enforce-eager", "--enforce-eager --dtype=float16"):  # the user's choice stands
        assert served_engine_args(given, "float32") == given


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY_CASES)
def test_eval_parity_served_tau_equals_builtin_tau(case, parity_target, tmp_path_factory):
    """`specdraft eval --parity` on vLLM-CPU with trained drafters: the server it starts accepts what the built-in
    runtime accepts (gap within 3%, not flagged), well above 1, with the target's greedy outputs. These drafters
    memorise their replies (every draft accepted), so they do not tell the old checkpoint fields or stock vLLM-CPU
    apart (benchmarks/vllm_parity.py measured the same tau before and after); the module-level tests above do."""
    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.integrations.vllm.parity import run_parity_eval

    work = tmp_path_factory.mktemp(f"parity-{case}")
    drafter = trained_parity_drafter(case, parity_target, work / "drafter")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "domain": d}) + "\n" for text, d in PARITY_PROMPTS))
    config = EvalConfig(
        out=str(work / "eval"),
        target=str(parity_target.path),
        prompts=str(prompts),
        drafters=[str(drafter)],
        max_new_tokens=PARITY_TOKENS,
        parity=True,
        vllm_args="--enforce-eager --max-model-len 256",  # no --dtype: the server runs in the built-in side's float32
        plots=False,
    )
    report = run_parity_eval(config, SamplingConfig(), target=parity_target, progress=False)
    (row,) = report["drafters"]
    print(f"\n{case}: built-in tau {row['builtin']['tau']:.3f}, served tau {row['served']['tau']:.3f}, gap {row['gap']:+.1%}")
    assert row["served_identical_to_autoregressive"] == len(PARITY_PROMPTS)
    assert row["builtin"]["tau"] > 2.0, row
    assert not row["flagged"], row
    assert "| ok |" in (work / "eval" / "parity.md").read_text()


@pytest.mark.slow
def test_vllm_dflash2_model_loads_our_checkpoint_and_drafts_as_specdraft(tiny_llama_dir, tiny_target, tmp_path):
    """vLLM's own config translation and loader build its DFlash2 model from a specdraft DFlash2 checkpoint (every
    tensor used, nothing missing but the target's shared embedding and head and an unused placeholder), and vLLM's
    modules, driven as its GPU
    DFlash2 runtime drives them (tests/vllm_dflash2_side.py says what the harness substitutes), draft what specdraft
    drafts on 12 blocks, with the same selector scores along the walk. The drafter's convolutions are not the
    identity and its selector overrules the unary argmax somewhere, so both additions are compared."""
    from specdraft.models import METHODS

    spec = METHODS.get("dflash2")
    torch.manual_seed(0)
    drafter = spec.build(
        spec.config_cls(layers="output:1,output:3,output:5", num_layers=2, block_size=4, selector_rank=16, selector_top_k=8), tiny_target
    )
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
        for codebook in (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook):
            codebook.mul_(40.0)
    drafter.eval().save_pretrained(tmp_path / "drafter")
    model = tiny_target.model
    prompt = torch.randint(0, tiny_target.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sequence = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0]
        states = model(sequence[None], output_hidden_states=True).hidden_states
    features = torch.stack([states[s.hf_index(tiny_target.num_layers)][0] for s in drafter.config.slots()], 1)  # [T, S, D]
    anchors = torch.arange(6, 18)
    ours, scores, unary_argmax = [], [], []
    with torch.no_grad():
        for p in anchors.tolist():
            cache = drafter.new_cache()
            drafter.append_context(cache, features=features[:p], positions=torch.arange(p))
            hidden = drafter.block_hidden(cache, anchor_token=int(sequence[p]), anchor_position=p)
            tokens = drafter.propose(hidden, anchor_token=int(sequence[p]), temperature=0.0, generator=None).tokens
            slots = hidden[drafter.draft_slots()]
            unary = drafter.lm_logits(slots)
            candidates = unary.topk(8, dim=-1).indices
            prev = torch.cat([sequence[p : p + 1], tokens[:-1]])
            scores.append(drafter.candidate_selector.scores(unary, slots, prev, candidates))
            ours.append(tokens)
            unary_argmax.append(unary.argmax(-1))
    expected = torch.stack(ours)
    assert not torch.equal(expected, torch.stack(unary_argmax)), "the selector must overrule the unary argmax somewhere"
    save_file(
        {"features": features.flatten(1).contiguous(), "tokens": sequence.contiguous(), "anchors": anchors}, tmp_path / "blocks.safetensors"
    )

    run_vllm(
        [
            str(ROOT / "tests/vllm_dflash2_side.py"),
            str(tiny_llama_dir),
            str(tmp_path / "drafter"),
            str(tmp_path / "blocks.safetensors"),
            str(tmp_path / "vllm.json"),
        ]
    )
    got = json.loads((tmp_path / "vllm.json").read_text())
    drafts = torch.tensor(got["drafts"])
    score_diff = (torch.tensor(got["realized_scores"]) - torch.stack(scores)).abs().max().item()
    print(
        f"\nvLLM DFlash2 load: {got['checkpoint_tensors']} checkpoint tensors, {got['loaded_parameters']} vLLM parameters loaded of "
        f"{got['model_parameters']}; unexpected {got['unexpected']}, not from the checkpoint {got['missing']}; method {got['method']}, "
        f"dflash_config {got['dflash_config']}"
    )
    print(
        f"blocks compared: {len(anchors)} x {drafts.shape[1]} drafts, identical {int((drafts == expected).sum())}/{drafts.numel()}, "
        f"max |selector score difference| {score_diff:.2e}"
    )
    # Not in the checkpoint: the target's embedding and head (shared in serving) and vLLM's unused mask_embedding
    # placeholder (MASK slots embed through the vocabulary row mask_token_id).
    assert got["unexpected"] == [] and got["missing"] == ["lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"]
    assert got["architectures"] == ["DFlash2DraftModel"] and got["method"] == "dflash"  # vLLM runs DFlash2 in its DFlash runtime
    assert {
        k: got["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "sample_from_anchor")
    } == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8, "sample_from_anchor": False}
    assert got["causal"] == [False, False] and got["num_speculative_tokens"] == 3
    assert got["conv_torch_calls"] > 0  # vLLM's own torch convolution path ran (4 per layer and block)
    assert torch.equal(drafts, expected), (drafts, expected)
    assert score_diff < 1e-3
