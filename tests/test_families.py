"""Every supported target family end to end, on a tiny random model of its own HF config class.

Per family (``conftest.TINY_FAMILIES``: Llama, Qwen3, Qwen3-MoE, Gemma 3, Mistral, DeepSeek-V3 (MLA + MoE),
GLM-4.5 (MoE, partial RoPE), gpt-oss (sinks, alternating windows, MoE), Gemma 4, and the linear-attention hybrids
Qwen3-Next, Qwen3.5, Qwen3.5-MoE and Kimi-Linear (recurrent states rolled back per row), GLM-5's sparse attention
(an indexer that keeps 4 of the cache's columns per query); hidden 64, heads of 32):
prepare -> extract (stored states == HF ``output_hidden_states`` at the declared layers, the last layer
included) -> train a DFlash drafter a few steps (and DSpark, EAGLE-3) -> decode greedy exact (batched, with the
trained drafter, and with drafts rejected at random positions) and sampled exact
(chi-square against the enumerated target distribution) -> the checkpoint loads in speculators 0.9.0
(``.venv-interop``) and, for the families vLLM serves drafters for, in vLLM 0.32's loader on CPU
(``EngineArgs(...).create_engine_config()`` + ``get_model()`` for target and drafter, ``.venv-vllm``).

Gemma 3, Gemma 4, gpt-oss and Mistral get windows (8) far shorter than prompt + output. The Gemma 3 target also gets a
Gemma-style chat template (``<start_of_turn>``/``<end_of_turn>``, no system role, roles must alternate)
so its run covers the template quirks: the system message is folded into the first user turn, a
non-alternating row is skipped and counted, and turns end at ``<end_of_turn>``, not the tokenizer's EOS.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import GATED_DELTA, KIMI, MLA, MOE, QWEN_MOE, TINY_FAMILIES, build_tiny_target_dir
from specdraft.errors import SpecdraftError

ROOT = Path(__file__).resolve().parents[1]
INTEROP_PYTHON = Path(os.environ.get("SPECDRAFT_INTEROP_PYTHON", ROOT / ".venv-interop/bin/python"))
VLLM_PYTHON = ROOT / ".venv-vllm/bin/python"
WINDOW = 8
EXTRA = {f: {"sliding_window": WINDOW} for f in ("gemma3", "mistral", "gpt_oss", "gemma4_text")}
#: families whose HF MoE (grouped expert matmul) has no float64 kernel: their exactness tests run in float32
FLOAT32_ONLY = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text", "kimi_linear", "glm_moe_dsa")
DFLASH = {"num_layers": 1, "block_size": 4, "max_anchors": 8, "intermediate_size": 64}
DRAFTERS = {"dflash": DFLASH, "dspark": {**DFLASH, "markov_rank": 16}, "eagle3": {"ttt_steps": 2}}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
QUESTIONS = [
    "Name three colours and say why you like them.",
    "Count from one to ten, please.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain rain to a child.",
    "List four animals that live in water.",
]
ROWS = [
    {
        "id": f"q{i}",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": q},
            {"role": "assistant", "content": f"Answer {i}: " + q.lower()},
        ],
    }
    for i, q in enumerate(QUESTIONS)
]
NOT_ALTERNATING = {
    "id": "twice",
    "messages": [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hello."}],
}


def gemma_style_tokenizer(smollm2_dir: Path, out: Path) -> Path:
    """The SmolLM2 tokenizer with Gemma's special tokens added (``<mask>`` below an unused one, as in Gemma's
    vocabulary) and a Gemma-style template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>"]})
    tok.chat_template = GEMMA_TEMPLATE
    tok.save_pretrained(out)
    return out


def varied(directory: Path) -> None:
    """Scale the random matrices x4 so greedy text varies (the default init repeats one token)."""
    from safetensors.torch import load_file, save_file

    weights = directory / "model.safetensors"
    save_file({k: (v * 4 if v.dim() == 2 else v).contiguous() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})


class FamilyRun:
    """The pipeline of one family, each stage run once and on demand (later stages need earlier ones)."""

    def __init__(self, family: str, root: Path, smollm2_dir: Path):
        self.family, self.root, self.smollm2_dir = family, root, smollm2_dir
        self._done: dict[str, object] = {}

    def stage(self, name: str):
        if name not in self._done:
            self._done[name] = getattr(self, "_" + name)()
        return self._done[name]

    def _target_dir(self) -> Path:
        tokenizer_dir = self.smollm2_dir
        if self.family == "gemma3":
            tokenizer_dir = gemma_style_tokenizer(self.smollm2_dir, self.root / "tokenizer")
        out = build_tiny_target_dir(
            self.root / "target", tokenizer_dir, family=self.family, num_layers=6, seed=1, **EXTRA.get(self.family, {})
        )
        varied(out)
        return out

    def _target(self):
        from specdraft.targets import load_target

        return load_target(str(self.stage("target_dir")))

    def _prepare(self) -> dict:
        from specdraft.data.prepare import PrepareConfig, prepare

        data = self.root / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:3], NOT_ALTERNATING, *ROWS[3:]]))
        config = PrepareConfig(out=str(self.root / "data"), target=str(self.stage("target_dir")), data=str(data))
        return prepare(config, progress=False)

    def _extract(self, method: str = "dflash") -> Path:
        from specdraft.hidden_states.config import ExtractConfig
        from specdraft.hidden_states.extract import extract_hidden_states

        self.stage("prepare")
        out = self.root / f"hs-{method}"
        extract_hidden_states(
            ExtractConfig(
                dataset=str(self.root / "data"), out=str(out), method=method, dtype="float32", target=str(self.stage("target_dir"))
            ),
            target=self.stage("target"),
            progress=False,
        )
        return out

    def _train(self, method: str = "dflash", steps: int = 3):
        from specdraft.train.config import TrainConfig
        from specdraft.train.trainer import train

        cfg = TrainConfig(
            method=method,
            data=str(self.stage("extract" if method == "dflash" else f"extract_{method}")),
            out=str(self.root / f"run-{method}"),
            model=DRAFTERS[method],
            max_steps=steps,
            pack_tokens=96,
            batch_rows=1,
            val_fraction=0.0,
            eval_interval=0,
            checkpoint_interval=0,
            keep_checkpoints=0,
            dtype="fp32",
            num_threads=1,
            seed=0,
            lr=3e-3,
        )
        return train(cfg, target=self.stage("target"))

    def _extract_dspark(self) -> Path:
        return self._extract("dspark")

    def _train_dspark(self):
        return self._train("dspark", steps=2)

    def _extract_eagle3(self) -> Path:
        return self._extract("eagle3")

    def _train_eagle3(self):
        return self._train("eagle3", steps=2)


@pytest.fixture(scope="module")
def runs(smollm2_dir, tmp_path_factory):
    return {f: FamilyRun(f, tmp_path_factory.mktemp(f"family-{f}"), smollm2_dir) for f in TINY_FAMILIES}


def _conversations_text(run: FamilyRun) -> list[str]:
    from specdraft.data.dataset import PreparedDataset

    tok = run.stage("target").tokenizer
    data = PreparedDataset(run.root / "data")
    return [tok.decode(data[i]["input_ids"]) for i in range(len(data))]


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prepare(runs, family):
    run = runs[family]
    summary = run.stage("prepare")
    target = run.stage("target")
    assert target.family.name == {"gemma3": "gemma3_text"}.get(family, family)
    if family == "gemma3":  # the Gemma-style template: folded system turn, one rejected row, <end_of_turn> ends turns
        assert summary["kept"] == len(ROWS) and summary["skipped"] == {"template_rejected": 1}
        eot = target.tokenizer.convert_tokens_to_ids("<end_of_turn>")
        assert eot in target.end_of_turn_ids and eot != target.tokenizer.eos_token_id
        assert all(t.count("Be brief.") == 1 and "<start_of_turn>user\nBe brief.\n\n" in t for t in _conversations_text(run))
    else:
        assert summary["kept"] == len(ROWS) + 1 and summary["skipped"] == {}
    from specdraft.data.dataset import PreparedDataset

    data = PreparedDataset(run.root / "data")
    for i in range(len(data)):  # the loss mask ends with the turn's end token, nothing of the template after it
        ids, mask = data[i]["input_ids"].tolist(), data[i]["loss_mask"].tolist()
        last = max(j for j, m in enumerate(mask) if m)
        assert ids[last] in target.end_of_turn_ids


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_extract_equals_hf_hidden_states(runs, family):
    from specdraft.data.dataset import PreparedDataset
    from specdraft.hidden_states.backends.file import FileBackend
    from specdraft.hidden_states.capture import HiddenStateCapture
    from specdraft.hidden_states.layers import LayerSlot

    run = runs[family]
    store = FileBackend(run.stage("extract"))
    target = run.stage("target")
    data = PreparedDataset(run.root / "data")
    for i in range(len(data)):
        payload = store.get(data[i]["sample_id"])
        slots = [LayerSlot.from_json(s) for s in payload.manifest["slots"]]
        with torch.no_grad():
            hf = target.model(data[i]["input_ids"][None], output_hidden_states=True).hidden_states
        want = torch.stack([hf[s.hf_index(target.num_layers)][0] for s in slots], dim=1)
        torch.testing.assert_close(payload.hidden_states, want, atol=1e-5, rtol=1e-5)
        # the LAST layer (speculators #705): HF's final entry is after the norm, so last_hidden (the norm's input)
        # is the output of layer L-1, and the norm of it is HF's hidden_states[L]
        assert len(hf) == target.num_layers + 1
        final = target.family.decoder_parts(target.model).norm
        with torch.no_grad():
            torch.testing.assert_close(final(payload.last_hidden[None])[0], hf[-1][0], atol=1e-5, rtol=1e-5)
        edges = [LayerSlot(0, "input"), LayerSlot(target.num_layers - 1, "input"), LayerSlot(target.num_layers - 1, "output")]
        ((captured, _),) = HiddenStateCapture(target.model, edges)([data[i]["input_ids"]])
        torch.testing.assert_close(captured[:, :2], torch.stack([hf[0][0], hf[target.num_layers - 1][0]], dim=1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(captured[:, 2], payload.last_hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_train(runs, family):
    run = runs[family]
    result = run.stage("train")
    assert result.completed and result.step == 3 and (result.final / "model.safetensors").is_file()
    if family == "gemma3":  # the MASK slots use the token Gemma reserves for it, not the highest unused special token
        mask = json.loads((result.final / "config.json").read_text())["mask_token_id"]
        assert mask == run.stage("target").tokenizer.convert_tokens_to_ids("<mask>")


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_dspark_trains(runs, family):
    result = runs[family].stage("train_dspark")
    assert result.completed and result.step == 2 and (result.final / "model.safetensors").is_file()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_eagle3_trains(runs, family):
    result = runs[family].stage("train_eagle3")
    assert result.completed and result.step == 2 and (result.final / "model.safetensors").is_file()


@torch.no_grad()
def _greedy_reference(model, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] in stop:
            break
    return ids[len(prompt) :]


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_decoding_with_the_trained_drafter_is_exact(runs, family):
    from specdraft.decode.config import DecodeConfig
    from specdraft.decode.runtime import decoder_for_target
    from specdraft.decode.sampling import SamplingConfig

    run = runs[family]
    target, final = run.stage("target"), run.stage("train").final
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for q in QUESTIONS[:3]
    ]
    assert min(len(p) for p in prompts) > WINDOW  # every row attends past its window
    decoder = decoder_for_target(
        target, config=DecodeConfig(drafter="dflash", drafter_path=str(final), max_new_tokens=24), sampling=SamplingConfig()
    )
    result = decoder.generate(prompts)
    assert [o.tokens for o in result.outputs] == [_greedy_reference(target.model, p, 24, target.end_of_turn_ids) for p in prompts]
    assert result.metrics.drafted > 0


SLIDE = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"])
DSA_SMALL = dict(index_topk=3, index_n_heads=2, index_head_dim=32)  # fewer columns than a context: the indexer really selects
HYBRID = dict(layer_types=["linear_attention", "full_attention"])
SAMPLED_EXTRA = {
    "gemma3": dict(query_pre_attn_scalar=32, **SLIDE),
    "mistral": dict(sliding_window=3),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "deepseek_v3": dict(num_key_value_heads=2, **{**MOE, **MLA}),
    "glm4_moe": MOE,
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, **SLIDE),
    "gemma4_text": dict(hidden_size_per_layer_input=16, per_layer_config={}, **SLIDE),
    "qwen3_next": dict(**GATED_DELTA, **QWEN_MOE, **HYBRID),
    "qwen3_5_text": dict(**GATED_DELTA, **HYBRID),
    "qwen3_5_moe_text": dict(**GATED_DELTA, **QWEN_MOE, **HYBRID),
    "kimi_linear": dict(**{**KIMI, **HYBRID}, num_key_value_heads=2),
    "glm_moe_dsa": dict(num_key_value_heads=2, **{**MOE, **MLA, **DSA_SMALL}),
}


def tiny_family_model(family: str, vocab: int, seed: int):
    """``test_decode.tiny_model`` (2 layers) of ``family`` with its ``SAMPLED_EXTRA``, in float32 where float64 has no MoE kernel."""
    from test_decode import tiny_model

    per_layer_vocab = {"vocab_size_per_layer_input": vocab} if family == "gemma4_text" else {}  # Gemma 4's per-layer embeddings
    model = tiny_model(vocab=vocab, layers=2, seed=seed, family=family, **SAMPLED_EXTRA.get(family, {}), **per_layer_vocab)
    return model.float() if family in FLOAT32_ONLY else model


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_sampled_decoding_is_exact(family):
    """Rejection sampling on a vocabulary-4 model of the family's config class (window 3 where it slides)."""
    from specdraft.decode.config import DecodeConfig
    from specdraft.decode.runtime import SpeculativeDecoder
    from specdraft.decode.sampling import SamplingConfig
    from test_decode import DistributionProposer, assert_target_distribution

    model = tiny_family_model(family, vocab=4, seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
    sampling, prompt = SamplingConfig(temperature=0.8, top_k=3), [0, 1, 2, 3, 2, 1]
    proposer = DistributionProposer(torch.tensor([2.0, 0.0, 1.0, -1.0], dtype=model.dtype))
    result = SpeculativeDecoder(
        model, proposer, config=DecodeConfig(max_new_tokens=3, num_draft_tokens=2, seed=7), sampling=sampling, eos_token_ids=[]
    ).generate([prompt] * 3000)
    assert 0 < result.metrics.accepted < result.metrics.drafted
    assert_target_distribution(model, prompt, [o.tokens for o in result.outputs], sampling, vocab=4)


SPECULATORS_LOAD = r"""
import json, sys
from speculators import SpeculatorModel
out = {}
for family, path in json.load(open(sys.argv[1])).items():
    model, info = SpeculatorModel.from_pretrained(path, output_loading_info=True)
    out[family] = {"class": type(model).__name__, "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}
print("RESULT " + json.dumps(out))
"""


def _run_side(python: Path, script: str, job: dict, tmp: Path, timeout: int) -> tuple[dict, str]:
    """Run ``script`` on ``job`` in another environment: its ``RESULT {...}`` lines merged, and the output's tail
    (what a test shows when a result it needs is not there)."""
    (tmp / "side.py").write_text(script)
    (tmp / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    proc = subprocess.run(
        [str(python), str(tmp / "side.py"), str(tmp / "job.json")], capture_output=True, text=True, timeout=timeout, env=env
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            results.update(json.loads(line.removeprefix("RESULT ")))
    return results, f"exit status {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"


def _side(python: Path, script: str, job: dict, tmp: Path, timeout: int) -> dict:
    results, log = _run_side(python, script, job, tmp, timeout)
    assert results and log.startswith("exit status 0\n"), log
    return results


@pytest.fixture(scope="module")
def speculators_loaded(runs, tmp_path_factory):
    if not INTEROP_PYTHON.exists():
        pytest.skip(f"speculators environment {INTEROP_PYTHON} not built (scripts/bootstrap.sh)")
    job = {f: str(run.stage("train").final) for f, run in runs.items()}
    return _side(INTEROP_PYTHON, SPECULATORS_LOAD, job, tmp_path_factory.mktemp("speculators-load"), timeout=600)


@pytest.mark.slow
@pytest.mark.interop
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_checkpoint_loads_in_speculators(speculators_loaded, family):
    loaded = speculators_loaded[family]
    assert loaded["class"] == "DFlashDraftModel" or "DFlash" in loaded["class"]
    assert loaded["unexpected"] == [] and all(k.startswith(("embed_tokens", "verifier", "lm_head")) for k in loaded["missing"]), loaded


# One vLLM process serves both vLLM checks (each process pays vLLM's ~25 s import): first what vLLM's model
# classes claim, then every family's tiny target and trained drafter through vLLM's loader.
VLLM_SIDE = r"""
import inspect, json, re, socket, sys
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3
job = json.load(open(sys.argv[1]))
out = {}
for model_type, arch in job["claims"].items():
    cls = ModelRegistry._try_load_model_cls(arch)
    if cls is None:  # the module does not import in this build
        out[model_type] = {"eagle3": None, "convention": None}
        continue
    ours = lambda c: inspect.isclass(c) and c.__module__.startswith(("vllm.model_executor.models", "vllm.models."))
    modules = {inspect.getmodule(c) for c in cls.__mro__ if ours(c)}
    # the decoder stacks those modules use (Qwen3Model subclasses qwen2.py's Qwen2Model)
    modules |= {inspect.getmodule(b) for m in list(modules) for c in vars(m).values() if ours(c) and c.__name__.endswith("Model")
                for b in c.__mro__ if ours(b)}
    source = "".join(inspect.getsource(m) for m in modules)
    # id start_layer (0) before the first layer, id idx + 1 after layer idx: id i = HF hidden_states[i]; or, as
    # deepseek_v2.py writes it, id idx taken before layer idx runs and id end_layer after the last one
    first = r"(aux_hidden_states|\[\]), (self\.start_layer|0), (hidden_states|x), residual"
    after = r"aux_hidden_states, (layer_)?(idx|i) \+ 1, (hidden_states|x), residual"
    before_each = (r"if idx in self\.aux_hidden_state_layers:\s*aux_hidden_state = hidden_states \+ residual[\s\S]{0,600}?"
                   r"hidden_states, residual = layer\([\s\S]*?if self\.end_layer in self\.aux_hidden_state_layers:\s*"
                   r"aux_hidden_states\.append\(hidden_states \+ residual\)")
    # or, as kimi_k3's model writes it, start_layer tested and (layer_idx + 1) tested after layer layer_idx ran
    listed = (r"self\.start_layer in self\.aux_hidden_state_layers[\s\S]{0,400}?aux_hidden_states\.append\(hidden_states \+ residual\)"
              r"[\s\S]*?hidden_states, [\w, ]*residual = layer\([\s\S]{0,300}?if \(layer_idx \+ 1\) in self\.aux_hidden_state_layers:")
    convention = bool(re.search(first, source) and re.search(after, source) or re.search(before_each, source) or re.search(listed, source))
    out[model_type] = {"eagle3": bool(supports_eagle3(cls)), "convention": convention}
print("RESULT " + json.dumps({"claims": out}), flush=True)  # kept if a load below fails
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader import get_model

# what vLLM's CPU model runner does before loading: no accelerator calls on a CPU-only host
torch.accelerator.synchronize = lambda *a, **k: None
torch.accelerator.empty_cache = lambda *a, **k: None
def engine_config(paths):
    args = EngineArgs(model=paths["target"], dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=2,
                      speculative_config={"method": "dflash", "model": paths["drafter"], "num_speculative_tokens": 3})
    return args.create_engine_config()

configs = {family: engine_config(paths) for family, paths in job["load"].items()}
# one process group for all: set up under a MoE config when there is one (dense configs create no expert group)
first = next((c for c in configs.values() if c.model_config.is_moe), next(iter(configs.values())))
with set_current_vllm_config(first):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)
out = {}
for family, config in configs.items():
    with set_current_vllm_config(config):
        target = get_model(vllm_config=config)
        draft_config = config.speculative_config.draft_model_config
        drafter = get_model(vllm_config=config, model_config=draft_config)
        out[family] = {"target": type(target).__name__, "drafter": type(drafter).__name__,
                       "aux_ids": list(draft_config.hf_config.eagle_aux_hidden_state_layer_ids),
                       "mask_token_id": draft_config.hf_config.dflash_config["mask_token_id"],
                       "drafter_params": sum(p.numel() for p in drafter.parameters())}
print("RESULT " + json.dumps({"load": out}), flush=True)
refused = {}
for family, paths in job["refused"].items():  # what Family.vllm_cpu_refusal claims: this build cannot load the target
    try:
        config = engine_config(paths)
        with set_current_vllm_config(config):
            get_model(vllm_config=config)
        refused[family] = {"failed": False, "error": ""}
    except Exception as exc:
        refused[family] = {"failed": True, "error": f"{type(exc).__name__}: {exc}"[-300:]}
print("RESULT " + json.dumps({"refused": refused}))
"""


@pytest.fixture(scope="module")
def vllm_side(runs, tmp_path_factory) -> tuple[dict, str]:
    """``VLLM_SIDE``'s results ("claims", "load") and output, shared by the two vLLM tests."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from specdraft.targets.families import FAMILIES

    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM environment {VLLM_PYTHON} not built (scripts/bootstrap.sh)")
    served = {f: run for f, run in runs.items() if run.stage("target").family.vllm_aux_hidden_states}
    paths = {f: {"target": str(run.stage("target_dir")), "drafter": str(run.stage("train").final)} for f, run in served.items()}
    job = {
        "claims": {name: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name] for name in FAMILIES.names()},
        "load": {f: p for f, p in paths.items() if not served[f].stage("target").family.vllm_cpu_refusal},
        "refused": {f: p for f, p in paths.items() if served[f].stage("target").family.vllm_cpu_refusal},
    }
    return _run_side(VLLM_PYTHON, VLLM_SIDE, job, tmp_path_factory.mktemp("vllm-side"), timeout=900)


def _vllm_result(vllm_side: tuple[dict, str], part: str) -> dict:
    results, log = vllm_side
    assert part in results, log
    return results[part]


@pytest.fixture(scope="module")
def vllm_loaded(vllm_side) -> dict:
    return _vllm_result(vllm_side, "load")


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_checkpoint_loads_in_vllm(runs, vllm_side, vllm_loaded, family):
    target = runs[family].stage("target")
    if not target.family.vllm_aux_hidden_states:
        assert family not in vllm_loaded
        pytest.skip(f"vLLM 0.32 serves no drafter for {family} targets (no aux hidden states)")
    if target.family.vllm_cpu_refusal:
        refused = _vllm_result(vllm_side, "refused")[family]
        assert refused["failed"], f"{family}: vLLM-CPU loaded the target that Family.vllm_cpu_refusal says it cannot"
        pytest.skip(f"vLLM-CPU cannot load {family} targets: {target.family.vllm_cpu_refusal} (shown here); a CUDA vLLM serves them")
    loaded = vllm_loaded[family]
    written = json.loads((runs[family].stage("train").final / "config.json").read_text())
    assert loaded["drafter_params"] > 0 and loaded["target"] == target.config.architectures[0]
    # vLLM's target returns hidden_states[i] for these ids: the layers we extracted and trained on
    assert loaded["aux_ids"] == written["aux_hidden_state_layer_ids"] and loaded["mask_token_id"] == written["mask_token_id"]


@pytest.mark.slow
def test_vllm_claims_of_every_family_match_vllm(vllm_side):
    """``Family.vllm_aux_hidden_states`` against vLLM 0.32's own model classes: aux hidden states exist
    (``SupportsEagle3``) exactly where claimed, and use specdraft's layer-id convention."""
    from specdraft.targets.families import FAMILIES

    found = _vllm_result(vllm_side, "claims")
    for name in FAMILIES.names():
        claim = FAMILIES.get(name).vllm_aux_hidden_states
        if found[name]["eagle3"] is None:  # vLLM's module for it does not import in this build: say so, and why
            assert FAMILIES.get(name).vllm_cpu_refusal, f"{name}: vLLM's model class does not import here and the family does not say why"
            continue
        assert found[name]["eagle3"] == claim, name
        if claim:
            assert found[name]["convention"], f"{name}: vLLM's aux layer ids no longer mean HF hidden_states indices"


def test_unknown_family_names_what_is_missing():
    import transformers

    from specdraft.targets.families import family_of

    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2)
    with pytest.raises(
        SpecdraftError,
        match=r"GPT2Config \(model_type 'gpt2'\) is not a supported family .*decoder layers.*sliding-window.*targets/families.py",
    ):
        family_of(config)


def test_vllm_paths_refuse_families_vllm_cannot_serve(tiny_target_factory, tmp_path):
    """Before any vLLM start: `serve` of a drafter for a Gemma 3 target says why and what to use instead."""
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "eagle3",
                "speculators_config": {
                    "proposal_methods": [{"speculative_tokens": 3}],
                    "verifier": {"name_or_path": str(tiny_target_factory("gemma3"))},
                },
            }
        )
    )
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM environment {VLLM_PYTHON} not built (scripts/bootstrap.sh)")
    with pytest.raises(SpecdraftError, match=r"vLLM 0.32 cannot serve a eagle3 drafter for gemma3_text targets.*specdraft generate"):
        drafter_server(ServeConfig(drafter=str(drafter), vllm_python=str(VLLM_PYTHON)))


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "kimi_linear", "glm_moe_dsa"])
def test_a_vllm_cpu_server_refuses_a_target_it_cannot_run_before_it_starts(tiny_target_factory, family):
    """Every vLLM start (prepare's regeneration, extraction, serving) goes through ``VllmServer.start``: a hybrid
    target the vLLM-CPU build cannot load is refused there in one line, no process started (the load itself is
    shown to fail in ``test_checkpoint_loads_in_vllm``)."""
    from specdraft.integrations.vllm.engine import VllmServer

    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM environment {VLLM_PYTHON} not built (scripts/bootstrap.sh)")
    server = VllmServer(tiny_target_factory(family), python=str(VLLM_PYTHON))
    with pytest.raises(SpecdraftError, match=rf"the vLLM-CPU build cannot run {family} targets: vLLM 0.32.*--engine hf"):
        server.start()
    assert server.process is None


def test_system_turn_is_folded_only_for_families_without_one():
    from specdraft.targets.families import FAMILIES

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    assert FAMILIES.get("llama").system_folded(chat) == chat
    assert FAMILIES.get("gemma3_text").system_folded(chat) == [{"role": "user", "content": "Be brief.\n\nHi."}]


def test_extraction_refuses_zero_states_from_a_layer_that_computed_nothing(tmp_path):
    """A layer whose output the capture sees as zeros (as speculators #613's hybrid target gave its DFlash
    drafter) stops extraction with the sample, layer and side, and nothing is stored."""
    from specdraft.hidden_states.backends.file import FileBackend
    from test_extract import make_dataset, random_llama_target, run

    target = random_llama_target()
    data = make_dataset(tmp_path / "data", target)
    layer = target.model.model.layers[1]
    layer.register_forward_hook(lambda module, args, output: torch.zeros_like(output[0] if isinstance(output, tuple) else output))
    with pytest.raises(
        SpecdraftError, match=r"sample 'sharegpt/1': layer 1 output holds all zeros at token 0 \(12 of 12 rows degenerate\)"
    ):
        run(target, data, tmp_path / "hs", layers="input:0,output:1,input:3", dtype="float32", batch_size=1)
    assert FileBackend(tmp_path / "hs").keys() == []


def test_extraction_refuses_a_hybrid_target_whose_linear_layers_pass_a_zero_row_on(tmp_path):
    """The hybrid case found while adding them: HF zero-initialises the pad token's embedding, and a Qwen3.5 stack
    whose first layers are linear attention + MLP maps that zero row to zero rows until a full-attention layer mixes
    other tokens in (nothing attends across tokens before it). A DFlash drafter trained on such rows would have
    validated on them; extraction stops at the first such sample, naming sample, layer and token."""
    import transformers

    from specdraft.data.dataset import PreparedDataset
    from specdraft.hidden_states.backends.file import FileBackend
    from specdraft.targets.base import Target
    from test_extract import make_dataset, run

    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        **GATED_DELTA,
    )
    assert config.layer_types[:3] == ["linear_attention"] * 3
    model = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    target = Target(name="tiny-qwen3.5", path=Path("/nowhere"), model=model, tokenizer=None, fingerprint="q" * 16, tokenizer_hash="t" * 16)
    data = make_dataset(tmp_path / "data", target)
    pad = int(PreparedDataset(data)[0]["input_ids"][3])
    model.get_input_embeddings().weight[pad] = 0  # what HF's init gives the pad token's row (padding_idx)
    with pytest.raises(
        SpecdraftError, match=r"sample 'sharegpt/0': layer 1 output holds all zeros at token 3 .*stored nothing for this sample"
    ):
        run(target, data, tmp_path / "hs", layers="output:1,output:3", dtype="float32", batch_size=1)
    assert "sharegpt/0" not in FileBackend(tmp_path / "hs").keys()  # samples without the token were stored, intact


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_moe_verify_forward_equals_step_by_step_decoding(family):
    """HF's eager MoE routes each token on its own (top-k of its own router logits), so which other rows and
    tokens share a verify forward cannot change a routed result: the logits of a 2-row, 5-token verify forward
    over a cache equal one-token steps of each row alone."""
    from transformers import DynamicCache

    model = tiny_family_model(family, vocab=64, seed=4)
    rows = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(rows[:, :6], cache=(batched := DynamicCache()), use_cache=True)
        verify = model(rows[:, 6:], cache=batched, use_cache=True).logits
        for r in range(2):
            model(rows[r : r + 1, :6], cache=(alone := DynamicCache()), use_cache=True)
            for t in range(6, 11):
                step = model(rows[r : r + 1, t : t + 1], cache=alone, use_cache=True).logits[0, -1]
                torch.testing.assert_close(verify[r, t - 6], step, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_is_exact_with_drafts_rejected_at_varied_positions(family):
    """Three rows, half of the drafts corrupted at random positions (rejected drafts stay as holes in the cache,
    sliding windows of 3 where the family slides): every token is the uncached full forward's."""
    from test_decode import assert_exact_under_random_rejections

    assert_exact_under_random_rejections(tiny_family_model(family, vocab=64, seed=2), 16)


@pytest.mark.parametrize("family", ["qwen3_5_text", "kimi_linear"])
def test_recurrent_rollback_leaves_each_row_at_its_own_last_accepted_token(family):
    """Two rows verify 4 columns in one recorded forward and keep 1 and 3 of them: each row's recurrent state and
    convolution window then equal a run of that row alone over exactly the tokens it kept, and the next forward's
    logits agree; keeping all 4 in both rows (the state as the forward left it) does not."""
    from specdraft.decode.kv_cache import GrowingCache

    model = tiny_family_model(family, vocab=64, seed=5)
    rows = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    kept = torch.tensor([1, 3])

    def prefill(ids):
        cache = GrowingCache(model.config)
        model(ids[:, :6], cache=cache, use_cache=True)
        return cache

    with torch.no_grad():
        batched = prefill(rows)
        batched.record(4)
        model(rows[:, 6:], position_ids=torch.arange(6, 10).expand(2, -1), cache=batched, use_cache=True)
        stale = [(layer.conv_states[0][:, :, -4:].clone(), layer.recurrent_states[0].clone()) for layer in batched.recurrent]
        batched.rollback(kept, 4)
        for r in range(2):
            alone = prefill(rows[r : r + 1])
            n = int(kept[r])
            model(rows[r : r + 1, 6 : 6 + n], position_ids=torch.arange(6, 6 + n)[None], cache=alone, use_cache=True)
            for ours, theirs, (_, state) in zip(batched.recurrent, alone.recurrent, stale):
                torch.testing.assert_close(ours.conv_states[0][r], theirs.conv_states[0][0], atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(ours.recurrent_states[0][r], theirs.recurrent_states[0][0], atol=1e-6, rtol=1e-6)
                if n < 4:
                    assert not torch.allclose(state[r], theirs.recurrent_states[0][0], atol=1e-4)
