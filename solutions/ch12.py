"""Reference answers for chapter 12's exercises (each self-contained: imports inside)."""


def lora_merge(W, A, B, alpha, r):
    """W0 [d, k] + (alpha / r) B [d, r] @ A [r, k]: the adapter folded into one matrix."""
    return W + (alpha / r) * (B @ A)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    """-mean log sigmoid(beta * [(log pi_w - log ref_w) - (log pi_l - log ref_l)]) (Rafailov et al. eq. 7)."""
    import torch.nn.functional as F

    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin).mean()


def grpo_advantages(rewards, group_size):
    """(r - group mean) / (group std + eps) within each consecutive group of group_size rewards."""
    groups = rewards.float().view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
