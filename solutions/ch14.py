"""Reference answers for chapter 14's exercises (each self-contained: it may travel as source)."""


def zigzag_chunks(seq, cp, rank):
    """Rank ``rank``'s two (start, stop) token ranges: chunk rank and chunk 2*cp-1-rank of 2*cp equal chunks."""
    size = seq // (2 * cp)
    mirror = 2 * cp - 1 - rank  # an early chunk (little causal work) with a late one (much): equal sums
    return [(rank * size, (rank + 1) * size), (mirror * size, (mirror + 1) * size)]


def block_kind(q_chunk, k_chunk):
    """Causal attention between two chunks cut at the same boundaries."""
    if q_chunk > k_chunk:
        return "full"  # every key is earlier than every query
    if q_chunk == k_chunk:
        return "diagonal"  # same positions: lower-triangular mask inside the block
    return "skip"  # every key is in the future


def seq_to_heads(x, cp, all_to_all):
    """Ulysses' first all-to-all on one rank: its rows ``[seq/cp, heads, d]`` -> every row of its h/cp heads
    ``[seq, heads/cp, d]``. ``all_to_all(pieces)``: piece j goes to rank j; the list returned has rank i's piece i-th."""
    import torch

    rows, heads, d = x.shape
    if heads % cp:
        raise ValueError(f"cp={cp} does not divide heads={heads}: Ulysses gives each rank whole heads")
    pieces = list(x.chunk(cp, dim=1))  # piece j: heads j*h/cp .. (j+1)*h/cp - 1 of my rows, for rank j
    received = all_to_all(pieces)  # piece i: rank i's rows of my heads  [seq/cp, heads/cp, d] each
    return torch.cat(received, dim=0)  # [seq, heads/cp, d], rank i's rows i-th: the sequence in order
