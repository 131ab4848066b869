"""The embedding, the LM head and the loss split by vocabulary on real ranks, against the same ends in one process.

    torchrun --nproc-per-node 4 workers/ch04_vocab_parallel.py --tp 4 --logit-scale 1000 --fault max_not_reduced

Every rank builds the same dense embedding and head from ``seed``, keeps its block of the vocabulary
(``workers/parallel/vocab.py``), and runs the loss ``vocab_parallel_cross_entropy`` on its ``[s, b, vocab/tp]``
logits: three all-reduces of ``[s, b]``, never the logits gathered. It returns its loss, every gradient (its rows of
the embedding and the head, the head's input, its columns of the logits), the bytes of its logits and of the dense
logits (measured), the loss's all-reduces, and the verdict of the comparison with the dense ends
(``vocab_harness.verdict``), which names the mistake a ``fault`` (``VOCAB_FAULTS``) puts in the loss, and says
where to look for one of the library's faults that break the collectives around it (``END_FAULTS``).
"""
from workers.layout.mesh import Mesh
from workers.parallel.faults import VOCAB_FAULTS
from workers.parallel.harness import DTYPES
from workers.parallel.vocab_harness import forward_backward, verdict
from workers.runtime import at_least, divides, divides_world, entrypoint, one_of, refusal


# the tensor-parallel library's faults that touch these ends: the embedding's g, the head's f
END_FAULTS = ("drop_forward_all_reduce", "drop_backward_all_reduce", "double_all_reduce")


def check_params(world_size, tp=0, vocab=32, hidden=16, seq=8, batch=4, logit_scale=1.0, fault="",
                 dtype="float64", **_):
    tp = tp or world_size
    bad = refusal(one_of("dtype", dtype, list(DTYPES)), one_of("fault", fault, ("",) + VOCAB_FAULTS + END_FAULTS),
                  at_least("vocab", vocab), at_least("hidden", hidden), at_least("seq", seq), at_least("batch", batch),
                  divides_world("tp", tp, world_size),
                  None if isinstance(logit_scale, (int, float)) and logit_scale > 0
                  else f"logit_scale={logit_scale!r} must be a positive number")
    # each rank holds vocab/tp words: the same number on every rank, as Megatron requires (it pads the vocabulary)
    return bad or divides("tp", tp, "vocab", vocab)


def main(ctx, vocab: int = 32, hidden: int = 16, seq: int = 8, batch: int = 4, tp: int = 0, tied: bool = False,
         logit_scale: float = 1.0, seed: int = 0, fault: str = "", dtype: str = "float64"):
    """One forward and backward of this rank's block of the vocabulary; its parts of every tensor and the verdict.

    ``tp`` splits the world into tensor-parallel groups of that size, each running the same ends independently
    (0: one group, the whole world). ``logit_scale`` multiplies the logits (1000: large enough that exp() of an
    unshifted logit overflows even in float64).
    """
    shape = dict(vocab=vocab, hidden=hidden, seq=seq, batch=batch, seed=seed, tied=tied, logit_scale=logit_scale)
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh:
        group = mesh.group("tp")
        out = forward_backward(**shape, group=group, device=ctx.device, dtype=DTYPES[dtype], fault=fault)
        judged = verdict(out, **shape, group=group, dtype=DTYPES[dtype])
        return {**out, "verdict": judged, "fault": fault, **mesh.describe("tp")}


if __name__ == "__main__":
    entrypoint(main)
