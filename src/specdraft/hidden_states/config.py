"""``ExtractConfig``: the one source of ``specdraft extract`` defaults and help text (kept torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.layers import LAYER_PRESETS, LayerSlot, parse_slots
from specdraft.targets.loading import DTYPES as TARGET_DTYPES
from specdraft.utils.config import config_field, require_finite
from specdraft.utils.vllm_options import VllmAttachOptions

#: Names of the dtypes hidden states can be stored in (see ``payload.STORAGE_DTYPES``).
STORAGE_DTYPE_NAMES = ("bfloat16", "float16", "float32")
#: How a hidden-state store is checked when it is opened for training (``HiddenStateDataset.verify``).
VERIFY_LEVELS = ("quick", "full")
DEFAULT_PRESET = "dspark"
#: Engines that can run the target for extraction (``extract.EXTRACT_ENGINES`` holds the functions).
ENGINE_NAMES = ("hf", "vllm")


@dataclass
class ExtractConfig(VllmAttachOptions):
    dataset: str = config_field(help="prepared dataset directory (written by `specdraft prepare`)")
    out: str = config_field(help="hidden-state store to create or resume (a directory for the file backend)")
    target: str | None = config_field(None, help="target name or HF model directory; default: the target recorded in the dataset manifest")
    method: str | None = config_field(
        None,
        help=f"layer preset of a drafter method; default: {DEFAULT_PRESET} unless --layers is given",
        metadata={"choices": LAYER_PRESETS.names},  # the families register their presets from above
    )
    layers: str | None = config_field(
        None, help="explicit layer slots instead of a preset, e.g. 'output:1,input:2' (a bare number = output)"
    )
    dtype: str = config_field(
        "bfloat16", help="storage dtype of hidden states (float32 keeps them exact)", metadata={"choices": list(STORAGE_DTYPE_NAMES)}
    )
    target_dtype: str = config_field("float32", help="dtype the target runs in", metadata={"choices": list(TARGET_DTYPES)})
    device: str = config_field("cpu", help="device the target runs on (cpu, cuda, cuda:1, ...)")
    batch_size: int = config_field(8, help="samples per forward pass (length-sorted, right-padded)")
    max_samples: int | None = config_field(None, help="extract only the first N samples of the dataset")
    restart: bool = config_field(
        False,
        help="delete the samples an existing store at --out holds and extract from scratch (e.g. after the dataset "
        "was re-prepared with other rows, which a resume refuses)",
    )
    backend: str = config_field("file", help="storage backend (registered name)")
    queue_size: int = config_field(8, help="payloads that may wait for the writer before capture blocks")
    writer_threads: int = config_field(1, help="background threads serialising and writing payloads")
    threads: int = config_field(
        0,
        help="--engine hf: torch CPU threads of the target's forward passes (0 = auto: the count that ran one batch-sized "
        "forward fastest here, measured once per machine and cached)",
    )
    engine: str = config_field(
        "hf",
        help="what runs the target: hf (transformers, in this process) or vllm (a private vLLM server, run by "
        "the vLLM environment --vllm-python finds, whose connector writes the store; --batch-size requests are in flight at once)",
        metadata={"choices": list(ENGINE_NAMES)},
    )

    def __post_init__(self) -> None:
        require_finite(self)
        if self.method is not None and self.layers is not None:
            raise SpecdraftError(f"give either {setting('method')} or {setting('layers')}, not both")
        if self.method is not None:
            LAYER_PRESETS.get(self.method)  # an unknown name raises with the list of presets
        if self.dtype not in STORAGE_DTYPE_NAMES:
            raise SpecdraftError(f"{setting('dtype')} {self.dtype!r} is not one of {', '.join(STORAGE_DTYPE_NAMES)}")
        for name in ("batch_size", "queue_size", "writer_threads"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{setting(name)} must be >= 1, got {getattr(self, name)}")
        if self.threads < 0:
            raise SpecdraftError(f"{setting('threads')} must be >= 0, got {self.threads}")
        if self.max_samples is not None and self.max_samples < 1:
            raise SpecdraftError(f"{setting('max_samples', of='extract')} must be >= 1, got {self.max_samples}")
        self.check_vllm_options(self.engine)

    def resolve_slots(self, num_layers: int) -> list[LayerSlot]:
        """The slots to store, checked against the target's layer count."""
        if self.layers is not None:
            return parse_slots(self.layers, num_layers)
        return LAYER_PRESETS.get(self.method or DEFAULT_PRESET)(num_layers)
