"""Deprecated: `hf_vanilla.conversion.convert("bart", ...)` and `to_transformers("bart", ...)` (api.py) replace the
names here."""

from .api import deprecated

convert = deprecated(f"{__name__}.convert", "bart", ("dtype", "force", "verify_parity", "command"))
to_bart = deprecated(f"{__name__}.to_bart", "to-bart", ("force", "verify_parity"))
