"""``prepare --regen-budget``: stop regenerating at a deadline, keep what is done, resume later."""

from __future__ import annotations

import pytest

from specdraft.data import regenerate as regenerate_module
from specdraft.data.prepare import PrepareConfig
from specdraft.errors import SpecdraftError
from test_data_prepare import _conversations, _prepare


def test_regen_budget_keeps_finished_batches_and_a_rerun_completes(tmp_path, tiny_llama_dir, monkeypatch):
    rows = _conversations(3)
    options = dict(
        regenerate=True, max_new_tokens=4, batch_size=1, threads=1, forward_path="eager"
    )  # no thread or path probe: it would count as a batch
    real = regenerate_module.generate_batch

    def stop_after_first(*args, **kwargs):
        if stop_after_first.calls:
            raise KeyboardInterrupt
        stop_after_first.calls += 1
        return real(*args, **kwargs)

    stop_after_first.calls = 0
    monkeypatch.setattr(regenerate_module, "generate_batch", stop_after_first)
    with pytest.raises(KeyboardInterrupt):  # a killed run: one batch finished
        _prepare(tmp_path, tiny_llama_dir, rows, **options)
    monkeypatch.setattr(regenerate_module, "generate_batch", real)

    # the budget is already spent when generation would start: keep the finished batch only
    summary, ds = _prepare(tmp_path, tiny_llama_dir, rows, regen_budget=1e-9, **options)
    assert summary["kept"] == summary["regenerated"] == 1 and summary["skipped"] == {"not_regenerated": 2}
    assert summary["reused_batches"] == 1 and summary["generated_batches"] == 0 and len(ds) == 1


def test_regen_budget_that_leaves_nothing_is_a_clear_error(tmp_path, tiny_llama_dir):
    with pytest.raises(SpecdraftError, match="not_regenerated=2"):
        _prepare(tmp_path, tiny_llama_dir, _conversations(2), regenerate=True, max_new_tokens=4, regen_budget=1e-9)
    with pytest.raises(SpecdraftError, match="--regen-budget must be >= 0"):
        PrepareConfig(out="o", regenerate=True, regen_budget=-1)
