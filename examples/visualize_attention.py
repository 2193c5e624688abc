"""Draw every attention head of a converted encoder on one sentence: a PNG grid of heatmaps, layers x heads.

    python examples/visualize_attention.py                                  # all-MiniLM-L6-v2: 6 layers x 12 heads
    python examples/visualize_attention.py --text "The cat sat on the mat." --output cat.png
    python examples/visualize_attention.py --source converted/minilm --layers 0 5 --heads 0 1 2 3

Cell (layer l, head h) shows the attention weights softmax(Q K^T / sqrt(D)) of that head: row i is the
distribution over which tokens token i reads from (each row sums to 1), so a bright column is a token that many
others attend to ([CLS], [SEP] and punctuation often are).

The weights only exist in eager attention: the fused kernels (sdpa, the default; flash; flex) compute
softmax(Q K^T) V without ever writing the T x T matrix out. So a call with `output_attentions=True` runs the eager
function for that call, whatever backend the model was loaded with, and the model keeps its fast backend otherwise.
"""

import tempfile
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

import _common
import hf_vanilla  # noqa: F401  (registers the vanilla models with the Auto classes)

TEXT = "The animal didn't cross the street because it was too tired."


@torch.no_grad()
def attention_weights(model, batch) -> torch.Tensor:
    """(L, B, H, T, T) attention weights of every layer (the eager function computes them, whatever the backend)."""
    return torch.stack(model(**batch, output_attentions=True).attentions)


def plot(weights: torch.Tensor, tokens: list[str], layers: list[int], heads: list[int], output: Path) -> None:
    """weights: (L, H, T, T) for one sentence. One heatmap per (layer, head), token labels on the outer axes."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed: the figure goes straight to a file
    import matplotlib.pyplot as plt

    size = max(1.6, 0.22 * len(tokens))
    figure, axes = plt.subplots(len(layers), len(heads), figsize=(size * len(heads), size * len(layers)),
                                squeeze=False)
    for row, layer in enumerate(layers):
        for column, head in enumerate(heads):
            ax = axes[row][column]
            ax.imshow(weights[layer, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(tokens)))
            ax.set_yticks(range(len(tokens)))
            ax.set_xticklabels(tokens if row == len(layers) - 1 else [], rotation=90, fontsize=6)
            ax.set_yticklabels(tokens if column == 0 else [], fontsize=6)
            if row == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if column == 0:
                ax.set_ylabel(f"layer {layer}\nquery token", fontsize=8)
    figure.suptitle("Attention weights (row: query token, column: key token it reads)", fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 0.97))  # leave the top strip to the title
    figure.savefig(output, dpi=100)
    plt.close(figure)


def main(argv=None) -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--source", help="BERT checkpoint (Hub id or folder) or a converted folder; "
                                         "default: the bundled all-MiniLM-L6-v2")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--output", type=Path, default=Path("attention.png"))
    parser.add_argument("--layers", type=_common.at_least(0), nargs="+", help="layers to draw (default: all)")
    parser.add_argument("--heads", type=_common.at_least(0), nargs="+", help="heads to draw (default: all)")
    args = _common.parse(parser, argv)
    _common.require("matplotlib")  # before the conversion, not after it

    with tempfile.TemporaryDirectory() as scratch:
        folder = _common.vanilla_checkpoint(args.source, Path(scratch) / "vanilla", head="base")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        batch = tokenizer(args.text, return_tensors="pt")

        model = AutoModel.from_pretrained(folder).eval()  # the default backend, sdpa: maps come from eager anyway
        weights = attention_weights(model, batch)[:, 0]  # (L, H, T, T) for the one sentence

    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    layers = args.layers if args.layers is not None else list(range(weights.shape[0]))
    heads = args.heads if args.heads is not None else list(range(weights.shape[1]))
    for name, chosen, count in (("--layers", layers, weights.shape[0]), ("--heads", heads, weights.shape[1])):
        if not all(0 <= i < count for i in chosen):
            raise _common.ExampleError(f"{name} {' '.join(map(str, chosen))}: this model has {count}, "
                                       f"numbered 0 to {count - 1}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    plot(weights, tokens, layers, heads, args.output)
    print(f"\n{len(tokens)} tokens: {' '.join(tokens)}")
    print(f"every row sums to 1: max |row sum - 1| = {(weights.sum(-1) - 1).abs().max():.1e}")
    print(f"Wrote {args.output} ({len(layers)} layers x {len(heads)} heads)")


if __name__ == "__main__":
    _common.run(main)
