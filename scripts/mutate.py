"""Mutation testing of the numerics core: named one-line mutations, each of which some test must catch (`make mutate`).

No maintained mutation tool fits this project's cost: a tool's generic operators (swap `<` for `<=`, drop a call)
produce thousands of mutants, most of them syntax-level, and every mutant of the regions would need the tests that
compare with the engine. The table below holds instead the mistakes that matter here, one line each: a rounding
moved, an fp32 accumulation done in bf16, the residual stream rounded, the row-block schedule or the TP sum taken in
another order, the sampler's log-softmax written another way, a metric window merged wrongly, the start-up check's
decision rule loosened. Each names the tests that must fail under it.

For each mutation the script copies the package and its tests (`trl_roundalign/`, `tests/`, `scripts/`,
`pyproject.toml`) into a temporary directory, applies the edit there (the snippet must occur exactly once in the
file: a stale table fails loudly, verdict "error"), runs `python -m pytest -x -q <node ids>` with a timeout, and
records "killed" (the tests failed), "survived" (they passed: a missing test) or "error". The working tree is never
edited. Before the mutations it runs every named test once on the unmutated copy: they must pass, or a "killed"
would mean nothing.

The report goes to docs/results/<cpu kind>/mutation.md and mutation.json. Exit status: 0 when every mutation is
killed, 1 when one survives, 2 on an error (a stale snippet, a baseline failure).

    python scripts/mutate.py                 # all mutations
    python scripts/mutate.py --only NAME ... # some of them (the report is then not written unless --report)
    python scripts/mutate.py --list          # the table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("trl_roundalign", "tests", "scripts", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    find: str  # must occur exactly once in the file
    replace: str
    breaks: str  # what the mutation breaks, in one line
    tests: tuple[str, ...]  # pytest node ids; at least one must fail


TRITON = "tests/ops/test_triton_ops.py"
REF = "tests/ops/test_reference_vs_vllm.py"
ATTN = "tests/ops/test_attention.py"
GEMM = "tests/ops/test_gemm.py"
TP_ENGINE = "tests/models/test_tensor_parallel_vllm.py"
TP_MINOR = "tests/trainer/test_review_minor.py"
SAMPLER = "tests/test_sampler_logprobs.py"
METRICS = "tests/test_metrics.py"
WINDOWS = "tests/test_metrics_windows.py"
TIE = "tests/trainer/test_verify_tie.py"
SCHEDULE = "tests/trainer/test_unreproduced.py"
SERVER = "tests/trainer/test_server_mode.py"
SERVER_EXACT = "tests/trainer/test_server_exact.py"
ALONE = "tests/engine/test_prefill_alone.py"
GDN = "tests/ops/test_gated_delta_net.py"
GDN_SAMPLER = "tests/trainer/test_sampler_exact_sweep.py::test_gated_delta_net_model_is_the_samplers"

MUTATIONS: tuple[Mutation, ...] = (
    # ---- the regions' arithmetic -------------------------------------------------------------------------------
    Mutation(
        "norm-two-roundings", "trl_roundalign/ops/_common.py",
        "return (xf * rstd) * weight.float(), rstd",
        "return (xf * rstd).to(weight.dtype).float() * weight.float(), rstd",
        "the aligned RMSNorm rounds x̂ before the weight (Hugging Face's two roundings, not the engine's one)",
        (f"{TRITON}::test_rms_norm_forward", f"{REF}::test_rms_norm"),
    ),
    Mutation(
        "norm-rstd-reciprocal", "trl_roundalign/ops/_common.py",
        "return torch.rsqrt(var + eps)",
        "return 1.0 / torch.sqrt(var + eps)",
        "rstd through eager `reciprocal` (not the compiled `1/sqrt`, which eager rsqrt reproduces)",
        (f"{REF}::test_rms_norm", f"{REF}::test_reduction_order_is_what_makes_rms_norm_exact"),
    ),
    Mutation(
        "norm-lane-tree-adjacent", "trl_roundalign/ops/_common.py",
        "acc = acc[..., :width] + acc[..., width:]",
        "acc = acc[..., 0::2] + acc[..., 1::2]",
        "sum(x^2)'s lanes reduced pairwise-adjacent instead of Inductor's halving tree",
        (f"{TRITON}::test_rms_norm_lanes_exact_many_rows", f"{REF}::test_reduction_order_is_what_makes_rms_norm_exact"),
    ),
    Mutation(
        "norm-square-sum-bf16", "trl_roundalign/ops/_common.py",
        "sq = xf * xf",
        "sq = (xf * xf).bfloat16().float()",
        "the squares of the RMSNorm reduction rounded to bf16 before the fp32 accumulation",
        (f"{TRITON}::test_rms_norm_forward", f"{REF}::test_rms_norm"),
    ),
    Mutation(
        "residual-stream-rounded", "trl_roundalign/ops/rms_norm.py",
        "        s = residual.float() + x.float()\n        y, rstd = norm_forward_fp32(s, weight, eps, lanes)",
        "        s = (residual.float() + x.float()).to(x.dtype).float()\n        y, rstd = norm_forward_fp32(s, weight, eps, lanes)",
        "the fp32 residual stream rounded to bf16 at every add (the engine's compiled graph never rounds it)",
        (f"{TRITON}::test_add_rms_norm_forward", f"{REF}::test_add_rms_norm"),
    ),
    Mutation(
        "residual-returned-rounded", "trl_roundalign/ops/rms_norm.py",
        "return y.to(weight.dtype), s\n",
        "return y.to(weight.dtype), s.to(x.dtype)\n",
        "add_rms_norm hands the next sublayer a rounded residual instead of the fp32 sum",
        (f"{TRITON}::test_add_rms_norm_forward", f"{REF}::test_add_rms_norm"),
    ),
    Mutation(
        "norm-backward-no-mean-term", "trl_roundalign/ops/_common.py",
        "dx = rstd * (dxhat - xhat * ((dxhat * xhat).sum(dim=-1, keepdim=True) / n))",
        "dx = rstd * dxhat",
        "the RMSNorm gradient loses the term through rstd (not the fp32 derivative)",
        (f"{TRITON}::test_rms_norm_backward", f"{TRITON}::test_add_rms_norm_backward"),
    ),
    Mutation(
        "swiglu-silu-rounded", "trl_roundalign/ops/swiglu.py",
        "return (_silu_fp32(gf) * up.float()).to(gate.dtype)",
        "return (_silu_fp32(gf).to(gate.dtype).float() * up.float()).to(gate.dtype)",
        "SwiGLU rounds silu(gate) before the product (two roundings, not the compiled one)",
        (f"{TRITON}::test_swiglu_forward_bitwise", f"{REF}::test_swiglu"),
    ),
    Mutation(
        "swiglu-silu-sigmoid", "trl_roundalign/ops/swiglu.py",
        "return gf / (torch.exp(-gf) + 1.0)",
        "return gf * torch.sigmoid(gf)",
        "silu in fp32 as g * sigmoid(g), not Inductor's g / (exp(-g) + 1)",
        (f"{REF}::test_swiglu", f"{TRITON}::test_swiglu_forward_every_gate_value"),
    ),
    Mutation(
        "swiglu-backward-gate", "trl_roundalign/ops/swiglu.py",
        "dg = go * uf * sig * (1.0 + gf * (1.0 - sig))",
        "dg = go * uf * sig",
        "the gate's gradient drops silu's derivative term",
        (f"{TRITON}::test_swiglu_backward",),
    ),
    Mutation(
        "rope-products-rounded", "trl_roundalign/ops/rope.py",
        "    o1 = x1 * c - x2 * s\n",
        "    o1 = (x1 * c).bfloat16().float() - (x2 * s).bfloat16().float()\n",
        "RoPE rounds each product to bf16 before the difference (not one fp32 rotation, one rounding)",
        (f"{TRITON}::test_rope_forward_bitwise", f"{REF}::test_rope"),
    ),
    Mutation(
        "qk-norm-rounded-before-rope", "trl_roundalign/ops/rope.py",
        "return rotate_fp32(y, c, s, rd).to(x.dtype)",
        "return rotate_fp32(y.to(x.dtype).float(), c, s, rd).to(x.dtype)",
        "Qwen3's q/k-norm rounded before the rotation (the fused region keeps it fp32)",
        (f"{TRITON}::test_qk_norm_rope_forward", f"{REF}::test_qk_norm_rope"),
    ),
    Mutation(
        "rope-backward-sign", "trl_roundalign/ops/rope.py",
        "d2 = g2 * c - g1 * s",
        "d2 = g2 * c + g1 * s",
        "the transposed rotation of the RoPE backward takes the wrong sign",
        (f"{TRITON}::test_rope_backward",),
    ),
    # ---- the exact attention path ------------------------------------------------------------------------------
    Mutation(
        "attn-backward-no-softmax-jacobian", "trl_roundalign/ops/attention.py",
        "ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))",
        "ds = p * dp",
        "the attention backward drops the softmax's row-sum term",
        (f"{ATTN}::test_backward_fp32_matches_autograd_without_vllm",),
    ),
    Mutation(
        "attn-backward-gqa-one-head", "trl_roundalign/ops/attention.py",
        "dk[sl, h] = torch.matmul(ds.transpose(1, 2), qf).sum(0) * scale",
        "dk[sl, h] = torch.matmul(ds.transpose(1, 2), qf)[0] * scale",
        "a key head's gradient takes one query head of its group instead of their sum",
        (f"{ATTN}::test_backward_fp32_matches_autograd_without_vllm",),
    ),
    Mutation(
        "attn-window-dropped", "trl_roundalign/ops/attention.py",
        "                sliding_window=int(sliding_window),\n                block_table=group_table,",
        "                sliding_window=-1,\n                block_table=group_table,",
        "the kernel call loses the layer's sliding window (the engine applies it)",
        (f"{ATTN}::test_the_kernel_applies_the_window_it_is_given",),
    ),
    Mutation(
        "attn-threads-leak", "trl_roundalign/ops/attention.py",
        "            torch._C.set_num_threads(previous_threads)",
        "            pass",
        "a one-call thread count (the engine's) is left set for every later kernel call",
        (f"{ATTN}::test_num_threads_is_restored",),
    ),
    Mutation(
        "attn-module-scale-ignored", "trl_roundalign/ops/attention.py",
        "scale = float(scaling) if scaling is not None else d**-0.5",
        "scale = d**-0.5",
        "the Hugging Face interface ignores the module's softmax scale (Gemma 3's query_pre_attn_scalar)",
        (f"{ATTN}::test_hf_interface_passes_the_modules_scale", f"{ATTN}::test_padded_batch_equals_unpadded_rows"),
    ),
    # ---- the row-block schedule --------------------------------------------------------------------------------
    Mutation(
        "gemm-tail-unpadded", "trl_roundalign/engine/gemm.py",
        "tail = x.new_zeros(rows, k)",
        "tail = x.new_zeros(m - full, k)",
        "the last row block is computed at its own row count, not zero-padded to the block size",
        (f"{GEMM}::test_every_gemm_call_has_exactly_block_rows_rows", f"{GEMM}::test_row_blocks_compute_f_linear_on_each_block"),
    ),
    Mutation(
        "gemm-block-size-doubled", "trl_roundalign/engine/gemm.py",
        "    return row_blocked_linear(x, weight, bias, rows)\n",
        "    return row_blocked_linear(x, weight, bias, 2 * rows)\n",
        "`linear` computes with another block size than the engine layout's",
        (f"{GEMM}::test_every_gemm_call_has_exactly_block_rows_rows", f"{GEMM}::test_install_and_remove_on_a_model"),
    ),
    Mutation(
        "gemm-single-rows-skipped", "trl_roundalign/engine/gemm.py",
        "for i in range(1, min(SINGLE_ROWS, max_rows)):",
        "for i in range(1, 1):",
        "the measurement tests M = 1 on row 0 only (a 1-row call that differs on other rows passes unseen)",
        ("tests/engine/test_single_sequence_decode.py::test_the_measurement_sees_a_single_row_that_differs_beyond_the_first",),
    ),
    Mutation(
        "gemm-auto-ignores-measurement", "trl_roundalign/engine/gemm.py",
        "    if reports[0].invariant:\n        return GemmSchedule(), reports",
        "    if True:\n        return GemmSchedule(), reports",
        "'auto' takes plain F.linear without looking at the measurement (wrong on Intel AMX and AMD AVX-512)",
        (f"{GEMM}::test_auto_blocks_where_plain_is_measured_variant", f"{GEMM}::test_choose_schedule_follows_the_measurement"),
    ),
    Mutation(
        "gemm-floor-unpadded", "trl_roundalign/engine/gemm.py",
        "    if m >= min_rows:\n",
        "    if m >= 1:\n",
        "the row floor computes a short call at its own row count (a 1-row decode GEMM on AMD AVX-512)",
        (f"{GEMM}::test_every_gemm_call_under_a_floor_has_at_least_the_floor",
         f"{GEMM}::test_row_floor_is_the_padded_gemm_below_the_floor_and_plain_above"),
    ),
    Mutation(
        "gemm-floor-never-tried", "trl_roundalign/engine/gemm.py",
        "    candidates = ([GemmSchedule(0, floor)] if floor else []) + [GemmSchedule(DEFAULT_BLOCK_ROWS)]",
        "    candidates = [GemmSchedule(DEFAULT_BLOCK_ROWS)]",
        "'auto' pads every call to 64-row blocks where a row floor would do (the decode-time cost it removes)",
        (f"{GEMM}::test_auto_takes_a_row_floor_where_only_the_smallest_row_counts_differ",),
    ),
    # ---- each prompt prefilled alone (engine.prefill) -----------------------------------------------------------
    Mutation(
        "engine-prompts-batched", "trl_roundalign/engine/prefill.py",
        "            groups = request_groups(lens) or [(0, len(lens))]\n",
        "            groups = [(0, len(lens))]\n",
        "the engine computes a step's prompts in one attention call again (a long prompt's bits depend on its company)",
        (f"{ALONE}::test_a_long_prompt_is_prefilled_as_alone_beside_others",),
    ),
    Mutation(
        "trainer-prompts-batched", "trl_roundalign/ops/attention.py",
        "    groups = (alone and request_groups(",
        "    groups = (False and request_groups(",
        "the trainer recomputes a forward's prompts in one kernel call, not each alone as the engine prefilled them",
        (f"{ALONE}::test_the_trainer_computes_each_prompt_as_its_lone_prefill",),
    ),
    # ---- the engine's schedule, reproduced from its record ------------------------------------------------------
    Mutation(
        "server-decode-form-colocated-only", "trl_roundalign/trainer/grpo.py",
        'if "attention" in self.args.roundalign_regions and self.roundalign_layout is not None:',
        'if "attention" in self.args.roundalign_regions and self.roundalign_engine is not None:',
        "exact mode's completions recomputed in decode form only for a colocated engine, not against a server",
        (f"{SERVER_EXACT}::test_exact_grpo_against_a_server_is_bit_identical_to_its_sampler",),
    ),
    Mutation(
        "server-weight-digest-differences-ignored", "trl_roundalign/engine/weight_digest.py",
        "            elif mine != digest:\n", "            elif False:\n",
        "a server tensor whose digest differs from the trainer's counted as compared",
        (f"{SERVER_EXACT}::test_exact_grpo_against_a_server_is_bit_identical_to_its_sampler",),
    ),
    Mutation(
        "server-restart-unnoticed", "trl_roundalign/trainer/server_exact.py",
        "    if started is None or now is None or now == started:\n", "    if True:\n",
        "a completion from another engine than the start-up check's (a restarted server) trained on",
        (f"{SERVER_EXACT}::test_each_completion_comes_back_with_its_schedule_record",),
    ),
    Mutation(
        "gdn-norm-eager-exp", "trl_roundalign/models/qwen3_5.py",
        "(zf / (inductor_exp(-zf) + 1.0))", "(zf / (torch.exp(-zf) + 1.0))",
        "Qwen3.5's gated output norm takes eager exp, not the engine's compiled one (92.2% of a GRPO step measured)",
        (f"{GDN}::test_the_gated_norm_is_inductors_and_eager_exp_is_not", GDN_SAMPLER),
    ),
    Mutation(
        "gdn-decode-as-prefill", "trl_roundalign/models/qwen3_5.py",
        "lens=lens, prefill=sampled_prefill_ends(lens, starts, rows, batch),",
        "lens=lens, prefill=None,",
        "the gated delta-net's sampled tokens recomputed in one chunked prefill, not one recurrent step each",
        (GDN_SAMPLER,),
    ),
    Mutation(
        "gdn-slot-zero", "trl_roundalign/ops/gated_delta_net.py",
        "        slots = _i32(i + 1 for i in seqs)\n", "        slots = _i32(seqs)\n",
        "a decoded sequence on cache slot 0, the engine's null block, which vLLM's conv update skips",
        (f"{GDN}::test_the_engine_form_is_the_formula_up_to_rounding_and_depends_on_the_schedule", GDN_SAMPLER),
    ),
    Mutation(
        "trainer-reprefills-ignored", "trl_roundalign/trainer/grpo.py",
        "        here = reprefill is not None and bool((reprefill > 0).any())\n",
        "        here = False\n",
        "a preempted request's tokens after its re-prefill recomputed as after the first prefill (86.4% measured)",
        (f"{SCHEDULE}::test_a_preempting_engine_is_reproduced_bit_for_bit",),
    ),
    Mutation(
        "trainer-prefill-cuts-ignored", "trl_roundalign/trainer/grpo.py",
        "        main_cuts = None if cuts is None else [row_cuts(cuts, r, 0) for r in range(input_ids.shape[0])]\n",
        "        main_cuts = None\n",
        "a chunked prefill's cuts inside KV blocks ignored (81.6% measured at a 200-token budget)",
        (f"{SCHEDULE}::test_vllms_chunked_prefill_is_reproduced_bit_for_bit",),
    ),
    Mutation(
        "engine-prefill-not-in-block-pieces", "trl_roundalign/engine/prefill.py",
        "for pa, pe in block_pieces(start, seq_lens[a], builder.block_size)]",
        "for pa, pe in [(start, seq_lens[a])]]",
        "the engine prefills a request in one call, so a cached block's bits depend on how far its request went (11.3%)",
        (f"{SCHEDULE}::test_prefix_caching_is_reproduced_bit_for_bit",),
    ),
    Mutation(
        "schedule-hit-inherits-nothing", "trl_roundalign/engine/schedule.py",
        "cuts = [*self.inherited[i], start] if start > 0 else []",
        "cuts = [start] if start > 0 else []",
        "a prefix hit recomputed without the starts inside the cached blocks (67.6% and 75.0% at a 200-token budget)",
        (f"{SCHEDULE}::test_prefix_caching_is_reproduced_bit_for_bit",),
    ),
    # ---- the TP sum order --------------------------------------------------------------------------------------
    Mutation(
        "tp-sum-in-bf16", "trl_roundalign/engine/tp.py",
        "acc_dtype = torch.promote_types(weight.dtype, torch.float32)",
        "acc_dtype = weight.dtype",
        "the row-parallel partials summed in bf16, not fp32 (the same bits at TP=2: two bf16 values add in fp32; not at 4)",
        (f"{TP_MINOR}::test_the_tp_sum_is_carried_in_fp32_across_every_partial",
         f"{TP_MINOR}::test_the_tp_sum_of_bf16_partials_still_goes_through_fp32"),
    ),
    Mutation(
        "tp-bias-in-last-partial", "trl_roundalign/engine/tp.py",
        "bias if r == 0 else None",
        "bias if r == tp - 1 else None",
        "the bias goes into the last rank's partial (the engine adds it on rank 0, before that partial's rounding)",
        (f"{TP_ENGINE}::test_row_parallel_linear_is_two_rounded_partials_summed_in_fp32",),
    ),
    Mutation(
        "tp-interleaved-slices", "trl_roundalign/engine/tp.py",
        "x[..., r * k : (r + 1) * k].contiguous(), weight[:, r * k : (r + 1) * k]",
        "x[..., r::tp].contiguous(), weight[:, r::tp]",
        "the inner dimension split into interleaved shards instead of contiguous slices",
        (f"{TP_MINOR}::test_the_tp_sum_of_bf16_partials_still_goes_through_fp32",
         f"{TP_ENGINE}::test_row_parallel_linear_is_two_rounded_partials_summed_in_fp32"),
    ),
    # ---- the sampler log-softmax -------------------------------------------------------------------------------
    Mutation(
        "sampler-temperature-reciprocal", "trl_roundalign/trainer/logprobs.py",
        "z.div_(temp)",
        "z.mul_(1.0 / temp)",
        "the temperature applied as a multiplication by its reciprocal (the sampler divides)",
        (f"{SAMPLER}::test_forward_is_the_samplers_bit_for_bit",),
    ),
    Mutation(
        "sampler-logits-bf16", "trl_roundalign/trainer/logprobs.py",
        "z = linear(hidden[s:e].to(compute_dtype), w, b, rows, schedule.min_rows).float()",
        "z = linear(hidden[s:e].to(compute_dtype), w, b, rows, schedule.min_rows)",
        "the log-softmax computed on bf16 logits (the sampler converts them to fp32 first)",
        (f"{SAMPLER}::test_forward_is_the_samplers_bit_for_bit",),
    ),
    Mutation(
        "sampler-logsumexp-form", "trl_roundalign/trainer/logprobs.py",
        "lp = torch.log_softmax(z, dim=-1)",
        "lp = z - torch.logsumexp(z, dim=-1, keepdim=True)",
        "log-softmax written as z - logsumexp(z): the same function, another fp32 order",
        (f"{SAMPLER}::test_forward_is_the_samplers_bit_for_bit",),
    ),
    # ---- the metrics' window merge -----------------------------------------------------------------------------
    Mutation(
        "merge-ratio-min-last", "trl_roundalign/metrics.py",
        "merged.ratio_min = min(merged.ratio_min, s.ratio_min)",
        "merged.ratio_min = s.ratio_min",
        "a merged window's minimum ratio is its last part's, not the minimum over the parts",
        (f"{METRICS}::test_merge_takes_the_extremes_wherever_they_fall", f"{WINDOWS}::test_logged_max_min_and_counts_cover_the_whole_window"),
    ),
    Mutation(
        "merge-abs-max-last", "trl_roundalign/metrics.py",
        "merged.abs_diff_max = max(merged.abs_diff_max, s.abs_diff_max)",
        "merged.abs_diff_max = s.abs_diff_max",
        "a merged window's max |Δlogp| is its last part's",
        (f"{METRICS}::test_merge_equals_union_of_tokens", f"{WINDOWS}::test_logged_max_min_and_counts_cover_the_whole_window"),
    ),
    Mutation(
        "merge-bitwise-count-last", "trl_roundalign/metrics.py",
        "merged.bitwise_equal += s.bitwise_equal",
        "merged.bitwise_equal = s.bitwise_equal",
        "the bit-identical token count of a window is its last part's, not the sum",
        (f"{METRICS}::test_merge_equals_union_of_tokens", f"{WINDOWS}::test_logged_max_min_and_counts_cover_the_whole_window"),
    ),
    Mutation(
        "merge-histogram-counts-lost", "trl_roundalign/metrics.py",
        "index_add_(0, inverse, counts)",
        "index_add_(0, inverse, torch.ones_like(counts))",
        "merged |Δ| histograms count each part's bucket once, not by its tokens (quantiles skew)",
        (f"{METRICS}::test_merge_equals_union_of_tokens", f"{WINDOWS}::test_logged_means_and_quantiles_are_token_weighted_over_the_window"),
    ),
    Mutation(
        "merge-seq-ratios-last", "trl_roundalign/metrics.py",
        "merged.seq_log_ratios = torch.cat([s.seq_log_ratios.cpu().double() for s in sums_list])",
        "merged.seq_log_ratios = sums_list[-1].seq_log_ratios.cpu().double()",
        "per-sequence log-ratios of a merge keep only the last part's sequences",
        (f"{METRICS}::test_merge_equals_union_of_tokens", f"{METRICS}::test_reduce_with_accelerator_gathers_in_rank_order"),
    ),
    # ---- the start-up check's decision rule ----------------------------------------------------------------------
    Mutation(
        "check-exact-99-percent", "trl_roundalign/trainer/startup_check.py",
        "        if chosen_score.frac_bitwise_equal < 1.0:",
        "        if chosen_score.frac_bitwise_equal < 0.99:",
        "exact mode accepted at 99% bit-identical (the rule is 100%)",
        (f"{TIE}::test_an_exact_profile_short_of_100_percent_is_refused",),
    ),
    Mutation(
        "check-margin-ignored", "trl_roundalign/trainer/startup_check.py",
        "and chosen_score.kl_k3 - best.kl_k3 > margin",
        "and chosen_score.kl_k3 - best.kl_k3 > 0",
        "a rival refutes the chosen profile by any lower k3, inside the engine's own noise",
        (f"{SERVER}::test_a_rival_must_beat_the_profile_by_more_than_the_engines_own_noise",),
    ),
    Mutation(
        "check-ratio-ignored", "trl_roundalign/trainer/startup_check.py",
        "best is not None and best.kl_k3 < better_ratio * chosen_score.kl_k3",
        "best is not None and best.kl_k3 < chosen_score.kl_k3",
        "a rival refutes the chosen profile without halving its k3 (better_ratio ignored)",
        (f"{TIE}::test_a_rival_must_beat_the_ratio_as_well_as_the_margin",),
    ),
    Mutation(
        "check-tie-by-order", "trl_roundalign/trainer/startup_check.py",
        "        if configured in bases:\n            return configured",
        "        if bases:\n            return bases[0]",
        "a tie between exact refinements decided by the order they were scored in",
        (f"{TIE}::test_a_tie_between_the_exact_refinements_is_decided_by_the_engines_configuration",
         f"{TIE}::test_a_tie_the_configuration_cannot_decide_is_reported_as_a_tie"),
    ),
    Mutation(
        "check-tie-accepts-any", "trl_roundalign/trainer/startup_check.py",
        "runs = chosen_base if chosen_base in result.tied else None",
        "runs = chosen_base",
        "an undecidable tie accepts a chosen profile that is not one of the tied ones",
        (f"{TIE}::test_an_undecidable_tie_refuses_a_profile_outside_it",),
    ),
    # ---- routing replay ----------------------------------------------------------------------------------------------
    Mutation(
        "routing-recompute-last-routes", "trl_roundalign/ops/routing.py",
        "                layer._gradient_checkpointing_func = _keeping_routes(function, self)",
        "                pass",
        "a layer recomputed in the backward replays the last forward's routes, not its own forward's",
        ("tests/ops/test_routing_checkpoint.py::test_a_recomputed_layer_replays_its_forwards_experts",),
    ),
)


def cpu_kind() -> str:
    sys.path.insert(0, str(ROOT))
    from trl_roundalign.engine.gemm import cpu_kind as kind

    return kind()


def apply(text: str, m: Mutation) -> str:
    n = text.count(m.find)
    if n != 1:
        raise LookupError(f"{m.name}: the snippet occurs {n} times in {m.file} (must be exactly once): {m.find!r}")
    return text.replace(m.find, m.replace)


def failed_test(output: str) -> str:
    """The first FAILED/ERROR node id of pytest's short summary (or its first error line)."""
    for line in output.splitlines():
        hit = re.match(r"^(FAILED|ERROR) (\S+)", line)
        if hit:
            return hit.group(2)
    for line in output.splitlines():
        if line.startswith("E "):
            return line.strip()[:160]
    return ""


def run_tests(work: Path, tests: tuple[str, ...], timeout: float, env: dict) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def test_env(work: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(work) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # The repository's caches (converted tiny models, Inductor's compile cache), not a fresh one per copy.
    env.setdefault("ROUNDALIGN_TEST_CACHE", str(ROOT / ".cache"))
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        env.setdefault(key, value)
    return env


def source_commit() -> str:
    """The commit the copy was taken from, marked when the copied paths had uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--", *COPIED) else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def write_report(results: list[dict], kind: str, seconds: float, baseline_s: float, commit: str) -> Path:
    out = ROOT / "docs" / "results" / kind
    out.mkdir(parents=True, exist_ok=True)
    killed = sum(r["verdict"] == "killed" for r in results)
    survived = sum(r["verdict"] == "survived" for r in results)
    errors = sum(r["verdict"] == "error" for r in results)
    summary = {"cpu_kind": kind, "commit": commit, "mutations": len(results), "killed": killed, "survived": survived, "errors": errors,
               "seconds": round(seconds, 1), "baseline_seconds": round(baseline_s, 1), "results": results}
    (out / "mutation.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        f"# Mutation testing of the numerics core ({kind})",
        "",
        "Written by `make mutate` (`scripts/mutate.py`). Each row is a one-line edit of the package, applied to a "
        "temporary copy; its tests must fail under it. Killed: they did; survived: they passed (a missing test).",
        "",
        f"**{len(results)} mutations: {killed} killed, {survived} survived, {errors} errors**; "
        f"{seconds / 60:.1f} min in all (the unmutated baseline of every named test: {baseline_s:.0f} s), "
        f"on {commit}.",
        "",
        "| mutation | file | what it breaks | verdict | killed by | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        by = f"`{r['killed_by']}`" if r["killed_by"] else ""
        lines.append(f"| `{r['name']}` | `{r['file']}` | {_cell(r['breaks'])} | {r['verdict']} | {_cell(by)} | "
                     f"{r['seconds']:.0f} |")
    (out / "mutation.md").write_text("\n".join(lines) + "\n")
    return out / "mutation.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutation's test run (default 600)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    ap.add_argument("--report", action="store_true", help="write the report also for a --only run")
    args = ap.parse_args(argv)

    names = [m.name for m in MUTATIONS]
    if len(set(names)) != len(names):
        print("duplicate mutation names", file=sys.stderr)
        return 2
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:36s} {m.file:40s} {m.breaks}")
        return 0
    chosen = list(MUTATIONS)
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            print(f"unknown mutations: {unknown}", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.name in args.only]

    # A terminated run ends its test process too (subprocess.run kills the child on the exception) and removes the copy.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.perf_counter()
    kind = cpu_kind()
    commit = source_commit()
    with tempfile.TemporaryDirectory(prefix="roundalign-mutate-") as tmp:
        work = Path(tmp)
        for name in COPIED:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, work / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, work / name)
        env = test_env(work)
        where = subprocess.run([sys.executable, "-c", "import trl_roundalign; print(trl_roundalign.__file__)"],
                               cwd=work, env=env, capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(work)):
            print(f"the copy's tests would import trl_roundalign from {where!r}, not the copy", file=sys.stderr)
            return 2

        baseline_s = 0.0
        if not args.no_baseline:
            every = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            print(f"baseline: {len(every)} test selections on the unmutated copy ...", flush=True)
            t0 = time.perf_counter()
            rc, out = run_tests(work, every, args.timeout * 2, env)
            baseline_s = time.perf_counter() - t0
            if rc != 0:
                print(out[-4000:], file=sys.stderr)
                print(f"baseline failed ({rc}): the named tests must pass before any mutation", file=sys.stderr)
                return 2
            print(f"baseline passed in {baseline_s:.0f} s", flush=True)

        results = []
        for i, m in enumerate(chosen, 1):
            path = work / m.file
            original = path.read_text()
            row = {"name": m.name, "file": m.file, "breaks": m.breaks, "tests": list(m.tests), "verdict": "error",
                   "killed_by": "", "seconds": 0.0}
            t0 = time.perf_counter()
            try:
                mutated = apply(original, m)
            except LookupError as e:
                row["killed_by"] = ""
                row["error"] = str(e)
                print(f"[{i}/{len(chosen)}] {m.name}: ERROR {e}", flush=True)
                results.append(row)
                continue
            try:
                path.write_text(mutated)
                rc, out = run_tests(work, m.tests, args.timeout, env)
            finally:
                path.write_text(original)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            if rc is None:
                row["verdict"], row["killed_by"] = "killed", f"timeout after {args.timeout:.0f} s"
            elif rc == 0:
                row["verdict"] = "survived"
            elif rc in (1, 2):  # tests failed (1), or collection/usage errors (2): the edit made them fail
                row["verdict"], row["killed_by"] = "killed", failed_test(out)
            else:  # 3: internal error, 4: usage, 5: no tests collected -- not a kill
                row["error"] = f"pytest exit {rc}: {out[-400:]}"
            print(f"[{i}/{len(chosen)}] {m.name}: {row['verdict']} {row['killed_by']} ({row['seconds']:.0f} s)",
                  flush=True)
            results.append(row)

    seconds = time.perf_counter() - start
    if not args.only or args.report:
        print(f"report: {write_report(results, kind, seconds, baseline_s, commit)}")
    survived = [r["name"] for r in results if r["verdict"] == "survived"]
    errors = [r["name"] for r in results if r["verdict"] == "error"]
    killed = sum(r["verdict"] == "killed" for r in results)
    print(f"{len(results)} mutations: {killed} killed, {len(survived)} survived, {len(errors)} errors "
          f"({seconds:.0f} s)")
    if errors:
        print(f"errors: {errors}", file=sys.stderr)
        return 2
    if survived:
        print(f"survived (missing tests): {survived}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
