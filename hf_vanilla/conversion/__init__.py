"""Weight conversion between transformers checkpoints and hf_vanilla models: `python -m conversion --help` in the
repository, `hf-vanilla --help` once installed (where this package is `hf_vanilla.conversion`).

Laid out by role:
    cli.py          the command line (argparse only)          errors.py    the one error path
    flow.py         the one flow: read -> map -> build -> verify -> write, and back
    mapping.py      the map step: key tables, strict renaming  building.py  the build step: the model on the meta device
    parity.py       the verify step's rule and comparisons
    io/             reading sources, writing outputs, placing the output folder whole or not at all
    formats/        the formats as data: BERT, RoBERTa, DistilBERT, ELECTRA, bert2bert, BART, Marian
    onnx_export.py  `onnx`: a vanilla checkpoint -> ONNX graphs, checked with ONNX Runtime

Light on purpose: importing it (and answering `--help`) imports neither torch nor transformers; the flow and the
formats do."""

from .errors import ConversionError, report_failure

__all__ = ["ConversionError", "report_failure"]
