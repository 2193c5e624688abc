"""Deprecated: `hf_vanilla.conversion.convert("bert2bert", ...)` and `convert("warm-start", ...)` (api.py) replace
the names here."""

from .api import deprecated

convert_bert2bert = deprecated(f"{__name__}.convert_bert2bert", "bert2bert",
                               ("dtype", "force", "verify_parity", "command"))
convert_warm_start = deprecated(f"{__name__}.convert_warm_start", "warm-start",
                                ("dtype", "force", "verify_parity", "seed", "decoder_start_token_id", "eos_token_id",
                                 "command"))
