"""Long documents as training prompts (``data/long_documents.py``): disjoint from the long-context eval suite's,
and prepared into long samples with their length distribution reported."""

from __future__ import annotations

import itertools
import re

import pytest

from specdraft.data.dataset import PreparedDataset
from specdraft.data.long_documents import TRAIN_MAX_CHARS, TRAIN_MIN_CHARS, document_side, documents
from specdraft.data.prepare import PrepareConfig, format_summary, length_distribution, prepare
from specdraft.data.sources import iter_rows
from specdraft.errors import SpecdraftError


def _module(name: str) -> str:
    return name.removesuffix(".py")


def test_documents_split_by_module_into_disjoint_sides():
    for domain in ("stdlib-code", "stdlib-docs"):
        train = {name for name, _ in documents(domain, "train")}
        held = {name for name, _ in documents(domain, "held-out")}
        assert train and held and not train & held
        assert {document_side(_module(n)) for n in train} == {"train"} and {document_side(_module(n)) for n in held} == {"held-out"}
        assert 0.4 < len(held) / (len(train) + len(held)) < 0.6
    # a module's docstrings fall on the side of its source
    code = {_module(n) for n, _ in documents("stdlib-code", "train")}
    assert {n for n, _ in documents("stdlib-docs", "train")} <= code
    assert documents("specdraft-source", "train") == [] and documents("specdraft-source", "held-out")


def test_training_source_yields_prompts_of_training_side_documents_only():
    rows = list(itertools.islice(iter_rows("long-documents"), 40))
    assert [r.sample_id.split(":")[0] for r in rows[:4]] == ["stdlib-code", "stdlib-docs"] * 2  # the domains alternate
    for row in rows:
        assert row.fmt == "openai" and row.source == "long-documents:openai"
        assert [m["role"] for m in row.messages] == ["user"]  # a prompt: --regenerate answers it
        assert document_side(_module(row.sample_id.split(":", 1)[1])) == "train"
        assert TRAIN_MIN_CHARS - 1000 < len(row.messages[0]["content"]) < TRAIN_MAX_CHARS + 1000
    assert [r.sample_id for r in itertools.islice(iter_rows("long-documents"), 40)] == [r.sample_id for r in rows]


def test_long_context_suite_reads_held_out_documents_only(smollm2_dir):
    from specdraft.eval.suites import long_context

    prompts = long_context(lengths=(512, 2048), per_length=3, domains=("stdlib-code",))
    names = [re.match(r"Here is the start of `([^`]+)`", p.messages[0]["content"]).group(1) for p in prompts]
    assert len(names) == 6 and {document_side(_module(n)) for n in names} == {"held-out"}


def test_length_distribution_quantiles_and_buckets():
    lengths = [300, 600, 1000, 1500, 3000, 5000, 7000, 8000, 200, 2048]
    got = length_distribution(lengths)
    assert (got["min"], got["median"], got["max"]) == (200, 2048, 8000)
    assert got["buckets"] == {"<=256": 1, "<=512": 1, "<=1024": 2, "<=2048": 2, "<=4096": 1, "<=8192": 3}
    assert list(got["buckets"]) == sorted(got["buckets"], key=lambda k: int(k[2:]))


def test_prepare_regenerates_long_documents_into_long_samples(tmp_path, tiny_llama_dir):
    config = PrepareConfig(
        out=str(tmp_path / "out"),
        target=str(tiny_llama_dir),
        data="long-documents",
        regenerate=True,
        max_samples=2,
        max_length=8192,
        max_new_tokens=2,
        engine="hf",
        batch_size=1,
    )
    summary = prepare(config, progress=False)
    dataset = PreparedDataset(config.out)
    lengths = sorted(len(dataset[i]["input_ids"]) for i in range(len(dataset)))
    assert summary["kept"] == 2 and lengths[0] > 700
    assert summary["lengths"]["max"] == lengths[-1] and sum(summary["lengths"]["buckets"].values()) == 2
    for i in range(len(dataset)):
        mask = dataset[i]["loss_mask"].tolist()
        assert 1 <= sum(mask) <= 2 and mask[-sum(mask) :] == [1] * sum(mask)  # the loss is on the target's reply only
    assert "length buckets" in format_summary(summary)
    with pytest.raises(SpecdraftError, match="--regenerate"):  # prompts only: without regeneration nothing is left
        prepare(
            PrepareConfig(
                out=str(tmp_path / "bare"), target=str(tiny_llama_dir), data="long-documents", max_samples=2, max_length=8192, engine="hf"
            ),
            progress=False,
        )
