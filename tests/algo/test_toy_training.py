"""End to end on a toy task: sampled groups -> score_group -> policy_loss -> Adam makes the reward go up. GPUs: 0.

The policy is a table of logits per position (no context), rewarded for emitting the target token; every episode
of a group is one sample, and two optimizer steps per batch make the second one off-policy (ratios != 1).

Legend: G = group size, L = completion length, V = vocabulary, M = G * L tokens.
"""

import pytest
import torch

from forge_megatron.algo import EpisodeOutcome, LossConfig, RewardConfig, policy_loss, score_group

G, L, V, TARGET = 8, 4, 5, 3


def _rollout(logits_LV: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    probs_LV = torch.softmax(logits_LV.detach(), dim=-1)
    tokens_GL = torch.stack([torch.multinomial(probs_LV, 1, generator=gen)[:, 0] for _ in range(G)])
    return tokens_GL, (tokens_GL == TARGET).float().mean(dim=1)


def _train(loss_cfg: LossConfig, steps: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    logits_LV = torch.zeros(L, V, requires_grad=True)
    opt = torch.optim.Adam([logits_LV], lr=0.1)
    cu_S1 = torch.arange(0, G * L + 1, L)
    first_reward = None
    for _ in range(steps):
        tokens_GL, reward_G = _rollout(logits_LV, gen)
        first_reward = reward_G.mean().item() if first_reward is None else first_reward
        outcomes = [EpisodeOutcome(float(r), success=bool(r == 1.0), duration_s=1.0) for r in reward_G]
        scores = score_group(outcomes, RewardConfig())
        adv_M = torch.tensor([a[0] for a in scores.segment_advantages]).repeat_interleave(L)
        positions_M = torch.arange(L).repeat(G)

        def logp_now():
            return torch.log_softmax(logits_LV, -1)[positions_M, tokens_GL.reshape(-1)]

        old_M = logp_now().detach()
        for _ in range(2):
            loss, _ = policy_loss(logp_now(), old_M, adv_M, torch.ones(G * L), cu_S1, loss_cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
    final_reward = torch.softmax(logits_LV.detach(), -1)[:, TARGET].mean().item()  # expected reward now
    return first_reward, final_reward


@pytest.mark.parametrize("loss_type", ["cispo", "ppo", "gspo"])
def test_toy_policy_learns_target(loss_type):
    first, final = _train(LossConfig.recommended(loss_type), steps=30)
    assert first < 0.5  # uniform start: 1/V expected
    assert final > 0.9, (loss_type, first, final)
