"""Deprecated: `hf_vanilla.conversion.convert("roberta", ...)` (api.py) replaces `convert` here."""

from .api import deprecated

convert = deprecated(f"{__name__}.convert", "roberta", ("head", "dtype", "force", "verify_parity", "command"))
