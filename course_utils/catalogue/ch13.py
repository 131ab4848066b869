"""Chapter 13's graded exercises: the 1F1B action list (checked here, by simulation), and one stage's
forward/backward step over real send/recv (on real ranks)."""
import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

CHECKER = "workers.exercises.ch13"
SHAPES = ((4, 8), (4, 2), (2, 5), (1, 3), (8, 8), (3, 1))  # (p, m): m < p too, where warm-up is capped at m


def check_one_f_one_b_schedule(answer) -> tuple[str, str]:
    """``answer(p, m, stage)`` for every stage: valid, deadlock-free, at most p - stage stashed, no extra bubble."""
    from workers.pipeline.schedules import (gpipe_schedule, ideal_bubble, num_warmup_microbatches, peak_stash,
                                            simulate, validate)

    for p, m in SHAPES:
        where = f"at p={p}, m={m}"
        try:
            raw = [list(answer(p, m, s)) for s in range(p)]
            odd = next((i for actions in raw for _, i in actions if isinstance(i, float) and not math.isfinite(i)), None)
            if odd is not None:
                return FAIL, f"{where}: micro-batch index {odd} is not a number of a micro-batch: use integers 0..m-1"
            got = [[(str(k), int(i)) for k, i in actions] for actions in raw]
        except (TypeError, ValueError):
            return FAIL, f"{where}: return a list of pairs like ('F', 0), ('B', 0) for each stage"
        problem = validate(got, m)
        if problem and m < p and any(k == "F" and i >= m for actions in got for k, i in actions):
            return FAIL, (f"{where}: {problem}: with fewer micro-batches than stages the warm-up is capped at m, "
                          "min(p - stage - 1, m) forwards")
        if problem:
            return FAIL, f"{where}: {problem}"
        for s, actions in enumerate(got):
            peak, bound = peak_stash(actions), min(p - s, m)
            if actions == gpipe_schedule(p, m, s) and not peak <= bound:
                return FAIL, (f"{where}, stage {s}: that is GPipe's order (all forwards, then all backwards), which "
                              f"stashes {peak} micro-batches; 1F1B starts backwards after p - stage - 1 warm-up forwards")
            if not peak <= bound:
                first_b = next(j for j, (k, _) in enumerate(actions) if k == "B")
                return FAIL, (f"{where}, stage {s}: {peak} micro-batches are stashed at once, 1F1B allows {bound}: "
                              f"you run {first_b} forwards before the first backward where 1F1B runs {bound}: "
                              f"a warm-up of p - stage - 1 = {num_warmup_microbatches(p, m, s)}, then one F and one B in turn")
        want = simulate(got)["makespan"]
        best = (m + p - 1) * 3.0
        if not want <= best + 1e-9:
            return FAIL, (f"{where}: the step takes {want:g} time units where 1F1B takes {best:g} (t_F = 1, t_B = 2): "
                          f"a warm-up shorter than p - stage - 1 forwards leaves the later stages waiting, a bigger bubble")
        if not abs(ideal_bubble(got) - (p - 1) / (m + p - 1)) <= 1e-9:
            return FAIL, f"{where}: the idle share is {ideal_bubble(got):.3g}, not (p-1)/(m+p-1)"
    return PASS, "valid at every (p, m) tried, at most p - stage micro-batches stashed, and the bubble of GPipe"


register(Exercise("one_f_one_b_schedule", "13", "one_f_one_b_schedule",
                  "The 1F1B schedule as data: warm-up, steady one-forward-one-backward, cool-down",
                  local=check_one_f_one_b_schedule, tries={
                      "non-finite": "a micro-batch index that is NaN or infinite is named, not cast",
                      "order": NOT_APPLICABLE + "an action list of labels: no gradient and no .grad to accumulate",
                      "sizes": "m < p and m not a multiple of p ((4, 2), (2, 5), (3, 1)): the warm-up must be capped "
                               "at m, and every micro-batch run once forward and once backward",
                      "ragged": NOT_APPLICABLE + "micro-batches are labels of equal cost (t_F = 1, t_B = 2); none is "
                                "smaller than another",
                      "layouts": "six (p, m) shapes from p = 1 to 8: the stash bound p - stage and the makespan "
                                 "(m + p - 1) x 3 at each, so a warm-up right for one shape fails another",
                      "traffic": NOT_APPLICABLE + "simulated in one process: no message is sent",
                      "mutation": NOT_APPLICABLE + "the inputs are three integers",
                      "output": NOT_APPLICABLE + "labels and indices read by value; a malformed pair is named as such",
                      "memory": NOT_APPLICABLE + "no tensors: the stash it bounds is counted on the action list",
                      "bits": NOT_APPLICABLE + "integers and labels, compared exactly",
                  }))
register(Exercise("stage_step", "13", "stage_step",
                  "One stage's forward and backward of a micro-batch over real send/recv",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "every stage's gradients are tested finite first: a NaN or infinity is named",
                      "order": "three micro-batches in a row: each backward must add to the .grad the earlier ones "
                               "left, not replace it",
                      "sizes": NOT_APPLICABLE + "the check sets the stage's module and the message shape; 2p layers "
                               "on p stages divide evenly by construction",
                      "ragged": NOT_APPLICABLE + "every micro-batch has the same shape and every stage two layers",
                      "layouts": "2 and 4 stages: with 4 there are middle stages that both receive and send, so a "
                                 "rule that treats every later stage as the last fails",
                      "traffic": "every point-to-point call of every stage is recorded: a missing, repeated or "
                                 "surplus send or receive is named",
                      "mutation": NOT_APPLICABLE + "the answer's job is to write .grad and send; the tensors it "
                                  "receives are its own",
                      "output": "what it sends: a tensor of the message's shape; None or another shape is named",
                      "memory": NOT_APPLICABLE + "one micro-batch at a time: nothing is stashed or released",
                      "bits": NOT_APPLICABLE + "gradients are sums in another order than the unsplit model's: compared "
                              "within float32 rounding",
                  }))
