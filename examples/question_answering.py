"""Extractive question answering with VanillaEncoderForQuestionAnswering: find the answer span in a context.

    python examples/question_answering.py                       # a RANDOM, untrained QA model (see below)
    python examples/question_answering.py --source DIR          # a BERT QA checkpoint (e.g. fine-tuned on SQuAD)
    python examples/question_answering.py --source DIR --question "Who wrote it?" --context "..."

transformers 5 removed the question-answering pipeline, so this script does its work by hand, in the classic way:
1. tokenise "[CLS] question [SEP] context [SEP]" (the context is truncated to --max-length tokens);
2. the model scores every token as a possible answer start and as a possible answer end;
3. the answer is the span (start, end) with end >= start, at most --max-answer-tokens long and inside the context,
   that maximises start_score + end_score;
4. the tokenizer's character offsets map that span back to the exact text of the context.

Without --source there is no QA checkpoint offline, so the script builds a small randomly initialised
BertForQuestionAnswering with the bert-base-uncased vocabulary and converts it: the answer it prints is an
arbitrary span, but the decoding is the real thing. --source accepts a BERT QA checkpoint (Hub id or folder) or a
folder already converted with `python -m conversion bert`.
"""

import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertForQuestionAnswering

import _common
from hf_vanilla import VanillaEncoderForQuestionAnswering

QUESTION = "Where was Marie Curie born?"
CONTEXT = ("Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity. She was born "
           "in Warsaw, in what was then the Kingdom of Poland, and later moved to Paris to study.")


def best_span(start_logits, end_logits, candidates, max_answer_tokens: int):
    """The (start, end) token pair maximising start + end score, with start <= end < start + max_answer_tokens and
    both tokens in `candidates` (a bool mask of context tokens). start_logits, end_logits, candidates: (T,)."""
    T = start_logits.shape[0]
    scores = start_logits[:, None] + end_logits[None, :]  # (T, T): row = start token, column = end token
    index = torch.arange(T)
    allowed = (index[None, :] >= index[:, None]) & (index[None, :] < index[:, None] + max_answer_tokens)
    allowed &= candidates[:, None] & candidates[None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    flat = int(scores.argmax())
    return flat // T, flat % T, float(scores.view(-1)[flat])


def answer(model, tokenizer, question: str, context: str, max_length: int, max_answer_tokens: int) -> dict:
    encoding = tokenizer(question, context, truncation="only_second", max_length=max_length,
                         return_offsets_mapping=True, return_tensors="pt")
    offsets = encoding.pop("offset_mapping")[0]  # (T, 2): character span of each token in its own text
    in_context = torch.tensor([sequence == 1 for sequence in encoding.sequence_ids(0)])  # (T,)
    with torch.no_grad():
        output = model(**encoding)
    start, end, score = best_span(output.start_logits[0], output.end_logits[0], in_context, max_answer_tokens)
    first_char, last_char = int(offsets[start][0]), int(offsets[end][1])
    return {"answer": context[first_char:last_char], "start_char": first_char, "end_char": last_char,
            "start_token": start, "end_token": end, "score": score}


def main(argv=None) -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--source", help="BERT QA checkpoint (Hub id or folder) or a converted folder; "
                                         "default: a random, untrained one")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--context", default=CONTEXT)
    parser.add_argument("--max-length", type=_common.at_least(1), default=384, help="question + context tokens kept")
    parser.add_argument("--max-answer-tokens", type=_common.at_least(1), default=30)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random model")
    args = _common.parse(parser, argv)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        source = args.source or str(_common.random_bert(BertForQuestionAnswering, scratch / "bert", args.seed))
        folder = _common.vanilla_checkpoint(source, scratch / "vanilla", head="question-answering")
        model = VanillaEncoderForQuestionAnswering.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        result = answer(model, tokenizer, args.question, args.context, args.max_length, args.max_answer_tokens)

    if args.source is None:
        print("\nWARNING: the weights are RANDOM and UNTRAINED (no QA checkpoint is available offline): the span "
              "below is arbitrary.\nPass --source with a QA checkpoint (e.g. BERT fine-tuned on SQuAD) for a real "
              "answer.")
    print(f"\nQuestion: {args.question}\nContext:  {args.context}")
    print(f"Answer:   {result['answer']!r}  (characters {result['start_char']}-{result['end_char']}, "
          f"tokens {result['start_token']}-{result['end_token']}, score {result['score']:.3f})")


if __name__ == "__main__":
    _common.run(main)
