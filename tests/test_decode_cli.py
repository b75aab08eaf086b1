"""``specdraft generate`` end to end on a tiny random target (with the embedded tokenizer)."""

from __future__ import annotations

import json

from specdraft.cli.main import main


def test_generate_cli_writes_metrics(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n\nCount to three, then count to three again.\n")
    out = tmp_path / "metrics.json"
    rc = main(
        [
            "generate",
            "--target",
            str(tiny_llama_dir),
            "--prompts-file",
            str(prompts),
            "--batch-size",
            "2",
            "--drafter",
            "ngram",
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
            "--metrics-out",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["metrics"]["requests"] == 2 and report["metrics"]["output_tokens"] == 12
    assert [o["prompt"] for o in report["outputs"]] == ["Say hello.", "Count to three, then count to three again."]
    assert report["decode"]["drafter"] == "ngram" and report["target"]["fingerprint"]
    assert "tau=" in capsys.readouterr().out


def test_generate_cli_errors(tiny_llama_dir, capsys):
    assert main(["generate", "--target", str(tiny_llama_dir)]) == 2
    assert "--prompt TEXT or --prompts-file" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_llama_dir), "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be 0 (greedy) or at least 0.001, got -1" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_llama_dir), "--prompt", "hi", "--drafter", "none", "--verify-policy", "scheduled"]) == 2
    assert "confidence" in capsys.readouterr().err
