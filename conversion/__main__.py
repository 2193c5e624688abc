"""`python -m conversion FORMAT --source SRC --output OUT`: one sub-command per source format."""

import argparse
import gc
import sys

from . import bart, bert
from . import seq2seq
from . import distilbert, electra, roberta
from . import onnx_export
from .common import ConversionError

CONVERTERS = [bert, seq2seq, bart, roberta, distilbert, electra, onnx_export]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conversion", description=__doc__)
    subparsers = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    for module in CONVERTERS:
        module.register(subparsers)
    args = parser.parse_args(argv)
    try:
        result = args.run(args)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Wrote {result}")
    return 0


if __name__ == "__main__":
    status = main()
    # At exit the interpreter's last garbage collections walk every object torch and transformers created: about
    # 1 s of a 5 s bert-base conversion, to collect nothing this ending process needs back. Exit handlers still run.
    gc.freeze()
    sys.exit(status)
