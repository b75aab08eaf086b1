"""specdraft: train, package, evaluate and serve speculative-decoding drafters."""

from specdraft.errors import SpecdraftError

__version__ = "0.1.0"
__all__ = ["SpecdraftError", "__version__"]
