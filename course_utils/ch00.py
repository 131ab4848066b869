"""Notebook-side helpers for chapter 00: the partition table, memory bars, the bubble and bandwidth figures,
and the planner widget. Every number comes from ``course_utils.ledger`` / ``course_utils.planner``; this
module only lays them out. Pure Python plus matplotlib/ipywidgets: no ranks are started.
"""
from __future__ import annotations


from course_utils.ledger import GB, collective_time, pipeline_bubble_fraction, tp_comm_bytes_per_layer
from course_utils import reference_data
from course_utils.planner import (CLUSTERS, GPUS, MODEL_SHAPES, NETWORK_TIERS, Layout, LayoutError, Plan,
                                  all_to_all_bytes, ep_rank_parameters, ep_traffic_per_step, model_shape,
                                  moe_parameter_counts, plan, zero_collectives_per_step)
from course_utils.published_configs import PUBLISHED_CONFIGS, PUBLISHED_MOE, PublishedConfig, PublishedMoE
from course_utils.tables import Table

STATE_COLOURS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}
# one colour per term of course_utils.step_time.TERMS: compute in blues, idle in grey, communication warm
TIME_COLOURS = {"matmul": "#4C72B0", "attention": "#7A9CC6", "memory-bound": "#A6BDDB", "kernel overhead": "#D0D9E8",
                "recompute": "#64B5CD", "tp": "#DD8452", "cp": "#8172B3", "ep": "#DA8BC3", "bubble": "#BBBBBB",
                "pp": "#937860", "dp": "#55A868", "optimizer": "#CCB974"}


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.0f} KiB"


# -- 1. the partition logic of each parallelism ------------------------------------------------------------

def zero_frequency(zero_stage: int, per: str = "") -> str:
    """How often a ZeRO stage's collectives run, read off ``planner.zero_collectives_per_step`` (so the table
    and the planner's step times count the same thing): a count that grows with the micro-batches is "per
    micro-batch", one that does not is "per step". ``per`` names the unit of each pass ("layer" for ZeRO-3)."""
    one, two = zero_collectives_per_step(zero_stage, 1), zero_collectives_per_step(zero_stage, 2)
    unit = f"per {per} per micro-batch" if per else "per micro-batch"
    parts = []
    order = ("all_reduce", "all_gather", "reduce_scatter") if zero_stage == 3 else ("all_reduce", "reduce_scatter",
                                                                                    "all_gather")
    for name in order:
        if one[name]:
            parts.append(f"{one[name]} {name} " + (unit if two[name] == 2 * one[name] else "per step"))
    return ", ".join(parts)


def partition_table(model: str = "70B", *, tp: int = 8, cp: int = 2, pp: int = 4, micro_batch: int = 1,
                    seq: int = 8192, experts_top_k: int = 2, ep: int = 8) -> Table:
    """What each parallelism splits, what it communicates, when, how big each message is and how often.

    Sizes are bf16 (2 bytes) for one micro-batch of ``micro_batch`` x ``seq`` tokens of ``model``; "per GPU"
    model states assume the ``tp`` x ``pp`` split. Sources: DP/ZeRO, Rajbhandari et al. 2020 sec 5 and 7;
    TP, Shoeybi et al. 2019 sec 3; SP, Korthikanti et al. 2022 sec 4.2.2; CP, Llama 3 paper sec 3.3.2;
    PP, Narayanan et al. 2021 sec 2.2 and 4.1; EP, Lepikhin et al. 2020 (GShard) sec 3. EP's message is the
    dispatch buffer (each of the CP rank's tokens, ``experts_top_k`` times) and, in brackets, what
    ``planner.all_to_all_bytes`` says leaves the rank over ``ep`` ranks under uniform routing.
    """
    m = model_shape(model)
    b, s, h = micro_batch, seq, m.hidden
    local_params = m.n_params / (tp * pp)
    layer_params = m.params_per_layer / tp
    act = b * (s // cp) * h * 2  # one [b, s/cp, h] bf16 activation: a CP rank holds s/cp of the tokens
    tpc = tp_comm_bytes_per_layer(b, s // cp, h, tp)
    kv = 2 * b * s * m.kv_dim / tp * 2  # K and V of the whole sequence, this TP rank's heads
    a2a_sent = all_to_all_bytes(b * (s // cp), h, experts_top_k, ep, 2)  # of act * top_k, (ep-1)/ep leaves the rank
    rows = [
        ["DP (DDP)", "the batch; model replicated", "all_reduce of gradients",
         "after the last micro-batch's backward (bucketed, overlapped)", _mb(2 * local_params), zero_frequency(0)],
        ["ZeRO-1", "+ optimizer states over DP", "reduce_scatter grads, all_gather params",
         "after the last backward / after the step", _mb(2 * local_params) + " each", zero_frequency(1)],
        ["ZeRO-2", "+ gradients over DP", "reduce_scatter grads (per bucket), all_gather params",
         "during every backward / after the step", _mb(2 * local_params) + " each", zero_frequency(2)],
        ["ZeRO-3 / FSDP", "+ parameters over DP", "all_gather a layer's params; reduce_scatter its grads",
         "before each layer's fwd and bwd; after its bwd", _mb(2 * layer_params) + " per layer",
         zero_frequency(3, per="layer")],
        ["TP", "weight matrices (heads, FFN columns/rows)", "all_reduce of activations",
         "inside every layer, fwd and bwd", _mb(tpc.message_bytes), "4 per layer per micro-batch"],
        ["SP (with TP)", "LayerNorm/dropout activations along the sequence", "reduce_scatter + all_gather",
         "replaces each TP all_reduce", _mb(tpc.message_bytes) + " (same wire bytes)", "4 + 4 per layer per micro-batch"],
        ["CP", "the sequence (queries stay, keys/values travel)", "all_gather K,V; reduce_scatter dK,dV",
         "inside every attention, fwd and bwd", _mb(kv), "2 per layer per micro-batch"],
        ["PP", "the layers into stages", "send/recv activations and their gradients",
         "at each stage boundary", _mb(act / tp) + " (1/tp with scatter/gather)", "2 per micro-batch per boundary"],
        [f"EP (MoE, top-{experts_top_k})", "the experts of each MoE layer", "all_to_all tokens out and back",
         "around every MoE FFN, fwd and bwd",
         f"{_mb(act * experts_top_k)} ({_mb(a2a_sent)} leave the rank at ep={ep})", "4 per MoE layer per micro-batch"],
    ]
    caption = (f"{m.name}, micro-batch {b} x {s} tokens, bf16, tp={tp}, cp={cp}, pp={pp}: "
               "message = the buffer one collective moves (nccl-tests' S); DP and ZeRO-1 accumulate full "
               "gradients over a step's micro-batches, ZeRO-2/3 keep a shard and reduce after each")
    return Table(["parallelism", "splits", "communicates", "when", "message", "how often"], rows, caption)


# -- 2. memory bars and time bars ----------------------------------------------------------------------------

def memory_bars(plans: list[Plan], labels: list[str], ax=None, title: str = "memory per GPU",
                zoom_gb: float | None = None):
    """Stacked bars of params / grads / optimizer / activations (GB) with each plan's GPU-memory line.

    The axis is linear, so each segment's height is its share of the bar (a log axis would shrink the top
    segments of a stack). With ``zoom_gb`` and a bar taller than it, ``ax`` zooms to 0..``zoom_gb`` (the
    small bars against the GPU line; the tall ones run off the top) and a second linear axis above it,
    ``ax.upper``, shows every bar whole at full scale, so the tall bars keep their proportions too.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(plans) + 2), 3.6))
    totals = [p.total_memory_bytes / GB for p in plans]
    gpu_line = max(p.gpu_memory_bytes / GB for p in plans)
    broken = zoom_gb is not None and max(totals) > zoom_gb
    axes = [ax]
    if broken:
        from mpl_toolkits.axes_grid1 import make_axes_locatable

        upper = make_axes_locatable(ax).append_axes("top", size="60%", pad=0.15, sharex=ax)
        axes.append(upper)
        ax.upper = upper
    for a in axes:
        bottoms = [0.0] * len(plans)
        for state, colour in STATE_COLOURS.items():
            values = [p.memory[state] / GB for p in plans]
            a.bar(range(len(plans)), values, bottom=bottoms, color=colour, label=state, width=0.6)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        for i, p in enumerate(plans):
            a.hlines(p.gpu_memory_bytes / GB, i - 0.4, i + 0.4, colors="black", linestyles="--", linewidth=1.2)
    for i, p in enumerate(plans):
        where = axes[-1] if broken and totals[i] > zoom_gb else ax
        where.text(i, totals[i], "fits" if p.fits else "does NOT fit", ha="center", va="bottom", fontsize=8,
                   color="#1a7f37" if p.fits else "#cf222e")
    ax.set_xticks(range(len(plans)), labels, fontsize=8)
    ax.set_ylabel("GB (1e9 bytes)")
    axes[-1].set_title(title + "  (dashed: GPU memory)", fontsize=10)
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if broken:
        ax.set_ylim(0, zoom_gb)
        upper.set_ylim(0, max(totals) * 1.2)
        upper.tick_params(axis="x", bottom=False, labelbottom=False)
        upper.text(0.99, 0.92, "full scale", transform=upper.transAxes, fontsize=7, color="#555555", ha="right",
                   va="top")
        ax.text(0.99, 0.97, f"zoom: 0 to {zoom_gb:.0f} GB", transform=ax.transAxes, fontsize=7, color="#555555",
                ha="right", va="top")
    else:
        ax.set_ylim(0, max(max(totals), gpu_line) * 1.18)
    return ax


def time_bars(plans: list[Plan], labels: list[str], ax=None, title: str = "time per step"):
    """Horizontal stacked bars of one step's terms (``course_utils.step_time.TERMS``: compute, idle, exposed
    communication, the optimizer), each labelled with its global batch, tokens/s, MFU and communication share:
    steps of different batches are not comparable by length, throughput always is."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(plans) + 2), 3.6))
    left = [0.0] * len(plans)
    for name, colour in TIME_COLOURS.items():
        values = [p.time.terms[name] for p in plans]
        if not any(values):
            continue
        ax.barh(range(len(plans)), values, left=left, color=colour,
                label=f"comm {name}" if name in ("tp", "cp", "ep", "pp", "dp") else name, height=0.6)
        left = [a + v for a, v in zip(left, values)]
    for i, p in enumerate(plans):
        ax.text(left[i], i, f" {p.sequences_per_step} seq, {p.tokens_per_second / 1e3:,.0f}k tok/s, "
                f"MFU {100 * p.mfu:.0f}%, comm {100 * p.comm_share:.0f}%", va="center", ha="left", fontsize=7)
    ax.set_xlim(0, max(left) * 1.75)
    ax.set_yticks(range(len(plans)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step (modelled)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    return ax


def plan_row(label: str, p: Plan) -> list[str]:
    lay = p.layout
    return [label, f"{p.n_gpus}", f"{lay.tp}/{lay.cp}/{lay.pp}/{lay.dp}", f"{lay.zero}",
            f"{lay.micro_batches}", f"{p.sequences_per_step}", f"{p.total_memory_bytes / GB:.1f}",
            "yes" if p.fits else "NO", f"{p.step_time_s:.2f}", f"{p.tokens_per_second / 1e3:,.0f}",
            f"{100 * p.comm_share:.0f}%", f"{100 * p.mfu:.0f}%"]


# m: micro-batches per replica; batch: sequences per step (dp x m x micro-batch); k tok/s: thousands of tokens/s
PLAN_HEADER = ["configuration", "GPUs", "tp/cp/pp/dp", "ZeRO", "m", "batch", "GB/GPU", "fits", "s/step", "k tok/s",
               "comm", "MFU"]


def fastest_fitting(plans: dict[str, Plan]) -> str:
    """The name of the fitting plan with the highest throughput (tokens/s), the fair race between layouts."""
    fitting = {name: p for name, p in plans.items() if p.fits}
    if not fitting:
        raise ValueError("none of these plans fits; nothing to race")
    return max(fitting, key=lambda name: fitting[name].tokens_per_second)


# -- 3. pipeline bubble -----------------------------------------------------------------------------------------

def bubble_figure(ps=(4, 8, 16), vs=(1, 2, 4), max_m: int = 64):
    """Two panels, one per denominator: bubble / ideal compute, and the idle share of the whole step."""
    import matplotlib.pyplot as plt

    from course_utils.plots import log2_axis

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
    ms = list(range(1, max_m + 1))
    styles = {1: "-", 2: "--", 4: ":"}
    for ax, denominator in zip(axes, ("ideal", "total")):
        for i, p in enumerate(ps):
            for v in vs:
                ys = [pipeline_bubble_fraction(p, m, v, denominator=denominator) if (v == 1 or m % p == 0) else None
                      for m in ms]
                pts = [(m, y) for m, y in zip(ms, ys) if y is not None]
                ax.plot([a for a, _ in pts], [b for _, b in pts], styles.get(v, "-"), color=f"C{i}",
                        label=f"p={p}, v={v}")
        log2_axis(ax, label="micro-batches per step, m")
        ax.axhline(0.1, color="grey", linewidth=0.8)
    axes[0].set_title("bubble / ideal compute = (1/v)(p-1)/m", fontsize=10)
    axes[0].set_ylim(0, 2)
    axes[1].set_title("idle share of the step = (p-1)/(vm+p-1)", fontsize=10)
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7, ncol=3)
    fig.suptitle("Pipeline bubble (Narayanan et al. 2021, sec 2.2); grey line: 10%", fontsize=10)
    fig.tight_layout()
    return fig


# -- 4. why TP stays inside the NVLink domain ----------------------------------------------------------------

def tp_layer_times(model: str = "70B", *, tp: int = 8, micro_batch: int = 1, seq: int = 4096,
                   gpu: str = "h100-ib") -> dict:
    """One layer, one micro-batch: one TP rank's compute (matmuls at their measured shapes, attention, memory-bound
    work, forward and backward, as ``step_time`` prices them) against the 4 TP all-reduces over each tier."""
    from course_utils.hardware import sustained_share
    from course_utils.step_time import COMPUTE_TERMS, layer_seconds

    m = model_shape(model)
    cl = CLUSTERS[gpu]
    b, s, h = micro_batch, seq, m.hidden
    parts = layer_seconds(m, Layout(tp=tp, micro_batch=b, seq=s), cl, sustained=sustained_share(cl.gpu))
    compute = sum(v for d in parts.values() for k, v in d.items() if k in COMPUTE_TERMS)
    comm = tp_comm_bytes_per_layer(b, s, h, tp)
    tiers = {}
    for key in ("nvlink4", "pcie4", "ib-ndr400", "ethernet100"):
        link = NETWORK_TIERS[key]
        tiers[key] = comm.all_reduces * collective_time("all_reduce", comm.message_bytes, tp, link.achieved,
                                                        link.latency)
    return {"compute_s": compute, "comm_s": tiers, "message_bytes": comm.message_bytes, "all_reduces": comm.all_reduces}


def _log_ticks(ax, ticks) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def bandwidth_figure(model: str = "70B", tp: int = 8):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    keys = list(NETWORK_TIERS)
    bws = [NETWORK_TIERS[k].bandwidth / 1e9 for k in keys]
    ax1.barh(range(len(keys)), bws, color=["#4C72B0" if k.startswith("nvlink") else "#999999" for k in keys])
    ax1.set_yticks(range(len(keys)), [NETWORK_TIERS[k].name for k in keys], fontsize=7)
    ax1.invert_yaxis()
    _log_ticks(ax1, [10, 30, 100, 300])
    ax1.set_xlim(5, 700)
    ax1.set_xlabel("GB/s per GPU, one direction (datasheets)")
    rows, _ = reference_data.published_allreduce()
    if rows:
        best = max(r["busbw"] for r in rows) / 1e9
        ax1.axvline(best, color="#C44E52", linestyle="--", linewidth=1)
        ax1.text(best * 0.95, len(keys) - 1, f"measured all_reduce\nbusbw, 8x H200:\n{best:.0f} GB/s", color="#C44E52",
                 fontsize=7, va="center", ha="right")
    ax1.set_title("bandwidth tiers", fontsize=10)
    t = tp_layer_times(model, tp=tp)
    labels = ["matmuls (60% of peak)"] + [f"TP all-reduces over {NETWORK_TIERS[k].name.split(' (')[0]}" for k in t["comm_s"]]
    values = [t["compute_s"] * 1e3] + [v * 1e3 for v in t["comm_s"].values()]
    colours = ["#4C72B0"] + ["#DD8452"] * len(t["comm_s"])
    ax2.barh(range(len(values)), values, color=colours)
    ax2.set_yticks(range(len(values)), labels, fontsize=7)
    ax2.invert_yaxis()
    _log_ticks(ax2, [0.3, 1, 3, 10, 30])
    ax2.set_xlim(0.2, 2 * max(values))
    ax2.set_xlabel("ms per layer per micro-batch (modelled, no overlap)")
    ax2.set_title(f"{model_shape(model).name}, tp={tp}: {t['all_reduces']} x {_mb(t['message_bytes'])} all-reduces",
                  fontsize=10)
    fig.tight_layout()
    return fig


# -- 5. published configurations -----------------------------------------------------------------------------

PUBLISHED_HEADER = ["run", "GPU", "GPUs", "tp/cp/pp/dp", "DP holds", "MFU", "TP*CP*PP*DP"]
PUBLISHED_CAPTION = ("Korthikanti et al. 2022 Tables 3 and 5 and sec 6.3 (the 2240-GPU row); Llama 3 Table 4; "
                     "BLOOM tr11 README; OPT sec 2.4 and the metaseq logbook")


def product_check(c: PublishedConfig) -> str:
    """The product rule for one row, honestly: "ok"/"MISMATCH" where every degree is as the source prints it;
    where a degree was derived from the rule (or chosen by it between printed values), the rule checks
    nothing, and the cell says so."""
    if c.derived:
        return f"{c.product}, not a check: {c.derived}"
    return f"{c.product} {'ok' if c.product == c.gpus else 'MISMATCH'}"


def published_table(configs=PUBLISHED_CONFIGS) -> Table:
    rows = [[c.name, c.gpu, str(c.gpus), f"{c.tp}/{c.cp}/{c.pp}/{c.dp}", c.data_parallel,
             f"{c.mfu:.0%}" if c.mfu else "-", product_check(c)] for c in configs]
    return Table(PUBLISHED_HEADER, rows, PUBLISHED_CAPTION)


# -- 5b. pricing expert parallelism -------------------------------------------------------------------------

def _billions(n: float) -> str:
    return f"{n / 1e9:,.2f}B"


def _published(value: float, unit: float) -> str:
    """A published count as its source prints it: "46.7B" to 0.1B, "671B" to 1B."""
    return f"{value / 1e9:.{1 if unit < 1e9 else 0}f}B"


MOE_COUNT_HEADER = ["model", "total (counted)", "published", "active (counted)", "... without input embedding",
                    "published"]


def moe_count_table(configs=PUBLISHED_MOE) -> Table:
    """Total and active parameters counted by ``planner.moe_parameter_counts`` next to what the sources print."""
    rows = []
    for c in configs:
        n = moe_parameter_counts(c)
        rows.append([c.name, f"{n['total']:,}", _published(c.published_total, c.published_unit),
                     f"{n['active']:,}", f"{n['active'] - n['input_embedding']:,}",
                     _published(c.published_active, c.published_unit)])
    caption = ("counted exactly from each model's shape (planner.moe_parameter_counts); published: Mixtral, Mistral "
               "AI's release post (the paper rounds to 47B / 13B); DeepSeek-V3, its report sec 4.2 (MTP module "
               "excluded)")
    return Table(MOE_COUNT_HEADER, rows, caption)


EP_HEADER = ["model", "EP", "routed experts/rank", "params/rank", "bf16 weights/rank", "one dispatch",
             "per MoE layer (x4)", "all MoE layers"]


def ep_table(plans: dict[str, tuple[int, ...]] | None = None, *, tokens_per_rank: int = 4096,
             bytes_per_element: int = 2) -> Table:
    """Expert parallelism priced for each (model, EP degree): parameters per rank (``planner.ep_rank_parameters``),
    their bf16 bytes, and the all-to-all bytes one rank sends (``planner.ep_traffic_per_step``) for a micro-batch
    of ``tokens_per_rank`` tokens: one dispatch, one MoE layer's four (dispatch and combine, forward and
    backward), and every MoE layer of the model. ``plans`` maps a ``PUBLISHED_MOE`` model's name to its EP
    degrees (default: Mixtral 1 and 8, DeepSeek-V3 1, 8 and 64)."""
    plans = plans or {"Mixtral 8x7B": (1, 8), "DeepSeek-V3": (1, 8, 64)}
    by_name = {c.name: c for c in PUBLISHED_MOE}
    rows = []
    for name, eps in plans.items():
        c = by_name[name]
        for ep in eps:
            held = ep_rank_parameters(c, ep)
            t = ep_traffic_per_step(c, tokens_per_rank, ep, bytes_per_element)
            rows.append([name, str(ep), str(c.experts // ep), _billions(held), f"{2 * held / GB:,.1f} GB",
                         _mb(t["per_all_to_all"]) if ep > 1 else "0", _mb(t["per_layer"]) if ep > 1 else "0",
                         f"{t['per_step'] / GB:,.1f} GB ({t['moe_layers']} layers)"])
    caption = (f"one rank, EP only (no TP/PP/ZeRO: all but the routed experts replicated); all-to-all bytes it sends "
               f"for one micro-batch of {tokens_per_rank:,} tokens, {bytes_per_element}-byte activations, uniform "
               "routing; the MoE layer's 4 = dispatch and combine, forward and backward (MiB = 2^20 B, GB = 1e9 B)")
    return Table(EP_HEADER, rows, caption)


def ep_comm_vs_compute(cfg: PublishedMoE, *, tokens_per_rank: int = 4096, ep: int = 64, gpus_per_node: int = 8,
                       dispatch_bytes: int = 2, combine_bytes: int = 2, link: str = "ib-ndr400", gpu: str = "h100",
                       compute_efficiency: float = 0.6) -> dict[str, float]:
    """One micro-batch of ``tokens_per_rank`` tokens on one EP rank: seconds of all-to-all between nodes against
    seconds of matmuls, nothing overlapped.

    Traffic: per MoE layer two all-to-alls in the dispatch direction (forward dispatch, backward's gradients
    to the experts), ``dispatch_bytes`` wide, and two in the combine direction, ``combine_bytes`` wide
    (``planner.all_to_all_bytes``, uniform routing); of the ep - 1 other ranks, ep - ``gpus_per_node`` are on
    other nodes, and that share crosses ``link`` (the rest travels over NVLink, concurrently and ~9x faster,
    and is left out). Compute: 6 FLOPs per active parameter per token (Kaplan et al. 2020; the input embedding,
    a lookup, left out; attention's sequence-dependent FLOPs too) at ``compute_efficiency`` of ``gpu``'s peak.
    """
    if ep <= gpus_per_node:
        raise ValueError(f"ep={ep} fits in one {gpus_per_node}-GPU node, so no all-to-all crosses {link}; "
                         f"choose ep > {gpus_per_node}.")
    moe_layers = cfg.layers - cfg.dense_layers
    per_layer = sum(2 * all_to_all_bytes(tokens_per_rank, cfg.hidden, cfg.top_k, ep, width)
                    for width in (dispatch_bytes, combine_bytes))
    between_nodes = per_layer * moe_layers * (ep - gpus_per_node) / (ep - 1)
    counts = moe_parameter_counts(cfg)
    flops = 6 * (counts["active"] - counts["input_embedding"]) * tokens_per_rank
    return {"comm_bytes": between_nodes, "comm_s": between_nodes / NETWORK_TIERS[link].bandwidth,
            "compute_flops": flops, "compute_s": flops / (GPUS[gpu].peak_flops * compute_efficiency)}


# -- 6. the planner widget ------------------------------------------------------------------------------------

GPU_COUNTS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def _draw_plan(p: Plan):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [1, 2.2]})
    memory_bars([p], [f"tp{p.layout.tp} cp{p.layout.cp} pp{p.layout.pp} dp{p.layout.dp}"], ax=ax1,
                title=f"{p.model.name}")
    time_bars([p], [f"ZeRO-{p.layout.zero}"], ax=ax2,
              title=f"{p.step_time_s:.2f} s/step, MFU {100 * p.mfu:.0f}% (modelled)")
    fig.tight_layout()
    return fig


def planner_view(model: str, n_gpus: int, tp: int, pp: int, cp: int, zero: int, seq: int, micro_batch: int,
                 recompute: str, cluster_name: str, inter_node: str) -> Plan:
    """What the widget shows for one setting of its controls (raises LayoutError with the planner's sentence).
    Sequence parallelism is on, as in every large run the chapter quotes."""
    layout = Layout(tp=tp, pp=pp, cp=cp, zero=zero, seq=seq, micro_batch=micro_batch, recompute=recompute,
                    sequence_parallel=True)
    return plan(model, layout, n_gpus, cluster_name=cluster_name, inter_node=inter_node)


def planner_widget(model: str = "llama-3-70b", n_gpus: int = 256, tp: int = 8, pp: int = 4, cp: int = 1,
                   zero: int = 1, seq: int = 4096, micro_batch: int = 1, recompute: str = "selective",
                   cluster_name: str = "h100-ib", inter_node: str = "ib-ndr400"):
    """Controls -> ``planner.plan`` -> stacked memory bars with the GPU line, time bars and the summary.

    Pure Python (no ranks), so it redraws at once; every control uses ``continuous_update=False``. A layout the
    planner refuses shows its one-sentence reason instead of a figure.
    """
    import ipywidgets as W

    style = {"description_width": "initial"}
    degree = lambda name, value: W.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=value,  # noqa: E731
                                            description=name, style=style, layout=W.Layout(width="120px"))
    controls = {
        "model": W.Dropdown(options=list(MODEL_SHAPES), value=model, description="model", style=style),
        "n_gpus": W.Dropdown(options=GPU_COUNTS, value=n_gpus, description="GPUs", style=style,
                             layout=W.Layout(width="150px")),
        "tp": degree("TP", tp), "pp": degree("PP", pp), "cp": degree("CP", cp),
        "zero": W.Dropdown(options=[0, 1, 2, 3], value=zero, description="ZeRO", style=style,
                                 layout=W.Layout(width="120px")),
        "seq": W.Dropdown(options=[2048, 4096, 8192, 16384, 32768, 131072], value=seq, description="sequence",
                          style=style, layout=W.Layout(width="170px")),
        "micro_batch": W.IntSlider(value=micro_batch, min=1, max=16, description="micro-batch",
                                   continuous_update=False, style=style),
        "recompute": W.Dropdown(options=["none", "selective", "full"], value=recompute, description="recompute",
                                style=style, layout=W.Layout(width="200px")),
        "cluster_name": W.Dropdown(options=list(CLUSTERS), value=cluster_name, description="cluster", style=style),
        "inter_node": W.Dropdown(options=[k for k in NETWORK_TIERS if not k.startswith("nvlink")], value=inter_node,
                                 description="between nodes", style=style),
    }
    # Both outputs are replaced in one step, never appended to or drawn into with pyplot's show: that shows nothing
    # under a non-interactive backend (Agg, which `make lab` exports to its kernels), and it needs a kernel, while
    # setting ``outputs`` works under any backend and without one (the tests read exactly what a learner sees).
    out, text = W.Output(), W.Output()

    def stdout(line: str) -> tuple[dict, ...]:
        return ({"output_type": "stream", "name": "stdout", "text": line + "\n"},)

    def update(_change=None):
        import base64

        from course_utils.widgets import figure_png

        try:
            p = planner_view(**{name: c.value for name, c in controls.items()})
        except LayoutError as exc:  # the refusal replaces the figure and the summary of the previous setting
            out.outputs, text.outputs = (), stdout(f"cannot run: {exc}")
            return
        try:
            png = base64.b64encode(figure_png(_draw_plan(p))).decode("ascii")  # figure_png closes the figure
        except Exception as exc:  # noqa: BLE001 - a drawing problem is a sentence, never a stale figure
            out.outputs, text.outputs = (), stdout(f"drawing failed: {type(exc).__name__}: {exc}")
            return
        out.outputs = ({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": png, "text/plain": "<planner figure>"}},)
        text.outputs = stdout(p.summary())

    for control in controls.values():
        control.observe(update, names="value")
    update()
    rows = [W.HBox([controls["model"], controls["n_gpus"], controls["cluster_name"], controls["inter_node"]]),
            W.HBox([controls["tp"], controls["cp"], controls["pp"], controls["zero"]]),
            W.HBox([controls["seq"], controls["micro_batch"], controls["recompute"]])]
    box = W.VBox(rows + [out, text])
    box.controls = controls  # named like planner_view's parameters
    box.output, box.text = out, text  # the figure; the summary or the refusal (for tests and for driving it)
    return box
