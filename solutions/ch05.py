"""Reference answers for chapter 05's exercises (each self-contained: it travels to the ranks as source)."""


def split_fused_qkv(w, heads, kv_heads, head_dim, rank, tp):
    """This rank's query heads from Q, then its KV heads from K and from V (whole heads, replicated if needed)."""
    import torch

    d, t = head_dim, tp
    q_per = heads // t
    if kv_heads % t == 0:  # split: kv_heads / t heads per rank
        kv = list(range(rank * kv_heads // t, (rank + 1) * kv_heads // t))
    else:  # replicated: t / kv_heads ranks share each KV head
        kv = [rank // (t // kv_heads)]
    q = w[rank * q_per * d:(rank + 1) * q_per * d]
    k_all, v_all = w[heads * d:(heads + kv_heads) * d], w[(heads + kv_heads) * d:]
    k = torch.cat([k_all[j * d:(j + 1) * d] for j in kv])
    v = torch.cat([v_all[j * d:(j + 1) * d] for j in kv])
    return torch.cat([q, k, v])


def kv_heads_for_rank(heads, kv_heads, tp, rank):
    """The KV heads this rank's query heads read: query head j reads KV head j // (heads / kv_heads)."""
    group = heads // kv_heads
    q_per = heads // tp
    return sorted({j // group for j in range(rank * q_per, (rank + 1) * q_per)})
