"""DSpark heads: the Markov (sequential-correction) head registry and the confidence head.

A Markov head turns the previous token x_{k-1} (x_0 = anchor) into a logit bias B_k added to the
backbone logits U_k, so a block drafted in one parallel pass still conditions on its own earlier
tokens. All variants share W1 = Embedding(V, r) over the target vocabulary (previous tokens are
target ids) and W2 = Linear(r, N, no bias) onto the draft vocabulary (N = V unless reduced), as in
speculators; tensor names match it (``markov_head.markov_w1`` ...). ``step`` is the inference form (left to right);
``block_bias`` the teacher-forced training form and must agree with repeated ``step``.

In memory W1 may hold fewer rows than V: with ``row_of`` int64[V] (target id -> W1 row) set, the
N draft ids have their own rows and every other id shares one last row (``DSparkDrafter`` uses
this with a reduced draft vocabulary: on a 262k target W1 would otherwise be most of the drafter,
and its dense gradient and AdamW update the bulk of a step). Drafted previous tokens are always
draft ids; only a teacher-forced or anchor token can be another id. ``full_w1`` expands it to the
[V, r] table that the format (speculators, vLLM's ``qwen3_dspark``) stores; both compute the same.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.registry import Registry

MARKOV_HEADS: Registry[type[MarkovHead]] = Registry("markov head")


class MarkovHead(nn.Module):
    """Vanilla first-order head: B_k = W2(W1[x_{k-1}])."""

    row_of: torch.Tensor | None  # buffer, see ``__init__``

    def __init__(self, *, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, w1_rows: int | None = None):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(w1_rows or vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        self.register_buffer("row_of", None, persistent=False)  # int64[V] target id -> W1 row; None: W1 is [V, r]

    def prev_embeddings(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids if self.row_of is None else self.row_of[prev_ids])

    def full_w1(self) -> torch.Tensor:
        """W1 as the format stores it, [V, r]."""
        weight = self.markov_w1.weight
        return weight if self.row_of is None else weight[self.row_of]

    def init_state(self, rows: int, like: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(self, state: torch.Tensor | None, prev_emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev_emb [R, r], hidden [R, D] -> (bias [R, N], new state)."""
        return self.markov_w2(prev_emb), state

    def block_bias(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev_emb [R, B, r], hidden [R, B, D] -> bias [R, B, N] (teacher-forced; stateless
        heads apply ``step`` to all positions at once)."""
        return self.step(None, prev_emb, hidden)[0]


MARKOV_HEADS.register("vanilla")(MarkovHead)


@MARKOV_HEADS.register("gated")
class GatedMarkovHead(MarkovHead):
    """B_k = W2(g_k * W1[x_{k-1}]), g_k = sigmoid(gate_proj([h_k; W1[x_{k-1}]]))."""

    def __init__(self, *, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, w1_rows: int | None = None):
        super().__init__(vocab_size=vocab_size, draft_vocab_size=draft_vocab_size, rank=rank, hidden_size=hidden_size, w1_rows=w1_rows)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, state: torch.Tensor | None, prev_emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
        return self.markov_w2(gate * prev_emb), state


@MARKOV_HEADS.register("rnn")
class RnnMarkovHead(MarkovHead):
    """Gated recurrent state s over the block: [g; c; o] = joint_proj([s; W1[x_{k-1}]; h_k]),
    s <- g*s + (1-g)*tanh(c), B_k = W2(tanh(o))."""

    def __init__(self, *, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, w1_rows: int | None = None):
        super().__init__(vocab_size=vocab_size, draft_vocab_size=draft_vocab_size, rank=rank, hidden_size=hidden_size, w1_rows=w1_rows)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(rows, self.rank)

    def block_bias(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        state = self.init_state(prev_emb.shape[0], prev_emb)
        out = []
        for k in range(prev_emb.shape[1]):
            bias, state = self.step(state, prev_emb[:, k], hidden[:, k])
            out.append(bias)
        return torch.stack(out, dim=1)

    # The shared signature allows a None state (stateless heads); this head's state always comes from its init_state.
    def step(  # type: ignore[override]
        self, state: torch.Tensor, prev_emb: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), state


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w . features + b), features = [h_k; W1[x_{k-1}]] (or h_k alone)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F] -> confidence logits [...] (apply sigmoid for c_k)."""
        return self.proj(features).squeeze(-1)
