"""Train a vanilla model with Accelerate: the same script on one CPU, two CPU processes, or many GPUs, with data
parallelism (DDP) or fully sharded data parallelism (FSDP2).

    python examples/train_accelerate.py --task classification --output runs/cls                  # one process
    torchrun --nproc_per_node 2 examples/train_accelerate.py --cpu --output runs/cls-ddp         # DDP over gloo
    torchrun --nproc_per_node 2 examples/train_accelerate.py --cpu --fsdp sharded --output runs/cls-fsdp
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 1 \
        examples/train_accelerate.py --cpu --output runs/cls-ddp --checkpoint-every 20 --resume-from latest
    accelerate launch examples/train_accelerate.py --task seq2seq --fsdp sharded --output runs/s2s  # GPUs

`--task classification` fine-tunes `VanillaEncoderForSequenceClassification` (from a converted checkpoint with
`--model DIR`, else a small random encoder); `--task seq2seq` trains `VanillaSeq2SeqForConditionalGeneration` from
scratch. Both learn a synthetic task generated here, so the script runs offline, and both end by printing held-out
loss and accuracy next to those of the untrained model, so a run says whether it learned.

What Accelerate does for us: wraps the model for data parallelism (DDP over gloo on CPU, NCCL on GPU) or shards it
(`--fsdp`: FSDP2's `fully_shard`, one shard unit per encoder/decoder layer), shards the data loader across
processes, averages gradients, runs mixed precision where the device has it, accumulates gradients, clips them
across processes, and saves/restores the whole training state (`save_state`/`load_state`: weights, optimizer,
scheduler, sampler and every process's random generators), so that `--resume-from` continues bit for bit.

Crashes: a checkpoint is written to `checkpoint-N.partial/` and renamed to `checkpoint-N/` once every process has
written its part, and `losses.json` and `final/` are likewise renamed into place when complete, so a process killed
at any moment leaves whole files or a `.partial` that nothing reads. `--resume-from latest` continues from the newest
whole checkpoint in `--output` (or starts afresh where there is none), which is what a restarted launch needs: with
`torchrun --max-restarts N` the whole group is restarted with the same command when one process dies, and the steps
after the checkpoint are replayed exactly. Each attempt needs a store of its own (`restarts_would_hang` says why):
`--rdzv-backend c10d` (`--standalone` on one machine) with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; the script refuses
a restartable launch without. Testing hook: TRAIN_ACCELERATE_KILL_AT_STEP=N makes the last process SIGKILL itself
at step N on a launch's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT unset or 0), as a crash would: after
the step's update, or, where step N writes a checkpoint, halfway through writing it.

The loss is the mean over every scored item (class label or target token) of the *global* micro-batch, whatever
the number of processes: a run on N processes with `--batch-size B` follows the same loss curve as one process with
`--batch-size N*B` (written to OUTPUT/losses.json).
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import sys
from collections import defaultdict
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, set_seed
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForSequenceClassification,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # finds _arguments.py also when a test loads this file by path
from _arguments import at_least, existing  # noqa: E402

VOCAB, PAD, START, END = 64, 0, 1, 2  # synthetic token ids: 3..VOCAB-1 are "words"
IGNORED = -100  # label value the losses skip
MODEL_CLASSES = {"classification": VanillaEncoderForSequenceClassification,
                 "seq2seq": VanillaSeq2SeqForConditionalGeneration}
# FSDP shard units. Not `_no_split_modules` (Accelerate's default): that list also names VanillaEmbeddings, whose
# word matrix the encoder-decoder ties to its output projection, and the decoder layer, absent from an encoder.
SHARD_UNITS = {"classification": ["VanillaEncoderLayer"], "seq2seq": ["VanillaEncoderLayer", "VanillaDecoderLayer"]}
KILL_AT_STEP = "TRAIN_ACCELERATE_KILL_AT_STEP"  # testing hook: see the module docstring
PARTIAL = ".partial"  # suffix of a folder still being written


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
            inputs["labels"] = pad([target for _, target in batch], IGNORED)
        return inputs

    return fn


def build_model(args):
    # `--dropout` sets every dropout the model has: on embeddings and sub-layer outputs, on attention weights, and
    # before the classifier. Each is a random draw per step that a resumed run must replay.
    dropouts = dict(hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    if args.task == "classification":
        dropouts["classifier_dropout"] = args.dropout
    model_class = MODEL_CLASSES[args.task]
    if args.model:
        extra = {"num_labels": 2} if args.task == "classification" else {}
        return model_class.from_pretrained(args.model, **dropouts, **extra)
    sizes = dict(vocab_size=VOCAB, hidden_size=args.width, num_attention_heads=4, intermediate_size=4 * args.width,
                 max_position_embeddings=64, pad_token_id=PAD, **dropouts)
    if args.task == "classification":
        return model_class(VanillaEncoderConfig(num_hidden_layers=2, num_labels=2, **sizes))
    return model_class(VanillaSeq2SeqConfig(
        num_hidden_layers=2, decoder_layers=2, bos_token_id=START, eos_token_id=END, decoder_start_token_id=START,
        **sizes))


def cpu_threads(args) -> int:
    """Torch threads per process. Torch starts one per core in every process, so N processes on N cores run N^2
    threads, and on a shared machine threads that outnumber free cores wait on each other at every op: the
    built-in 64-wide model ran 10-20x slower with two threads on a busy 2-core machine than with one. Its matrices
    are too small for a second thread to pay, so it gets one; a converted checkpoint (`--model`, BERT-base sized)
    gets this process's share of the cores."""
    if args.threads:
        return args.threads
    if not args.model:
        return 1
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // local_processes)


def fsdp_plugin(args):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across processes, gathered one
    layer at a time. `full`/`sharded` choose how `save_state` writes the model: one file gathered on the main
    process, or one piece per process (torch.distributed.checkpoint)."""
    if not args.fsdp:
        return None
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=SHARD_UNITS[args.task],
        state_dict_type="FULL_STATE_DICT" if args.fsdp == "full" else "SHARDED_STATE_DICT",
        reshard_after_forward=True, cpu_ram_efficient_loading=False,
    )


def select_fsdp_on_cpu(accelerator, plugin):
    """Accelerate 1.15 chooses FSDP only on accelerator devices: with `cpu=True` it sets up MULTI_CPU (DDP over
    gloo) and silently drops the plugin (accelerate/state.py: FSDP is selected inside the MULTI_GPU/NPU/XPU/...
    branch only). torch's `fully_shard` itself runs on CPU over gloo, so make the choice that branch makes. A no-op
    wherever Accelerate chose FSDP itself."""
    if plugin is None or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    PartialState().distributed_type = DistributedType.FSDP  # AcceleratorState() re-reads it from here
    AcceleratorState().distributed_type = DistributedType.FSDP
    AcceleratorState().fsdp_plugin = plugin
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)


def shard_tied_modules_together(model, plugin):
    """FSDP2 puts each parameter in one shard group and refuses a parameter that two groups see. Accelerate groups
    the input embedding with the output projection when those two are tied, but the encoder-decoder ties a third
    module: its target embedding shares the source embedding's matrix. So every module holding a shared parameter
    goes into one group, before Accelerate shards the layers and the rest; the ties survive training."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    holders = defaultdict(list)
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            holders[parameter].append(module)
    tied = list(dict.fromkeys(module for modules in holders.values() if len(modules) > 1 for module in modules))
    if tied:  # the settings Accelerate gives its own tied group (accelerate/utils/fsdp_utils.py)
        fully_shard(tied, reshard_after_forward=False, offload_policy=plugin.cpu_offload,
                    mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())


def scaled_loss(accelerator, loss, labels):
    """The model's loss is the mean over this process's scored items (labels that are not -100). DDP and FSDP
    average gradients over processes, which weighs every process alike; weighting each by its share of the items
    makes the update the mean over the whole global micro-batch, as one process would compute it."""
    items = (labels != IGNORED).sum()
    total = accelerator.reduce(items.clone(), reduction="sum")
    return loss * (items * accelerator.num_processes / total)


@torch.no_grad()
def evaluate(model, task, data, device):
    """Held-out loss and accuracy, from one forward pass on every process alike (so FSDP's gathers match up).
    seq2seq accuracy is per target token, and exact match counts targets right at every position: the model's
    greedy `generate()` produces exactly those, since each step then feeds back the correct token."""
    model.eval()
    batch = {k: v.to(device) for k, v in collate(task)([data[i] for i in range(len(data))]).items()}
    out = model(**batch)
    predicted, labels = out.logits.argmax(-1), batch["labels"]
    model.train()
    if task == "classification":
        return {"loss": out.loss.item(), "accuracy": (predicted == labels).float().mean().item()}
    scored = labels != IGNORED
    right = (predicted == labels) | ~scored
    return {"loss": out.loss.item(), "accuracy": right[scored].float().mean().item(),
            "exact match": right.all(-1).float().mean().item()}


def describe(metrics, untrained, task):
    chance = "ln 2 = 0.693" if task == "classification" else f"ln {VOCAB} = {math.log(VOCAB):.3f}"
    parts = [f"loss {metrics['loss']:.4f} (untrained {untrained['loss']:.4f}; a uniform guess scores {chance})"]
    parts += [f"{name} {metrics[name]:.1%} (untrained {untrained[name]:.1%})" for name in metrics if name != "loss"]
    return ", ".join(parts)


def full_weights(model):
    """Every parameter in full on every process, in float32 (FSDP gathers its shards: all processes call this)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu().clone()
            for k, v in model.state_dict().items()}


def restarts_would_hang() -> bool:
    """Whether this is a multi-process torchrun launch allowed restarts (`--max-restarts`) whose processes share the
    launcher's store. That store outlives a failed attempt (torchrun's default static rendezvous keeps it, and
    `--rdzv-backend c10d` shares its own unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and a restarted group reads
    the dead attempt's connection addresses from it: with torch 2.15 and gloo, the restart's process group failed
    ("Gloo connectFullMesh failed ... Connection refused") or hung at its first connect. Refused before anything
    is trained."""
    return (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def kill_if_asked(accelerator, step):
    """The testing hook TRAIN_ACCELERATE_KILL_AT_STEP: the last process dies at `step`, on the first attempt only, so
    that the restarted group runs on."""
    if (os.environ.get(KILL_AT_STEP) == str(step) and accelerator.process_index == accelerator.num_processes - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)


def write_atomically(path: Path, text: str):
    """`text` into `path` whole or not at all: written beside it, then renamed over it."""
    partial = path.with_name(path.name + PARTIAL)
    partial.write_text(text)
    os.replace(partial, path)


def move_into_place(partial: Path, final: Path):
    """Rename a finished `.partial` folder to its name. A folder already there is the same step written by an
    earlier attempt (a run replays steps only after a crash): the new one replaces it."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)


def save_checkpoint(accelerator, model, output: Path, step: int, progress: dict):
    """`save_state` (every process writes its part: the main one the weights, optimizer, scheduler and sampler, each
    one its random generators) into checkpoint-STEP.partial, then progress.json, then the rename: a process killed
    at any point leaves no folder that looks whole. A `.partial` left by a killed attempt is removed first."""
    partial = output / f"checkpoint-{step}{PARTIAL}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(partial)
    kill_if_asked(accelerator, step)  # halfway: this process's part is written, the other's may not be
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # the config makes a merged FSDP checkpoint loadable on its own
        accelerator.unwrap_model(model).config.save_pretrained(partial)
        (partial / "progress.json").write_text(json.dumps(progress))
        move_into_place(partial, output / f"checkpoint-{step}")
    accelerator.wait_for_everyone()


def checkpoint_progress(parser, checkpoint: str) -> dict:
    """The progress.json of `checkpoint` (the step, the losses so far, the untrained model's metrics), read before any
    process starts: a folder that is not a whole checkpoint of this script is refused, naming what is wrong."""
    progress, saved, problem = Path(checkpoint) / "progress.json", None, None
    if not Path(checkpoint).is_dir():
        problem = "no such folder"
    elif not progress.is_file():
        problem = "no progress.json in it, so not a whole checkpoint of this script"
    else:
        try:
            saved = json.loads(progress.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            problem = f"its progress.json is damaged ({error})"
        if problem is None and not (isinstance(saved, dict) and {"step", "losses", "untrained"} <= saved.keys()):
            problem = "its progress.json lacks the step, losses and untrained metrics this script writes"
    if problem:
        parser.error(f"argument --resume-from: {checkpoint}: {problem}; pass a checkpoint-N folder written by "
                     f"--checkpoint-every, or `latest`")
    return saved


def latest_checkpoint(output: Path):
    """The whole checkpoint of the highest step in `output` (`.partial` folders are not whole), or None."""
    steps = [int(match[1]) for path in output.glob("checkpoint-*")
             if (match := re.fullmatch(r"checkpoint-(\d+)", path.name)) and (path / "progress.json").is_file()]
    return output / f"checkpoint-{max(steps)}" if steps else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["classification", "seq2seq"], default="classification")
    parser.add_argument("--model", type=existing("folder"),
                        help="start from this checkpoint (e.g. a converted BERT) instead of random init")
    parser.add_argument("--output", required=True, help="directory for checkpoints, losses.json and final/")
    parser.add_argument("--steps", type=at_least(1), default=200, help="optimizer steps")
    parser.add_argument("--batch-size", type=at_least(1), default=16, help="per process, per micro-batch")
    parser.add_argument("--grad-accum", type=at_least(1), default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--width", type=at_least(1), default=64)
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="every dropout: embeddings, sub-layer outputs, attention weights, classifier")
    parser.add_argument("--mixed-precision", choices=["auto", "no", "fp16", "bf16"], default="auto",
                        help="auto: bf16 on a GPU that supports it, otherwise full precision")
    parser.add_argument("--fsdp", choices=["full", "sharded"],
                        help="shard the model with FSDP2 (needs a multi-process launch); checkpoints are written "
                             "as one full state dict or as one shard per process")
    parser.add_argument("--checkpoint-every", type=at_least(0, " (0: never)"), default=0,
                        help="save_state every N steps (0: never)")
    parser.add_argument("--resume-from",
                        help="a checkpoint directory written by --checkpoint-every, or `latest`: the newest whole "
                             "checkpoint in --output, or a fresh start where there is none (for torchrun "
                             "--max-restarts: the restarted processes run the same command)")
    parser.add_argument("--save-rank-weights", action="store_true",
                        help="also write each process's final weights (rank{N}.safetensors), to check they agree")
    parser.add_argument("--threads", type=at_least(0, " (0: the script's choice)"), default=0,
                        help="torch CPU threads per process (0: 1 for the built-in small model, else the process's "
                             "share of the cores)")
    parser.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is present")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if restarts_would_hang():
        parser.error("torchrun --max-restarts needs a store per attempt, or a restarted group hangs at its first "
                     "connect: launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d "
                     "--rdzv-endpoint HOST:PORT (one machine: --standalone)")
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        parser.error(f"argument --output: {output} is a file; pass a folder (a new one, or one this script wrote)")
    if args.resume_from == "latest" and (output / "final").exists():
        print(f"{output} holds a finished run ({output / 'final'}); nothing to resume")
        return json.loads((output / "losses.json").read_text())[-1]
    if (output / "final").exists():
        parser.error(f"{output / 'final'} already exists; choose another --output (nothing was overwritten)")
    if args.resume_from == "latest":
        # Read before the process group forms, so no process of this launch has written anything yet.
        latest = latest_checkpoint(output) if output.is_dir() else None
        args.resume_from = str(latest) if latest else None
    resumed = checkpoint_progress(parser, args.resume_from) if args.resume_from else None

    mixed = args.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if not args.cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    plugin = fsdp_plugin(args)
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=mixed, gradient_accumulation_steps=args.grad_accum, fsdp_plugin=plugin,
        # The shuffled order is a function of (seed, epoch), saved with the state: a resumed run replays it.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # The warm-up counts optimizer steps. Left to Accelerate, the schedule would advance once per process per
        # step (as if written for one process's batches), and N processes would warm up N times faster.
        step_scheduler_with_optimizer=False,
    )
    select_fsdp_on_cpu(accelerator, plugin)
    if args.fsdp and accelerator.distributed_type != DistributedType.FSDP:
        parser.error("--fsdp needs a multi-process launch: torchrun --nproc_per_node N ... or accelerate launch ...")
    torch.set_num_threads(cpu_threads(args))
    set_seed(args.seed)  # the same initial weights in every process
    output.mkdir(parents=True, exist_ok=True)

    model = build_model(args)
    global_batch = args.batch_size * accelerator.num_processes
    data = Synthetic(args.task, size=args.steps * args.grad_accum * global_batch, seed=args.seed)
    held_out = Synthetic(args.task, size=256, seed=args.seed + 1)
    # The loader's own generator: creating an iterator draws a seed from it, and a draw from the global generator
    # would shift every dropout mask after a resume.
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=collate(args.task),
                        generator=torch.Generator().manual_seed(args.seed))
    if accelerator.distributed_type == DistributedType.FSDP:
        model.to(accelerator.device)
        shard_tied_modules_together(model, accelerator.state.fsdp_plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    if args.resume_from:
        try:
            accelerator.load_state(args.resume_from)  # weights, optimizer, scheduler, sampler, RNG states
        except FileNotFoundError as error:  # a file deleted from a whole checkpoint: progress.json was written last
            parser.error(f"argument --resume-from: {args.resume_from} is incomplete ({error.filename} is missing); "
                         f"pass another checkpoint-N folder, or start afresh without --resume-from")
        step, losses, untrained = resumed["step"], resumed["losses"], resumed["untrained"]
        accelerator.print(f"resumed from {args.resume_from} at step {step}")
    else:
        step, losses, untrained = 0, [], evaluate(model, args.task, held_out, accelerator.device)
    micro_batches = accelerator.skip_first_batches(loader, step * args.grad_accum)

    model.train()
    progress = tqdm(total=args.steps, initial=step, desc=f"{args.task} ({accelerator.distributed_type}, "
                    f"{accelerator.num_processes} process{'es' if accelerator.num_processes > 1 else ''})",
                    disable=not accelerator.is_local_main_process)
    step_loss = 0.0
    for batch in micro_batches:
        with accelerator.accumulate(model):
            loss = scaled_loss(accelerator, model(**batch).loss, batch["labels"])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()  # a no-op between accumulated micro-batches
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        step_loss += accelerator.reduce(loss.detach(), reduction="mean").item() / args.grad_accum
        if not accelerator.sync_gradients:
            continue
        step += 1
        losses.append(step_loss)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}")
        step_loss = 0.0
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save_checkpoint(accelerator, model, output, step, {"step": step, "losses": losses, "untrained": untrained})
        else:
            kill_if_asked(accelerator, step)
        if step >= args.steps:
            break
    progress.close()

    accelerator.wait_for_everyone()
    if args.save_rank_weights:
        from safetensors.torch import save_file

        weights = output / f"rank{accelerator.process_index}.safetensors"
        save_file(full_weights(accelerator.unwrap_model(model)), weights.with_name(weights.name + PARTIAL))
        os.replace(weights.with_name(weights.name + PARTIAL), weights)
    state_dict = accelerator.get_state_dict(model)  # FSDP: gathered in full on the main process only
    trained = evaluate(model, args.task, held_out, accelerator.device)
    if accelerator.is_main_process:
        # A fresh instance of the model's own class: under FSDP2 the prepared model's class is a generated subclass
        # (FSDPVanilla...), which save_pretrained would name in config.json's auto_map, next to copies of torch's
        # FSDP source files.
        config = accelerator.unwrap_model(model).config
        state_dict = {k: v.cpu() for k, v in state_dict.items()}
        final = MODEL_CLASSES[args.task].from_pretrained(None, config=config, state_dict=state_dict)
        shutil.rmtree(output / f"final{PARTIAL}", ignore_errors=True)  # left by a killed attempt
        final.save_pretrained(output / f"final{PARTIAL}")
        write_atomically(output / "losses.json", json.dumps(losses))
        move_into_place(output / f"final{PARTIAL}", output / "final")  # last: final/ marks a finished run
        accelerator.print(f"final training loss {losses[-1]:.4f} after {step} steps; model saved to {output / 'final'}")
        accelerator.print(f"held-out ({len(held_out)} examples): {describe(trained, untrained, args.task)}")
    # Every process waits for the main one's saving, then all take the process group down together. Without it the
    # others tore theirs down while the main process was still running; on torch 2.15 one of them then aborted in
    # the teardown ("terminate called without an active exception") in about 1 run in 20 (2-core AMD Zen 5), and
    # torchrun reported the whole run failed after everything had been written.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return losses[-1]


if __name__ == "__main__":
    main()
