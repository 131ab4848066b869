"""Chapter 16's exercise declarations and what is particular to its checkers (the grading itself is in
tests/test_exercises.py): the dispatch plan is checked in the notebook on cases that hold every situation it must
handle, and accepts any order of the tokens within an expert; the rank-side checks run on data where each mistake
shows. Everything here is exact: integer counts and routings fixed by seeded float64 draws far from any tie."""
import torch

from course_utils.catalogue.ch16 import DISPATCH_CASES, check_dispatch_plan, dispatch_case
from course_utils.exercises import PASS, exercises
from workers.exercises.ch16 import COMBINE_CFG, COMBINE_RUN, LB_CASES, _draw


def test_chapter_16_declares_one_local_exercise_and_two_on_ranks():
    by_name = {e.name: e for e in exercises("16")}
    assert set(by_name) == {"dispatch_plan", "load_balancing_loss", "combine"}
    assert by_name["dispatch_plan"].local is not None and by_name["dispatch_plan"].worker is None
    for name in ("load_balancing_loss", "combine"):
        assert by_name[name].worker == "workers.exercises.ch16" and by_name[name].world_sizes == (2, 4)
        assert by_name[name].local is None


def test_dispatch_cases_hold_every_situation_the_plan_must_handle():
    seen = set()
    for case in DISPATCH_CASES:
        tokens, n_experts, top_k, ep, _, _, _ = case
        experts, keep = dispatch_case(*case)
        counts = torch.bincount(experts[keep], minlength=n_experts)
        seen |= {f"top{top_k}", f"ep{ep}", f"experts{n_experts}"}
        seen |= {"drops"} if not keep.all() else {"dropless"}
        seen |= {"an expert without tokens"} if (counts == 0).any() else set()
        seen |= {"the last expert without tokens"} if counts[-1] == 0 else set()
        per_rank = counts.view(ep, -1).sum(1)
        if ep > 1 and not torch.equal(per_rank, torch.bincount(experts[keep] % ep, minlength=ep)):
            seen.add("round robin differs")
        if ep < n_experts:
            seen.add("several experts per rank")
    assert seen >= {"top1", "top2", "ep1", "ep2", "ep4", "experts4", "experts8", "drops", "dropless",
                    "an expert without tokens", "the last expert without tokens", "round robin differs",
                    "several experts per rank"}


def test_dispatch_plan_accepts_any_token_order_within_an_expert():
    def reversed_within_expert(experts, keep, n_experts, ep):
        import torch

        kept = experts[keep]
        a = len(kept)
        order = torch.argsort(kept * a + (a - 1 - torch.arange(a)))  # by expert, later tokens first
        return order, torch.bincount(kept, minlength=n_experts).view(ep, -1).sum(1).tolist()

    status, message = check_dispatch_plan(reversed_within_expert)
    assert status == PASS, message


def test_load_balancing_data_tells_local_from_global_statistics():
    """Every rank's own counts give another term than the group's, at 2 and 4 ranks: the local-statistics mistake
    cannot pass by accident."""
    for case, (n_experts, top_k, sizes) in enumerate(LB_CASES):
        for n in (2, 4):
            draws = [_draw(n_experts, top_k, sizes[m % len(sizes)], seed=1000 * case + m, lean=(3 * m) % n_experts)
                     for m in range(n)]
            total = sum(torch.bincount(ex.reshape(-1), minlength=n_experts) for _, ex in draws)
            for _, ex in draws:
                own = torch.bincount(ex.reshape(-1), minlength=n_experts)
                assert not torch.equal(own * n, total), (case, n)


def test_load_balancing_has_a_ragged_batch_with_a_rank_of_few_tokens():
    """At 2 and 4 ranks the ranks of one case hold different numbers of tokens, one of them very few: the group's
    token count is then not any rank's times the group's size."""
    ragged = [sizes for _, _, sizes in LB_CASES if len(set(sizes)) > 1]
    assert ragged and all(len(set(sizes[:n])) > 1 and min(sizes[:n]) <= 2 for sizes in ragged for n in (2, 4))


def test_combine_batch_has_tokens_fully_dropped_half_dropped_and_kept_on_every_rank():
    """At each world size, also a rank whose last token dropped both choices: an output sized by the last token that
    kept a choice (token_index.max() + 1) is short there."""
    from workers.moe.batch import batch
    from workers.moe.layer import build_weights
    from workers.moe.router import TopKRouter, keep_mask

    weights = build_weights(COMBINE_CFG, COMBINE_RUN["seed"], torch.float64)
    x, _ = batch(COMBINE_CFG, COMBINE_RUN["tokens"], COMBINE_RUN["data_seed"], COMBINE_RUN["skew"], torch.float64,
                 weights)
    router = TopKRouter(COMBINE_CFG, dtype=torch.float64)
    with torch.no_grad():
        router.weight.copy_(weights["router.weight"])
    for world in (2, 4):
        per = COMBINE_RUN["tokens"] // world
        last_kept = []
        for rank in range(world):
            _, _, _, experts = router(x[rank * per:(rank + 1) * per])
            kept = keep_mask(experts, COMBINE_CFG.experts, COMBINE_CFG.capacity(per)).sum(dim=1)
            assert {0, 1, 2} <= set(kept.tolist()), (world, rank, kept.tolist())
            last_kept.append(int(kept[-1]))
        assert 0 in last_kept, (world, last_kept)
