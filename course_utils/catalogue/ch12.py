"""Chapter 12's graded exercises, all checked in the notebook process (pure tensor functions):

- ``lora_merge``: fold a LoRA adapter into its base weight, W0 + (alpha / r) B A (Hu et al. 2021, sec. 4.1);
- ``dpo_loss``: the DPO loss from sequence log-probs (Rafailov et al. 2023, eq. 7);
- ``grpo_advantages``: group-relative advantages (Shao et al. 2024, DeepSeekMath, sec. 4.1.2).
"""
from __future__ import annotations

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register


def _close(got, want, tol=1e-6) -> bool:
    import torch

    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(
        got.double(), want.double(), rtol=tol, atol=tol, equal_nan=False)


# -- 1. LoRA merge --------------------------------------------------------------------------------------

# (d, k, r, alpha): alpha = r once, on purpose; then ints as configs write them, where r does not divide alpha
MERGE_CASES = [(6, 5, 2, 4.0), (8, 3, 1, 1.0), (4, 7, 4, 16.0), (5, 6, 3, 8), (6, 4, 8, 4)]


def check_lora_merge(answer) -> tuple[str, str]:
    import torch

    g = torch.Generator().manual_seed(0)
    for d, k, r, alpha in MERGE_CASES:
        W, A, B = (torch.randn(d, k, generator=g), torch.randn(r, k, generator=g), torch.randn(d, r, generator=g))
        W_before, A_before, B_before = W.clone(), A.clone(), B.clone()
        got = answer(W, A, B, alpha, r)
        want = W_before + (alpha / r) * B @ A
        where = f"d={d}, k={k}, r={r}, alpha={alpha:g}"
        if not torch.equal(W, W_before):
            return FAIL, f"{where}: you changed W in place: return a new merged matrix and leave the base weight alone"
        if not (torch.equal(A, A_before) and torch.equal(B, B_before)):
            return FAIL, f"{where}: you changed A or B in place: the adapter must survive the merge (to unmerge, or save)"
        if not isinstance(got, torch.Tensor) or got.shape != (d, k):
            return FAIL, f"{where}: return a [d, k] = [{d}, {k}] tensor (W's shape), got {getattr(got, 'shape', got)}"
        if not bool(torch.isfinite(got).all()):
            return FAIL, (f"{where}: the merged weight holds {int((~torch.isfinite(got)).sum())} NaN or infinite "
                          "entries, although W, A and B are finite: W0 + (alpha / r) B @ A")
        if _close(got, want):
            continue
        if alpha % r and _close(got, W_before + (alpha // r) * B @ A):
            return FAIL, (f"{where}: you scaled by alpha // r = {alpha // r} (floor division) instead of alpha / r = "
                          f"{alpha / r:.4g}: with integer alpha and r, // rounds down, which only shows when r does "
                          "not divide alpha; use /")
        if _close(got, W_before + B @ A) and alpha != r:
            return FAIL, f"{where}: you forgot the scale alpha / r: W = W0 + (alpha / r) * B @ A"
        if _close(got, W_before + alpha * B @ A):
            return FAIL, f"{where}: you scaled by alpha instead of alpha / r"
        if _close(got, W_before + r / alpha * B @ A):
            return FAIL, f"{where}: the scale is upside down: alpha / r, not r / alpha"
        if _close(got, (alpha / r) * B @ A):
            return FAIL, f"{where}: you returned only the update: add it to the frozen W0"
        return FAIL, f"{where}: wrong merged weight; W0 is [d, k], B is [d, r], A is [r, k]: W0 + (alpha/r) B @ A"
    return PASS, "correct: W0 + (alpha / r) B A, the same output as the adapted layer, at no extra inference cost"


# -- 2. DPO loss ----------------------------------------------------------------------------------------

def _dpo_reference(pc, pr, rc, rr, beta):
    import torch.nn.functional as F

    return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()


DPO_CASES = [  # (n, beta, log-prob centre, spread): sequence log-probs are sums over tokens, often hundreds below 0
    (5, 0.1, -5.0, 3.0), (3, 0.5, -5.0, 3.0), (4, 2.0, -5.0, 3.0),
    (6, 1.0, -300.0, 150.0),  # margins of hundreds: sigmoid(margin) rounds to 0 or 1 in fp32
]


def check_dpo_loss(answer) -> tuple[str, str]:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    for n, beta, centre, spread in DPO_CASES:
        pc, pr, rc, rr = (torch.randn(n, generator=g) * spread + centre for _ in range(4))
        pc.requires_grad_()
        pr.requires_grad_()
        before = [t.detach().clone() for t in (pc, pr, rc, rr)]
        got = answer(pc, pr, rc, rr, beta)
        want = _dpo_reference(pc.detach(), pr.detach(), rc, rr, beta)
        where = f"n={n}, beta={beta:g}" + (f", log-probs around {centre:g}" if centre < -100 else "")
        if not isinstance(got, torch.Tensor) or got.dim() != 0:
            return FAIL, f"{where}: return a scalar tensor (the mean loss over pairs), got {got!r}"
        if not all(torch.equal(t.detach(), b) for t, b in zip((pc, pr, rc, rr), before)):
            return FAIL, f"{where}: you changed the log-probs in place: compute into new tensors"
        if not got.requires_grad:
            return FAIL, f"{where}: the loss has no gradient: compute it with torch ops from the log-probs"
        if torch.isinf(got):
            return FAIL, (f"{where}: got {got.item()}: log(sigmoid(x)) is -inf once sigmoid(x) rounds to 0 (x below "
                          "about -100 in fp32): an unstable form. Use F.logsigmoid(x), which never takes the log of 0")
        if torch.isnan(got):
            return FAIL, (f"{where}: got nan, not a number: look for 0/0 or inf - inf (a log of 0 times 0, a "
                          "division by a difference); -F.logsigmoid(beta * margin).mean() is finite for any margin")
        if _close(got.detach(), want, 1e-5):
            grads = torch.autograd.grad(got, (pc, pr), allow_unused=True)
            ref_pc, ref_pr = pc.detach().clone().requires_grad_(), pr.detach().clone().requires_grad_()
            want_grads = torch.autograd.grad(_dpo_reference(ref_pc, ref_pr, rc, rr, beta), (ref_pc, ref_pr))
            for name, grad, want_grad in zip(("policy_chosen", "policy_rejected"), grads, want_grads):
                grad = torch.zeros_like(want_grad) if grad is None else grad
                scale = want_grad.abs().max().item()
                if torch.allclose(grad.double(), want_grad.double(), rtol=1e-4, atol=1e-5 * scale + 1e-12):
                    continue
                if not grad.any():
                    return FAIL, (f"{where}: the loss is right but its gradient with respect to {name} is zero: "
                                  f"{name} is detached from the graph (.detach(), .item() or torch.no_grad()), so "
                                  f"training never moves {'the rejected answer down' if 'rejected' in name else 'the chosen answer up'}; "
                                  "keep both policy log-probs in the graph")
                return FAIL, (f"{where}: the loss is right but its gradient with respect to {name} is not "
                              f"({grad.tolist()[:3]}... instead of {want_grad.tolist()[:3]}...): part of it is detached")
            continue
        v = got.detach()
        pc_, pr_ = pc.detach(), pr.detach()
        alt = {
            "the sign is flipped: the loss must fall as the chosen answer gains on the rejected one, "
            "-log sigmoid(beta * (chosen log-ratio - rejected log-ratio))":
                -F.logsigmoid(-beta * ((pc_ - rc) - (pr_ - rr))).mean(),
            "beta is missing: the margin is beta * (log-ratio of chosen - log-ratio of rejected)":
                -F.logsigmoid((pc_ - rc) - (pr_ - rr)).mean(),
            "the reference is not subtracted: DPO compares log(pi / pi_ref), not log pi alone":
                -F.logsigmoid(beta * (pc_ - pr_)).mean(),
            "you summed over pairs: average, so the loss does not grow with the batch":
                -F.logsigmoid(beta * ((pc_ - rc) - (pr_ - rr))).sum(),
        }
        for why, value in alt.items():
            if _close(v, value.detach(), 1e-5):
                return FAIL, f"{where}: {why}"
        return FAIL, f"{where}: got {v.item():.6g}, expected {want.item():.6g}"
    return PASS, ("correct: -mean log sigmoid(beta * [(log pi_w - log ref_w) - (log pi_l - log ref_l)]), with the "
                  "gradient of both policy log-probs, stable for margins of hundreds")


# -- 3. GRPO advantages ---------------------------------------------------------------------------------

def _adv_reference(rewards, group_size, unbiased=True):
    groups = rewards.double().view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True, unbiased=unbiased) + 1e-4)).view(-1)


def check_grpo_advantages(answer) -> tuple[str, str]:
    import torch

    cases = [  # (rewards, group_size): groups on different scales, and one group whose rewards all agree
        (torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]), 4),
        (torch.tensor([0.0, 1.0, 1.0, 1.0, 10.0, 12.0, 8.0, 10.0]), 4),
        (torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 3),
        (torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]), 4),
    ]
    for rewards, G in cases:
        given = rewards.clone()
        got = answer(given, G)
        where = f"rewards={rewards.tolist()}, group_size={G}"
        if not torch.equal(given, rewards):
            return FAIL, (f"{where}: your function changed the rewards it was given (now {given.tolist()}): "
                          "rewards.view(...) shares their memory, so -= or /= on it writes into the caller's tensor, "
                          "which the logger and the next step still read. Compute the advantages into a new tensor")
        if not isinstance(got, torch.Tensor) or got.shape != rewards.shape:
            return FAIL, f"{where}: return one advantage per reward, a tensor of shape {tuple(rewards.shape)}"
        if not bool(torch.isfinite(got).all()):
            constant = bool((rewards.view(-1, G).std(1) == 0).any())
            return FAIL, (f"{where}: NaN or infinite advantages: " + (
                "a group whose rewards are all equal has std 0: add a small eps (1e-4) to the denominator so its "
                "advantages are 0" if constant else "every group's std is positive here: look for another division "
                "by 0"))
        if any(_close(got, _adv_reference(rewards, G, u), 1e-3) for u in (True, False)):
            continue
        flat = rewards.double()
        if torch.allclose(got.double(), (flat - flat.mean()) / (flat.std() + 1e-4), atol=1e-3):
            return FAIL, f"{where}: you normalised over the whole batch: normalise within each group of {G} answers"
        centred = (flat.view(-1, G) - flat.view(-1, G).mean(1, keepdim=True)).view(-1)
        if torch.allclose(got.double(), centred, atol=1e-3):
            return FAIL, f"{where}: you subtracted the group mean but did not divide by the group's std"
        return FAIL, f"{where}: got {got.tolist()}, expected (r - group mean) / (group std + eps) per group"
    return PASS, "correct: (r - mean) / (std + eps) within each group; a group with equal rewards gets 0"


ONE_PROCESS = "a tensor formula in one process: no ranks, nothing sent"
NO_GRADIENTS = NOT_APPLICABLE + "no gradient is accumulated: the answer is called once per case, on fresh inputs"
NO_BUFFERS = NOT_APPLICABLE + "the answer keeps no buffer to release: a few small tensors per call"
TOLERANCE = NOT_APPLICABLE + "values are compared to a tolerance: the same formula in another order moves the last bits"

register(Exercise("lora_merge", "12", "lora_merge", "LoRA merge: fold B A, scaled by alpha / r, into W0",
                  local=check_lora_merge, tries={
                      "non-finite": "a NaN or infinite entry of the merged weight is named",
                      "order": NO_GRADIENTS,
                      "sizes": "ranks r that divide alpha and ranks that do not (alpha 8, r 3; alpha 4, r 8): floor "
                               "division shows only there",
                      "ragged": NOT_APPLICABLE + "W, A and B are whole matrices; nothing is partitioned",
                      "layouts": NOT_APPLICABLE + "five shapes (d != k, r = 1, r > k) are tried, but W0 + (alpha/r) "
                                 "B @ A has one layout: a wrong product fails to run on any shape",
                      "traffic": NOT_APPLICABLE + ONE_PROCESS,
                      "mutation": "W, A and B are compared with copies after the call",
                      "output": NOT_APPLICABLE + "the merged weight is compared by shape and value; it is never "
                                "written into a buffer of the caller's",
                      "memory": NO_BUFFERS,
                      "bits": TOLERANCE}))
register(Exercise("dpo_loss", "12", "dpo_loss", "The DPO loss from policy and reference log-probs (eq. 7)",
                  local=check_dpo_loss, tries={
                      "non-finite": "margins of hundreds, where log(sigmoid(x)) is -inf in fp32: the loss must be "
                                    "finite, and a NaN or infinite loss is named",
                      "order": NO_GRADIENTS,
                      "sizes": NOT_APPLICABLE + "the pairs are averaged, not divided between ranks",
                      "ragged": NOT_APPLICABLE + "every pair has its four log-probs; nothing is partitioned",
                      "layouts": NOT_APPLICABLE + "one layout: four vectors of n sequence log-probs",
                      "traffic": NOT_APPLICABLE + ONE_PROCESS,
                      "mutation": "the four log-prob vectors are compared with copies after the call",
                      "output": "the answer must be a 0-dim tensor, the mean over the pairs, not one loss per pair",
                      "memory": NO_BUFFERS,
                      "bits": TOLERANCE}))
register(Exercise("grpo_advantages", "12", "grpo_advantages",
                  "GRPO's group-relative advantages: normalise rewards within each group", local=check_grpo_advantages,
                  tries={
                      "non-finite": "a group whose rewards are all equal (std 0): the advantages must be finite (0), "
                                    "and NaN or infinity is named",
                      "order": NO_GRADIENTS,
                      "sizes": NOT_APPLICABLE + "a batch is a whole number of groups by definition",
                      "ragged": NOT_APPLICABLE + "every group holds group_size rewards by definition",
                      "layouts": "two groups per batch on different scales, of 3 and of 4: normalising over the "
                                 "whole batch, true of one group only, fails",
                      "traffic": NOT_APPLICABLE + ONE_PROCESS,
                      "mutation": "the rewards are compared with a copy after the call (a view shares their memory)",
                      "output": NOT_APPLICABLE + "the advantages are compared by shape and value; float rewards in, "
                                "float advantages out",
                      "memory": NO_BUFFERS,
                      "bits": TOLERANCE}))
