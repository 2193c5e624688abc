"""Weight conversion between transformers checkpoints and hf_vanilla models: `python -m conversion --help` in the
repository, `hf-vanilla --help` once installed (where this package is `hf_vanilla.conversion`).

From Python, `convert` and `to_transformers` (api.py) do what the command line does:

    from hf_vanilla.conversion import convert, to_transformers
    convert("bert", "bert-base-uncased", "bert-vanilla", head="masked-lm", dtype="bfloat16")

Laid out by role:
    api.py          the Python calls                          cli.py       the command line (argparse only)
    commands.py     the registry of conversions and options   errors.py    the one error path
    flow.py         the one flow: read -> map -> build -> verify -> write, and back
    mapping.py      the map step: key tables, strict renaming  building.py  the build step: the model on the meta device
    parity.py       the verify step's rule and comparisons
    io/             reading sources, writing outputs, placing the output folder whole or not at all
    formats/        the formats as data: BERT, RoBERTa, DistilBERT, ELECTRA, bert2bert, BART, Marian
    onnx_export.py  `onnx`: a vanilla checkpoint -> ONNX graphs, checked with ONNX Runtime
    bert.py, roberta.py, distilbert.py, electra.py, bart.py, marian.py, bert2bert.py: the `convert` names these
                    modules had before the one flow, deprecated (each warns, naming the call that replaces it)

Light on purpose: importing it (and answering `--help`) imports neither torch nor transformers; the flow and the
formats do."""

from .api import convert, to_transformers
from .errors import ConversionError, report_failure

__all__ = ["ConversionError", "convert", "report_failure", "to_transformers"]
