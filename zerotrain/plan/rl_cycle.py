"""The arithmetic of online RL's generation cycle (--task grpo): which optimizer step and rank each prompt of a
generation batch belongs to, and the steps an epoch of prompts makes. The plan's steps per epoch
(zerotrain/plan/resolve.py plan_run) and the rollouts (zerotrain/train/grpo.py) both read it here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError


@dataclass(frozen=True)
class Cycle:
    """The arithmetic of a generation cycle, from the plan's batch and the rl section."""

    num_generations: int
    """Completions per prompt (rl.num_generations)."""
    prompts_per_step: int
    """Prompts of one optimizer step, all ranks (the global batch / num_generations)."""
    prompts_per_rank: int
    """Prompts of one optimizer step that one data-parallel rank samples."""
    steps_per_generation: int
    """Optimizer steps one generation batch feeds (rl.steps_per_generation / grad_accum)."""
    num_iterations: int
    """Passes over each generation batch (rl.num_iterations, TRL's mu)."""

    @property
    def prompts_per_generation(self) -> int:
        return self.prompts_per_step * self.steps_per_generation

    @property
    def steps(self) -> int:
        """Optimizer steps per cycle: every step of the generation batch, num_iterations times."""
        return self.steps_per_generation * self.num_iterations

    def owner(self, j: int) -> tuple[int, int]:
        """(step within the generation batch, rank) of the generation batch's prompt j."""
        step, within = divmod(j, self.prompts_per_step)
        return step, within // self.prompts_per_rank

    def steps_per_epoch(self, n_prompts: int) -> int:
        return (n_prompts // self.prompts_per_generation) * self.steps

    def rows_per_call(self, engine: str, rollout_rows: int) -> int:
        """Completions a rank's largest rollout `generate` call samples: one prompt's group (rl.rollout_engine exact),
        else the rank's prompts of a generation batch in whole groups, at most rollout_rows a call (0: all of them;
        zerotrain/backends/generation.py generate_batch)."""
        g = self.num_generations
        if engine == "exact":
            return g
        prompts = self.prompts_per_rank * self.steps_per_generation
        return g * min(prompts, max(1, (rollout_rows or prompts * g) // g))


def cycle_of(cfg: Any, global_batch: int, grad_accum: int, dp: int) -> Cycle:
    """The run's cycle; a batch that does not split into whole prompt groups per rank is refused in one line."""
    rl = cfg.rl
    g = rl.num_generations
    if global_batch % g:
        raise UserError(f"--global-batch {global_batch} with --num-generations {g}: the global batch counts "
                        "completions, whole groups of num_generations each; pass a multiple of it")
    if (global_batch // g) % dp:
        raise UserError(f"--global-batch {global_batch} / --num-generations {g} = {global_batch // g} prompts per step "
                        f"do not split over {dp} data-parallel ranks (each rank samples whole groups); pass a global "
                        f"batch that is a multiple of {g * dp}")
    per_gen = rl.steps_per_generation or grad_accum
    if per_gen % grad_accum:
        raise UserError(f"--steps-per-generation {per_gen} with --grad-accum {grad_accum}: a generation batch must be "
                        "whole optimizer steps; pass a multiple of --grad-accum")
    per_step = global_batch // g
    return Cycle(g, per_step, per_step // dp, per_gen // grad_accum, rl.num_iterations)
