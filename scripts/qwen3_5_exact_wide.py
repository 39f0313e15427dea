"""Exact GRPO on a Qwen3.5 hybrid with transformers' default gated delta-net head layout (16 key / 32 value heads of
128; hidden 1024, 3 gated delta-net layers then 1 full attention, random weights): 2 steps of 2 prompts x 2 completions
of up to 256 tokens, colocated, every completion token against the sampler. Prints each step's mismatch and the
start-up check's record. Run from the repository root:

    python scripts/qwen3_5_exact_wide.py    # docs/results/<kind>/qwen3_5-exact.txt records its answer
"""

import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "trainer")]
from test_sampler_exact_sweep import run  # noqa: E402

from trl_roundalign.local_models import tiny_qwen3_5  # noqa: E402

W = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
     "intermediate_size": 3072, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
     "linear_key_head_dim": 128, "linear_value_head_dim": 128, "initializer_range": 0.02}
tmp = pathlib.Path(tempfile.mkdtemp())
t0 = time.time()
checks = []
layout, logs = run(tmp, prompts_per_step=2, completions=2, stop=True, seed=1, length=256, model=tiny_qwen3_5(**W), verification=checks)
for h in logs:
    print("LOG", {k: v for k, v in h.items() if k in ("mismatch/frac_bitwise_equal", "mismatch/tokens", "mismatch/kl_k3", "mismatch/unreproduced_tokens", "schedule/preemptions", "schedule/prefilled_tokens")})
print("CHECK", checks[0].sampler_forms, checks[0].sampler_bitwise, checks[0].sampler_tokens, "GDN", layout.gated_delta_net, "seconds", round(time.time() - t0))
