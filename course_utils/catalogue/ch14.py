"""Chapter 14's graded exercises, both checked here in one process: the zigzag split (which tokens a rank
holds) and the causal block rule of ring attention (which blocks a rank computes, masks, or skips)."""
import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

SPLIT_SHAPES = ((8, 2), (16, 4), (48, 4), (32, 8), (4, 1), (24, 4), (6, 1))  # (seq, cp); the last two: odd chunks


def _ranges(got) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in got]


def _not_finite(got):
    """The first bound that is a NaN or an infinity (Python's or a tensor's), or None."""
    return next((x for pair in got for x in pair if not math.isfinite(float(x))), None)


def _not_ints(got) -> bool:
    """True if a bound is a float (seq / (2 * cp)), Python's or a tensor's."""
    return any(isinstance(x, float) or (hasattr(x, "is_floating_point") and x.is_floating_point())
               for pair in got for x in pair)


def check_zigzag_chunks(answer) -> tuple[str, str]:
    """``answer(seq, cp, rank)`` = [(start, stop), (start, stop)]: chunk rank and chunk 2cp-1-rank of 2cp."""
    from workers.context_parallel.blocks import work_per_rank
    from workers.context_parallel.split import chunk_ranges

    for seq, cp in SPLIT_SHAPES:
        size = seq // (2 * cp)
        for rank in range(cp):
            where = f"at seq={seq}, cp={cp}, rank={rank}"
            try:
                bad = _not_finite(answer(seq, cp, rank))
                if bad is not None:
                    return FAIL, (f"{where}: a bound is {bad}: every bound is a token position, a finite integer "
                                  "from 0 to seq")
                got = _ranges(answer(seq, cp, rank))
            except (TypeError, ValueError):
                return FAIL, f"{where}: return a list of two (start, stop) pairs, like [(0, 2), (6, 8)]"
            want = chunk_ranges(seq, cp, rank, "zigzag")
            if got == want and _not_ints(answer(seq, cp, rank)):
                return FAIL, (f"{where}: the bounds are right but not ints ({answer(seq, cp, rank)}): seq / (2 * cp) is "
                              "a float, and a float cannot index or slice a tensor; use seq // (2 * cp)")
            if got == want:
                continue
            per = seq // cp
            if got == [(rank * per, (rank + 1) * per)] or got == [(rank * per, rank * per + size),
                                                                    (rank * per + size, (rank + 1) * per)]:
                work = [w["score_entries"] for w in work_per_rank(seq, cp, "contiguous", True)]
                return FAIL, (f"{where}: that is the contiguous split (one block of seq/cp tokens): with a causal "
                              f"mask rank {cp - 1} computes {work[-1] // work[0]}x rank 0's work; cut the sequence "
                              f"into 2*cp chunks and give rank r chunk r and chunk 2*cp-1-r")
            if len(got) == 2 and got[0] == want[0] and got[1] == ((cp + rank) * size, (cp + rank + 1) * size):
                return FAIL, (f"{where}: you pair chunk r with chunk cp + r, a shift, not a mirror: the late chunks "
                              f"still grow with r; the second chunk is 2*cp-1-r, counted from the end")
            if got == want[::-1]:
                return FAIL, (f"{where}: the right two chunks in the wrong order: return the early chunk (chunk r) "
                              f"first, then its mirror, {want}: the local rows are stored in that order")
            if len(got) == 2 and got[0] == want[0] and got[1] in [((m) * size, (m + 1) * size)
                                                                  for m in (2 * cp - rank, 2 * cp - 2 - rank)]:
                m = got[1][0] // size
                return FAIL, (f"{where}: the mirror is off by one: you took chunk {m}, but the mirror of chunk r among "
                              f"2*cp chunks numbered 0..2*cp-1 is 2*cp-1-r = {2 * cp - 1 - rank}"
                              + (" (chunk 2*cp is past the end of the sequence)" if m == 2 * cp else ""))
            return FAIL, f"{where}: got {got}, expected chunks of {size} tokens, chunk r and chunk 2*cp-1-r: {want}"
    return PASS, f"chunk r and its mirror 2*cp-1-r for every rank at (seq, cp) in {list(SPLIT_SHAPES)}"


def check_block_kind(answer) -> tuple[str, str]:
    """``answer(q_chunk, k_chunk)`` is "full" / "diagonal" / "skip" for causal attention at chunk granularity."""
    from workers.attention.reference import attention_reference, relative_error
    from workers.context_parallel.blocks import block_kind
    from workers.context_parallel.inputs import make_inputs
    from workers.context_parallel.simulate import one_process_ring

    for qc in range(6):
        for kc in range(6):
            got, want = answer(qc, kc), block_kind(qc, kc)
            if got == want:
                continue
            where = f"block (q_chunk={qc}, k_chunk={kc})"
            if got not in ("full", "diagonal", "skip"):
                return FAIL, f"{where}: return one of 'full', 'diagonal', 'skip', not {got!r}"
            if all(answer(a, b) == block_kind(b, a) for a in range(6) for b in range(6)):
                return FAIL, (f"{where}: q_chunk and k_chunk swapped: your rule says 'full' when the keys come after "
                              "the queries. A causal query sees keys at or before it: 'full' when q_chunk > k_chunk, "
                              "'skip' when q_chunk < k_chunk")
            q, k, v, _ = make_inputs(1, 1, 16, 8, seed=3)
            out, _ = one_process_ring(q, k, v, cp=4, split="contiguous", rule=answer)
            err = relative_error(out, attention_reference(q, k, v, causal=True)[0])
            off = f" (ring attention with your rule is off by {err:.2g} relative to full causal attention)"
            if qc == kc and got == "skip":
                return FAIL, (f"{where}: you skipped the diagonal block, masking it fully: but its queries must see "
                              f"the keys at and before them in their own chunk (the first query sees only itself); "
                              f"compute it with the causal mask inside: 'diagonal'{off}")
            if qc == kc:
                return FAIL, (f"{where}: the diagonal block needs the causal mask inside it, or each query sees the "
                              f"later keys of its own chunk: 'diagonal'{off}")
            if qc < kc:
                return FAIL, (f"{where}: every key here is later than every query, so a causal query sees none of "
                              f"them: skip future blocks ('skip'), do not compute them{off}")
            return FAIL, (f"{where}: every key here is earlier than every query: the whole block is visible, "
                          f"'full'{off}")
    return PASS, "full below the diagonal, masked on it, skipped above it, for chunks 0..5"


register(Exercise("zigzag_chunks", "14", "zigzag_chunks",
                  "The load-balanced zigzag split: chunk r and its mirror 2cp-1-r", local=check_zigzag_chunks, tries={
                      "non-finite": "a bound that is NaN or infinite is named, not cast",
                      "order": NOT_APPLICABLE + "token ranges from a formula: no gradients",
                      "sizes": NOT_APPLICABLE + "the split needs seq divisible by 2 x cp (the notebook says so): only "
                               "such seq are tried, odd chunk sizes (3 tokens) included",
                      "ragged": NOT_APPLICABLE + "the split's chunks are equal by definition",
                      "layouts": "seven (seq, cp) from cp = 1 to 8: every rank's two chunks at each, so a mirror rule "
                                 "right at cp = 2 alone fails",
                      "traffic": NOT_APPLICABLE + "computed in one process: no message is sent",
                      "mutation": NOT_APPLICABLE + "the inputs are three integers",
                      "output": "the bounds' type: floats (seq / (2 cp)) cannot slice a tensor and are named",
                      "memory": NOT_APPLICABLE + "no tensors are held",
                      "bits": NOT_APPLICABLE + "integers, compared exactly",
                  }))
register(Exercise("block_kind", "14", "block_kind",
                  "Ring attention's causal block rule: full, diagonal (masked) or skip", local=check_block_kind, tries={
                      "non-finite": NOT_APPLICABLE + "the answer returns one of three words, no number",
                      "order": NOT_APPLICABLE + "a rule on two chunk numbers: no gradients",
                      "sizes": NOT_APPLICABLE + "chunks are indices 0..5; their size does not enter the rule",
                      "ragged": NOT_APPLICABLE + "every block is a pair of equal chunks",
                      "layouts": NOT_APPLICABLE + "the rule has one input shape, a pair of chunks: all 36 pairs of "
                                 "0..5 are tried",
                      "traffic": NOT_APPLICABLE + "computed in one process: no message is sent",
                      "mutation": NOT_APPLICABLE + "the inputs are two integers",
                      "output": "the returned value: anything but 'full', 'diagonal' or 'skip' (a bool, a mask) is "
                                "named",
                      "memory": NOT_APPLICABLE + "no tensors are held",
                      "bits": NOT_APPLICABLE + "words, compared exactly",
                  }))
