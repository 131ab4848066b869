"""Chapter 14's graded exercises, all checked here in one process: the zigzag split (which tokens a rank
holds), the causal block rule of ring attention (which blocks a rank computes, masks, or skips), and Ulysses'
first all-to-all (sequence shards to head shards), run on cp simulated ranks (threads) that share an all-to-all."""
import math
import threading

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


# -- Ulysses' sequence-to-heads all-to-all, on simulated ranks ------------------------------------------------------

# (seq, heads, head_dim, cp, dtype, seed): heads = cp^2 first (where x.split(cp) happens to cut cp pieces), then
# other ratios, cp from 1 to 4, one head per rank, three dtypes
A2A_SHAPES = ((8, 4, 2, 2, "float64", 141), (16, 8, 3, 2, "float32", 142), (12, 6, 2, 3, "bfloat16", 143),
              (16, 8, 2, 4, "float64", 144), (8, 4, 2, 4, "float32", 145), (4, 2, 2, 1, "float64", 146))
A2A_REFUSED = (8, 6, 2, 4)  # (seq, heads, head_dim, cp): cp does not divide the heads
_BITS = {"float64": "int64", "float32": "int32", "bfloat16": "int16"}


class _Stop(Exception):
    """A simulated rank stops: the group already holds the reason."""


class SimulatedGroup:
    """cp ranks as threads sharing one all-to-all: ``all_to_all(pieces)`` on rank r takes a list of cp tensors
    (piece j goes to rank j) and returns the list whose piece i came from rank i, once every rank has posted.
    It records what each rank sent (shapes, bytes, calls) and stops every rank with one sentence at the first
    malformed call, so a mistake that would hang or crash real ranks becomes a verdict."""

    def __init__(self, cp: int, refuse: str | None = None):
        self.cp, self.refuse = cp, refuse  # refuse: the sentence for any call at all (the heads cannot be split)
        self.barrier = threading.Barrier(cp, timeout=5)
        self.posted: dict = {}
        self.calls, self.sent_bytes = [0] * cp, [0] * cp
        self.problem: str | None = None
        self.lock = threading.Lock()

    def stop(self, problem: str) -> None:
        with self.lock:
            self.problem = self.problem or problem
        self.barrier.abort()
        raise _Stop

    def all_to_all_for(self, rank: int):
        import torch

        def all_to_all(pieces):
            call = self.calls[rank]
            self.calls[rank] += 1
            if self.refuse:
                self.stop(self.refuse)
            if not isinstance(pieces, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in pieces):
                self.stop(f"rank {rank} passed all_to_all a {type(pieces).__name__}: it takes a list of cp tensors, "
                          "piece j for rank j (x.chunk(cp, dim=1) returns such a tuple)")
            if len(pieces) != self.cp:
                self.stop(f"rank {rank} passed {len(pieces)} pieces to all_to_all at cp={self.cp}: it takes exactly "
                          f"cp pieces, piece j for rank j. x.split(n, dim) cuts pieces of n heads each; "
                          f"x.chunk(cp, dim=1) cuts cp pieces")
            if len({tuple(p.shape) for p in pieces}) > 1:
                self.stop(f"rank {rank} passed pieces of shapes {[tuple(p.shape) for p in pieces]}: an all-to-all "
                          "moves equal pieces (each rank's h/cp heads of the same rows)")
            if call > 0:
                self.stop(f"rank {rank} called all_to_all {call + 1} times: one all-to-all carries every piece at "
                          "once (piece j of the one list goes to rank j)")
            self.posted[call, rank] = [p.detach().clone() for p in pieces]
            self.sent_bytes[rank] += sum(p.numel() * p.element_size() for j, p in enumerate(pieces) if j != rank)
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                self.stop("the ranks did not all call all_to_all: every rank calls it once, with its own pieces")
            return [self.posted[call, i][rank].clone() for i in range(self.cp)]

        return all_to_all


def _run_ranks(answer, blocks: list, refuse: str | None = None):
    """Call ``answer(x_r, cp, all_to_all)`` on every simulated rank at once; ``(group, outcomes)``, each outcome
    ``("returned", value)`` or ``("raised", exception)``."""
    cp = len(blocks)
    group = SimulatedGroup(cp, refuse)
    outcomes: list = [None] * cp

    def rank(r):
        try:
            outcomes[r] = ("returned", answer(blocks[r], cp, group.all_to_all_for(r)))
        except BaseException as exc:  # noqa: BLE001 - every rank's outcome is reported
            outcomes[r] = ("raised", exc)
            group.barrier.abort()  # the others must not wait for this rank

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return group, outcomes


def _bits(t):
    import torch

    return t.contiguous().view(getattr(torch, _BITS[str(t.dtype).removeprefix("torch.")]))


def _inputs(seq, heads, head_dim, cp, dtype, seed):
    """The whole [seq, heads, d] (random, with some -0.0) and rank r's rows [seq/cp, heads, d], as separate tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)  # the global RNG is untouched
    full = torch.randn(seq, heads, head_dim, generator=g, dtype=torch.float64).to(getattr(torch, dtype))
    full[::3, :, 0] = -0.0  # a copy keeps the sign bit; arithmetic (0.0 + -0.0) loses it
    return full, [block.clone() for block in full.chunk(cp, dim=0)]


def _wrong_values(got, full, rank, cp, where) -> str:
    """Name the layout the answer's output has, among the plausible wrong ones."""
    import torch

    seq, heads, d = full.shape
    per = heads // cp
    strided = full[:, rank::cp]
    rows = seq // cp
    interleaved = torch.stack(full[:, rank * per:(rank + 1) * per].split(rows, dim=0), dim=1).reshape(seq, per, d)
    if per > 1 and torch.equal(got, strided):
        return (f"{where}: rank {rank} holds heads {list(range(heads))[rank::cp]}, strided: rank j takes h/cp "
                f"consecutive heads, j*h/cp to (j+1)*h/cp - 1 (here {list(range(rank * per, (rank + 1) * per))}), "
                "the ones one KV head's query heads are (grouped-query attention), and the ones the reverse "
                "all-to-all puts back: cut x with x.chunk(cp, dim=1)")
    if cp > 1 and rows > 1 and torch.equal(got, interleaved):
        return (f"{where}: rank {rank}'s rows are interleaved (row 0 of every rank, then row 1 of every rank...): the "
                "pieces that arrive are whole runs of positions, rank i's rows i-th; concatenate them along the "
                "sequence, torch.cat(received, dim=0), instead of stacking and reshaping")
    return (f"{where}: rank {rank}'s output is not every position of heads {rank * per} to {(rank + 1) * per - 1}, in "
            "order: send piece j (x.chunk(cp, dim=1)[j], heads j*h/cp onwards) to rank j, then concatenate what "
            "arrives along the sequence (dim 0), rank i's rows i-th")


def check_seq_to_heads(answer) -> tuple[str, str]:
    """``answer(x, cp, all_to_all)``: rank r's rows ``[seq/cp, heads, d]`` -> every row of heads
    ``[r h/cp, (r+1) h/cp)``, ``[seq, heads/cp, d]``, with one all-to-all; a ValueError if cp does not divide heads."""
    import torch

    for seq, heads, head_dim, cp, dtype, seed in A2A_SHAPES:
        where = f"at seq={seq}, heads={heads}, head_dim={head_dim}, cp={cp}, {dtype} (inputs from seed {seed})"
        full, blocks = _inputs(seq, heads, head_dim, cp, dtype, seed)
        saved = [b.clone() for b in blocks]
        group, outcomes = _run_ranks(answer, blocks)
        if group.problem:
            return FAIL, f"{where}: {group.problem}"
        for r, (kind, value) in enumerate(outcomes):
            if kind == "raised" and isinstance(value, NotImplementedError):
                raise NotImplementedError
            if kind == "raised" and not isinstance(value, _Stop):
                return FAIL, f"{where}: rank {r} raised {type(value).__name__}: {value}"
        if cp > 1 and any(c == 0 for c in group.calls):
            r = group.calls.index(0)
            return FAIL, (f"{where}: rank {r} never called all_to_all: each rank holds only its own rows, so the other "
                          "rows of its heads can only arrive through the all-to-all")
        per, rows = heads // cp, seq // cp
        for r, (_, got) in enumerate(outcomes):
            want = full[:, r * per:(r + 1) * per]  # [seq, heads/cp, d]
            if isinstance(got, (list, tuple)):
                return FAIL, (f"{where}: rank {r} returned a {type(got).__name__}, not one tensor [seq, heads/cp, d]: "
                              "concatenate the received pieces along the sequence, torch.cat(received, dim=0)")
            if not isinstance(got, torch.Tensor):
                return FAIL, f"{where}: rank {r} returned {type(got).__name__}: return one tensor [seq, heads/cp, d]"
            if got.dtype != want.dtype or got.device != want.device:
                return FAIL, (f"{where}: rank {r} returned {got.dtype} on {got.device} for {want.dtype} input on "
                              f"{want.device}: an all-to-all moves the tensors as they are; a buffer made with "
                              "torch.zeros or torch.empty takes the default dtype unless given dtype=x.dtype "
                              "(torch.cat keeps the dtype)")
            if tuple(got.shape) != tuple(want.shape):
                sent = tuple(group.posted[0, r][0].shape)
                if sent == (rows // cp, heads, head_dim) or (rows < cp and sent[1:] == (heads, head_dim)):
                    hint = ("you split the sequence (dim 0) into pieces: Ulysses scatters the heads, "
                            "x.chunk(cp, dim=1), and gathers the sequence")
                elif sent == (rows, per, head_dim) and tuple(got.shape) == (rows, heads, head_dim):
                    hint = ("the pieces you sent are right, but you concatenated what arrived along the heads (dim 1): "
                            "the pieces are other ranks' rows of your heads, so concatenate them along the sequence "
                            "(dim 0)")
                else:
                    hint = ("after the all-to-all each rank holds every position of h/cp heads: split x along the "
                            "heads (dim 1) into cp pieces, and concatenate what arrives along the sequence (dim 0)")
                return FAIL, (f"{where}: rank {r} returned shape {tuple(got.shape)}, expected [seq, heads/cp, d] = "
                              f"{tuple(want.shape)}: {hint}")
            if not torch.equal(got, want):
                return FAIL, _wrong_values(got, full, r, cp, where)
            if not torch.equal(_bits(got), _bits(want)):
                return FAIL, (f"{where}: rank {r}'s output has the right values but not their bits (a -0.0 became "
                              "0.0): a data move copies bits and computes nothing; adding the pieces into a buffer "
                              "of zeros changes them. Concatenate the pieces (torch.cat)")
        full_bytes = rows * heads * head_dim * full.element_size()  # one rank's block
        need = (cp - 1) * full_bytes // cp
        if any(b != need for b in group.sent_bytes):
            r = next(i for i, b in enumerate(group.sent_bytes) if b != need)
            sent, piece = group.sent_bytes[r], group.posted[0, r][0]
            if piece.dtype != full.dtype:
                why = (f"you sent the pieces as {piece.dtype} for {full.dtype} input: the wider dtype moves more bytes "
                       "and rounds nothing back; send the pieces in x's dtype")
            elif tuple(piece.shape) == tuple(blocks[r].shape):
                why = ("you sent the whole block to every rank (an all-gather) and cut the heads after arrival; send "
                       "rank j only its heads, piece j = x.chunk(cp, dim=1)[j]")
            else:
                why = "send rank j only its heads of your rows, piece j = x.chunk(cp, dim=1)[j], and nothing else"
            return FAIL, (f"{where}: rank {r} sent {sent} bytes, where an all-to-all of its block sends (cp-1)/cp of "
                          f"it, {need} bytes: {why}")
        for r, (block, before) in enumerate(zip(blocks, saved)):
            if block.shape != before.shape or not torch.equal(_bits(block), _bits(before)):
                what = (f"its shape {tuple(before.shape)} became {tuple(block.shape)}"
                        if block.shape != before.shape else "its values or their layout")
                return FAIL, (f"{where}: your function changed the caller's x on rank {r} ({what}): an in-place operation (transpose_, mul_, a slice "
                              "assignment) rewrites the caller's tensor; x.transpose, x.chunk and x.split return "
                              "views and leave it as it was")
    seq, heads, head_dim, cp = A2A_REFUSED
    where = f"at seq={seq}, heads={heads}, cp={cp}"
    _, blocks = _inputs(seq, heads, head_dim, cp, "float64", 147)
    refuse = (f"{where}: cp does not divide the heads, yet a rank called all_to_all: Ulysses gives each rank whole "
              "heads, so raise ValueError naming cp and heads before anything is sent")
    group, outcomes = _run_ranks(answer, blocks, refuse)
    if group.problem:
        return FAIL, group.problem
    for r, (kind, value) in enumerate(outcomes):
        if kind == "returned":
            return FAIL, (f"{where}: rank {r} returned instead of refusing: cp does not divide the heads, so raise "
                          "ValueError (Ulysses gives each rank whole heads)")
        if not isinstance(value, ValueError):
            return FAIL, (f"{where}: rank {r} raised {type(value).__name__}: {value}; raise ValueError when cp does "
                          "not divide the heads, before anything is sent")
    shapes = ", ".join(f"{s}x{h}x{d} over cp={c} ({t})" for s, h, d, c, t, _ in A2A_SHAPES)
    return PASS, (f"every rank holds every position of its h/cp consecutive heads, bit for bit, after one all-to-all "
                  f"of (cp-1)/cp of its block, inputs untouched, at {shapes}; heads={heads} over cp={cp} refused")


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
register(Exercise("seq_to_heads", "14", "seq_to_heads",
                  "Ulysses' first all-to-all: sequence shards become head shards", local=check_seq_to_heads, tries={
                      "non-finite": NOT_APPLICABLE + "the answer moves values and computes none: the inputs are "
                                    "finite, and any NaN in an output fails the exact comparison (torch.equal)",
                      "order": NOT_APPLICABLE + "a data move, checked without gradients (its backward, the reverse "
                               "all-to-all, runs in the chapter's worker)",
                      "sizes": "heads=6 over cp=4: the answer must raise ValueError on every rank before any "
                               "all_to_all call",
                      "ragged": NOT_APPLICABLE + "every rank holds seq/cp rows and h/cp heads: Ulysses has no ragged "
                                "pieces (a head count cp does not divide is refused, see sizes)",
                      "layouts": "six shapes: cp 1 to 4, heads/cp from 1 to 4 (heads = cp^2 first, where "
                                 "x.split(cp) happens to cut cp pieces), so a rule right for one ratio fails",
                      "traffic": "one all_to_all call per rank, cp equal pieces, and exactly (cp-1)/cp of the rank's "
                                 "block sent: pieces sent in a wider dtype, or the whole block to every rank, are named",
                      "mutation": "each rank's x keeps its shape and bits (an in-place transpose_ is named)",
                      "output": "one tensor, not the list of pieces, of the input's dtype (float64, float32, "
                                "bfloat16) and device: a float32 buffer is named",
                      "memory": NOT_APPLICABLE + "the answer returns new tensors: nothing is held or freed",
                      "bits": "inputs hold -0.0: the output must equal the expected bit for bit, so pieces added "
                              "into a buffer of zeros (0.0 + -0.0 = 0.0) are named",
                  }))
