"""flex_attention's compiled CPU kernels and torch's compile cache, which every process of a user shares.

torch keys a cached CPU graph without the vector instructions it was generated for (ATEN_CPU_CAPABILITY, per
process); a graph cached under AVX2 and read back under AVX-512 answered wrongly (hf_vanilla.compat.
flex_attention_forward). These tests fill a fresh cache under one capability and read it under another, each in its
own process (the capability is read when torch loads), and check the answer against sdpa at the float32 rule.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import assert_close

from hf_vanilla import VanillaEncoderConfig, VanillaEncoderModel

pytestmark = pytest.mark.numerics
ROOT = Path(__file__).resolve().parent.parent

# One process: a small encoder under flex_attention and under sdpa at two lengths (the second makes the compiled
# shapes dynamic); prints the largest difference and torch's FX graph cache counters as JSON.
CHILD = """
import json, torch
from torch._dynamo.utils import counters
from hf_vanilla import VanillaEncoderConfig, VanillaEncoderModel
torch.manual_seed(0)
config = VanillaEncoderConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=32)
model = VanillaEncoderModel(config).eval()
worst = 0.0
with torch.no_grad():
    for length in (5, 9):
        ids = torch.randint(5, 100, (1, length))
        model.set_attn_implementation("sdpa")
        expected = model(input_ids=ids).last_hidden_state
        model.set_attn_implementation("flex_attention")
        worst = max(worst, (model(input_ids=ids).last_hidden_state - expected).abs().max().item())
print(json.dumps({"diff": worst, "capability": torch.backends.cpu.get_cpu_capability(),
                  "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def run_child(cache: Path, capability: str | None) -> dict:
    env = {name: value for name, value in os.environ.items() if name != "ATEN_CPU_CAPABILITY"}
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_cache_filled_under_avx2_is_not_read_under_another_capability(tmp_path):
    """The cache filled by a process capped at AVX2, then read by one at the machine's own capability: the second
    answers as sdpa does, and where its capability is another, it compiled afresh rather than reading AVX2's graphs
    (on an AVX2-only CPU the two are the same capability, and reading them back is right)."""
    filled = run_child(tmp_path, "avx2")
    read = run_child(tmp_path, None)
    for run in (filled, read):
        assert_close(torch.tensor(run["diff"]), torch.tensor(0.0), msg=f"flex_attention under {run['capability']}")
    if read["capability"] != filled["capability"]:
        assert read["hits"] == 0 and read["misses"] > 0, read
    else:
        assert read["hits"] > 0, read


def test_flex_attention_keys_compile_caches_by_cpu_capability():
    """Stands for the test above in the default run: after a flex_attention call on the CPU, torch's compile cache
    key tag names this process's CPU capability (any tag set before is kept), so a graph cached under another
    capability is not read back; the answer equals sdpa's."""
    before = torch.compiler.config.cache_key_tag
    try:
        torch.compiler.config.cache_key_tag = "users-own-tag"
        torch.manual_seed(0)
        model = VanillaEncoderModel(VanillaEncoderConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32)).eval()
        ids = torch.randint(5, 100, (1, 7))
        with torch.no_grad():
            expected = model(input_ids=ids).last_hidden_state
            model.set_attn_implementation("flex_attention")
            assert_close(model(input_ids=ids).last_hidden_state, expected)
        capability = torch.backends.cpu.get_cpu_capability()
        assert torch.compiler.config.cache_key_tag == f"users-own-tag,cpu-capability={capability}"
    finally:
        torch.compiler.config.cache_key_tag = before
