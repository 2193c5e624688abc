"""Deprecated: `hf_vanilla.conversion.convert("distilbert", ...)` (api.py) replaces `convert` here."""

from .api import deprecated

convert = deprecated(f"{__name__}.convert", "distilbert", ("head", "dtype", "force", "verify_parity", "command"))
