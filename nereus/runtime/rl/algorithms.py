"""RL advantages and losses: PPO (GAE, clipped objective, value loss), GRPO, ReMax (DESIGN.md §4.1).

Pure functions on tensors. Shapes: ``B`` sequences, ``R`` response positions; ``mask`` ``[B, R]`` is 1
for response tokens up to and including EOS. Losses are *sums* divided by ``denom`` (the number of
response tokens in the whole mini-batch, across DP replicas and micro-batches), so micro-batch and DP
gradients add up to the token-mean loss of the mini-batch exactly (verl's ``token-mean``).

Sources: GAE, Schulman et al. 2016 (arXiv 1506.02438); PPO clipped objective and clipped value loss,
Schulman et al. 2017 and OpenAI baselines ``ppo2``; GRPO, Shao et al. 2024 (arXiv 2402.03300),
group-normalized outcome advantages and the k3 KL estimator in the loss; ReMax, Li et al. 2023
(arXiv 2310.10505), return minus the greedy rollout's reward.
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_whiten", "token_rewards", "gae", "grpo_advantages",
           "remax_advantages", "kl_k3", "policy_loss", "value_loss"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked entries (unbiased variance), zero elsewhere."""
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp_min(1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def token_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> torch.Tensor:
    """Per-token rewards ``[B, R]``: ``-kl_coef·(logp - ref_logp)`` plus ``scores[b]`` on the last token.

    Raises:
        ValueError: a sequence with an empty mask.
    """
    if (mask.sum(1) == 0).any():
        raise ValueError("token_rewards: every sequence needs at least one response token in mask")
    r = -kl_coef * (logp - ref_logp) * mask
    last = mask.sum(1).long() - 1
    r[torch.arange(r.shape[0]), last] += scores
    return r


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over masked response tokens.

    ``δ_t = r_t + γ·V_{t+1}·m_{t+1} - V_t``; ``A_t = δ_t + γλ·m_{t+1}·A_{t+1}``; returns ``A + V``.
    Positions after the last valid token end the episode (their values never leak in).

    Returns:
        (advantages ``[B, R]``, returns ``[B, R]``), both zero outside ``mask``.
    """
    B, R = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype)
    for t in reversed(range(R)):
        if t + 1 < R:
            nm = mask[:, t + 1]
            nv = values[:, t + 1] * nm
        else:
            nm = torch.zeros(B, dtype=rewards.dtype)
            nv = nm
        delta = rewards[:, t] + gamma * nv - values[:, t]
        last = delta + gamma * lam * nm * last
        adv[:, t] = last
    return adv * mask, (adv + values) * mask


def grpo_advantages(scores: torch.Tensor, group_size: int, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(s - mean_group) / (std_group + eps)`` broadcast over each sequence's tokens ``[B, R]``.

    Sequences of one prompt are contiguous groups of ``group_size``; std is unbiased (verl). A group
    of one (``n = 1``) takes mean 0 and std 1, so its advantage is ``s / (1 + eps)``, as verl's
    ``compute_grpo_outcome_advantage`` does (``verl/trainer/ppo/core_algos.py``, verl 0.9.1).

    Raises:
        ValueError: ``group_size < 1`` or ``B`` not a multiple of it.
    """
    B = scores.shape[0]
    if group_size < 1 or B % group_size:
        raise ValueError(f"grpo_advantages: group_size={group_size} must be >= 1 and divide the batch {B}")
    g = scores.view(-1, group_size)
    if group_size == 1:
        return (g / (1.0 + eps)).reshape(B, 1) * mask
    a = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)
    return a.reshape(B, 1) * mask


def remax_advantages(rewards: torch.Tensor, baseline: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return-to-go of per-token ``rewards`` minus the greedy rollout's score ``baseline`` ``[B]``."""
    rtg = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
    return (rtg - baseline[:, None]) * mask


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's k3, >= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip: float, denom: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate ``Σ max(-r·A, -clip(r, 1±ε)·A)·m / denom`` with ``r = exp(logp - old_logp)``.

    Returns:
        (loss scalar, number of clipped tokens).
    """
    ratio = torch.exp(logp - old_logp)
    l1 = -ratio * adv
    l2 = -torch.clamp(ratio, 1 - clip, 1 + clip) * adv
    loss = (torch.maximum(l1, l2) * mask).sum() / denom
    return loss, ((l2 > l1).float() * mask).sum().detach()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, denom: float) -> torch.Tensor:
    """Clipped value loss ``0.5·Σ max((V-R)², (clip(V, V_old±c) - R)²)·m / denom``."""
    vc = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * (torch.maximum((values - returns) ** 2, (vc - returns) ** 2) * mask).sum() / denom
