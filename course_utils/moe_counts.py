"""Mixture of experts for the planner: exact parameter counts, what expert parallelism leaves on a rank, and the
all-to-all bytes it sends.

``moe_parameter_counts(cfg)`` counts every matrix and norm vector of an MoE decoder whose shape is a
``published_configs.PublishedMoE`` (total, active, routed experts, the dense rest); ``ep_rank_parameters`` is what
one rank holds when each MoE layer's routed experts are split over ``ep`` ranks; ``all_to_all_bytes`` and
``ep_traffic_per_step`` are the bytes one rank sends for the dispatch and the combine, under uniform routing.
``tests/test_planner_moe.py`` holds the counts to Mixtral 8x7B's and DeepSeek-V3's published figures; chapter 16
measures the bytes against ``all_to_all_bytes``. ``course_utils.planner`` re-exports every public name.
"""

from __future__ import annotations

from .model_shapes import LayoutError, _check_degree, _divisors


def _attention_params(cfg) -> int:
    """One layer's attention weights, no biases (neither Mixtral nor DeepSeek-V3 has any).

    "gqa": W_q and W_o (hidden x heads*head_dim), W_k and W_v (hidden x kv_heads*head_dim).
    "mla" (DeepSeek-V2/V3's multi-head latent attention, the released modeling_deepseek.py): q_a_proj
    hidden x q_lora_rank, its RMSNorm, q_b_proj q_lora_rank x heads*(nope + rope); kv_a_proj_with_mqa
    hidden x (kv_lora_rank + rope) (the latent and the shared RoPE key), its RMSNorm, kv_b_proj kv_lora_rank x
    heads*(nope + v); o_proj heads*v x hidden.
    """
    h = cfg.hidden
    if cfg.attention == "gqa":
        head_dim = cfg.head_dim or h // cfg.heads
        return 2 * h * cfg.heads * head_dim + 2 * h * cfg.kv_heads * head_dim
    if cfg.attention == "mla":
        qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * cfg.heads * qk_head
        kv = (h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
              + cfg.kv_lora_rank * cfg.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        return q + kv + cfg.heads * cfg.v_head_dim * h
    raise LayoutError(f"{cfg.name}: attention must be 'gqa' or 'mla', got {cfg.attention!r}.")


def moe_parameter_counts(cfg) -> dict[str, int]:
    """Exact parameter counts of an MoE decoder (a ``published_configs.PublishedMoE``), as Python ints.

    Keys: ``total``; ``active``, the parameters one token's forward pass uses; ``experts``, the routed experts'
    parameters over all layers (what expert parallelism shards); ``dense``, everything else (attention, norms,
    routers, shared experts, dense FFN layers, embedding and LM head: what every EP rank holds whole);
    ``active_experts``, the routed expert parameters one token uses (``top_k`` per MoE layer); and
    ``input_embedding``, the vocab x hidden table, so that ``active - input_embedding`` is the count without it.

    What is counted: every expert (shared or routed) and every dense FFN is SwiGLU, three hidden x ffn matrices
    (gate, up, down), no biases; two RMSNorm weight vectors per layer and a final one; the router, experts x
    hidden, plus, where ``router_bias`` (DeepSeek-V3), the per-expert bias its auxiliary-loss-free balancing adds
    to the routing scores (a parameter of the released checkpoint, so counted, though it takes no gradient);
    attention as ``_attention_params`` says; the embedding and a separate LM head unless ``tied_embeddings``.
    DeepSeek-V3's multi-token-prediction module is not part of the model counted (its 671B excludes it).

    ``active`` counts every parameter a token touches: the dense part whole, ``top_k`` routed experts per MoE
    layer, the embedding table and the LM head (as a matrix; the embedding is a lookup of one row, but it is
    counted whole, as parameter counts usually do). Against the published figures:

    - Mixtral 8x7B: total 46,702,792,704 and active 12,879,925,248, which round to the release post's 46.7B and
      12.9B (to the nearest 0.1B). Without the input embedding, active would be 12.75B, which would not: Mistral
      counts the embedding table as active.
    - DeepSeek-V3: total 671,026,419,200, which rounds to the report's 671B; active 37,552,297,472, which rounds
      to 38B, not the report's 37B. The report's 37B is what is left with one vocab x hidden table fewer
      (36,625,618,432 without the input embedding, a lookup that does no matmul, rounds to 37B), or 37.55B cut
      to 37B; the report does not say which. Either way the two publishers count "active" differently, and
      ``tests/test_planner_moe.py`` holds both facts.
    """
    h = cfg.hidden
    swiglu = lambda ffn: 3 * h * ffn  # noqa: E731  gate, up and down projections, no biases
    per_expert = swiglu(cfg.expert_ffn)
    moe_layers = cfg.layers - cfg.dense_layers
    norms = 2 * h  # before attention and before the FFN
    attention = _attention_params(cfg) + norms
    router = cfg.experts * h + (cfg.experts if cfg.router_bias else 0)
    dense_layer = attention + swiglu(cfg.ffn)
    moe_layer_dense_part = attention + router + cfg.shared_experts * per_expert
    input_embedding = cfg.vocab * h
    embeddings = input_embedding * (1 if cfg.tied_embeddings else 2)
    dense = cfg.dense_layers * dense_layer + moe_layers * moe_layer_dense_part + embeddings + h  # + final norm
    experts = moe_layers * cfg.experts * per_expert
    active_experts = moe_layers * cfg.top_k * per_expert
    return {"total": dense + experts, "active": dense + active_experts, "experts": experts, "dense": dense,
            "active_experts": active_experts, "input_embedding": input_embedding}


def ep_rank_parameters(cfg, ep: int) -> int:
    """Parameters one rank holds when each MoE layer's routed experts are split over ``ep`` ranks.

    Expert parallelism (Lepikhin et al. 2020, GShard, sec 3; Fedus et al. 2021, Switch Transformer, sec 5)
    gives every rank ``experts / ep`` whole routed experts of every MoE layer and replicates everything else
    (attention, routers, shared experts, dense layers, embeddings): ``dense + experts / ep``. No other
    parallelism is applied; with PP or TP as well, divide further.
    """
    ep = _check_degree("ep", ep)
    if cfg.experts % ep:
        raise LayoutError(
            f"ep={ep} does not divide the {cfg.experts} routed experts of {cfg.name}, so ranks would hold "
            f"different numbers of experts; use an ep from {_divisors(cfg.experts)}."
        )
    counts = moe_parameter_counts(cfg)
    return counts["dense"] + counts["experts"] // ep


def all_to_all_bytes(tokens: int, hidden: int, top_k: int, ep: int, bytes_per_element: int) -> float:
    """Bytes one rank sends in ONE all-to-all of the dispatch, under uniform routing.

    The rank holds ``tokens`` tokens (its micro-batch) of ``hidden`` elements, ``bytes_per_element`` wide (bf16:
    2), and sends one copy of each token to each of its ``top_k`` experts: ``tokens x top_k`` rows. With the
    experts spread evenly over ``ep`` ranks and the router picking them uniformly, a fraction 1/ep of the rows
    stay on the rank and (ep - 1)/ep cross the network:

        tokens x hidden x bytes_per_element x top_k x (ep - 1) / ep

    The combine brings the same rows back, another all-to-all of the same size; per MoE layer the forward pass
    is dispatch + combine (2x this) and the backward pass another 2x (the gradients travel the same routes in
    reverse), 4 all-to-alls per layer per micro-batch (6 if the MoE layer's forward is recomputed). Uniform
    routing is the model's assumption: a skewed router sends other amounts, and a rank that holds the popular
    experts receives more than it sends. Two copies of a token bound for experts on the same rank are counted
    twice, as a plain all-to-all sends them (DeepSeek-V3 instead sends a token over InfiniBand once per target
    node, at most 4 nodes, and forwards it there over NVLink: report sec 3.2.2).
    """
    for name, value in (("tokens", tokens), ("hidden", hidden), ("top_k", top_k), ("ep", ep),
                        ("bytes_per_element", bytes_per_element)):
        _check_degree(name, value)
    return tokens * hidden * bytes_per_element * top_k * (ep - 1) / ep


def ep_traffic_per_step(cfg, tokens_per_rank: int, ep: int, bytes_per_element: int = 2,
                        num_microbatches: int = 1) -> dict[str, float]:
    """All-to-all bytes one rank sends for expert parallelism, per MoE layer and per optimizer step.

    ``tokens_per_rank`` is the tokens of one micro-batch on this rank; ``num_microbatches`` how many it runs per
    step. Keys: ``per_all_to_all`` (``all_to_all_bytes``), ``all_to_alls_per_layer`` (4: dispatch and combine,
    forward and backward), ``per_layer`` (one MoE layer, one micro-batch, forward and backward), ``moe_layers``
    and ``per_step`` (every MoE layer of the model, every micro-batch: what the rank sends if it runs all the
    layers, i.e. without pipeline parallelism; with PP a rank sends its stage's share). Uniform routing, as in
    ``all_to_all_bytes``.
    """
    ep_rank_parameters(cfg, ep)  # the same refusal when ep does not divide the experts
    _check_degree("num_microbatches", num_microbatches)
    one = all_to_all_bytes(tokens_per_rank, cfg.hidden, cfg.top_k, ep, bytes_per_element)
    moe_layers = cfg.layers - cfg.dense_layers
    per_layer = 4 * one
    return {"per_all_to_all": one, "all_to_alls_per_layer": 4, "per_layer": per_layer, "moe_layers": moe_layers,
            "per_step": per_layer * moe_layers * num_microbatches}
