"""Weight conversion between transformers checkpoints and hf_vanilla models: `python -m conversion --help` in the
repository, `hf-vanilla --help` once installed (where this package is `hf_vanilla.conversion`).

Light on purpose: importing it (and answering `--help`) imports neither torch nor transformers; the converter
modules (`bert`, `roberta`, ...) do."""

from .errors import ConversionError, report_failure

__all__ = ["ConversionError", "report_failure"]
