"""Deprecated: `hf_vanilla.conversion.convert("electra", ...)` (api.py) replaces `convert` here."""

from .api import deprecated

convert = deprecated(f"{__name__}.convert", "electra", ("head", "dtype", "force", "verify_parity", "command"))
