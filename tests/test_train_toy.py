"""A tiny method-agnostic stand-in drafter + in-memory store for trainer tests (the data-pipeline tests are
``test_batches.py``: this file must import into older checkouts, see ``scripts/resume_across.py``).

The toy drafter uses dropout and a random anchor subset (so every step draws random numbers, as
DFlash/DSpark do), has a frozen parameter (like a drafter's copy of the target embedding) and
predicts K tokens ahead inside each packed segment. Run as a script it trains on the toy store
(used by the SIGTERM and torchrun tests): ``python tests/test_train_toy.py '<TrainConfig JSON>' [SEEN_DIR [READ_DELAY_S]]``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from specdraft.hidden_states.layers import LayerSlot
from specdraft.models.base import METHODS, DrafterBatch, DrafterModel, MethodSpec, TrainOutput

TOY = "toy"
VOCAB = 64


@dataclass
class ToyConfig:
    hidden: int = 16
    positions: int = 3
    dropout: float = 0.1


class ToyDrafter(DrafterModel):
    method = TOY

    def __init__(self, cfg: ToyConfig, num_slots: int, hidden_size: int):
        super().__init__()
        self.cfg = cfg
        self.num_slots, self.hidden_size = num_slots, hidden_size
        self.fc = nn.Linear(num_slots * hidden_size, cfg.hidden)
        self.embed = nn.Embedding(VOCAB, cfg.hidden)
        self.embed.weight.requires_grad_(False)  # frozen, like a copy of the target embedding
        self.drop = nn.Dropout(cfg.dropout)
        self.heads = nn.Linear(cfg.hidden, cfg.positions * VOCAB)

    def training_forward(self, batch: DrafterBatch) -> TrainOutput:
        B, T, S, D = batch.aux_hidden.shape
        K = self.cfg.positions
        h = self.drop(torch.tanh(self.fc(batch.aux_hidden.reshape(B, T, S * D)) + self.embed(batch.token_ids % VOCAB)))
        logits = self.heads(h).view(B, T, K, VOCAB).float()
        anchors = (batch.segment_ids >= 0) & (torch.rand(B, T) < 0.8)  # random anchor subset
        losses, accs, conds, counts = [], [], [], []
        prefix_ok = torch.ones(B, T, dtype=torch.bool)
        for k in range(K):
            shift = k + 1
            labels = torch.full((B, T), -1, dtype=torch.long)
            same = batch.segment_ids[:, shift:] == batch.segment_ids[:, :-shift]
            ok = same & batch.loss_mask[:, shift:] & anchors[:, :-shift]
            labels[:, :-shift] = torch.where(ok, batch.token_ids[:, shift:] % VOCAB, -1)
            valid = labels >= 0
            losses.append(
                nn.functional.cross_entropy(logits[:, :, k].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-1)
                if valid.any()
                else logits.sum() * 0
            )
            correct = (logits[:, :, k].argmax(-1) == labels) & valid
            n = valid.sum().clamp_min(1)
            accs.append(correct.sum() / n)
            cond_valid = valid & prefix_ok
            conds.append((correct & cond_valid).sum() / cond_valid.sum().clamp_min(1))
            counts.append(valid.sum().float())
            prefix_ok = prefix_ok & correct
        loss = torch.stack(losses).mean()
        return TrainOutput(
            loss=loss,
            metrics={"ce": float(loss.detach())},
            position_acc=torch.stack(accs).detach(),
            position_cond_acc=torch.stack(conds).detach(),
            position_count=torch.stack(counts),
        )

    def save_pretrained(self, directory) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(
            json.dumps({"speculators_model_type": TOY, **asdict(self.cfg), "num_slots": self.num_slots, "hidden_size": self.hidden_size})
        )
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, directory, **kwargs) -> ToyDrafter:
        from safetensors.torch import load_file

        meta = json.loads((Path(directory) / "config.json").read_text())
        cfg = ToyConfig(**{k: meta[k] for k in ("hidden", "positions", "dropout")})
        model = cls(cfg, meta["num_slots"], meta["hidden_size"])
        model.load_state_dict(load_file(str(Path(directory) / "model.safetensors")))
        return model


def toy_slots(num_layers: int) -> list[LayerSlot]:
    return [LayerSlot(1, "output"), LayerSlot(num_layers - 2, "output")]


def build_toy(cfg: ToyConfig, target, **_) -> ToyDrafter:
    return ToyDrafter(cfg, len(toy_slots(target.num_layers)), target.hidden_size)


if TOY not in METHODS:
    METHODS.register(TOY)(MethodSpec(name=TOY, config_cls=ToyConfig, model_cls=ToyDrafter, layer_slots=toy_slots, build=build_toy))


@dataclass
class ToyTarget:
    name: str = "toy-target"
    fingerprint: str = "toyfp0001"
    num_layers: int = 6
    hidden_size: int = 8
    vocab_size: int = VOCAB


class ToyStore:
    """In-memory ``SampleSource`` with deterministic random samples of varied lengths. It spells out the whole
    interface rather than inheriting it: ``scripts/resume_across.py`` imports it into older checkouts too."""

    def __init__(
        self, n: int = 24, *, slots=None, fingerprint: str = "toyfp0001", hidden_size: int = 8, seed: int = 0, read_delay: float = 0.0
    ):
        g = torch.Generator().manual_seed(seed)
        self.read_delay = read_delay  # seconds per item read: slows a subprocess run down enough to kill it mid-run
        self.slots = list(slots if slots is not None else toy_slots(6))
        self.target_info = {"name": "toy-target", "fingerprint": fingerprint, "num_layers": 6, "hidden_size": hidden_size}
        self.sample_ids = [f"s{i:03d}" for i in range(n)]
        self.items = []
        self.seen: set[str] = set()  # ids read so far (the DDP test checks ranks read disjoint data)
        for sid in self.sample_ids:
            T = int(torch.randint(5, 30, (1,), generator=g))
            tokens = torch.randint(0, VOCAB, (T,), generator=g)
            mask = torch.zeros(T, dtype=torch.bool)
            mask[T // 3 :] = True
            hs = torch.randn(T, len(self.slots), hidden_size, generator=g) + tokens.view(T, 1, 1).float() / VOCAB
            self.items.append(
                {
                    "sample_id": sid,
                    "token_ids": tokens,
                    "loss_mask": mask,
                    "hidden_states": hs.to(torch.bfloat16),
                    "last_hidden": torch.randn(T, hidden_size, generator=g).to(torch.bfloat16),
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        self.seen.add(self.sample_ids[i])
        if self.read_delay:
            import time

            time.sleep(self.read_delay)
        return self.items[i]

    def lengths(self) -> list[int]:
        return [len(it["token_ids"]) for it in self.items]

    def token_row(self, i: int):
        """Tokens and loss mask without a read of the sample (the split keys every sample on every rank)."""
        return self.items[i]["token_ids"].numpy(), self.items[i]["loss_mask"].numpy()

    def source_label(self, i: int) -> str:
        return ""

    def token_counts(self) -> None:
        return None

    made_with: ClassVar[dict] = {}  # how its hidden states were made: nothing recorded


class SignalAfterReads:
    """Wraps a ``SampleSource`` and sends SIGTERM to this process on the ``at``-th item read (a kill mid-step)."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.reads = inner, at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        import signal

        self.reads += 1
        if self.reads == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.inner[i]


def toy_config(out, **overrides):
    from specdraft.train.config import TrainConfig

    values = dict(
        method=TOY,
        out=str(out),
        data=None,
        max_steps=12,
        pack_tokens=48,
        batch_rows=2,
        val_fraction=0.2,
        eval_interval=5,
        checkpoint_interval=4,
        log_interval=1,
        keep_checkpoints=0,
        dtype="fp32",
        num_threads=1,
        seed=3,
    )
    values.update(overrides)
    return TrainConfig(**values)


def main(argv: list[str]) -> int:
    """Script entry for subprocess tests: train the toy on the toy store with a JSON config."""
    import logging

    from specdraft.train.config import TrainConfig
    from specdraft.train.trainer import train

    logging.basicConfig(level=logging.INFO)
    cfg = TrainConfig(**json.loads(argv[0]))
    store = ToyStore(read_delay=float(argv[2]) if len(argv) > 2 else 0.0)
    result = train(cfg, target=ToyTarget(), dataset=store)
    if len(argv) > 1 and argv[1]:  # where to record the ids this process read, and the DDP wrappers still alive
        import gc

        from torch.nn.parallel import DistributedDataParallel

        rank = os.environ.get("RANK", "0")
        Path(argv[1], f"seen-{rank}.json").write_text(json.dumps(sorted(store.seen)))
        Path(argv[1], f"wrappers-{rank}.json").write_text(json.dumps(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())))
    print(json.dumps({"step": result.step, "stopped_by": result.stopped_by, "completed": result.completed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
