"""Deprecated: `hf_vanilla.conversion.convert("bert", ...)` (api.py) replaces `convert` here."""

from .api import deprecated

convert = deprecated(f"{__name__}.convert", "bert", ("head", "dtype", "force", "verify_parity", "command"))
