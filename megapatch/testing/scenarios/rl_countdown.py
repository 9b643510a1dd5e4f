"""A test fixture, labelled as such: a Megatron RL environment modelled on upstream's
``examples/rl/environments/countdown`` -- the same prompt text and the same reward function
(upstream's ``compute_score``, imported from the checkout ``train_rl.py`` runs in, not copied) --
whose tasks are generated from a seed instead of read from a Hugging Face dataset (no hub here).

Named in ``--langrl-env-config`` as ``megapatch.testing.scenarios.rl_countdown.SyntheticCountdownAgent``;
imported by Megatron RL's agent loader inside ``train_rl.py`` (it needs ``megatron.rl``). The
reward adds a small shaping term to upstream's score (see ``get_reward``), so that a tiny untrained
model's rollouts differ in reward and each GRPO step has a gradient: rewards are not the point here,
the train-vs-rollout log-prob mismatch is."""

from __future__ import annotations

import random
from typing import Any

from megatron.rl.agent.reward_only_agent import RewardOnlyAgent


def task(rng: random.Random) -> dict:
    """A countdown task as upstream's dataset holds them: 3 or 4 numbers and a target."""
    return {"target": rng.randint(1, 100), "nums": [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]}


def prompt(target: int, nums: list) -> str:
    # upstream's CountdownAgent.make_prefix in chat mode, shortened to fit a 64-token sequence
    return f"Using the numbers {nums}, create an equation that equals {target}. <answer>"


class SyntheticCountdownAgent(RewardOnlyAgent):
    seed: int = 0
    drawn: int = 0
    env_id: str = "synthetic-countdown"  # Megatron-LM main labels every rollout with it (upstream's agents set one)

    async def evaluation_prompts(self, num_prompts: int, validation: bool = False) -> list:
        rng = random.Random(self.seed + 10_000)
        return [(prompt(**t), t) for t in (task(rng) for _ in range(num_prompts))]

    async def get_prompt(self, validation: bool = False) -> tuple:
        self.drawn += 1  # the n-th prompt of this agent, the same in every run
        golden = task(random.Random(self.seed * 1_000_003 + self.drawn))
        return prompt(**golden), golden

    async def get_reward(self, response: str, golden: Any, finish_reason: Any = None) -> float:
        # finish_reason: Megatron-LM main hands it (core_v0.16.1 does not); the score does not use it
        from examples.rl.environments.countdown.countdown import compute_score

        # upstream's score, plus a shaping term (the share of digits in the response, at most 0.05): an
        # untrained model never closes an <answer> tag, so every rollout of a group would score 0,
        # every advantage would be 0 and GRPO's policy gradient with it
        return compute_score(response, golden) + 0.05 * sum(c.isdigit() for c in response) / max(len(response), 1)
