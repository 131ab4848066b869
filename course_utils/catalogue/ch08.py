"""Chapter 08's graded exercises: mixed precision (in the notebook) and checkpointing (on real ranks)."""
from __future__ import annotations

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

# -- precision ---------------------------------------------------------------------------------------------

def _bits(x) -> int:
    """The fp32 bit pattern of a one-element tensor, as an unsigned 32-bit number (for messages)."""
    import torch

    return int(x.reshape(1).view(torch.int32).item()) & 0xFFFFFFFF


def _from_bits(patterns):
    import torch

    signed = [p - 2**32 if p >= 2**31 else p for p in patterns]  # uint32 patterns -> int32 values
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _random_patterns(n: int, exponents: tuple[int, int], low16=None, seed: int = 0) -> list[int]:
    """n random fp32 bit patterns with biased exponent in [lo, hi], both signs; ``low16`` fixes the low 16 bits."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sign, exp, mant = rng.getrandbits(1), rng.randint(*exponents), rng.getrandbits(23)
        if low16 is not None:
            mant = (mant & ~0xFFFF) | low16
        out.append((sign << 31) | (exp << 23) | mant)
    return out


def _bf16_cases():
    """(what the values are, fp32 tensor): every corner of fp32 -> bf16 rounding, built from bit patterns."""
    return [
        ("random values from 2^-126 to 2^127", _from_bits(_random_patterns(4000, (1, 254), seed=1))),
        ("+0 and -0", _from_bits([0x00000000, 0x80000000])),
        ("exact ties (the dropped 16 bits are 0x8000)",
         _from_bits([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000]  # 1 + 2^-8, 1 + 3*2^-8 and their negatives
                    + _random_patterns(500, (1, 253), low16=0x8000, seed=2))),
        ("fp32 subnormals (below 2^-126)",
         _from_bits([0x00000001, 0x00008000, 0x00018000, 0x80018000, 0x007FFFFF]
                    + _random_patterns(500, (0, 0), seed=3) + _random_patterns(200, (0, 0), low16=0x8000, seed=4))),
        ("values at the top of the bf16 range",  # bf16 max is 0x7F7F; halfway to the next step is a tie whose even side is inf
         _from_bits([0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0xFF7FFFFF, 0x7F7E8000])),
        ("+-inf and NaNs with several payloads",
         _from_bits([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFF800001, 0xFFC00000, 0x7F808000])),
    ]


def _bf16_reference(x):
    import torch

    return x.to(torch.bfloat16).float()


def _describe_bf16_mismatch(x, got, want) -> str:
    """Name the mistake from the first wrong value (and from what the wrong values have in common)."""
    import torch

    nan_x = torch.isnan(x)
    if (nan_x & ~torch.isnan(got)).any():
        i = int(torch.nonzero(nan_x & ~torch.isnan(got))[0])
        return (f"NaN must stay NaN: the NaN with bits 0x{_bits(x[i]):08X} came back as {got[i].item()!r}. Adding a "
                "rounding increment to a NaN's bit pattern can carry into the exponent or the sign; treat NaN apart")
    ok = ~nan_x
    xb = x.view(torch.int32)
    wrong = ok & (got.view(torch.int32) != want.view(torch.int32))
    if not wrong.any():
        return "some values differ from x.to(torch.bfloat16).float()"
    i = int(torch.nonzero(wrong)[0])
    example = (f"x = {x[i].item()!r} (bits 0x{_bits(x[i]):08X}) should become {want[i].item()!r} "
               f"(0x{_bits(want[i]):08X}), you returned {got[i].item()!r} (0x{_bits(got[i]):08X})")
    truncated = (xb & -65536).view(torch.float32)
    half_up = ((xb + 0x8000) & -65536).view(torch.float32)
    gb = got.view(torch.int32)
    if torch.equal(gb[ok], truncated.view(torch.int32)[ok]):
        return (f"your function rounds toward zero (truncates): it drops the low 16 bits without rounding. {example}. "
                "Round to the nearest bf16 value instead")
    if want[i] == 0 and bool(torch.signbit(want[i])) != bool(torch.signbit(got[i])):
        return (f"-0.0 must stay -0.0 and +0.0 stay +0.0: {example}. The two are equal as values (-0.0 < 0 is False), "
                "so a rounding done on |x| and signed again by comparing x with 0 loses the sign bit: keep it from the "
                "pattern (bits & 0x80000000), or round the signed pattern as it is")
    if torch.isinf(want[i]) and torch.isfinite(got[i]):
        return (f"{example}: fp32 values at or above halfway between the bf16 max and the next step round up to inf, "
                "as torch does (the rounding increment carries into the exponent)")
    tie = (xb & 0xFFFF) == 0x8000
    if bool(tie[i]):
        how = ("that is round-half-up (away from zero), not round-half-to-even"
               if torch.equal(gb[ok & tie], half_up.view(torch.int32)[ok & tie]) else "")
        return (f"exact ties must go to the even neighbour, the one whose last kept bit is 0: {example}"
                + (f"; {how}" if how else ""))
    if torch.isnan(got[i]):
        return f"{example}: only NaN inputs may give NaN"
    return example


def check_round_to_bf16(answer) -> tuple[str, str]:
    import torch

    n_values = 0
    for what, x in _bf16_cases():
        n_values += x.numel()
        for shaped in ((x, x[: (len(x) // 2) * 2].reshape(2, -1)) if len(x) > 100 else (x,)):  # also a 2-D x
            original = shaped.clone()
            got = answer(shaped)
            if not torch.equal(shaped.view(torch.int32), original.view(torch.int32)):
                return FAIL, ("your function changed its input in place: x.view(torch.int32) shares x's memory, so "
                              "an in-place update of the view rewrites x. Compute new tensors instead")
            if not isinstance(got, torch.Tensor) or got.shape != shaped.shape:
                return FAIL, (f"return a torch.Tensor with the shape of x, {tuple(shaped.shape)}; got "
                              + (f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else f"{type(got).__name__}"))
            if got.dtype != torch.float32:
                return FAIL, (f"return the rounded values as float32 (each one exactly a bf16 value), not {got.dtype}")
            want = _bf16_reference(original)
            got, want, flat_x = got.reshape(-1), want.reshape(-1), original.reshape(-1)
            nan = torch.isnan(want)
            same = torch.equal(torch.isnan(got), nan) and torch.equal(got.view(torch.int32)[~nan],
                                                                      want.view(torch.int32)[~nan])
            if not same:
                return FAIL, f"{what}: {_describe_bf16_mismatch(flat_x, got, want)}"
    return PASS, (f"correct: bit for bit equal to x.to(torch.bfloat16).float() on {n_values} values: random magnitudes, "
                  "ties both ways, subnormals, the overflow boundary, +-0, +-inf and NaN")


# (init_scale, growth_factor, backoff_factor, growth_interval, good steps already counted, found_inf flags)
SCALE_SEQUENCES = [
    (2.0**16, 2.0, 0.5, 3, 0, "......x.....xx......"),
    (1024.0, 2.0, 0.5, 1, 0, "...x..x.xx..."),
    (2.0**16, 4.0, 0.25, 2, 0, "..x.....x.x...."),
    (512.0, 1.5, 0.7, 4, 0, ".........x........x"),
    (2.0**16, None, None, 2000, 1996, "........x..."),  # the defaults: the learner's own keyword defaults are used
]


def _gradscaler_trajectory(init_scale, growth_factor, backoff_factor, growth_interval, start_good, flags):
    """The real torch.amp.GradScaler on the CPU, fed a gradient with inf wherever ``flags`` says: (scale, good) after
    every update. Its state after each ``update`` is the ground truth; nothing here re-implements the rule."""
    import torch

    kwargs = {"init_scale": init_scale, "growth_interval": growth_interval}
    if growth_factor is not None:
        kwargs.update(growth_factor=growth_factor, backoff_factor=backoff_factor)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    if start_good:
        state = scaler.state_dict()
        state["_growth_tracker"] = start_good
        scaler.load_state_dict(state)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    out = []
    for flag in flags:
        opt.zero_grad(set_to_none=True)
        scaler.scale(w.sum()).backward()
        if flag:
            w.grad[0] = float("inf")  # what an fp16 overflow leaves in a gradient
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), int(scaler.state_dict()["_growth_tracker"])))
    return out


def _as_number(v):
    import numbers

    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    return v if isinstance(v, numbers.Real) and not isinstance(v, bool) else None


def _scale_hint(found_inf, scale, good, got, real, gi) -> str:
    (got_scale, got_good), (real_scale, real_good) = got, real
    scale_ok = abs(got_scale - real_scale) <= 1e-5 * real_scale
    if found_inf:
        if not scale_ok and abs(got_scale / scale - 0.5) < 1e-9:
            return (f"you halved the scale, the default, instead of multiplying it by backoff_factor="
                    f"{real_scale / scale:g}: use the arguments, not constants")
        if not scale_ok:
            return f"on an inf/NaN step the scale is multiplied by backoff_factor ({real_scale / scale:g} here)"
        return "after an inf/NaN step the real GradScaler resets the count of good steps to 0"
    grew, you_grew = real_scale > scale, got_scale > scale
    if grew and not you_grew:
        return (f"counting this step, {good + 1} good steps in a row reached growth_interval={gi}, so the real "
                "GradScaler grew the scale here; you did not: an off-by-one in when you compare with growth_interval?")
    if you_grew and not grew:
        return (f"you grew the scale after {good + 1} good steps in a row; the real GradScaler grows only when the count "
                f"reaches growth_interval={gi}: an off-by-one in when you compare with growth_interval?")
    if grew and scale_ok and got_good != real_good:
        return "the real GradScaler restarts the count at 0 after growing the scale"
    if not scale_ok and abs(got_scale / scale - 2.0) < 1e-9:
        return (f"you grew the scale by 2, the default, instead of growth_factor={real_scale / scale:g}: use the "
                "arguments, not constants")
    if not scale_ok:
        return f"the scale changes by growth_factor when it grows ({real_scale / scale:g} here)"
    return "a good step adds one to the count of good steps"


def check_update_scale(answer) -> tuple[str, str]:
    import math

    updates = 0
    for j, (init, gf, bf, gi, start_good, pattern) in enumerate(SCALE_SEQUENCES, 1):
        flags = [c == "x" for c in pattern]
        real = _gradscaler_trajectory(init, gf, bf, gi, start_good, flags)
        scale, good = init, start_good
        for k, (flag, (real_scale, real_good)) in enumerate(zip(flags, real), 1):
            if gf is None:  # the defaults: growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
                got = answer(scale, flag, good)
            else:
                got = answer(scale, flag, good, growth_factor=gf, backoff_factor=bf, growth_interval=gi)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                return FAIL, f"return a pair (new_scale, new_good_steps), got {got!r}"
            new_scale, new_good = _as_number(got[0]), _as_number(got[1])
            if new_scale is None or new_good is None:
                return FAIL, f"return two numbers (new_scale, new_good_steps), got {got!r}"
            if not math.isfinite(new_scale) or not new_scale > 0:
                return FAIL, (f"sequence {j}, update {k}: with scale={scale:g}, good_steps={good} and found_inf={flag} "
                              f"you returned the scale {new_scale!r}, which is not a finite positive number (the real "
                              f"GradScaler went to {real_scale:g}): every later step would scale its loss by it")
            if not abs(new_scale - real_scale) <= 1e-5 * real_scale or new_good != real_good:
                args = (f"growth_factor={gf:g}, backoff_factor={bf:g}, growth_interval={gi}" if gf is not None
                        else "the default growth_factor, backoff_factor, growth_interval")
                hint = _scale_hint(flag, scale, good, (new_scale, new_good), (real_scale, real_good), gi)
                return FAIL, (f"sequence {j} ({args}), update {k}: with scale={scale:g}, good_steps={good} and "
                              f"found_inf={flag} you returned ({new_scale:g}, {new_good:g}); the real GradScaler went to "
                              f"scale={real_scale:g}, good_steps={real_good}. Hint: {hint}")
            scale, good = new_scale, int(new_good)
            updates += 1
    return PASS, (f"correct: {updates} updates in {len(SCALE_SEQUENCES)} sequences match torch.amp.GradScaler's own "
                  "scale and good-step count after every update")


_NO_RANKS = {
    "order": NOT_APPLICABLE + "no gradients arrive: the answer is a pure function of its arguments",
    "traffic": NOT_APPLICABLE + "one process, no collective: checked in the notebook",
    "memory": NOT_APPLICABLE + "returns new values; nothing is held that should be released",
}
register(Exercise("round_to_bf16", "08", "round_to_bf16",
                  "fp32 -> bf16 by hand from the bit pattern: round to nearest, ties to even", local=check_round_to_bf16,
                  tries={**_NO_RANKS,
                         "non-finite": "+-inf and NaNs with several payloads: inf stays inf, NaN stays NaN, and only "
                                       "a NaN may give NaN",
                         "sizes": NOT_APPLICABLE + "an elementwise map: no size is split",
                         "ragged": NOT_APPLICABLE + "an elementwise map: nothing is partitioned",
                         "layouts": "a 1-D x and a 2-D one: the result keeps x's shape",
                         "mutation": "x's bit pattern is compared with a copy's after the call (a view of x shares its "
                                     "memory)",
                         "output": "the result must be a float32 tensor of x's shape, each value exactly a bf16 one",
                         "bits": "bit for bit against torch's own rounding: +0 and -0, exact ties both ways, "
                                 "subnormals, the overflow boundary"}))
register(Exercise("update_scale", "08", "update_scale",
                  "GradScaler's update rule: back off on inf, grow after growth_interval good steps",
                  local=check_update_scale,
                  tries={**_NO_RANKS,
                         "non-finite": "a scale that is nan, inf or not positive fails, named, at the update that "
                                       "made it",
                         "sizes": NOT_APPLICABLE + "a rule on two numbers: no size",
                         "ragged": NOT_APPLICABLE + "a rule on two numbers: nothing is partitioned",
                         "layouts": "five sequences with other factors and intervals (x1.5 to x4, backoff 0.25 to "
                                    "0.7, interval 1 to 2000, the defaults): a rule right for the defaults only fails",
                         "mutation": NOT_APPLICABLE + "its arguments are numbers, which no function can change",
                         "output": NOT_APPLICABLE + "any two real numbers are accepted, Python's or one-element "
                                                    "tensors",
                         "bits": NOT_APPLICABLE + "scales are compared within 1e-5 relative, as torch's own float "
                                                  "arithmetic gives them"}))


# -- checkpointing -----------------------------------------------------------------------------------------

# Both checked on real ranks by workers/exercises/ch08.py: the training state under DDP at world 1 and 2 (each
# rank has RNG streams of its own), the atomic save on 2 ranks at once (each in a directory of its own).
register(Exercise("training_state", "08", "training_state",
                  "Everything a checkpoint must hold: resume bit for bit after a restore into fresh objects",
                  worker="workers.exercises.ch08", world_sizes=(1, 2), timeout_s=60.0,
                  tries={"non-finite": "a state whose weights hold nan or inf is not the saved state: named, after "
                                       "the restore",
                         "order": NOT_APPLICABLE + "the answer captures a state; the check's own training makes the "
                                                   "gradients",
                         "sizes": NOT_APPLICABLE + "the state is saved whole; no size is split",
                         "ragged": NOT_APPLICABLE + "one rank's state per rank, whole: nothing is partitioned",
                         "layouts": NOT_APPLICABLE + "world 1 and 2 ask the same of each rank (its own state); no "
                                                     "rule depends on the world size",
                         "traffic": NOT_APPLICABLE + "a capture runs no collective",
                         "mutation": "the live run is compared before and after the capture: weights, mode "
                                     "(train/eval), every RNG stream, optimizer, scheduler, sampler and scaler",
                         "output": NOT_APPLICABLE + "any dict torch.save can write is accepted; the restore, not "
                                                    "the types, is the test",
                         "memory": NOT_APPLICABLE + "a capture holds references to the state; nothing is released",
                         "bits": "every batch, mask, learning rate, scale and weight after the restore is compared "
                                 "bit for bit (torch.equal) with an uninterrupted run"}))
register(Exercise("atomic_save", "08", "atomic_save",
                  "An atomic save: a crash midway leaves the old checkpoint, never a truncated one",
                  worker="workers.exercises.ch08", world_sizes=(2,), timeout_s=60.0,
                  tries={"non-finite": NOT_APPLICABLE + "it writes a file and returns nothing: no number to compare",
                         "order": NOT_APPLICABLE + "no gradients: it saves an object it is given",
                         "sizes": NOT_APPLICABLE + "one checkpoint of a fixed size, written whole",
                         "ragged": NOT_APPLICABLE + "one file per save: nothing is partitioned",
                         "layouts": NOT_APPLICABLE + "one file per rank in a directory of its own: each rank does "
                                                     "the same",
                         "traffic": "the file operations a save makes are watched in order, not only the file it "
                                    "leaves: the temporary file's own data fsynced before os.replace, the directory "
                                    "after it, no copy over path, no remove first",
                         "mutation": NOT_APPLICABLE + "obj only goes through torch.save; the file, not obj, is "
                                                      "what a save changes",
                         "output": NOT_APPLICABLE + "it returns nothing: the file at path is loaded and compared",
                         "memory": NOT_APPLICABLE + "a save holds nothing after it returns; the disk is checked "
                                                    "instead (no temporary file left beside path)",
                         "bits": NOT_APPLICABLE + "the file is loaded and compared with torch.equal; the save "
                                                  "computes no number"}))

# -- checkpoint interval -----------------------------------------------------------------------------------

# (checkpoint seconds, per-GPU MTBF seconds, GPUs): Llama 3's scale first (its 419 interruptions in 54 days, every
# cause, spread over 16,384 GPUs: 5.8 years per GPU, any cause; a job MTBF of ~3.1 h), then a small cluster, a
# slow write, and one GPU.
INTERVAL_CASES = [(120.0, 5.8 * 365 * 86400, 16384), (60.0, 5 * 365 * 86400, 1024), (600.0, 2 * 365 * 86400, 4096),
                  (30.0, 3 * 365 * 86400, 1), (300.0, 4 * 365 * 86400, 24576)]


def check_checkpoint_every(answer) -> tuple[str, str]:
    import math

    from course_utils.checkpoint_interval import job_mtbf, young_interval

    for cost, gpu_mtbf, n in INTERVAL_CASES:
        got = answer(cost, gpu_mtbf, n)
        want = young_interval(cost, job_mtbf(gpu_mtbf, n))
        case = f"checkpoint_s={cost:g}, gpu_mtbf_s={gpu_mtbf:.4g}, n_gpus={n}"
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return FAIL, f"return the interval in seconds as a number, got {got!r} for {case}"
        if not math.isfinite(got):
            return FAIL, f"for {case} you returned {got!r}, not a finite number of seconds: a division by zero?"
        if abs(got - want) <= 1e-9 * want:
            continue
        ratio = got / want
        if abs(ratio * math.sqrt(2) - 1) < 1e-6:
            hint = "Young's optimum is sqrt(2 * C * M): the factor 2 is missing"
        elif n > 1 and abs(ratio - math.sqrt(n)) < 1e-6 * math.sqrt(n):
            hint = (f"the job stops when any of its {n} GPUs fails, so its MTBF is gpu_mtbf_s / n_gpus, "
                    "not one GPU's MTBF")
        elif n > 1 and abs(ratio * math.sqrt(n) - 1) < 1e-6:
            hint = "more GPUs fail more often: divide the per-GPU MTBF by n_gpus, do not multiply"
        elif abs(ratio * 60 - 1) < 1e-6 or abs(ratio * 3600 - 1) < 1e-6:
            hint = "return seconds, not minutes or hours"
        else:
            hint = f"expected sqrt(2 * {cost:g} * {gpu_mtbf:.4g} / {n}) = {want:.1f} s"
        return FAIL, f"for {case} you returned {got:.6g}: {hint}"
    c, m, n = INTERVAL_CASES[0]
    return PASS, (f"correct: at Llama 3's scale (a failure every {job_mtbf(m, n) / 3600:.1f} h) a {c:.0f}-s checkpoint "
                  f"is worth writing every {young_interval(c, job_mtbf(m, n)) / 60:.0f} minutes")


_FORMULA = NOT_APPLICABLE + "a formula of three numbers: no tensors, no ranks"
register(Exercise("checkpoint_every", "08", "checkpoint_every",
                  "Young's interval for a job on many GPUs: sqrt(2 C M) with the job's MTBF",
                  local=check_checkpoint_every,
                  tries={**{c: _FORMULA for c in ("order", "sizes", "ragged", "layouts", "traffic", "mutation",
                                                  "memory", "bits")},
                         "non-finite": "an interval that is nan or inf fails, named with the case that gave it",
                         "output": NOT_APPLICABLE + "any real number is accepted as the seconds"}))
