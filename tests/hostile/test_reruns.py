"""A rerun replaces a run directory's outputs whole; a resume refuses settings that would mix samples (issue 37).

Each case is a reproduction from the issue's sweep that failed before its fix: a rerun of ``eval --out E``
without plots kept the old PNGs beside the new report; ``eval --drafters W/a/final,W/b/final`` was refused as
"the same drafter twice"; ``extract --target-dtype bfloat16`` resumed an fp32 store and mixed its samples; a
truncated or mistyped ``quickstart.json`` was a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.cli.main import main
from specdraft.decode.config import SamplingConfig
from specdraft.errors import SpecdraftError
from specdraft.eval.config import EvalConfig
from specdraft.eval.runner import run_eval
from test_extract_cli import write_chat_dataset


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": t, "domain": "d"}) + "\n" for t in texts))
    return path


# ----- eval: the report directory is replaced whole ------------------------------------------------


def test_an_eval_rerun_without_plots_or_with_other_prompts_leaves_no_stale_file(tmp_path, tiny_target):
    out = tmp_path / "eval"
    config = EvalConfig(
        out=str(out),
        prompts=str(_prompts(tmp_path / "p.jsonl", ["Say hi.", "Count: one two three one two three"])),
        drafters=["ngram"],
        max_new_tokens=4,
        threads=1,
        forward_path="eager",
    )
    run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    assert (out / "tau_vs_context.png").is_file()  # two prompt lengths
    single = dataclasses.replace(config, prompts=str(_prompts(tmp_path / "one.jsonl", ["Say hi."])))
    run_eval(single, SamplingConfig(), target=tiny_target, progress=False)
    assert not (out / "tau_vs_context.png").exists() and (out / "tau_per_domain.png").is_file()
    run_eval(dataclasses.replace(single, plots=False), SamplingConfig(), target=tiny_target, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["provenance.json", "report.json", "report.md"]  # no plot of an earlier run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "one.jsonl", "p.jsonl"]  # no temporary directory left


def test_a_parity_rerun_replaces_its_directory_whole(tmp_path, monkeypatch):
    """``eval --parity`` builds every side's report in a fresh directory: a rerun with one drafter of two drops
    ``builtin-1/`` and ``served-1/``, and its ``provenance.json`` names the drafters it compared now (by their config's
    digest) and the machine choices of each built-in side. The sides are stubbed: what is checked is where they are
    written and what the parity run records."""
    from specdraft.integrations.vllm import parity

    drafters = []
    for name in ("a", "b"):
        (tmp_path / name / "final").mkdir(parents=True)
        (tmp_path / name / "final" / "config.json").write_text(json.dumps({"speculators_model_type": "dspark"}))
        drafters.append(str(tmp_path / name / "final"))

    def side(config, *args, **kwargs):
        report = {
            "format": "specdraft.eval_report",
            "prompts": [],
            "runs": [{"drafter": "x", "overall": {}}],
            "threads": 2,
            "threads_source": "measured",
            "threads_seconds": {"2": 0.5},
        }
        Path(config.out).mkdir(parents=True, exist_ok=True)
        (Path(config.out) / "report.json").write_text(json.dumps(report))
        return report

    monkeypatch.setattr(parity, "read_drafter_info", lambda path: type("Info", (), {"num_speculative_tokens": 4}))
    monkeypatch.setattr("specdraft.eval.runner.run_eval", side)
    monkeypatch.setattr(parity, "run_endpoint_eval", side)
    monkeypatch.setattr(parity, "compare_sides", lambda builtin, served, path: {"drafter": "x", "path": path, "gap": 0.0, "flagged": False})
    monkeypatch.setattr(parity, "render_parity", lambda report: "")
    monkeypatch.setattr(parity, "drafter_server", lambda config: contextlib.nullcontext(type("Server", (), {"url": "http://x"})))
    out, target = tmp_path / "parity", type("Target", (), {"tokenizer": None, "describe": lambda self: {"name": "tiny"}})()
    config = EvalConfig(out=str(out), drafters=drafters, parity=True)
    report = parity.run_parity_eval(config, target=target)
    assert sorted(p.name for p in out.iterdir()) == [
        "builtin-0",
        "builtin-1",
        "parity.json",
        "parity.md",
        "provenance.json",
        "served-0",
        "served-1",
    ]
    parity.run_parity_eval(dataclasses.replace(config, drafters=drafters[:1]), target=target)
    assert sorted(p.name for p in out.iterdir()) == ["builtin-0", "parity.json", "parity.md", "provenance.json", "served-0"]
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["config"]["eval"]["parity"] is True and provenance["target"] == {"name": "tiny"}
    config_digest = hashlib.sha256(Path(drafters[0], "config.json").read_bytes()).hexdigest()
    assert provenance["inputs"] == [{"path": drafters[0], "manifest": "config.json", "sha256": config_digest}]
    assert provenance["measured"] == {"builtin-0": {"threads": {"value": 2, "source": "measured", "seconds": {"2": 0.5}}}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "parity"]
    # the parity table names the drafters as eval does: apart, though their directories share a name
    assert [r["drafter"] for r in report["drafters"]] == ["dspark:a/final@full", "dspark:b/final@full"]


# ----- eval: drafters with equal names get distinct labels ------------------------------------------


def _save_drafter(directory: Path, target) -> Path:
    from specdraft.models import METHODS

    spec = METHODS.get("dspark")
    torch.manual_seed(0)
    drafter = spec.build(spec.config_cls(block_size=4, num_layers=1, markov_rank=16), target, counts=torch.arange(target.vocab_size))
    drafter.save_pretrained(directory)
    return directory


def test_drafters_with_equal_directory_names_are_told_apart(tmp_path, tiny_target):
    a = _save_drafter(tmp_path / "W" / "a" / "final", tiny_target)
    b = tmp_path / "W" / "b" / "final"
    shutil.copytree(a, b)
    config = EvalConfig(
        out=str(tmp_path / "eval"),
        prompts=str(_prompts(tmp_path / "p.jsonl", ["Say hi."])),
        drafters=[str(a), str(b)],
        max_new_tokens=4,
        threads=1,
        forward_path="eager",
        draft_dtype="fp32",
        plots=False,
    )
    report = run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    assert [r["drafter"] for r in report["runs"]] == ["autoregressive", "dspark:a/final", "dspark:b/final"]
    assert report["drafters"]["dspark:b/final"]["drafter_path"] == str(b)


def test_drafter_labels_given_derived_and_refused(tmp_path):
    from specdraft.eval.runner import resolve_drafters

    def labels(*items: str) -> list[str]:
        return [s.label for s in resolve_drafters(list(items), num_draft_tokens=4, max_new_tokens=8, seed=0)]

    paths = {}
    for rel in ("W/a/final", "W/b/final", "V/a/final", "V/c/best"):
        paths[rel] = tmp_path / rel
        paths[rel].mkdir(parents=True)
        (paths[rel] / "config.json").write_text(json.dumps({"speculators_model_type": "dspark"}))
    a, b, va, best = (str(paths[k]) for k in ("W/a/final", "W/b/final", "V/a/final", "V/c/best"))
    # the shortest distinguishing suffix, per clash; distinct names stay METHOD:DIRNAME
    assert labels(a, b, va, best) == ["dspark:W/a/final", "dspark:b/final", "dspark:V/a/final", "dspark:best"]
    assert labels(a, f"{a}@scheduled", f"{a}+ngram", "ngram") == ["dspark:final", "dspark:final@scheduled", "dspark+ngram:final", "ngram"]
    assert labels(f"mine={a}", f"theirs={b}@scheduled", "lookup=ngram") == ["mine", "theirs", "lookup"]
    assert labels(f"dspark:final={best}", a) == ["dspark:final", "dspark:a/final"]  # an unlabelled one steps aside
    (tmp_path / "lr=3").mkdir()
    shutil.copytree(paths["V/c/best"], tmp_path / "lr=3" / "best")
    assert labels(str(tmp_path / "lr=3" / "best")) == ["dspark:best"]  # '=' in a directory name is no label
    (tmp_path / "alias").symlink_to(tmp_path / "W" / "a")
    for items in ([a, a], [a, str(tmp_path / "alias" / "final")], [f"x={a}", f"y={a}"], ["ngram", "n=ngram"]):
        with pytest.raises(SpecdraftError, match="names the same drafter twice"):
            labels(*items)
    with pytest.raises(SpecdraftError, match=r"'x=.*b/final' is labelled 'x', as is 'x=.*a/final'; give it another label"):
        labels(f"x={a}", f"x={b}")
    with pytest.raises(SpecdraftError, match="labelled 'autoregressive', as is the baseline"):
        labels(f"autoregressive={a}")
    with pytest.raises(SpecdraftError, match="LABEL=DRAFTER, both non-empty"):
        labels("=ngram")


# ----- a resume refuses settings that would mix samples --------------------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_extract_resume_in_another_target_dtype_is_refused_naming_it(tiny_target, tmp_path, capsys):
    data = write_chat_dataset(tmp_path / "data", tiny_target, [f"question {i}: what is {i} plus {i}?" for i in range(4)])
    store = tmp_path / "hs"
    argv = ["extract", "--dataset", str(data), "--out", str(store), "--method", "dspark", "--dtype", "float32"]
    assert main([*argv, "--max-samples", "2"]) == 0  # interrupted, in effect: 2 of 4 samples stored, target in fp32
    capsys.readouterr()
    before = _tree(store)
    assert main([*argv, "--target-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert f"{store} holds hidden states of target" in err and "target dtype 'float32' != 'bfloat16'" in err
    assert "resuming would mix samples of both" in err and "add --restart to delete the stored samples" in err
    assert _tree(store) == before  # nothing extracted in bf16 beside the fp32 samples, manifest unchanged
    assert main([*argv, "--target-dtype", "bfloat16", "--restart"]) == 0
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["config"]["target_dtype"] == "bfloat16" and manifest["count"] == 4 and manifest["complete"]


def test_a_training_resume_on_hidden_states_made_otherwise_is_refused_naming_the_setting(tmp_path):
    from specdraft.train.trainer import train
    from test_train_toy import ToyStore, ToyTarget, toy_config

    def store(target_dtype: str) -> ToyStore:
        source = ToyStore()
        source.made_with = {"dtype": "bfloat16", "target_dtype": target_dtype}
        return source

    out = tmp_path / "run"
    train(toy_config(out, max_steps=4), target=ToyTarget(), dataset=store("float32"))
    before = _tree(out)
    with pytest.raises(
        SpecdraftError,
        match=r"the run's hidden_states changed \(hidden_states.target_dtype: checkpoint has \"float32\", "
        r"now \"bfloat16\"\)\. Use a new --out",
    ):
        train(toy_config(out, max_steps=8), target=ToyTarget(), dataset=store("bfloat16"))
    with pytest.raises(SpecdraftError, match=r"model_config changed \(model_config.hidden: checkpoint has 16, now 32\)"):
        train(toy_config(out, max_steps=8, model={"hidden": 32}), target=ToyTarget(), dataset=store("float32"))
    assert _tree(out) == before
    assert train(toy_config(out, max_steps=8), target=ToyTarget(), dataset=store("float32")).step == 8  # the same settings resume


def test_a_training_resume_with_another_optimizer_is_refused_before_any_step(tmp_path):
    """A resume with another --optimizer only warned, then loaded AdamW's state into Muon (KeyError in
    set_optimizer_state_dict); now refused up front naming the setting, the run directory untouched."""
    from specdraft.train.trainer import train
    from test_train_toy import ToyStore, ToyTarget, toy_config

    out = tmp_path / "run"
    train(toy_config(out, max_steps=4), target=ToyTarget(), dataset=ToyStore())
    before = _tree(out)
    with pytest.raises(
        SpecdraftError,
        match=r"step-4: its optimizer state was written under --optimizer adamw, and cannot be loaded "
        r"under --optimizer muon; resume with --optimizer adamw, or train with muon into a new --out",
    ):
        train(toy_config(out, max_steps=8, optimizer="muon"), target=ToyTarget(), dataset=ToyStore())
    assert _tree(out) == before
    assert train(toy_config(out, max_steps=8), target=ToyTarget(), dataset=ToyStore()).step == 8


# ----- the quickstart journal is verified on read ---------------------------------------------------


def _journal(path: Path):
    from specdraft.quickstart import QuickstartConfig
    from specdraft.quickstart.journal import Journal

    return Journal(path, QuickstartConfig(out=str(path.parent)))


@pytest.mark.parametrize(
    "content, problem",
    [
        ('{"stages": {"prepare": {"status": "done", "seconds": 1', "not valid JSON"),  # truncated
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"stages": {"prepare": "done"}}', "stage 'prepare' is \"done\", not an object"),
        ('{"stages": ["prepare"]}', "'stages' is a list, not an object"),
        ('{"stages": {"prepare": {"status": "done", "seconds": 1.0, "kept": 6}}}', "stage 'prepare' does not match the sha256 it records"),
    ],
)
def test_a_bad_quickstart_journal_is_one_warning_and_its_stages_are_redone(tmp_path, caplog, content, problem):
    path = tmp_path / "quickstart.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        journal = _journal(path)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"{path}: ") and problem in warning and "redoes the stage(s) it cannot vouch for" in warning
    ran = []
    assert journal.run("prepare", lambda: ran.append("prepare") or {"kept": 6})["kept"] == 6
    assert ran == ["prepare"]
    caplog.clear()
    assert _journal(path).state["stages"]["prepare"]["kept"] == 6 and not caplog.records  # rewritten whole, and verified


def test_a_redone_stage_redoes_every_later_one(tmp_path, capsys):
    """A tampered ``train`` entry: train is redone (it resumes from its checkpoints and rewrites ``final/``), so the
    calibration of the old ``final/`` must be redone too; the stages before it are not."""
    path = tmp_path / "quickstart.json"
    journal = _journal(path)
    for name in ("prepare", "extract", "train", "calibrate"):
        journal.run(name, lambda: {"steps": 5})
    state = json.loads(path.read_text())
    state["stages"]["train"]["steps"] = 500
    path.write_text(json.dumps(state))
    capsys.readouterr()
    journal, ran = _journal(path), []
    for name in ("prepare", "extract", "train", "calibrate"):
        journal.run(name, lambda name=name: ran.append(name) or {"steps": 5})
    assert ran == ["train", "calibrate"]
    assert "[quickstart] calibrate ... (again: an earlier stage was redone)" in capsys.readouterr().out


def test_a_finished_data_stage_is_reused_when_the_journal_lost_it(tiny_target, tmp_path):
    from specdraft.data.dataset import write_prepared
    from specdraft.quickstart.data import prepared_earlier

    rows = [{"sample_id": "a", "source": "t", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]
    data = write_prepared(
        tmp_path / "data",
        rows,
        target_info=tiny_target.describe(),
        config={},
        stats={"kept": 1, "tokens": 3},
        vocab_size=tiny_target.vocab_size,
    )
    assert prepared_earlier(data, tiny_target) == {"kept": 1, "tokens": 3}
    assert prepared_earlier(tmp_path / "missing", tiny_target) is None
    assert prepared_earlier(data, dataclasses.replace(tiny_target, fingerprint="0" * 16)) is None  # another target's: prepared again
