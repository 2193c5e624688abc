#!/usr/bin/env python
"""The floor of any bert-base conversion that skips transformers' model code: a bare script that imports torch,
safetensors and `PretrainedConfig`, reads the checkpoint, renames every key and writes it back. No checks, config,
tokenizer or model card: less than any real converter does.

    python benchmarks/conversion_floor.py        # about 30 s: builds the checkpoint, then 3 fresh processes

Prints each process's wall time (interpreter start included) and its split into imports and read-rename-write.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _cli import child_output

BARE = """
import sys, time
t0 = time.perf_counter()
import torch
from safetensors.torch import load_file, save_file
t1 = time.perf_counter()
from transformers import PretrainedConfig
t2 = time.perf_counter()
tensors = {"encoder." + key: tensor for key, tensor in load_file(sys.argv[1]).items()}
save_file(tensors, sys.argv[2], metadata={"format": "pt"})
t3 = time.perf_counter()
print(f"imports: torch + safetensors {t1 - t0:.2f} s, PretrainedConfig {t2 - t1:.2f} s; "
      f"read-rename-write {t3 - t2:.2f} s")
"""


def main(argv=None):
    # No options; parsing makes --help (or an unknown argument) stop before any work.
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    from transformers import BertConfig, BertModel

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        BertModel(BertConfig()).save_pretrained(scratch / "bert")
        source, output = scratch / "bert" / "model.safetensors", scratch / "out.safetensors"
        print(f"bert-base checkpoint: {source.stat().st_size / 2**20:.0f} MiB")
        for _ in range(3):
            start = time.perf_counter()
            split = child_output([sys.executable, "-c", BARE, str(source), str(output)],
                                 case=f"the bare read-rename-write of {source}").strip()
            print(f"wall {time.perf_counter() - start:.2f} s ({split})")


if __name__ == "__main__":
    main()
