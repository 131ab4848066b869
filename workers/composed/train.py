"""The composed training step on one rank, and the one-process run it must equal.

One optimizer step of a layout (``Layout``), on every rank:

1. **Data.** Every rank derives the step's whole global batch from the seed and keeps its part: data-parallel
   rank d the samples ``[d B/dp, (d+1) B/dp)``, cut into m micro-batches in order; context-parallel rank c the
   token positions of its chunks (``workers/context_parallel/split.py``); every TP rank the same as its group.
2. **Pipeline.** The stage's actions (GPipe, 1F1B, interleaved) run through chapter 13's executor: activations
   ``[s', b/m, h]`` go to the next stage, their gradients come back. Inside each forward, TP's and SP's
   collectives (chapters 04-06) and the KV ring (chapter 14) run in the TP and CP groups.
3. **Loss normalised by tokens.** Micro-batch i on this rank contributes ``sum of its valid tokens' CE / N``,
   N the valid tokens of the *whole global batch*: summed over micro-batches, CP and DP ranks this is exactly
   the global mean, however ragged the micro-batches are (Megatron's ``calculate_per_token_loss``). The CE is
   loss-parallel, as Megatron's: the embedding and the tied head are split by vocabulary over TP
   (``Parallelism(vocab_parallel=True)``), each TP rank holds the logits of its V/tp words, and
   ``vocab_parallel_cross_entropy`` computes every token's loss from them with three all-reduces of ``[s, b]``.
4. **Gradients.** The tied embedding's two copies (first and last stage) are summed over the embedding group;
   then every gradient is *summed* (not averaged: the loss is already the global mean) over ``dp_cp``, the ranks
   that hold the same parameters with other samples or other tokens: one all-reduce of one flat bucket (ZeRO-0),
   or the reduce-scatter of ZeRO-1 (``workers/zero/zero1.py``), whose all-gather after the step brings the
   updated shards back.

What a rank reports: the loss of every step (last stage); the gradient of every parameter at every step and the
parameters after the last, as shards with their place in the dense tensor (only the ranks at dp = cp = 0: the
others hold copies); and from every rank a digest of every parameter after every step, so that the
test can check that replicas are bit for bit equal.

Faults (``workers/composed/faults.py``): each injects one composition bug the equivalence check must catch, by
replacing one of the methods below (``gradient_group``, ``normalise_loss``, ``sum_tied_gradients``) or of the model.
"""
from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from workers.layout import DIMS, Layout, Mesh, problem
from workers.layout.mesh import link_names
from workers.layout.rules import equal_stages_problem
from workers.composed.model import make_dense
from workers.model.batch import make_batch, token_losses
from workers.model import GPTConfig, Where
from workers.parallel.gpt import ParallelGPT, Parallelism
from workers.context_parallel.ring import Ring
from workers.context_parallel.split import local_positions
from workers.parallel.comm_stats import ACTIVATION, CommLedger, message_bytes, wire_factor
from workers.parallel.plan import split_of
from workers.parallel.vocab import vocab_parallel_cross_entropy
from workers.pipeline.executor import run_schedule
from workers.pipeline.p2p import P2P
from workers.pipeline.schedules import schedule as make_schedule, virtual_stage
from workers.runtime import all_gather_single, host_staged

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.01  # AdamW, the same in the reference
ZERO_STAGES = (0, 1)  # what the trainer implements; stages 2 and 3 are chapter 11's


def layout_problem(layout: Layout, world: int, cfg: GPTConfig, global_batch: int) -> str | None:
    """Why this trainer cannot run ``layout`` of ``cfg`` on ``world`` ranks, or None: the course's one rule set
    (``workers/layout/rules.py``), then what this trainer does not implement (ZeRO-2 and 3, stages of unequal size,
    a vocabulary tp does not divide)."""
    from workers.runtime import divides, one_of, refusal

    # The vocabulary is split over TP in equal blocks. Not a rule of the layout: Megatron pads the vocabulary to a
    # multiple of 128 tp (GPT-2's 50257 to 51200 at tp 8), so the planner's published runs keep theirs. This trainer
    # does not pad: padded words would change the model it is held equal to.
    vocab = divides("tp", layout.tp, "vocab", cfg.vocab) if isinstance(layout.tp, int) and layout.tp >= 1 else None
    return refusal(problem(layout, world, cfg, global_batch=global_batch), one_of("zero", layout.zero, ZERO_STAGES),
                   equal_stages_problem(layout, cfg.layers), vocab)


def vocab_parallel_token_losses(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                                group) -> torch.Tensor:
    """``workers/model/batch.py: token_losses`` from this rank's ``logits [s, b, V/tp]``: the valid tokens'
    cross-entropy summed (``targets`` and ``valid [b, s]``), the same number on every rank of the TP group."""
    ce = vocab_parallel_cross_entropy(logits, targets.t(), group)  # [s, b]
    return (ce * valid.t().to(ce.dtype)).sum()


def digest(t: torch.Tensor) -> str:
    """The bytes of ``t``, hashed: equal digests mean bit-identical tensors."""
    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def record(named: dict, what: str, values: dict | None = None) -> dict:
    """``{name: {"dim", "index", "value"}}`` of these parameters' values or gradients (``plan.assemble``'s input);
    ``values`` (by parameter id) replaces what the parameters hold (ZeRO-1's gathered gradient)."""
    out = {}
    for name, p in named.items():
        dim, index = split_of(p)
        value = values[id(p)] if values is not None else (p.grad if what == "grad" else p.data)
        out[name] = {"dim": dim, "index": index if index is not None else torch.empty(0, dtype=torch.long),
                     "value": (value if value is not None else torch.zeros_like(p)).detach().cpu().clone()}
    return out


class ComposedTrainer:
    """This rank's part of a layout: its stage modules, groups, optimizer. ``step(i)`` runs optimizer step i."""

    def __init__(self, layout: Layout, cfg: GPTConfig, *, rank: int, device, comm_device, global_batch: int,
                 lr: float, seed: int = 0, data_seed: int = 1, dtype=torch.float64, normalise=None, batch=make_batch):
        self.layout, self.cfg, self.rank, self.device = layout, cfg, rank, device
        self.global_batch, self.seed, self.data_seed, self.dtype = global_batch, seed, data_seed, dtype
        self.batch = batch  # (cfg, global_batch, step, seed) -> (tokens, valid): make_batch, or a check's own data
        # normalise(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp): a micro-batch's loss (exercise 2)
        self.normalise = normalise
        t0 = time.perf_counter()
        # on gloo a pipeline link's two directions travel on two groups (pipeline/p2p.py says why)
        links = link_names(dist.get_backend(), layout.pp)
        self.mesh = Mesh(layout.grid, rank, DIMS + ("dp_cp", "embedding") + links, fresh=True)
        self.device_mesh = self.mesh.device_mesh(DIMS, torch.device(device).type)  # torch's view of the same groups
        self.build_s = time.perf_counter() - t0
        c = self.coords = self.mesh.coords
        tp_members = self.mesh.ranks("tp")
        cp_members = self.mesh.ranks("cp")
        ring = Ring(c["cp"], cp_members, device, comm_device) if layout.cp > 1 else None
        self.par = Parallelism(tp_group=self.mesh.group("tp"), tp=layout.tp, tp_rank=c["tp"],
                               sequence_parallel=layout.sequence_parallel, ring=ring, split=layout.split,
                               vocab_parallel=True)
        assert tp_members.index(rank) == c["tp"]
        dense = make_dense(cfg, seed, dtype)
        V = layout.pp * layout.virtual_stages
        self.stage = c["pp"]
        self.modules = [ParallelGPT(dense, self.par, virtual_stage(self.stage, ch, layout.pp), V).to(device)
                        for ch in range(layout.virtual_stages)]
        self.named = {n: p for mod in self.modules for n, p in mod.named_parameters()}
        self.params = list(self.named.values())
        self.tied = [p for p in self.params if hasattr(p, "tied_to")] + \
            ([self.modules[0].embed.weight] if self.modules[0].first and layout.pp > 1 else [])
        self.reduce_group = self.gradient_group()
        # Two buckets: the tied embedding's copy alone, then the rest. The copies on the first and last stage must
        # stay bit for bit equal, and a sum is only bit-reproducible if it is done in the same order: in one shared
        # bucket the copy would sit at offset 0 on the first stage and at the end on the last, in other chunks of
        # the ring all-reduce (or other ZeRO shards), summed in another order, 1 ulp apart after a step.
        tied_ids = {id(p) for p in self.tied}
        self.buckets = [b for b in ([p for p in self.params if id(p) in tied_ids],
                                    [p for p in self.params if id(p) not in tied_ids]) if b]
        if layout.zero == 1:
            from workers.zero.zero1 import Zero1Optimizer

            self.optimizer = Zero1Optimizer([{"params": b} for b in self.buckets], torch.optim.AdamW,
                                            group=self.reduce_group, average=False, lr=lr, betas=BETAS, eps=EPS,
                                            weight_decay=WEIGHT_DECAY)
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        pipeline = self.mesh.ranks("pp")
        wrap = layout.virtual_stages > 1  # interleaved: the last rank's chunk c feeds rank 0's chunk c + 1
        p = layout.pp
        self.prev_rank = pipeline[(self.stage - 1) % p] if self.stage > 0 or wrap else None
        self.next_rank = pipeline[(self.stage + 1) % p] if self.stage < p - 1 or wrap else None
        self.comm_device = comm_device
        self.actions = make_schedule(layout.schedule, p, layout.micro_batches, self.stage, layout.virtual_stages)
        self.positions = local_positions(cfg.seq, layout.cp, c["cp"], layout.split)  # [s/cp] global positions
        self.reporter = c["dp"] == 0 and c["cp"] == 0  # one copy of every shard is enough to compare

    # -- one step ------------------------------------------------------------------------------------------------

    def _micro_batches(self, step: int):
        """This rank's m micro-batches: (tokens [b, s/cp], targets [b, s/cp], valid [b, s/cp], samples [b])."""
        L, cfg = self.layout, self.cfg
        tokens, valid = self.batch(cfg, self.global_batch, step, self.data_seed)  # [B, s+1], [B, s]
        per_rank = self.global_batch // L.dp
        b = per_rank // L.micro_batches
        first = self.coords["dp"] * per_rank
        out = []
        for i in range(L.micro_batches):
            samples = torch.arange(first + i * b, first + (i + 1) * b)
            inputs, targets = tokens[samples, :-1], tokens[samples, 1:]
            out.append((inputs[:, self.positions], targets[:, self.positions], valid[samples][:, self.positions],
                        samples, valid[samples].sum().item()))
        return out, int(valid.sum())

    def step(self, step: int, forward_s: float = 0.0, backward_s: float = 0.0, timed: bool = False) -> dict:
        """Optimizer step ``step``. ``forward_s``/``backward_s`` > 0 pad each stage's forward and backward of a
        micro-batch to that wall time (chapter 13's calibrated wait), so that the measured bubble is the schedule's.
        ``timed`` also times the tensor-parallel collectives (``CommLedger(timed=True)``)."""
        L = self.layout
        self.calls = []  # (dimension, collective, message bytes, ranks) of the step's gradient collectives
        if self.par.ring is not None:  # per-step counters of the KV ring
            ring = self.par.ring
            ring.sent_bytes, ring.messages = {"forward": 0, "backward": 0}, {"forward": 0, "backward": 0}
            ring.score_entries, ring.wait_s = 0, 0.0
        micro, total_tokens = self._micro_batches(step)
        wheres = [Where(step, self.positions, mb[3], self.global_batch, self.cfg.seq) for mb in micro]
        rows = self.cfg.seq // L.cp // (L.tp if L.sequence_parallel else 1)
        b = micro[0][0].shape[0]
        p2p = P2P(self.prev_rank, self.next_rank, (rows, b, self.cfg.hidden), self.device, self.comm_device, self.dtype,
                  links=self.mesh.links())

        def forward(chunk, i, x):
            return self.modules[chunk](x.to(self.device), wheres[i])

        def loss(logits, i):
            _, targets, valid, _, micro_tokens = micro[i]
            # logits [s/cp, b, V/tp]: this TP rank's words; the loss comes back whole on every TP rank
            summed = vocab_parallel_token_losses(logits, targets.to(self.device), valid.to(self.device),
                                                 self.par.tp_group)
            if self.normalise is not None:  # the learner's rule (chapter 15's exercise)
                return self.normalise(summed, micro_tokens, total_tokens, L.micro_batches, L.dp, L.cp)
            return self.normalise_loss(summed, micro_tokens, total_tokens)

        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        with CommLedger(timed=timed, device=torch.device(self.device)) as ledger:  # every TP collective, sized
            ran = run_schedule(self.actions, self.modules, p2p, stage=self.stage, num_stages=L.pp,
                               inputs=[mb[0] for mb in micro], targets=None, forward=forward, loss=loss,
                               forward_s=forward_s, backward_s=backward_s)
        t_schedule = time.perf_counter() - t0
        self.sum_tied_gradients()
        loss_value = None
        if self.modules[-1].last:  # the step's loss: the sum of every micro-batch's share over dp x cp
            total = torch.tensor([sum(ran["losses"])], dtype=torch.float64, device=self.device)  # NCCL: on the GPU
            dist.all_reduce(total, group=self.mesh.group("dp_cp"))
            loss_value = total.item()
        t1 = time.perf_counter()
        n = dist.get_world_size(self.reduce_group)
        if self.layout.zero == 1:
            for flat in self.optimizer.groups:
                self.calls += [("dp", "reduce_scatter", flat.flat_grads.nbytes, n),
                               ("dp", "all_gather", flat.flat_params.nbytes // n, n)]  # each rank hands in its shard
            self.optimizer.step()  # reduce-scatter (sum), step my shard, all-gather
            grads = self._zero1_grads()
        else:
            for bucket in self.buckets:
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # one all-reduce per bucket
                self.calls.append(("dp", "all_reduce", flat.nbytes, n))
                dist.all_reduce(flat, group=self.reduce_group)
                offset = 0
                for p in bucket:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            grads = record(self.named, "grad") if self.reporter else None
            self.optimizer.step()
        t_sync = time.perf_counter() - t1
        return {"loss": loss_value, "grads": grads, "timeline": ran["timeline"], "comm": self._comm(ledger, p2p),
                "memory": {**self._state_bytes(), "activations": ran["peak_saved_bytes"]},
                "score_entries": self.par.ring.score_entries if self.par.ring is not None else None,
                "p2p": {k: ran[k] for k in ("sent_bytes", "messages", "sent_on")},
                "peak_saved_bytes": ran["peak_saved_bytes"],
                "schedule_s": t_schedule, "sync_s": t_sync,
                # seconds in communication, per dimension: TP collectives (timed runs only), waiting for the ring's
                # transfers beyond the compute they overlapped, blocked in pipeline receives (bubble included),
                # and the gradient synchronisation after the schedule
                "comm_s": {"tp": sum(t for _, _, t in ledger.intervals()) if timed else None,
                           "cp": self.par.ring.wait_s if self.par.ring is not None else 0.0, "pp": p2p.wait_s,
                           "dp": t_sync},
                "digests": {n: digest(p.data) for n, p in self.named.items()}}

    # -- the three places a composition bug hides (workers/composed/faults.py replaces each) -------------------------

    def gradient_group(self):
        """The group gradients are summed over: ``dp_cp``, every rank that holds the same parameters with other
        samples or other tokens (Megatron's ``get_data_parallel_group(with_context_parallel=True)``)."""
        return self.mesh.group("dp_cp")

    def normalise_loss(self, summed: torch.Tensor, micro_tokens: int, total_tokens: int) -> torch.Tensor:
        """A micro-batch's summed cross-entropy / N, N the valid tokens of the whole global batch: every token weighs
        1 / N, however ragged the micro-batches (Megatron's ``calculate_per_token_loss``)."""
        return summed / total_tokens

    def sum_tied_gradients(self) -> None:
        """The tied embedding's two copies (first and last stage) take one gradient: summed over the embedding group."""
        for p in self.tied:
            self.calls.append(("embedding", "all_reduce", p.grad.nbytes, 2))
            dist.all_reduce(p.grad, group=self.mesh.group("embedding"))

    def _comm(self, ledger: CommLedger, p2p: P2P) -> dict:
        """Bytes this rank sent in the step, per dimension: ``{dim: {"wire_bytes", "calls"}}``.

        tp: the TP and SP mappings' collectives on activations (``tp_parameters``: the sequence-parallel
        LayerNorm and bias gradients' all-reduces); cp: the KV ring's sends; pp: the stage's sends; dp: the
        gradient collectives over dp x cp; embedding: the tied embedding's all-reduce. Collectives count their
        ring-algorithm wire bytes (``comm_stats.wire_factor``), point-to-point sends their size.
        """
        out = {dim: {"wire_bytes": 0.0, "calls": 0} for dim in ("tp", "tp_parameters", "cp", "pp", "dp", "embedding")}
        for r in ledger.records():
            dim = "tp" if r["kind"] == ACTIVATION else "tp_parameters"
            out[dim]["wire_bytes"] += r["wire_bytes"]
            out[dim]["calls"] += 1
        ring = self.par.ring
        if ring is not None:
            out["cp"] = {"wire_bytes": float(sum(ring.sent_bytes.values())), "calls": sum(ring.messages.values())}
        out["pp"] = {"wire_bytes": float(sum(p2p.sent_bytes.values())), "calls": sum(p2p.messages.values())}
        for dim, collective, nbytes, n in self.calls:
            out[dim]["wire_bytes"] += wire_factor(collective, n) * message_bytes(collective, nbytes, n)
            out[dim]["calls"] += 1
        return out

    def _state_bytes(self) -> dict:
        """This rank's parameters, gradients and optimizer state, in bytes, as held (buffers and padding included)."""
        if self.layout.zero == 1:
            buffers = self.optimizer.buffer_bytes()
            return {"params": buffers["params"], "grads": buffers["grads"],
                    "optimizer": self.optimizer.state_bytes()["elementwise"]}
        state = sum(v.nbytes for st in self.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)  # exp_avg, exp_avg_sq (not the step counters)
        return {"params": sum(p.nbytes for p in self.params), "grads": sum(p.grad.nbytes for p in self.params),
                "optimizer": state}

    def _zero1_grads(self):
        """The summed gradient as ZeRO-1 computed it (each rank holds only its shard): gathered for the report."""
        opt = self.optimizer
        full = {}
        for flat, shard in zip(opt.groups, opt.last_shard_grads):
            whole = torch.empty_like(flat.flat_grads)
            host_staged("all_gather", all_gather_single, whole, shard.contiguous(), opt.group)  # the report only
            for p, off in zip(flat.params, flat.offsets):
                full[id(p)] = whole[off:off + p.numel()].view_as(p)
        return record(self.named, "grad", full) if self.reporter else None

    def close(self) -> None:
        self.mesh.destroy()


def reference_run(cfg: GPTConfig, *, steps: int, global_batch: int, lr: float, seed: int = 0,
                  data_seed: int = 1, dtype=torch.float64, batch=make_batch) -> dict:
    """The same training in one process, on the whole batch (``batch``: as the trainer's): the ground truth of every
    layout.

    Returns the loss of every step, every parameter's gradient at every step, and the parameters after the last.
    """
    model = make_dense(cfg, seed, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, grads = [], []
    for step in range(steps):
        tokens, valid = batch(cfg, global_batch, step, data_seed)
        where = Where(step, torch.arange(cfg.seq), torch.arange(global_batch), global_batch, cfg.seq)
        optimizer.zero_grad()
        logits = model(tokens[:, :-1], where).transpose(0, 1)  # [B, s, V] -> [s, B, V]
        loss = token_losses(logits, tokens[:, 1:], valid) / valid.sum()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
