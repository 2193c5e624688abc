"""`python -m conversion FORMAT --source SRC --output OUT`: one sub-command per source format."""

import argparse
import sys

from . import bert
from . import seq2seq
from . import distilbert, electra, roberta
from . import onnx_export
from .common import ConversionError

CONVERTERS = [bert, seq2seq, roberta, distilbert, electra, onnx_export]


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
    sys.exit(main())
