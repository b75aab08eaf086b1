"""Target resolution, loading, identity hashes, and the one-time embedded GGUF conversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.targets import EMBEDDED_TARGETS, fingerprint, load_target, resolve_target_dir, tokenizer_hash
from specdraft.targets.embedded import MARKER_FILE


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_load_tiny_families(tiny_target_factory, family):
    path = tiny_target_factory(family, num_layers=4)
    target = load_target(str(path))
    assert target.num_layers == 4 and target.hidden_size == 64
    assert target.vocab_size == len(target.tokenizer)
    assert target.tokenizer.chat_template
    info = target.describe()
    assert info["path"] == str(path) and info["fingerprint"] == target.fingerprint
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        logits = target.model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), target.vocab_size)


def test_identity_hashes(tiny_target_factory, tiny_llama_dir):
    other_seed = tiny_target_factory("llama", seed=1)
    assert fingerprint(tiny_llama_dir) == fingerprint(tiny_llama_dir)
    assert fingerprint(tiny_llama_dir) != fingerprint(other_seed)  # same shapes, different weights
    assert tokenizer_hash(tiny_llama_dir) == tokenizer_hash(other_seed)
    assert len(fingerprint(tiny_llama_dir)) == 16


def test_tiny_target_fixture(tiny_target, tiny_llama_dir):
    assert tiny_target.path == tiny_llama_dir and tiny_target.num_layers == 6
    assert not tiny_target.model.training
    assert all(not p.requires_grad for p in tiny_target.model.parameters())


def test_unknown_target(tmp_path):
    with pytest.raises(SpecdraftError, match="smollm2-135m"):
        resolve_target_dir("no-such-model")
    with pytest.raises(SpecdraftError, match="config.json"):
        resolve_target_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpecdraftError, match="safetensors"):
        resolve_target_dir(str(tmp_path))
    assert "smollm2-135m" in EMBEDDED_TARGETS


def test_bad_dtype(tiny_llama_dir):
    with pytest.raises(SpecdraftError, match="dtype"):
        load_target(str(tiny_llama_dir), dtype="int8")


_CONVERT = "from specdraft.targets import resolve_target_dir; print(resolve_target_dir('smollm2-135m'))"


@pytest.mark.slow
def test_embedded_conversion_is_once_and_concurrency_safe(tmp_path):
    """Two processes convert into an empty cache at once: one converts, the other waits and reuses."""
    env = {**os.environ, "SPECDRAFT_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONVERT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    final = tmp_path / "cache" / "targets" / "smollm2-135m"
    assert {o[0].strip() for o in outs} == {str(final)}
    assert sorted(p.name for p in final.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]  # no temp dirs
    marker = json.loads((final / MARKER_FILE).read_text())
    assert marker["fingerprint"] == fingerprint(final)
    mtime = (final / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CONVERT], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(final)
    assert (final / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert time.perf_counter() - start < 15


@pytest.mark.slow
def test_converted_logits_match_gguf(smollm2_dir):
    from specdraft.targets.embedded import load_gguf_model

    target = load_target("smollm2-135m")
    assert target.path == smollm2_dir and target.num_layers == 30 and target.vocab_size == 49152
    gguf_model, gguf_tokenizer = load_gguf_model(EMBEDDED_TARGETS.get("smollm2-135m").gguf_path())
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = target.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert ids == gguf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert target.tokenizer.chat_template == gguf_tokenizer.chat_template
    x = torch.tensor([ids])
    with torch.no_grad():
        converted = target.model(x).logits
        reference = gguf_model(x).logits
    torch.testing.assert_close(converted, reference, rtol=0, atol=1e-5)
