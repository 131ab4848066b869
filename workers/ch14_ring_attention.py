"""Ring attention on real ranks (context parallelism): forward and backward over isend/irecv.

    torchrun --nproc-per-node 4 workers/ch14_ring_attention.py --seq 64 --split zigzag --causal true
    torchrun --nproc-per-node 4 workers/ch14_ring_attention.py --cp 2 --split contiguous

Every rank derives the same whole-sequence q, k, v and upstream gradient dout from ``seed``
(``workers/context_parallel/inputs.py``) and keeps only its rows (``split``: "contiguous" or "zigzag").
``cp`` (0: the whole world) is the ring size, a degree of the course's one layout (``workers/layout/rules.py``, whose
rules ``check_params`` asks); a world larger than cp runs world / cp identical rings side by side (ranks 0..cp-1,
cp..2cp-1, ...), so cp = 1, 2 and 4 all run on one set of 4 warm ranks.
Each rank returns its output rows, lse, dq, dk, dv (with the global positions of those rows), the blocks
it computed at each ring step, its work and the bytes it sent. Ground truth:
``workers/attention/reference.attention_reference_grads`` on the whole sequence in one process.
"""
from workers.context_parallel.attention import ring_attention_backward, ring_attention_forward
from workers.context_parallel.inputs import DTYPES, make_inputs
from workers.context_parallel.ring import Ring
from workers.context_parallel.split import local_positions, take_local
from workers.layout.grid import RankGrid
from workers.layout.rules import Layout, problem
from workers.runtime import at_least, entrypoint, one_of, refusal


def check_params(world_size, seq=64, heads=2, head_dim=16, batch=1, causal=True, split="zigzag", cp=0,
                 dtype="float64", **_):
    # the layout's rules (cp against the world, the split, seq against its chunks), then this worker's own
    degrees = (f"cp={cp} must be at least 0 (0: the whole world)" if cp < 0 else
               problem(Layout(cp=cp or world_size, split=split, seq=seq), world_size))
    return refusal(degrees, at_least("heads", heads), at_least("head_dim", head_dim), at_least("batch", batch),
                   one_of("dtype", dtype, DTYPES))


def main(ctx, seq: int = 64, heads: int = 2, head_dim: int = 16, batch: int = 1, causal: bool = True,
         split: str = "zigzag", cp: int = 0, seed: int = 0, dtype: str = "float64", backward: bool = True):
    """One ring-attention forward (and backward) of a [batch, heads, seq, head_dim] problem over cp ranks."""
    ring_size = cp or ctx.world_size
    grid = RankGrid.for_world(ctx.world_size, cp=ring_size)  # the other ranks: rings side by side (dp)
    members = grid.group("cp", ctx.rank)  # this rank's ring, in ring order
    index = members.index(ctx.rank)
    ring = Ring(index, members, ctx.device, ctx.comm_device("send"))
    q, k, v, dout = make_inputs(batch, heads, seq, head_dim, seed, dtype)  # [b, h, s, d] each, whole sequence
    q, k, v, dout = (take_local(t, seq, ring_size, index, split).to(ctx.device) for t in (q, k, v, dout))  # [b, h, s/cp, d]
    with ctx.timer("forward"):
        out, lse, log = ring_attention_forward(q, k, v, ring, split, causal)  # [b, h, s/cp, d], [b, h, s/cp]
    result = {"out": out.cpu(), "lse": lse.cpu()}
    if backward:
        with ctx.timer("backward"):
            dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout, ring, split, causal)
        result.update(dq=dq.cpu(), dk=dk.cpu(), dv=dv.cpu())
    chunk_bytes = k.numel() * k.element_size()  # one rank's K (or V) chunk: [b, h, s/cp, d]
    computed = [b for b in log if b[3] != "skip"]
    chunk_len = q.shape[-2] // (2 if split == "zigzag" else 1)  # tokens per chunk
    return {**result, "positions": local_positions(seq, ring_size, index, split),
            "blocks": [list(b) for b in log], "work_blocks": len(computed),
            "work_diagonal": sum(b[3] == "diagonal" for b in computed),
            "score_entries": len(computed) * chunk_len ** 2,  # FLOPs are proportional to this
            "sent_bytes": dict(ring.sent_bytes), "messages": dict(ring.messages), "kv_chunk_bytes": chunk_bytes,
            "ring_index": index, "ring": grid.coords(ctx.rank)["dp"], "cp": ring_size,
            "config": {"seq": seq, "heads": heads, "head_dim": head_dim, "batch": batch, "causal": causal,
                       "split": split, "seed": seed, "dtype": dtype}}


if __name__ == "__main__":
    entrypoint(main)
