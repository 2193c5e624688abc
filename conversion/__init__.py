"""Weight conversion between transformers checkpoints and hf_vanilla models: `python -m conversion --help`."""

from .common import ConversionError

__all__ = ["ConversionError"]
