"""The three drafters on the embedded SmolLM2-135M target: presets, layer ids, mask token, round trip."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.hidden_states.layers import LayerSlot
from specdraft.models import METHODS, DrafterBatch, load_drafter
from test_models_support import single_thread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from specdraft.targets import load_target

    return load_target(str(smollm2_dir))


def _payload(target, slots, tokens):
    captured = {}
    handle = target.model.get_decoder().norm.register_forward_hook(lambda m, a, o: captured.__setitem__("x", a[0]))
    with torch.no_grad():
        out = target.model(input_ids=tokens, output_hidden_states=True)
    handle.remove()
    aux = torch.stack([out.hidden_states[s.hf_index(target.num_layers)] for s in slots], dim=2)
    n, t = tokens.shape
    return DrafterBatch(
        token_ids=tokens,
        loss_mask=torch.ones(n, t, dtype=torch.bool),
        segment_ids=torch.zeros(n, t, dtype=torch.int32),
        position_ids=torch.arange(t)[None].expand(n, t),
        aux_hidden=aux,
        last_hidden=captured["x"],
    )


@pytest.mark.parametrize(
    "method,ids",
    [("eagle3", [2, 15, 27]), ("dflash", [2, 9, 15, 21, 28]), ("dspark", [2, 9, 15, 21, 28])],
)
def test_real_target_build_train_step_and_round_trip(tmp_path, smollm2, method, ids):
    spec = METHODS.get(method)
    small = {
        "eagle3": {"draft_vocab_size": 2048, "ttt_steps": 2},
        "dflash": {"num_layers": 1, "block_size": 4},
        "dspark": {"num_layers": 1, "block_size": 4, "markov_rank": 32},
    }
    with single_thread():
        counts = torch.zeros(smollm2.vocab_size, dtype=torch.int64)
        counts[:3000] = torch.arange(3000, 0, -1)
        model = spec.build(spec.config_cls(**small[method]), smollm2, counts=counts)
        assert model.config.hidden_size == 576 and model.config.num_target_layers == 30
        if method != "eagle3":  # pad = eos = <|im_end|> is a real token; a spare special is used
            assert smollm2.tokenizer.convert_ids_to_tokens(model.config.mask_token_id) == "<empty_output>"
        tokens = smollm2.tokenizer("The quick brown fox jumps over the lazy dog because", return_tensors="pt").input_ids
        batch = _payload(smollm2, model.config.slots(), tokens)
        out = model.training_forward(batch)
        assert torch.isfinite(out.loss)
        out.loss.backward()
        model.save_pretrained(tmp_path / method)
        cfg = json.loads((tmp_path / method / "config.json").read_text())
        key = "eagle_aux_hidden_state_layer_ids" if method == "eagle3" else "aux_hidden_state_layer_ids"
        assert cfg[key] == ids
        side = "input" if method == "eagle3" else "output"
        assert [LayerSlot.from_json(s) for s in cfg["specdraft"]["layer_slots"]] == [
            LayerSlot(i if side == "input" else i - 1, side) for i in ids
        ]
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(smollm2.path)
        loaded = load_drafter(tmp_path / method, target=smollm2)
        for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
            assert torch.equal(a, b)
