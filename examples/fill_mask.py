"""Fill in [MASK] with transformers' fill-mask pipeline running on a converted checkpoint.

    python examples/fill_mask.py                                  # a RANDOM, untrained masked-LM (see below)
    python examples/fill_mask.py --source bert-base-uncased       # a real masked-LM (a Hub id: needs the Hub)
    python examples/fill_mask.py --source MLM_DIR --text "Paris is the [MASK] of France." --top-k 3

The bundled all-MiniLM-L6-v2 is a sentence encoder without a masked-LM head, so without --source this builds a small
randomly initialised BertForMaskedLM with the bert-base-uncased vocabulary, converts it, and runs the pipeline on
it: the predictions are noise, but they are the same noise as transformers' BERT gives, which the script checks.
With --source (a BERT masked-LM checkpoint, or a folder already converted with
`python -m conversion bert --head masked-lm`), the predictions are real.

`pipeline("fill-mask", model=FOLDER)` finds our model through `import hf_vanilla` (which registers it with the
Auto classes); without hf_vanilla installed, add `trust_remote_code=True` to run the code files saved in FOLDER.
"""

import tempfile
from pathlib import Path

from transformers import BertForMaskedLM, pipeline

import _common
import hf_vanilla  # noqa: F401  (registers the vanilla models with the Auto classes)

TEXTS = ["The capital of France is [MASK].", "I [MASK] this movie, it was great fun.",
         "She took the [MASK] to work this morning."]


def main(argv=None) -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--source", help="BERT masked-LM checkpoint (Hub id or folder) or a converted folder; "
                                         "default: a random, untrained one")
    parser.add_argument("--text", action="append", help="text with [MASK] (repeatable); default: three examples")
    parser.add_argument("--top-k", type=_common.at_least(1), default=5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random model")
    args = _common.parse(parser, argv)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # initializer_range 0.1 (BERT's is 0.02) spreads the random logits, so that the ranking is clear-cut
        reference = args.source or str(_common.random_bert(BertForMaskedLM, scratch / "bert", args.seed,
                                                           initializer_range=0.1))
        folder = _common.vanilla_checkpoint(reference, scratch / "vanilla", head="masked-lm")
        fill = pipeline("fill-mask", model=str(folder))
        print(f"\nModel: {type(fill.model).__name__} from {args.source or 'a random BertForMaskedLM'}")
        if args.source is None:
            print("WARNING: the weights are RANDOM and UNTRAINED (the bundled MiniLM has no masked-LM head):\n"
                  "the predictions below are noise. Pass --source with a masked-LM checkpoint for real ones.")
        bert = pipeline("fill-mask", model=reference) if folder != Path(reference) else None

        worst = 0.0
        for text in args.text or TEXTS:
            answers = fill(text.replace("[MASK]", fill.tokenizer.mask_token), top_k=args.top_k)
            print(f"\n{text}")
            for group in answers if isinstance(answers[0], list) else [answers]:  # one list per [MASK]
                for answer in group:
                    print(f"  {answer['score']:.4f}  {answer['token_str']}")
            if bert is not None:
                theirs = bert(text.replace("[MASK]", fill.tokenizer.mask_token), top_k=args.top_k)
                ours_flat, theirs_flat = _flatten(answers), _flatten(theirs)
                if [a["token"] for a in ours_flat] != [b["token"] for b in theirs_flat]:
                    raise SystemExit("The converted model ranks different tokens than transformers' BERT.")
                worst = max([worst] + [abs(a["score"] - b["score"]) for a, b in zip(ours_flat, theirs_flat)])
        if bert is not None:
            print(f"\nSame tokens as transformers' BERT pipeline; max |score difference| = {worst:.2e}")


def _flatten(answers):
    return [a for group in (answers if isinstance(answers[0], list) else [answers]) for a in group]


if __name__ == "__main__":
    _common.run(main)
