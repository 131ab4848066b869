"""Chapter 13's graded exercises: the 1F1B action list (checked here, by simulation), and one stage's
forward/backward step over real send/recv (on real ranks)."""
from course_utils.exercises import FAIL, PASS, Exercise, register

CHECKER = "workers.exercises.ch13"
SHAPES = ((4, 8), (4, 2), (2, 5), (1, 3), (8, 8), (3, 1))  # (p, m): m < p too, where warm-up is capped at m


def check_one_f_one_b_schedule(answer) -> tuple[str, str]:
    """``answer(p, m, stage)`` for every stage: valid, deadlock-free, at most p - stage stashed, no extra bubble."""
    from workers.pipeline.schedules import (gpipe_schedule, ideal_bubble, num_warmup_microbatches, peak_stash,
                                            simulate, validate)

    for p, m in SHAPES:
        where = f"at p={p}, m={m}"
        try:
            got = [[(str(k), int(i)) for k, i in answer(p, m, s)] for s in range(p)]
        except (TypeError, ValueError):
            return FAIL, f"{where}: return a list of pairs like ('F', 0), ('B', 0) for each stage"
        problem = validate(got, m)
        if problem:
            return FAIL, f"{where}: {problem}"
        for s, actions in enumerate(got):
            peak, bound = peak_stash(actions), min(p - s, m)
            if actions == gpipe_schedule(p, m, s) and peak > bound:
                return FAIL, (f"{where}, stage {s}: that is GPipe's order (all forwards, then all backwards), which "
                              f"stashes {peak} micro-batches; 1F1B starts backwards after p - stage - 1 warm-up forwards")
            if peak > bound:
                first_b = next(j for j, (k, _) in enumerate(actions) if k == "B")
                return FAIL, (f"{where}, stage {s}: {peak} micro-batches are stashed at once, 1F1B allows {bound}: "
                              f"you run {first_b} forwards before the first backward where 1F1B runs {bound}: "
                              f"a warm-up of p - stage - 1 = {num_warmup_microbatches(p, m, s)}, then one F and one B in turn")
        want = simulate(got)["makespan"]
        best = (m + p - 1) * 3.0
        if want > best + 1e-9:
            return FAIL, (f"{where}: the step takes {want:g} time units where 1F1B takes {best:g} (t_F = 1, t_B = 2): "
                          f"a warm-up shorter than p - stage - 1 forwards leaves the later stages waiting, a bigger bubble")
        if abs(ideal_bubble(got) - (p - 1) / (m + p - 1)) > 1e-9:
            return FAIL, f"{where}: the idle share is {ideal_bubble(got):.3g}, not (p-1)/(m+p-1)"
    return PASS, "valid at every (p, m) tried, at most p - stage micro-batches stashed, and the bubble of GPipe"


register(Exercise("one_f_one_b_schedule", "13", "one_f_one_b_schedule",
                  "The 1F1B schedule as data: warm-up, steady one-forward-one-backward, cool-down",
                  local=check_one_f_one_b_schedule))
register(Exercise("stage_step", "13", "stage_step",
                  "One stage's forward and backward of a micro-batch over real send/recv",
                  worker=CHECKER, world_sizes=(2, 4)))
