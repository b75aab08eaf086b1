"""Training data: reading raw conversations, rendering them for a target, and the prepared-dataset format."""

from specdraft.data.dataset import PreparedDataset, write_prepared

__all__ = ["PreparedDataset", "write_prepared"]
