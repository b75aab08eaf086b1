"""``specdraft prepare``: formats, loss masks from render boundaries, filtering, errors, regeneration."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from specdraft.data import regenerate as regenerate_module
from specdraft.data.dataset import PreparedDataset
from specdraft.data.prepare import PrepareConfig, prepare
from specdraft.data.sources import iter_json_values, iter_rows
from specdraft.errors import SpecdraftError

SYSTEM = "You are terse."
EXCHANGES = [("Hi there, who are you?", "I am a small model."), ("What is 2+2?", "It is 4.\nAnything else?")]

SHAREGPT_ROW = {
    "id": "sg1",
    "conversations": [{"from": "system", "value": SYSTEM}]
    + [turn for q, a in EXCHANGES for turn in ({"from": "human", "value": q}, {"from": "gpt", "value": a})],
}
OPENAI_ROW = {
    "id": "oa1",
    "messages": [{"role": "system", "content": SYSTEM}]
    + [turn for q, a in EXCHANGES for turn in ({"role": "user", "content": q}, {"role": "assistant", "content": a})],
}
TOKENIZED_ROW = {"id": "tk1", "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0]}


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _masked_runs(tokenizer, ids, mask) -> list[str]:
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r) for r in runs]


def _prepare(tmp_path, target_dir, rows, **overrides) -> tuple[dict, PreparedDataset]:
    """``prepare`` with the HF engine unless told otherwise (``auto`` would time a vLLM server start where .venv-vllm exists)."""
    overrides = {"engine": "hf", **overrides}
    config = PrepareConfig(out=str(tmp_path / "out"), target=str(target_dir), data=_jsonl(tmp_path / "in.jsonl", rows), **overrides)
    summary = prepare(config, progress=False)
    return summary, PreparedDataset(config.out)


def test_loss_mask_covers_exactly_assistant_replies(tmp_path, tiny_target, tiny_llama_dir):
    summary, ds = _prepare(tmp_path, tiny_llama_dir, [SHAREGPT_ROW, OPENAI_ROW])
    assert summary["formats"] == {"openai": 1, "sharegpt": 1} and summary["kept"] == 2
    tok = tiny_target.tokenizer
    eot = tok.eos_token
    assert eot == "<|im_end|>"
    for item in ds:
        assert _masked_runs(tok, item["input_ids"], item["loss_mask"]) == [a + eot for _, a in EXCHANGES]
        text = tok.decode(item["input_ids"].tolist())
        assert SYSTEM in text and all(q in text for q, _ in EXCHANGES)
    assert ds[0]["input_ids"].tolist() == ds[1]["input_ids"].tolist()  # both formats render identically
    assert [ds[0]["source"], ds[1]["source"]] == ["in.jsonl:sharegpt", "in.jsonl:openai"]
    ds.check_target(tiny_target)
    counts = ds.token_counts()
    assert int(counts.sum()) == int(sum(item["loss_mask"].sum() for item in ds))


def test_leading_assistant_fragment_is_dropped(tmp_path, tiny_target, tiny_llama_dir):
    row = {"conversations": [{"from": "gpt", "value": "orphan reply"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    _, ds = _prepare(tmp_path, tiny_llama_dir, [row])
    item = ds[0]
    assert "orphan" not in tiny_target.tokenizer.decode(item["input_ids"].tolist())
    assert _masked_runs(tiny_target.tokenizer, item["input_ids"], item["loss_mask"]) == ["A<|im_end|>"]


@pytest.mark.parametrize("regenerate", [False, True])
def test_pretokenized_rows_pass_through(tmp_path, tiny_llama_dir, regenerate):
    _, ds = _prepare(tmp_path, tiny_llama_dir, [TOKENIZED_ROW], regenerate=regenerate, max_new_tokens=2)
    assert ds[0]["sample_id"] == "tk1"
    assert ds[0]["input_ids"].tolist() == TOKENIZED_ROW["input_ids"]
    assert ds[0]["loss_mask"].tolist() == [bool(m) for m in TOKENIZED_ROW["loss_mask"]]


def test_skips_are_counted_and_max_samples(tmp_path, tiny_llama_dir):
    no_reply = {"messages": [{"role": "user", "content": "anyone?"}]}
    long_row = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    rows = [no_reply, long_row, SHAREGPT_ROW, OPENAI_ROW, OPENAI_ROW]
    summary, ds = _prepare(tmp_path, tiny_llama_dir, rows, max_length=128, max_samples=2)
    assert summary["skipped"] == {"no_assistant": 1, "too_long": 1}
    assert summary["read"] == 4 and summary["kept"] == 2 and len(ds) == 2  # the fifth row is never read
    assert ds.manifest["stats"] == summary and ds.manifest["config"]["max_length"] == 128


def test_nothing_left_is_an_error(tmp_path, tiny_llama_dir):
    with pytest.raises(SpecdraftError, match="no samples left.*no_assistant=1.*too_long=1"):
        _prepare(tmp_path, tiny_llama_dir, [{"messages": [{"role": "user", "content": "x"}]}, SHAREGPT_ROW], max_length=8)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"messages": [', "invalid JSON"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
        ({"conversations": [{"from": "human"}]}, "needs 'from' and 'value'"),
        ({"text": "plain"}, "unrecognised row"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "equally long"),
        ({"input_ids": [10**7], "loss_mask": [1]}, "outside the target's vocabulary"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, tiny_llama_dir, bad, message):
    with pytest.raises(SpecdraftError, match=rf"in\.jsonl:2: .*{message}"):
        _prepare(tmp_path, tiny_llama_dir, [SHAREGPT_ROW, bad])


def test_unknown_target_and_data(tmp_path):
    with pytest.raises(SpecdraftError, match="smollm2-135m"):
        prepare(PrepareConfig(out=str(tmp_path / "o"), target="nope", data=_jsonl(tmp_path / "in.jsonl", [SHAREGPT_ROW])))
    with pytest.raises(SpecdraftError, match="sharegpt"):
        list(iter_rows(str(tmp_path / "missing.jsonl")))
    with pytest.raises(SpecdraftError, match="--batch-size"):
        PrepareConfig(out="x", batch_size=0)


def test_json_list_files_and_truncation(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([SHAREGPT_ROW, OPENAI_ROW], indent=1))
    assert [r.fmt for r in iter_rows(str(path))] == ["sharegpt", "openai"]
    path.write_text(json.dumps([SHAREGPT_ROW, OPENAI_ROW], indent=1)[:-40])
    with pytest.raises(SpecdraftError, match=r"list\.json:\d+: invalid JSON"):
        list(iter_json_values(path))
    assert [v["id"] for v, _ in iter_json_values(path, allow_truncated_tail=True)] == ["sg1"]


def test_embedded_sharegpt_reads_lazily():
    rows = []
    for row in iter_rows("sharegpt"):
        rows.append(row)
        if len(rows) == 3:
            break
    assert [r.fmt for r in rows] == ["sharegpt"] * 3 and rows[0].sample_id == "QWJhYvA_0"
    assert rows[0].where.endswith("ShareGPT_V3_unfiltered_cleaned_split.json:2")


def test_dataset_for_other_target_is_refused(tmp_path, tiny_llama_dir, tiny_target_factory):
    from specdraft.targets import load_target

    _, ds = _prepare(tmp_path, tiny_llama_dir, [SHAREGPT_ROW])
    other = load_target(str(tiny_target_factory("llama", seed=1)))
    with pytest.raises(SpecdraftError, match="was prepared for target .*fingerprint"):
        ds.check_target(other)


def test_a_further_shard_joins_an_earlier_dataset(tmp_path, tiny_llama_dir, tiny_target_factory):
    """--skip-rows prepares the rows after an earlier dataset's; --data OLD,NEW joins them unchanged."""
    rows = _jsonl(tmp_path / "in.jsonl", _conversations(5))
    first = prepare(PrepareConfig(out=str(tmp_path / "a"), target=str(tiny_llama_dir), data=rows, max_samples=2), progress=False)
    shard = PrepareConfig(out=str(tmp_path / "b"), target=str(tiny_llama_dir), data=rows, skip_rows=first["read"])
    assert prepare(shard, progress=False)["read"] == 3
    joined = prepare(
        PrepareConfig(out=str(tmp_path / "ab"), target=str(tiny_llama_dir), data=f"{tmp_path / 'a'},{tmp_path / 'b'}"), progress=False
    )
    assert joined["formats"] == {"prepared": 5} and joined["kept"] == 5
    parts = [PreparedDataset(tmp_path / d) for d in ("a", "b", "ab")]
    assert parts[2].sample_ids == parts[0].sample_ids + parts[1].sample_ids == [f"c{i}" for i in range(5)]
    assert parts[2].rows_sha256(2) == parts[0].rows_sha256() != parts[2].rows_sha256()  # a store of "a" resumes into "ab"
    for i in range(5):
        part, j = (parts[0], i) if i < 2 else (parts[1], i - 2)
        assert parts[2][i]["input_ids"].tolist() == part[j]["input_ids"].tolist()
        assert parts[2][i]["loss_mask"].tolist() == part[j]["loss_mask"].tolist()
        assert parts[2].sources[i] == part.sources[j] == "in.jsonl:openai"

    other = str(tiny_target_factory("llama", seed=1))
    with pytest.raises(SpecdraftError, match="was prepared for target"):
        prepare(PrepareConfig(out=str(tmp_path / "x"), target=other, data=str(tmp_path / "a")), progress=False)
    with pytest.raises(SpecdraftError, match="has an empty source"):
        list(iter_rows(f"{tmp_path / 'a'},"))
    with pytest.raises(SpecdraftError, match="--skip-rows must be >= 0"):
        PrepareConfig(out="x", skip_rows=-1)


def _conversations(n: int) -> list[dict]:
    return [
        {"id": f"c{i}", "messages": [{"role": "user", "content": "count " * (i + 1)}, {"role": "assistant", "content": "x"}]}
        for i in range(n)
    ]


def test_regenerate_greedy_matches_unbatched_generation(tmp_path, tiny_target, tiny_llama_dir):
    import torch

    summary, ds = _prepare(tmp_path, tiny_llama_dir, _conversations(3), regenerate=True, max_new_tokens=5, batch_size=3)
    assert summary["regenerated"] == 3 and summary["generated_tokens"] > 0
    tok = tiny_target.tokenizer
    for i, item in enumerate(ds):
        prompt = tok.apply_chat_template([{"role": "user", "content": "count " * (i + 1)}], add_generation_prompt=True, return_dict=False)
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)]) and all(mask[len(prompt) :])
        with torch.no_grad():
            alone = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        expected = alone[0, len(prompt) :].tolist()
        if tok.eos_token_id in expected:
            expected = expected[: expected.index(tok.eos_token_id) + 1]
        assert ids[len(prompt) :] == expected


PROMPT_ONLY_ROWS = [
    {"id": "p0", "messages": [{"role": "user", "content": "Name a colour."}]},
    {
        "id": "p1",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hi."},
            {"role": "user", "content": "Still there?"},
        ],
    },
    {"id": "p2", "conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": "Count to three."}]},
]


def test_regenerate_answers_prompt_only_rows(tmp_path, tiny_target, tiny_llama_dir):
    """Rows of system/user messages and no assistant turn are prompts: --regenerate answers every message of them."""
    no_user = {"id": "s0", "messages": [{"role": "system", "content": SYSTEM}]}
    summary, ds = _prepare(tmp_path, tiny_llama_dir, PROMPT_ONLY_ROWS + [no_user], regenerate=True, max_new_tokens=3, batch_size=2)
    assert summary["kept"] == summary["regenerated"] == 3 and summary["skipped"] == {"no_user": 1}
    tok = tiny_target.tokenizer
    for row, item in zip(PROMPT_ONLY_ROWS, ds):
        messages = row.get("messages") or [
            {"role": {"human": "user"}.get(t["from"], t["from"]), "content": t["value"]} for t in row["conversations"]
        ]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        assert item["sample_id"] == row["id"] and ids[: len(prompt)] == prompt
        assert len(ids) > len(prompt) and not any(mask[: len(prompt)]) and all(mask[len(prompt) :])


def test_prompt_only_rows_without_regenerate_name_the_flag(tmp_path, tiny_llama_dir, caplog):
    with pytest.raises(SpecdraftError, match=r"no_assistant=3; .*pass --regenerate") as info:
        _prepare(tmp_path, tiny_llama_dir, PROMPT_ONLY_ROWS)
    assert "max-length" not in str(info.value)  # the old hint named the wrong fix
    (tmp_path / "mixed").mkdir()
    summary, _ = _prepare(tmp_path / "mixed", tiny_llama_dir, PROMPT_ONLY_ROWS + [OPENAI_ROW])
    assert summary["kept"] == 1 and summary["skipped"] == {"no_assistant": 3}
    assert "pass --regenerate" in caplog.text


def test_regenerate_resumes_after_a_crash(tmp_path, tiny_llama_dir, monkeypatch):
    rows = _conversations(5)
    options = dict(regenerate=True, max_new_tokens=4, batch_size=2, temperature=0.9, seed=3)
    (tmp_path / "ref").mkdir()
    reference_summary, reference = _prepare(tmp_path / "ref", tiny_llama_dir, rows, **options)
    assert reference_summary["generated_batches"] == 3

    real = regenerate_module.generate_batch
    calls = []

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a Ctrl-C / kill mid-job looks like to the loop
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate_module, "generate_batch", crash_on_second)
    (tmp_path / "run").mkdir()
    with pytest.raises(KeyboardInterrupt):
        _prepare(tmp_path / "run", tiny_llama_dir, rows, **options)
    out = tmp_path / "run" / "out"
    assert not (out / "manifest.json").exists() and not (out / "data.parquet").exists()
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["batch-000000.json"]  # the finished batch only, no temporary files

    monkeypatch.setattr(regenerate_module, "generate_batch", real)
    summary, resumed = _prepare(tmp_path / "run", tiny_llama_dir, rows, **options)
    assert summary["reused_batches"] == 1 and summary["generated_batches"] == 2
    assert len(resumed) == len(reference) == 5
    for a, b in zip(resumed, reference):
        assert a["sample_id"] == b["sample_id"]
        assert a["input_ids"].tolist() == b["input_ids"].tolist() and a["loss_mask"].tolist() == b["loss_mask"].tolist()
    assert not (out / ".work").exists()  # the finished dataset replaced the work area


def test_cli_reports_errors(tmp_path, capsys):
    from specdraft.cli.main import main

    assert main(["prepare", "--target", "no-such-target", "--out", str(tmp_path / "o")]) == 2
    assert "smollm2-135m" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_prepare_regenerate_on_embedded_target(tmp_path, smollm2_dir, capsys):
    from specdraft.cli.main import main
    from specdraft.targets import fingerprint

    out = tmp_path / "data"
    argv = [
        "prepare",
        "--data",
        "sharegpt",
        "--max-samples",
        "4",
        "--regenerate",
        "--max-new-tokens",
        "16",
        "--engine",
        "hf",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "generated_tokens_per_second" in printed and f"wrote {out}" in printed
    ds = PreparedDataset(out)
    assert len(ds) == 4 and ds.manifest["target"]["fingerprint"] == fingerprint(smollm2_dir)
    stats = ds.manifest["stats"]
    assert stats["regenerated"] == 4 and 4 <= stats["generated_tokens"] <= 64
    for item in ds:
        n = int(item["loss_mask"].sum())
        assert 1 <= n <= 16 and item["loss_mask"][-n:].all()  # the reply is the masked tail


def test_threads_option_sets_torch_threads(tmp_path, tiny_llama_dir):
    import torch

    before = torch.get_num_threads()
    try:
        _prepare(tmp_path, tiny_llama_dir, [TOKENIZED_ROW], threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SpecdraftError, match="--threads"):
        PrepareConfig(out="x", threads=-1)


def test_regeneration_engine_option_is_validated():
    from specdraft.cli.main import build_parser
    from specdraft.utils.config import dataclass_from_args

    args = build_parser().parse_args(["prepare", "--out", "o", "--regenerate", "--engine", "vllm", "--vllm-args=--enforce-eager"])
    config = dataclass_from_args(PrepareConfig, args)
    assert (config.engine, config.vllm_args) == ("vllm", "--enforce-eager")
    assert regenerate_module.REGENERATION_ENGINES.names() == ["hf", "vllm"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prepare", "--out", "o", "--regenerate", "--engine", "onnx"])
    with pytest.raises(SpecdraftError, match="unknown regeneration engine 'onnx'; choose one of: hf, vllm"):
        PrepareConfig(out="o", regenerate=True, engine="onnx")
    with pytest.raises(SpecdraftError, match="only apply with --regenerate"):
        PrepareConfig(out="o", engine="vllm")
    with pytest.raises(SpecdraftError, match="need --engine vllm or auto"):
        PrepareConfig(out="o", regenerate=True, engine="hf", vllm_args="--enforce-eager")
    assert PrepareConfig(out="o").engine == "auto" and PrepareConfig(out="o", regenerate=True, vllm_args="--enforce-eager").engine == "auto"


def test_engine_is_part_of_the_work_key_and_a_finished_run_starts_no_engine(tmp_path):
    from specdraft.data.regenerate import EngineRequest, GenerationSettings, regenerate, work_key

    prompts = [("a", [1, 2, 3]), ("b", [4, 5])]
    hf, vllm = (GenerationSettings(8, 0.0, 1, 0, engine) for engine in ("hf", "vllm"))
    assert work_key("f", prompts, hf) != work_key("f", prompts, vllm)
    # Every batch is on disk (length-sorted: "b" first), so the vLLM server -- whose python does not exist -- is never started.
    for index, (sample_id, reply) in enumerate([("b", [9, 2]), ("a", [7])]):
        (tmp_path / f"batch-{index:06d}.json").write_text(json.dumps({"sample_ids": [sample_id], "completions": [reply]}))
    target = types.SimpleNamespace(vocab_size=10)  # all a finished run reads of it: the range its stored ids must be in
    request = EngineRequest(target=target, pad_id=0, eos_ids=frozenset({2}), settings=vllm, vllm_python=str(tmp_path / "no-python"))
    completions, stats = regenerate(request, prompts, work_dir=tmp_path, progress=False)
    assert completions == {"a": [7], "b": [9, 2]} and (stats.reused_batches, stats.generated_batches) == (2, 0)


def test_vllm_answers_are_cut_at_the_first_end_of_turn():
    from specdraft.data.regenerate import GenerationSettings
    from specdraft.integrations.vllm.generate import completion_ids, request_body, server_args

    body = request_body(GenerationSettings(16, 0.7, 4, 3), {2, 0}, seed=5)
    assert (body["temperature"], body["seed"], body["stop_token_ids"], body["return_token_ids"]) == (0.7, 5, [0, 2], True)
    assert completion_ids({"choices": [{"token_ids": [5, 6, 2, 7]}]}, {2}, url="u") == [5, 6, 2]
    assert completion_ids({"choices": [{"token_ids": [5, 6]}]}, {2}, url="u") == [5, 6]  # cut by max_tokens: no end of turn
    with pytest.raises(SpecdraftError, match="returned no token_ids"):
        completion_ids({"choices": [{"text": "hi"}]}, {2}, url="u")
    args = server_args(dtype="float32", max_model_len=300, max_num_seqs=4, extra="--dtype bfloat16")
    assert args[args.index("--generation-config") + 1] == "vllm" and args[-2:] == ["--dtype", "bfloat16"]  # the user's flags come last


def test_select_samples_gives_the_ids_sources_and_prompts_of_a_regenerated_dataset_without_generating(
    tmp_path, tiny_target, tiny_llama_dir, monkeypatch
):
    """What split_leak.py rebuilds a regenerated dataset's split keys from: the rows prepare keeps, before any reply."""

    from specdraft.data.prepare import select_samples
    from specdraft.hidden_states.source import PreparedRows
    from specdraft.train.split import sample_key, sample_keys

    rows = [SHAREGPT_ROW, {**SHAREGPT_ROW, "id": "sg1_1"}, OPENAI_ROW, *PROMPT_ONLY_ROWS]
    summary, ds = _prepare(tmp_path, tiny_llama_dir, rows, regenerate=True, max_new_tokens=3, batch_size=2, max_samples=5)

    def no_generation(*args, **kwargs):
        raise AssertionError("select_samples generated a reply")

    monkeypatch.setattr(regenerate_module, "generate_batch", no_generation)
    config = PrepareConfig(out="-", target=str(tiny_llama_dir), data=str(tmp_path / "in.jsonl"), regenerate=True, max_samples=5)
    selection = select_samples(config, tiny_target)
    assert selection.stats["read"] == summary["read"] == 5 and [i for i, _ in selection.prompts] == list(range(5))
    assert [s.sample_id for s in selection.samples] == list(ds.sample_ids)
    rebuilt = [sample_key(s.sample_id, s.source, s.input_ids, s.loss_mask) for s in selection.samples]
    assert rebuilt == sample_keys(PreparedRows(ds))
    assert rebuilt[0].group == rebuilt[1].group == "sg1" and rebuilt[0].prompt == rebuilt[1].prompt
