"""The trainer's optimizers (train/optimizers.py): Muon's parameter split and update, AdamW's half of it, exact resume."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdraft.train.optimizers import OPTIMIZERS, MuonAdamW, muon_eligible, orthogonalise


def test_orthogonalise_flattens_the_spectrum_of_wide_and_tall_matrices():
    g = torch.Generator().manual_seed(0)
    for shape in ((16, 64), (64, 16)):
        update = torch.randn(shape, generator=g) * torch.logspace(-2, 0, shape[1])  # condition number 8 (wide), 116 (tall)
        singular = torch.linalg.svdvals(orthogonalise(update))
        assert orthogonalise(update).shape == shape
        assert float(singular.min()) > 0.65 and float(singular.max()) < 1.2, singular


def test_muon_takes_hidden_matrices_and_leaves_vocabulary_rows_norms_and_vectors_to_adamw():
    class Drafter(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 8)
            self.fc = nn.Linear(24, 8)
            self.norm = nn.LayerNorm(8)
            self.confidence = nn.Linear(8, 1)  # a [1, 8] matrix: a vector
            self.lm_head = nn.Linear(8, 50, bias=False)
            self.markov_w1 = nn.Embedding(50, 4)

    module = Drafter()
    muon = {n for n, p in module.named_parameters() if muon_eligible(n, p)}
    assert muon == {"fc.weight"}
    optimizer = OPTIMIZERS.get("muon")(module, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused_loops=False)
    groups = [(g["muon"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups]
    assert groups == [(True, 0.1, 1), (False, 0.1, 4), (False, 0.0, 4)]  # matrices decay, vectors (biases, norm gains) do not


def test_the_adamw_half_equals_torch_adamw():
    torch.manual_seed(0)
    ours, theirs = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(5, 3))
    theirs.data.copy_(ours.data)
    a = MuonAdamW([{"params": [ours]}], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    b = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for _ in range(5):
        grad = torch.randn(5, 3)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    torch.testing.assert_close(ours.data, theirs.data, rtol=1e-5, atol=1e-6)


def test_muon_step_is_orthogonal_momentum_scaled_to_adamw_rms():
    weight = nn.Parameter(torch.zeros(32, 8))
    optimizer = MuonAdamW([{"params": [weight], "muon": True}], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    weight.grad = torch.randn(32, 8)
    optimizer.step()
    # first step: buffer = g, update = orth(g + 0.95 g) = orth(g); size lr * 0.2 * sqrt(32) per unit singular value
    expected = -0.01 * 0.2 * 32**0.5 * orthogonalise(weight.grad)
    torch.testing.assert_close(weight.data, expected)


def test_muon_training_resumes_bitwise(tmp_path):
    from specdraft.train.trainer import train
    from test_train import assert_same_weights
    from test_train_toy import SignalAfterReads, ToyStore, ToyTarget, toy_config

    reference = train(toy_config(tmp_path / "ref", optimizer="muon"), target=ToyTarget(), dataset=ToyStore())
    adamw = train(toy_config(tmp_path / "adamw"), target=ToyTarget(), dataset=ToyStore())
    first = train(toy_config(tmp_path / "run", optimizer="muon"), target=ToyTarget(), dataset=SignalAfterReads(ToyStore(), 30))
    assert first.stopped_by == "signal" and 0 < first.step < 12
    second = train(toy_config(tmp_path / "run", optimizer="muon"), target=ToyTarget(), dataset=ToyStore())
    assert reference.completed and second.completed and second.step == 12
    assert_same_weights(tmp_path / "ref" / "final", tmp_path / "run" / "final")
    with pytest.raises(AssertionError):  # and Muon did train differently from AdamW
        assert_same_weights(tmp_path / "ref" / "final", tmp_path / "adamw" / "final")
    assert adamw.completed


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_muon_half_follows_torch_optim_muon_as_speculators_configures_it():
    """speculators 0.9.0 steps its matrices with torch.optim.Muon(adjust_lr_fn='match_rms_adamw'); ours takes the same
    steps up to torch's bf16 Newton-Schulz (about 1% of the displacement), and a non-Nesterov variant would not."""
    torch.manual_seed(0)
    start = torch.randn(48, 16) * 0.1
    ours, theirs, plain = (nn.Parameter(start.clone()) for _ in range(3))
    a = MuonAdamW([{"params": [ours], "muon": True}], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
    b = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    c = torch.optim.Muon([plain], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", nesterov=False)
    for _ in range(5):
        grad = torch.randn(48, 16)
        for p in (ours, theirs, plain):
            p.grad = grad.clone()
        for opt in (a, b, c):
            opt.step()
    moved = (theirs.detach() - start).norm()
    assert float((ours.detach() - theirs.detach()).norm() / moved) < 0.04
    assert float((plain.detach() - theirs.detach()).norm() / moved) > 0.1


def test_non_matrix_parameters_go_to_adamw_and_a_muon_trained_drafter_learns(target):
    """Every 1-D and 3-D tensor of a tiny DSpark lands in an AdamW group, and 60 steps of Muon halve its loss."""
    from specdraft.models import METHODS
    from test_models_support import make_batch, single_thread

    spec = METHODS.get("dspark")
    torch.manual_seed(0)
    model = spec.build(spec.config_cls(block_size=4, num_layers=1, markov_rank=16), target)
    model.register_parameter("extra_kernel", nn.Parameter(torch.zeros(2, 3, 4)))  # a 3-D tensor (a conv kernel's shape)
    optimizer = OPTIMIZERS.get("muon")(model, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, fused_loops=False)
    muon_params = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert muon_params and all(p.ndim == 2 for n, p in trainable if id(p) in muon_params)
    assert all(id(p) not in muon_params for n, p in trainable if p.ndim != 2)
    assert any(p.ndim == 1 for n, p in trainable) and model.extra_kernel.ndim == 3
    batch = make_batch(target, "dspark", count=4, length=24, pack=2)
    with single_thread():
        with torch.no_grad():
            first = float(model.training_forward(batch).loss)
        for _ in range(60):
            out = model.training_forward(batch)
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        with torch.no_grad():
            last = float(model.training_forward(batch).loss)
    assert last < 0.5 * first, (first, last)
