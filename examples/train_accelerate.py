"""Train a vanilla model with Accelerate: the same script on one CPU, two CPU processes, or many GPUs.

    python examples/train_accelerate.py --task classification --output runs/cls            # one process
    torchrun --nproc_per_node 2 examples/train_accelerate.py --cpu --output runs/cls       # 2-process gloo (CPU)
    accelerate launch examples/train_accelerate.py --task seq2seq --output runs/s2s        # GPUs, as configured

`--task classification` fine-tunes `VanillaEncoderForSequenceClassification` (from a converted checkpoint with
`--model DIR`, else a small random encoder); `--task seq2seq` trains `VanillaSeq2SeqForConditionalGeneration` from
scratch. Both learn a synthetic task generated here, so the script runs offline.

What Accelerate does for us: wraps the model for data parallelism (DDP over gloo on CPU, NCCL on GPU), shards the
data loader across processes, averages gradients, runs mixed precision where the device has it, accumulates
gradients, clips them across processes, and saves/restores the whole training state (`save_state`/`load_state`).
"""

import argparse
import math
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForSequenceClassification,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

VOCAB, PAD, START, END = 64, 0, 1, 2  # synthetic token ids: 3..VOCAB-1 are "words"


class Synthetic(Dataset):
    """classification: is the sequence's first word smaller than its last? seq2seq: reverse the words."""

    def __init__(self, task: str, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.task, self.items = task, []
        for _ in range(size):
            length = int(torch.randint(4, 12, (1,), generator=generator))
            words = torch.randint(3, VOCAB, (length,), generator=generator)
            if task == "classification":
                self.items.append((words, int(words[0] < words[-1])))
            else:
                self.items.append((words, torch.cat([words.flip(0), torch.tensor([END])])))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(task):
    def pad(seqs, value):
        return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)

    def fn(batch):
        sources = [source for source, _ in batch]
        inputs = {"input_ids": pad(sources, PAD), "attention_mask": pad([torch.ones_like(s) for s in sources], 0)}
        if task == "classification":
            inputs["labels"] = torch.tensor([label for _, label in batch])
        else:
            inputs["labels"] = pad([target for _, target in batch], -100)  # -100: not scored
        return inputs

    return fn


def build_model(args):
    if args.model:
        model_class = (VanillaEncoderForSequenceClassification if args.task == "classification"
                       else VanillaSeq2SeqForConditionalGeneration)
        return model_class.from_pretrained(args.model, num_labels=2) if args.task == "classification" \
            else model_class.from_pretrained(args.model)
    sizes = dict(vocab_size=VOCAB, hidden_size=args.width, num_attention_heads=4, intermediate_size=4 * args.width,
                 max_position_embeddings=64, hidden_dropout_prob=args.dropout, pad_token_id=PAD)
    if args.task == "classification":
        return VanillaEncoderForSequenceClassification(VanillaEncoderConfig(num_hidden_layers=2, num_labels=2, **sizes))
    return VanillaSeq2SeqForConditionalGeneration(VanillaSeq2SeqConfig(
        num_hidden_layers=2, decoder_layers=2, bos_token_id=START, eos_token_id=END, decoder_start_token_id=START,
        **sizes))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["classification", "seq2seq"], default="classification")
    parser.add_argument("--model", help="start from this checkpoint (e.g. a converted BERT) instead of random init")
    parser.add_argument("--output", required=True, help="directory for checkpoints and the final model")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="per process, per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--mixed-precision", choices=["auto", "no", "fp16", "bf16"], default="auto",
                        help="auto: bf16 on a GPU that supports it, otherwise full precision")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save_state every N steps (0: never)")
    parser.add_argument("--resume-from", help="a checkpoint directory written by --checkpoint-every")
    parser.add_argument("--save-rank-weights", action="store_true",
                        help="also write each process's final weights (rank{N}.safetensors), to check they agree")
    parser.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is present")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    mixed = args.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if not args.cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=mixed, gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)  # the same initial weights in every process
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)

    model = build_model(args)
    examples_needed = args.steps * args.batch_size * args.grad_accum * accelerator.num_processes
    data = Synthetic(args.task, size=examples_needed, seed=args.seed)
    # shuffle=False keeps the order reproducible across a resume; Accelerate still shards it across processes.
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False, collate_fn=collate(args.task))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)  # weights, optimizer, scheduler, RNG states
        step = int(Path(args.resume_from).name.rsplit("-", 1)[-1])
        accelerator.print(f"resumed from {args.resume_from} at step {step}")
    micro_batches = accelerator.skip_first_batches(loader, step * args.grad_accum)

    model.train()
    progress = tqdm(total=args.steps, initial=step, desc=f"{args.task} ({accelerator.distributed_type}, "
                    f"{accelerator.num_processes} process{'es' if accelerator.num_processes > 1 else ''})",
                    disable=not accelerator.is_local_main_process)
    for batch in micro_batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        progress.update(1)
        progress.set_postfix(loss=f"{accelerator.gather(loss.detach()).mean().item():.4f}")
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            accelerator.save_state(output / f"checkpoint-{step}")
        if step >= args.steps:
            break
    progress.close()

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if args.save_rank_weights:
        from safetensors.torch import save_file

        weights = {k: v.detach().float().clone() for k, v in unwrapped.state_dict().items()}  # tied: own copies
        save_file(weights, output / f"rank{accelerator.process_index}.safetensors")
    unwrapped.save_pretrained(output / "final", is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        accelerator.print(f"final loss {loss.item():.4f} after {step} steps; model saved to {output / 'final'}")
    accelerator.end_training()
    return math.nan if loss is None else loss.item()


if __name__ == "__main__":
    main()
