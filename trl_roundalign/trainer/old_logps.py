"""Exact mode's old log-probs: the sampler's, bit for bit, instead of TRL's extra forward.

TRL computes `old_per_token_logps` at generation, with a no-grad forward of the whole batch, where the policy may move
before a batch is used (`num_iterations > 1`, `steps_per_generation` not dividing the gradient accumulation) or to
correct for the trainer-sampler gap (`vllm_importance_sampling_correction`). In exact mode the trainer's log-probs at
the generation's weights are the sampler's, bit for bit, on every completion token the engine's schedule record says
it reproduces (`unreproduced`): that forward would return the sampler's log-probs. So they stand in for it
(`roundalign_reuse_sampler_logps`, on by default), on a batch where:

- every completion token's form is reproduced (no `mismatch/unreproduced_tokens`) and the sampler returned a finite
  log-prob for each; a batch with any other takes TRL's forward, and the step says so
  (`schedule/old_logps_from_sampler` 0);
- each slice of the generation is first used at the generation's weights (`steps_per_generation <=
  gradient_accumulation_steps`, and a generation starts at an optimizer step: `steps_per_generation x num_iterations`
  a multiple of the accumulation): the step's check (`mismatch/*`) then compares the sampler's log-probs with the loss
  forward's, at the same weights, so a batch where the stand-in was not exact shows there.
"""

from __future__ import annotations

import torch

__all__ = ["OLD_FROM_SAMPLER_KEY", "OLD_FROM_SAMPLER_METRIC", "reuses_sampler_logps", "sampler_old_logps"]

# A `[B]` marker the batch carries where the sampler's log-probs stood in for TRL's old log-probs: the step's check then
# takes the loss forward's log-probs (`RoundAlignGRPOTrainer._compute_loss`).
OLD_FROM_SAMPLER_KEY = "roundalign_old_from_sampler"
OLD_FROM_SAMPLER_METRIC = "schedule/old_logps_from_sampler"


def reuses_sampler_logps(args, *, exact: bool, recorded: bool) -> bool:
    """Whether TRL computes old log-probs at generation and the sampler's may stand in for them (module docstring):
    exact mode with the engine's schedule recorded, the option on, and every slice first used at the generation's
    weights."""
    ga, spg, ni = int(args.gradient_accumulation_steps), int(args.steps_per_generation), int(args.num_iterations)
    trl_computes = ga % (spg * ni) != 0 or bool(args.use_vllm and args.vllm_importance_sampling_correction)
    first_use_at_generation = spg <= ga and (spg * ni) % ga == 0
    return bool(args.roundalign_reuse_sampler_logps and exact and recorded and trl_computes and first_use_at_generation)


def sampler_old_logps(sampling: list, codes: torch.Tensor, *, pad_to_multiple_of, device) -> torch.Tensor | None:
    """The sampler's log-probs (`sampling`: TRL's per-completion lists) as TRL pads them (right, 0.0), to stand in for
    the old log-probs of a batch whose schedule codes (`unreproduced.ScheduleCapture.codes`) are `codes`; None where
    some completion token was computed in a form the trainer does not reproduce (a code above 0), a log-prob is
    missing, or the shapes differ: TRL's forward is then taken."""
    from trl.trainer.utils import pad

    if bool((codes > 0).any()) or any(x is None for logps in sampling for x in logps):
        return None
    out = pad([torch.tensor(list(logps), dtype=torch.float32) for logps in sampling], padding_value=0.0,
              padding_side="right", pad_to_multiple_of=pad_to_multiple_of).to(device)
    return out if tuple(out.shape) == tuple(codes.shape) else None
