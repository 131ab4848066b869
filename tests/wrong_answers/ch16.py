"""Plausible wrong answers for chapter 16, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def dispatch_plan_splits_per_expert(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    return torch.argsort(kept, stable=True), torch.bincount(kept, minlength=n_experts).tolist()  # [E], not [ep]


def dispatch_plan_counts_dropped(experts, keep, n_experts, ep):
    import torch

    chosen = experts.reshape(-1)  # every choice, the dropped ones too
    counts = torch.bincount(chosen, minlength=n_experts)
    return torch.argsort(chosen, stable=True), counts.view(ep, -1).sum(1).tolist()


def dispatch_plan_token_order(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    counts = torch.bincount(kept, minlength=n_experts)
    return torch.arange(len(kept)), counts.view(ep, -1).sum(1).tolist()  # sorted by token, not by expert


def dispatch_plan_sorted_ids(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    counts = torch.bincount(kept, minlength=n_experts)
    return torch.sort(kept).values, counts.view(ep, -1).sum(1).tolist()  # the sorted values, not the permutation


def dispatch_plan_round_robin(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    return torch.argsort(kept, stable=True), torch.bincount(kept % ep, minlength=ep).tolist()  # expert e on rank e % ep


def dispatch_plan_splits_tensor(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    counts = torch.bincount(kept, minlength=n_experts)
    return torch.argsort(kept, stable=True), counts.view(ep, -1).sum(1)  # a tensor: all_to_all_single refuses it


def dispatch_plan_ranks_in_place(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    order = torch.argsort(kept, stable=True)
    experts //= n_experts // ep  # expert -> its EP rank, written into the caller's experts
    return order, torch.bincount(experts[keep], minlength=ep).tolist()


def dispatch_plan_bincount_without_minlength(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    counts = torch.bincount(kept)  # as long as the highest expert chosen, not n_experts
    return torch.argsort(kept, stable=True), counts.view(ep, -1).sum(1).tolist()


def dispatch_plan_nan_split(experts, keep, n_experts, ep):
    import torch

    kept = experts[keep]
    splits = torch.bincount(kept, minlength=n_experts).view(ep, -1).sum(1).tolist()
    splits[-1] = float("nan")
    return torch.argsort(kept, stable=True), splits


def load_balancing_loss_local(probs, experts, n_experts, top_k, group):
    import torch

    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype)  # this rank's alone
    f = counts / (experts.shape[0] * top_k)
    return n_experts * (f * probs.mean(dim=0)).sum()


def load_balancing_loss_no_factor(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    stats = torch.cat([torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype),
                       torch.tensor([float(experts.shape[0])], dtype=probs.dtype)])
    dist.all_reduce(stats, group=group)
    return (stats[:-1] / (stats[-1] * top_k) * probs.mean(dim=0)).sum()  # no n_experts


def load_balancing_loss_tokens_only(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    stats = torch.cat([torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype),
                       torch.tensor([float(experts.shape[0])], dtype=probs.dtype)])
    dist.all_reduce(stats, group=group)
    return n_experts * (stats[:-1] / stats[-1] * probs.mean(dim=0)).sum()  # f sums to top_k


def load_balancing_loss_p_summed(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    stats = torch.cat([torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype),
                       torch.tensor([float(experts.shape[0])], dtype=probs.dtype)])
    dist.all_reduce(stats, group=group)
    return n_experts * (stats[:-1] / (stats[-1] * top_k) * probs.sum(dim=0)).sum()  # a sum over tokens


def load_balancing_loss_f_from_probs(probs, experts, n_experts, top_k, group):
    P = probs.mean(dim=0)
    f = P  # the router's probabilities as the fractions: differentiable, and another loss
    return n_experts * (f * P).sum()


def load_balancing_loss_p_all_reduced(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    stats = torch.cat([torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype),
                       torch.tensor([float(experts.shape[0])], dtype=probs.dtype)])
    dist.all_reduce(stats, group=group)
    P = dnn.all_reduce(probs.mean(dim=0), group=group) / dist.get_world_size(group)  # the group's mean
    return n_experts * (stats[:-1] / (stats[-1] * top_k) * P).sum()


def load_balancing_loss_detached(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    stats = torch.cat([torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype),
                       torch.tensor([float(experts.shape[0])], dtype=probs.dtype)])
    dist.all_reduce(stats, group=group)
    return n_experts * (stats[:-1] / (stats[-1] * top_k) * probs.detach().mean(dim=0)).sum()  # no gradient


def load_balancing_loss_world_group(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    stats = torch.cat([torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype),
                       torch.tensor([float(experts.shape[0])], dtype=probs.dtype)])
    dist.all_reduce(stats)  # the default group: the whole world
    return n_experts * (stats[:-1] / (stats[-1] * top_k) * probs.mean(dim=0)).sum()


def load_balancing_loss_tokens_times_ranks(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype)
    dist.all_reduce(counts, group=group)
    tokens = experts.shape[0] * dist.get_world_size(group)  # the group's tokens, if every rank held as many
    return n_experts * (counts / (tokens * top_k) * probs.mean(dim=0)).sum()


def load_balancing_loss_gathers_choices(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    everyone = [torch.empty_like(experts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, experts, group=group)  # one shape on every rank assumed
    chosen = torch.cat(everyone)
    f = torch.bincount(chosen.reshape(-1), minlength=n_experts).to(probs.dtype) / (chosen.shape[0] * top_k)
    return n_experts * (f * probs.mean(dim=0)).sum()


def load_balancing_loss_mask_in_probs(probs, experts, n_experts, top_k, group):
    import torch.distributed as dist

    mask = probs.detach().zero_().scatter_(1, experts, 1.0)  # detach() shares probs' memory: probs is now the mask
    stats = mask.sum(dim=0)
    dist.all_reduce(stats, group=group)
    tokens = probs.new_tensor([float(experts.shape[0])])
    dist.all_reduce(tokens, group=group)
    return n_experts * (stats / (tokens * top_k) * probs.mean(dim=0)).sum()


def load_balancing_loss_p_over_choosers(probs, experts, n_experts, top_k, group):
    import torch
    import torch.distributed as dist

    stats = torch.cat([torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype),
                       torch.tensor([float(experts.shape[0])], dtype=probs.dtype)])
    dist.all_reduce(stats, group=group)
    chose = torch.zeros_like(probs).scatter(1, experts, 1.0)
    P = (probs * chose).sum(dim=0) / chose.sum(dim=0)  # the mean over the tokens that chose i: 0/0 if none did
    return n_experts * (stats[:-1] / (stats[-1] * top_k) * P).sum()


def combine_assign(rows, token_index, weight, tokens):
    out = rows.new_zeros((tokens, rows.shape[-1]))
    out[token_index] = rows * weight[:, None]  # a repeated index keeps one write
    return out


def combine_unweighted(rows, token_index, weight, tokens):
    return rows.new_zeros((tokens, rows.shape[-1])).index_add(0, token_index, rows)


def combine_weighted_twice(rows, token_index, weight, tokens):
    weighted = rows * weight[:, None]
    return rows.new_zeros((tokens, rows.shape[-1])).index_add(0, token_index, weighted * weight[:, None])


def combine_no_grad(rows, token_index, weight, tokens):
    import torch

    with torch.no_grad():
        return rows.new_zeros((tokens, rows.shape[-1])).index_add(0, token_index, rows * weight[:, None])


def combine_rows_detached(rows, token_index, weight, tokens):
    out = rows.new_zeros((tokens, rows.shape[-1]))
    return out.index_add(0, token_index, rows.detach() * weight[:, None])  # the router still learns; the experts not


def combine_weight_detached(rows, token_index, weight, tokens):
    out = rows.new_zeros((tokens, rows.shape[-1]))
    return out.index_add(0, token_index, rows * weight.detach()[:, None])


def combine_kept_tokens_only(rows, token_index, weight, tokens):
    out = rows.new_zeros((tokens, rows.shape[-1])).index_add(0, token_index, rows * weight[:, None])
    return out[token_index.unique()]  # the tokens whose choices were all dropped are left out


def combine_scales_rows_in_place(rows, token_index, weight, tokens):
    rows *= weight[:, None]  # the right sum, written over the caller's rows
    return rows.new_zeros((tokens, rows.shape[-1])).index_add(0, token_index, rows)


def combine_sized_by_token_index(rows, token_index, weight, tokens):
    out = rows.new_zeros((int(token_index.max()) + 1, rows.shape[-1]))  # short when the last tokens kept nothing
    return out.index_add(0, token_index, rows * weight[:, None])


def combine_default_device(rows, token_index, weight, tokens):
    import torch

    out = torch.zeros(tokens, rows.shape[-1], dtype=rows.dtype)  # on the default device, not rows'
    return out.index_add(0, token_index, rows * weight[:, None])


def combine_float32(rows, token_index, weight, tokens):
    import torch

    out = torch.zeros(tokens, rows.shape[-1], device=rows.device)  # float32 by default
    return out.index_add(0, token_index, (rows * weight[:, None]).to(out.dtype))


def combine_renormalised(rows, token_index, weight, tokens):
    out = rows.new_zeros((tokens, rows.shape[-1])).index_add(0, token_index, rows * weight[:, None])
    total = weight.new_zeros(tokens).index_add(0, token_index, weight)
    return out / total[:, None]  # the kept weights renormalised: 0 / 0 for a token that kept none


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("layouts")(load_balancing_loss_world_group)
tries("ragged")(load_balancing_loss_tokens_times_ranks)
tries("ragged")(load_balancing_loss_gathers_choices)
tries("mutation")(load_balancing_loss_mask_in_probs)
tries("non-finite")(load_balancing_loss_p_over_choosers)
tries("mutation")(combine_scales_rows_in_place)
tries("ragged")(combine_sized_by_token_index)
tries("output")(combine_default_device)
tries("output")(combine_float32)
tries("non-finite")(combine_renormalised)
tries("layouts")(dispatch_plan_splits_per_expert)
tries("output")(dispatch_plan_splits_tensor)
tries("mutation")(dispatch_plan_ranks_in_place)
tries("ragged")(dispatch_plan_bincount_without_minlength)
tries("non-finite")(dispatch_plan_nan_split)


WRONG = [
    ("dispatch_plan", dispatch_plan_splits_per_expert, "one per expert"),
    ("dispatch_plan", dispatch_plan_counts_dropped, "the dropped choices (keep False) are never sent"),
    ("dispatch_plan", dispatch_plan_token_order, "the rows stay in token order"),
    ("dispatch_plan", dispatch_plan_sorted_ids, "the sorted expert ids, not positions"),
    ("dispatch_plan", dispatch_plan_round_robin, "round robin"),
    ("dispatch_plan", dispatch_plan_splits_tensor, "refuses a tensor"),
    ("dispatch_plan", dispatch_plan_ranks_in_place, "changed experts in place"),
    ("dispatch_plan", dispatch_plan_bincount_without_minlength, "unless you pass minlength=n_experts"),
    ("dispatch_plan", dispatch_plan_nan_split, "send_splits[1] is nan"),
    ("load_balancing_loss", load_balancing_loss_local, "counts this rank's token choices alone"),
    ("load_balancing_loss", load_balancing_loss_no_factor, "multiply by n_experts"),
    ("load_balancing_loss", load_balancing_loss_tokens_only, "divide by tokens * top_k"),
    ("load_balancing_loss", load_balancing_loss_p_summed, "summed over the tokens, not averaged"),
    ("load_balancing_loss", load_balancing_loss_f_from_probs, "sum_i P_i^2"),
    ("load_balancing_loss", load_balancing_loss_p_all_reduced, "P was all-reduced as well"),
    ("load_balancing_loss", load_balancing_loss_detached, "carries no gradient to probs"),
    ("load_balancing_loss", load_balancing_loss_world_group, "used the default (world) group"),
    ("load_balancing_loss", load_balancing_loss_tokens_times_ranks, "this rank's tokens times the group's size"),
    ("load_balancing_loss", load_balancing_loss_gathers_choices, "gathered tensors of different shapes"),
    ("load_balancing_loss", load_balancing_loss_mask_in_probs, "changed probs in place"),
    ("load_balancing_loss", load_balancing_loss_p_over_choosers, "not finite"),
    ("combine", combine_assign, "a token chose two experts"),
    ("combine", combine_unweighted, "without their routing weights"),
    ("combine", combine_weighted_twice, "weight squared"),
    ("combine", combine_no_grad, "no gradient reaches the experts"),
    ("combine", combine_rows_detached, "no gradient reaches the experts"),
    ("combine", combine_weight_detached, "the routing weights must stay in the graph"),
    ("combine", combine_kept_tokens_only, "whose choices were all dropped"),
    ("combine", combine_scales_rows_in_place, "changed rows in place"),
    ("combine", combine_sized_by_token_index, "one per token up to the last that kept a choice"),
    ("combine", combine_default_device, "lands on the default device"),
    ("combine", combine_float32, "the rows are torch.float64"),
    ("combine", combine_renormalised, "the output holds NaN or inf"),
]
