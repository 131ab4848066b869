"""Reference answers for chapter 05's exercises (each self-contained: it travels to the ranks as source)."""


def split_fused_qkv(w, n_heads, n_kv_heads, head_dim, rank, world_size):
    """This rank's query heads from Q, then its KV heads from K and from V (whole heads, replicated if needed)."""
    import torch

    d, t = head_dim, world_size
    q_per = n_heads // t
    if n_kv_heads % t == 0:  # split: n_kv_heads / t heads per rank
        kv = list(range(rank * n_kv_heads // t, (rank + 1) * n_kv_heads // t))
    else:  # replicated: t / n_kv_heads ranks share each KV head
        kv = [rank // (t // n_kv_heads)]
    q = w[rank * q_per * d:(rank + 1) * q_per * d]
    k_all, v_all = w[n_heads * d:(n_heads + n_kv_heads) * d], w[(n_heads + n_kv_heads) * d:]
    k = torch.cat([k_all[j * d:(j + 1) * d] for j in kv])
    v = torch.cat([v_all[j * d:(j + 1) * d] for j in kv])
    return torch.cat([q, k, v])


def kv_heads_for_rank(n_heads, n_kv_heads, world_size, rank):
    """The KV heads this rank's query heads read: query head j reads KV head j // (n_heads / n_kv_heads)."""
    group = n_heads // n_kv_heads
    q_per = n_heads // world_size
    return sorted({j // group for j in range(rank * q_per, (rank + 1) * q_per)})
