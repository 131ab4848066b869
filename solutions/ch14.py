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
