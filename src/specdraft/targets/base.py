"""The loaded target model and the facts about it that every other stage checks against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Target:
    """A causal LM ready for inference, plus its identity.

    ``fingerprint`` identifies the weights + tokenizer (a short hash); stores, datasets and
    drafters record it so that data made for one target is never silently used with another.
    """

    name: str  # what the user asked for: an embedded name or a path
    path: Path  # the plain HF directory the model was loaded from
    model: Any  # transformers PreTrainedModel (eval mode, no grad needed)
    tokenizer: Any  # transformers PreTrainedTokenizerBase with a chat template
    fingerprint: str
    tokenizer_hash: str

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def text_config(self) -> Any:
        """The decoder config (multimodal configs such as Gemma3 nest it)."""
        return self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config

    @property
    def family(self) -> Any:
        """The target's ``targets.families.Family`` (decoder parts, attention layout, template quirks)."""
        from specdraft.targets.families import family_of

        return family_of(self.model)

    @property
    def end_of_turn_ids(self) -> set[int]:
        """Ids that end an assistant turn: the chat template's end-of-turn token plus every declared EOS."""
        from specdraft.targets.chat import end_of_turn_ids

        return end_of_turn_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    def describe(self) -> dict:
        """Identity recorded in manifests and checkpoints."""
        return {
            "name": self.name,
            "path": str(self.path),
            "fingerprint": self.fingerprint,
            "tokenizer_hash": self.tokenizer_hash,
            "architectures": list(getattr(self.config, "architectures", None) or []),
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }
