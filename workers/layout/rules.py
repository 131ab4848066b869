"""One layout for a training run, and the one set of rules it must obey (torchtitan's ``ParallelDims``).

A layout names every way a step is split, for the runnable chapters and the planner alike:

    dp x tp x pp x cp      data, tensor, pipeline and context parallel degrees (product = world size); dp None:
                           whatever the others leave of the world
    ep                     expert parallelism, carved out of dp x cp (chapter 16: the ranks that hold different
                           experts and exchange tokens; each expert is replicated over the other dp x cp / ep)
    zero                   0: every data-parallel rank keeps the whole optimizer state; 1, 2, 3: ZeRO's stages
    sequence_parallel      LayerNorms, dropouts and residuals on sequence shards inside each TP group
    micro_batches          m, per data-parallel rank and optimizer step (gradient accumulation; the pipeline's m);
                           None: 1, or 4p when pipelining (GPipe's rule of thumb), unless a global batch sets it
    virtual_stages         v, model chunks per pipeline rank (interleaved 1F1B, Narayanan et al. 2021, sec 2.2)
    schedule               the pipeline schedule: "gpipe", "1f1b" or "interleaved" (1F1B with v > 1), or one that
                           splits the backward (chapter 13, ``workers/pipeline/zero_bubble.py``): "zb-h1", "zb-h2",
                           and "zb-v" or "dualpipev" (two chunks per rank in a V: virtual_stages 2)
    split                  which tokens each context-parallel rank holds ("zigzag" balances causal work)
    micro_batch, seq       the step's shape for the planner: sequences per micro-batch, tokens per sequence
                           (None: the model's own ``seq``)
    recompute              activation recomputation for the planner: "none", "selective", "full" (None: the
                           planner assumes "selective"; the course's trainers keep every activation)

``Layout.name`` (``2x2x2x1``) writes the degrees in the order papers quote them, DP x TP x PP x CP. The ranks
themselves sit in the course's one rank grid (``grid.py``, ``arange(world).view(dp, pp, cp, tp)``, tp innermost),
and ``mesh.py: Mesh`` makes the groups.

``problem(layout, world, model)`` is the rule set: chapter 00's planner, chapter 05's attention, chapter 15's
composed trainer and every worker that takes degrees ask it before anything is built, and it names every offending
value in one sentence. The rules are the layout's, not one implementation's: a worker that implements less (ZeRO-1
at most, stages of equal size) adds its own refusal for that. Grouped-query attention has one answer everywhere:
tp must divide the query heads, and tp and the KV heads must divide one another; when tp is a multiple of the KV
heads, each KV head is replicated on tp / kv_heads ranks (chapter 05), which the planner's memory counts.

This file is plain data and arithmetic (no torch), so the notebook side's planner imports it cheaply.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from workers.pipeline.schedules import SCHEDULES as LOOP_SCHEDULES
from workers.pipeline.zero_bubble import SPLIT_SCHEDULES, V_SCHEDULES

SCHEDULES = LOOP_SCHEDULES + SPLIT_SCHEDULES  # every pipeline schedule the course builds as a table

DEGREES = ("dp", "tp", "pp", "cp")  # the order a layout's name is written in, "DPxTPxPPxCP"
ZERO_STAGES = (0, 1, 2, 3)  # Rajbhandari et al. 2020, sec 5
SPLITS = ("contiguous", "zigzag")
RECOMPUTE_MODES = ("none", "selective", "full")  # Korthikanti et al. 2022, Table 2
DEFAULT_SEQ = 4096  # the planner's tokens per sequence when neither the layout nor the model says


@dataclass(frozen=True, repr=False)
class Layout:
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    micro_batches: int | None = None
    virtual_stages: int = 1
    schedule: str = "1f1b"
    split: str = "zigzag"
    micro_batch: int = 1
    seq: int | None = None
    recompute: str | None = None

    @classmethod
    def parse(cls, name: str, **options) -> "Layout":
        """``Layout.parse("2x2x2x1", zero=1)``: degrees in the order dp x tp x pp x cp."""
        parts = name.lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"layout {name!r} is not four degrees DPxTPxPPxCP, like '2x2x2x1'")
        return cls(**dict(zip(DEGREES, map(int, parts))), **options)

    def resolve(self, world: int) -> "Layout":
        """dp filled in from the world (when it divides), m = 1 when unset: what a run on ``world`` ranks uses."""
        dp = self.dp
        if dp is None and _whole(self.tp) and _whole(self.pp) and _whole(self.cp):
            rest = self.tp * self.pp * self.cp
            dp = world // rest if world % rest == 0 else None
        return replace(self, dp=dp, micro_batches=1 if self.micro_batches is None else self.micro_batches)

    @property
    def name(self) -> str:
        return "x".join(str(getattr(self, d)) for d in DEGREES)

    @property
    def world(self) -> int:
        return (self.dp or 1) * self.tp * self.pp * self.cp

    @property
    def grid(self):
        """The rank grid of this layout (dp None counts as 1 here: no world to fill)."""
        from workers.layout.grid import RankGrid

        return RankGrid(dp=self.dp or 1, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep)

    def kv_replicas(self, kv_heads: int) -> int:
        """How many TP ranks hold each KV head: tp / kv_heads when tp is a multiple of them, else 1."""
        return self.tp // kv_heads if self.tp > kv_heads else 1

    def as_dict(self) -> dict:
        return asdict(self)

    def __repr__(self) -> str:
        """The four degrees, then only the options that differ from their defaults."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name in DEGREES or getattr(self, f.name) != f.default]
        return f"Layout({', '.join(shown)})"


def num_chunks(cp: int, split: str) -> int:
    """How many equal chunks context parallelism cuts the sequence into: 2 cp for zigzag (one early, one late chunk
    per rank), cp for contiguous."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return 2 * cp if split == "zigzag" else cp


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def problem(layout: Layout, world: int, model=None, *, global_batch: int | None = None) -> str | None:
    """Why ``layout`` cannot train ``model`` on ``world`` ranks, naming every offending value; or None.

    ``model`` is anything with ``layers``, ``heads``, ``kv_heads`` and ``ffn`` (the course's ``GPTConfig``, the
    planner's ``ModelShape``), and ``seq`` if it has one; the rules of what it lacks are skipped (chapter 13's stack
    has layers and no heads), and None checks the degrees alone. ``global_batch``: sequences
    per optimizer step, which dp x micro_batches x micro_batch must divide.
    """
    from workers.runtime import divides_world, one_of, refusal

    lay = layout
    names = ("tp", "pp", "cp", "ep", "virtual_stages", "micro_batch") + (("dp",) if lay.dp is not None else ()) \
        + (("micro_batches",) if lay.micro_batches is not None else ()) + (("seq",) if lay.seq is not None else ())
    bad = [f"{n}={getattr(lay, n)!r}" for n in names if not _whole(getattr(lay, n))]
    if bad:
        return f"{', '.join(bad)} must be {'a whole number' if len(bad) == 1 else 'whole numbers'} of at least 1"
    kinds = refusal(one_of("zero", lay.zero, ZERO_STAGES), one_of("schedule", lay.schedule, SCHEDULES),
                    one_of("split", lay.split, SPLITS), None if lay.recompute is None else one_of("recompute", lay.recompute, RECOMPUTE_MODES))
    if kinds:
        return kinds
    tp, pp, cp, v = lay.tp, lay.pp, lay.cp, lay.virtual_stages
    reasons = []
    rest = tp * pp * cp
    if lay.dp is None:
        split = [d for d in ("tp", "pp", "cp") if getattr(lay, d) != 1]
        if world % rest and len(split) == 1:
            reasons.append(divides_world(split[0], rest, world))
        elif world % rest:
            reasons.append(f"tp x pp x cp = {tp} x {pp} x {cp} = {rest} does not divide the world's {world} ranks")
        dp = world // rest if world % rest == 0 else None
    else:
        dp = lay.dp
        if dp * rest != world:
            reasons.append(f"dp x tp x pp x cp = {lay.name} makes {dp * rest} ranks, not the world's {world}")
    if dp is not None and lay.ep > 1 and (dp * cp) % lay.ep:
        reasons.append(f"ep={lay.ep} does not divide dp x cp = {dp * cp} (expert parallelism is carved out of them)")
    if lay.schedule == "interleaved":
        if v < 2 or pp < 2:
            reasons.append(f"the interleaved schedule needs pp >= 2 and virtual_stages >= 2, not pp={pp}, "
                           f"virtual_stages={v}")
    elif lay.schedule in V_SCHEDULES:
        if v != 2:
            reasons.append(f"schedule={lay.schedule!r} holds two chunks per rank in a V: set virtual_stages=2, not {v}")
    elif v != 1:
        reasons.append(f"schedule={lay.schedule!r} holds one chunk per rank, not virtual_stages={v}: for more choose "
                       "'interleaved', for two in a V 'zb-v' or 'dualpipev'" if lay.schedule in SPLIT_SCHEDULES
                       else f"virtual_stages={v} needs schedule='interleaved'")
    m = lay.micro_batches
    if lay.schedule == "dualpipev" and m is not None and m < 2 * pp:
        # DualPipeV's eight phases fill the 2p virtual stages from both ends at once (deepseek-ai/DualPipe asserts it)
        reasons.append(f"micro_batches={m} is fewer than the 2 x pp = {2 * pp} virtual stages DualPipeV fills: "
                       f"choose micro_batches >= {2 * pp}")
    if lay.schedule == "interleaved" and m is not None and m % pp:
        reasons.append(f"micro_batches={m} is not a multiple of pp={pp} (the interleaved schedule sends micro-batches "
                       f"round in groups of pp): choose a multiple of {pp}")
    if getattr(model, "heads", None):
        reasons.append(heads_problem(model.heads, model.kv_heads, tp))
    if getattr(model, "ffn", None) and model.ffn % tp:
        reasons.append(f"tp={tp} does not divide ffn={model.ffn}")
    if getattr(model, "layers", None):
        # the first and the last stage may hold the embedding or the head alone (Llama 3, sec 3.3.2: "the first model
        # chunk on the first stage has only the embedding"); every other stage needs a layer
        if pp * v > model.layers + 2:
            what = f"pp={pp}" if v == 1 else f"pp x virtual_stages = {pp * v}"
            reasons.append(f"{what} is more than layers={model.layers} plus the embedding's and the head's stages "
                           f"(a stage without layers)")
        # uneven chunks are a layout (Llama 3 ran 126 layers interleaved over 16 stages, sec 3.3.2); an implementation
        # that cuts equal chunks, as Megatron and the course's ranks do, adds equal_stages_problem
    seq = lay.seq or getattr(model, "seq", None)
    if seq is not None and _whole(seq):
        n = num_chunks(cp, lay.split)
        if cp > 1 and seq % n:  # one rank holds the whole sequence, whatever its length
            reasons.append(f"cp={cp} cuts seq={seq} into {n} chunks ({lay.split}), which does not divide it: choose seq "
                           f"divisible by {n}")
        if lay.sequence_parallel and tp > 1 and seq % (cp * tp):
            held = f"seq={seq}" if cp == 1 else f"the {seq // cp} tokens each cp={cp} rank holds"
            reasons.append(f"tp={tp} does not divide {held} (sequence parallelism gives each TP rank its rows)")
    if global_batch is not None and dp is not None:
        per = dp * (m or 1) * lay.micro_batch
        if not _whole(global_batch) or global_batch % per:
            terms = [f"{k}={val}" for k, val in (("dp", dp), ("micro_batches", m or 1), ("micro_batch", lay.micro_batch))
                     if k == "dp" or val != 1]
            what = terms[0] if len(terms) == 1 else f"{' x '.join(terms)} = {per}"
            reasons.append(f"{what} does not divide global_batch={global_batch} (choose a multiple of {per})")
    return refusal(*reasons)


def heads_problem(heads: int, kv_heads: int, tp: int) -> str | None:
    """The one answer to attention heads over tensor parallelism (chapter 05), or None when they split.

    tp must divide the query heads (each rank holds whole heads). A KV head cannot be split either: when tp divides
    the KV heads each rank holds kv_heads / tp of them, the ones its query heads read; when tp is a multiple of them
    each KV head is copied onto tp / kv_heads consecutive ranks (GQA and MQA at large tp; the copies' gradients are
    summed). Anything else would leave a rank's query heads reading KV heads split across ranks.
    """
    from workers.runtime import divides

    if heads % tp:
        return divides("tp", tp, "heads", heads)
    if kv_heads % tp and tp % kv_heads:
        return (f"tp={tp} and kv_heads={kv_heads} do not divide one another (each rank must hold whole KV heads, or "
                f"each KV head be copied onto tp / kv_heads ranks)")
    return None


def equal_stages_problem(layout: Layout, layers: int) -> str | None:
    """The runnable chapters cut the layers into equal stages, and equal chunks when interleaved (Megatron asserts
    it; Llama 3 gave the first and last stage one layer fewer)."""
    chunks = layout.pp * layout.virtual_stages
    if layers % chunks:
        if layout.virtual_stages == 1:
            return f"pp={layout.pp} does not divide layers={layers} into equal stages"
        return f"pp x virtual_stages = {chunks} does not divide layers={layers} into equal chunks"
    return None


def model_parallel_size(layout: Layout) -> int:
    """tp x pp x cp: the ranks one data-parallel replica spans."""
    return math.prod((layout.tp, layout.pp, layout.cp))
