"""Deprecated: `hf_vanilla.conversion.convert("marian", ...)` and `to_transformers("marian", ...)` (api.py) replace
the names here."""

from .api import deprecated

FORWARD = ("dtype", "force", "verify_parity", "command")
convert = deprecated(f"{__name__}.convert", "marian", FORWARD)
convert_marian = deprecated(f"{__name__}.convert_marian", "marian", FORWARD)
to_marian = deprecated(f"{__name__}.to_marian", "to-marian", ("force", "verify_parity"))
