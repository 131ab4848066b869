"""Context parallelism (chapter 14): the sequence split over cp ranks, and ring attention and Ulysses over it.

    split.py      which token positions each rank holds: contiguous, or the load-balanced zigzag
    blocks.py     which (query chunk, key chunk) blocks a causal mask leaves to compute, per rank and ring step
    ring.py       the ring's point-to-point links: send to rank + 1, receive from rank - 1, bytes counted
    attention.py  ring attention forward (online-softmax merge) and its hand-written ring backward
    inputs.py     the deterministic q, k, v, dout every rank (and the notebook's reference) derives
    simulate.py   the same ring loop in one process (grading a block rule, no ranks)
    ulysses.py    DeepSpeed-Ulysses: all-to-all from sequence to heads and back, alone or around the ring (USP),
                  with the bytes each rank sends, beside the ring's
    reference.py  full attention with grouped-query heads in one process, float64: what every rank's rows must equal

Ring attention: Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers"
(arXiv:2310.01889); the zigzag split and the KV ring as in Megatron-Core's context parallelism.
Ulysses: Jacobs et al. 2023 (arXiv:2309.14509); Ulysses x ring: Fang and Zhao 2024, USP (arXiv:2405.07719).
"""
