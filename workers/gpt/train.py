"""The training loop of chapter 09: telemetry every step, faults injected where they happen in real life,
snapshots every k steps, rewind-and-skip recovery, and deterministic replay.

    trainer = Trainer(MODEL, TrainConfig(fault="garbage_batch"), rank, world_size)
    out = trainer.run(recover=True)        # out["trajectory"]: one record per committed step

Every rank runs this loop; gradients are averaged by hand (``reduce.average_gradients``), so the
communication faults have a place to live. Where each fault is injected:

- ``garbage_batch``: the samples of the batch at ``at_step`` are corrupted in the dataset (a data fault);
- ``high_lr``: the run uses ``high_lr`` instead of ``lr`` (a numeric fault);
- ``fp16_underflow``: forward and backward in fp16 without loss scaling (numeric);
- ``sum_not_average``: from ``at_step`` on, ``fault_rank`` sums the gradients without dividing (communication);
- ``bit_flip``: at ``at_step``, one bit of one element on ``fault_rank`` flips, in its gradient before the
  all-reduce or in its parameters after the step (hardware: silent data corruption). Transient: a replay
  on the same inputs does not see it again, which is how replay tells hardware from software. The other
  faults are part of the code or the data, so a replay reproduces them bit for bit.

Two diagnostics for fp16 underflow: ``fp32_grad_probe`` grades each step's gradient against the exact fp32
gradient of the same batch (over the elements whose gradient is nonzero for the first time), and
``freeze_dormant_from`` withholds updates from the weights that had no gradient before that step.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from workers.gpt import telemetry as tm
from workers.gpt.config import TrainConfig
from workers.gpt.data import Loader, MarkovDataset, rank_rows
from workers.gpt.detect import SpikeDetector, first_divergence, odd_ones_out
from workers.gpt.loss_scale import DynamicLossScaler, HalfCopy
from workers.gpt.reduce import (average_gradients, distributed, gather_objects, projection_probes,
                                reduction_culprits)
from workers.gpt.telemetry import layer_groups, token_loss
from workers.model import GPTConfig, make_model

TRANSIENT_FAULTS = ("bit_flip",)


class Trainer:
    def __init__(self, mcfg: GPTConfig, tcfg: TrainConfig, rank: int = 0, world_size: int = 1, skip=(), metric=None,
                 device="cpu"):
        self.mcfg, self.tcfg, self.rank, self.world_size = mcfg, tcfg, rank, world_size
        self.metric = metric or (lambda **_: None)
        self.device = torch.device(device)
        self.model = make_model(mcfg, seed=tcfg.seed).to(self.device)
        self.params = list(self.model.parameters())
        self.groups = layer_groups(self.model)
        self.opt = torch.optim.AdamW(self.params, lr=tcfg.lr_at(0), betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=tcfg.weight_decay)
        n_samples = 2 * (tcfg.steps + 4) * tcfg.global_batch  # room for skipped ids
        self.data = MarkovDataset(mcfg.vocab, mcfg.seq, n_samples, tcfg.data_seed)
        if tcfg.fault == "garbage_batch":  # the ids a clean loader hands out at at_step
            self.data.corrupt(range(tcfg.at_step * tcfg.global_batch, (tcfg.at_step + 1) * tcfg.global_batch))
        self.loader = Loader(n_samples, tcfg.global_batch, skip)
        self.half = HalfCopy(self.model) if tcfg.fp16 else None
        self.scaler = DynamicLossScaler(tcfg.init_loss_scale, enabled=tcfg.fp16 and tcfg.loss_scaling)
        self.step = 0
        self.faults_on = True  # a replay turns transient faults off
        n_elements = sum(p.numel() for p in self.params)
        self.seen = torch.zeros(n_elements, dtype=torch.bool, device=self.device)  # had a nonzero gradient
        self.frozen = None  # freeze_dormant_from: the weights that get no update from then on
        self.probes = projection_probes(n_elements, device=self.device) if world_size > 1 else None

    # -- one step ---------------------------------------------------------------------------------------
    def _fault(self, name: str) -> bool:
        t = self.tcfg
        return self.faults_on and t.fault == name and self.rank == t.fault_rank

    def train_step(self, ids: list[int]) -> dict:
        t, step = self.tcfg, self.step
        for group in self.opt.param_groups:
            group["lr"] = t.lr_at(step)
        tokens = self.data.batch(rank_rows(ids, self.rank, self.world_size)).to(self.device)  # [B/n, seq + 1]
        reference = self._fp32_gradient(tokens) if t.fp32_grad_probe else None
        if step == t.freeze_dormant_from:
            self.frozen = ~self.seen
        before = tm.flat_params(self.params)
        net = self.model
        if self.half is not None:
            self.half.refresh()
            net = self.half.model
        self.opt.zero_grad(set_to_none=True)
        logits = net(tokens[:, :-1])  # [B/n, seq, V]
        loss, stats = token_loss(logits, tokens[:, 1:], t.z_loss)
        scale = self.scaler.scale  # 1.0 unless dynamic loss scaling is on
        multiplier = scale * t.grad_multiplier
        (loss * multiplier).backward()
        if self.half is not None:
            found_inf = self.half.grads_to_master(multiplier)  # fp32 master grads = fp16 grads / multiplier
        else:
            found_inf = False
            if multiplier != 1.0:
                for p in self.params:
                    p.grad /= multiplier
        zero_frac = tm.zero_grad_fraction(self.params)  # this rank's gradient, before any communication

        flat_grad = [p.grad for p in self.params]
        if self._fault("bit_flip") and t.flip_target == "grad" and step == t.at_step:
            _flip_flat(flat_grad, t.flip_index, t.flip_bit)
        local_grad = torch.cat([g.reshape(-1) for g in flat_grad])  # [P] this rank's gradient, as it will be sent
        grad_checksum = tm.bitwise_checksum(local_grad)
        woken = tm.newly_nonzero(local_grad, self.seen)
        self.seen |= woken
        sums = average_gradients(self.params, divide=not (self._fault("sum_not_average") and step >= t.at_step),
                                 probes=self.probes)

        # one SUM and one MAX over the ranks: the global loss, and whether anyone overflowed
        totals = torch.tensor([stats["loss"], stats["log_z_mean"], float(found_inf)], dtype=torch.float64,
                              device=self.device)
        peaks = torch.tensor([net.max_attention_logit(), stats["log_z_max"]], dtype=torch.float64, device=self.device)
        if distributed():
            dist.all_reduce(totals)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
            totals[:2] /= self.world_size
        found_inf = bool(totals[2] > 0)
        grad_norm = tm.global_grad_norm(self.params)
        layer_norms = tm.group_grad_norms(self.groups)
        if self.frozen is not None:
            _zero_where(self.params, self.frozen)
        if not found_inf:
            self.opt.step()
        self.scaler.update(found_inf)
        if self._fault("bit_flip") and t.flip_target == "param" and step == t.at_step:
            _flip_flat(self.params, t.flip_index, t.flip_bit)

        after = tm.flat_params(self.params)
        param_checksum = tm.bitwise_checksum(after)
        woken_cpu = woken.cpu()
        n_woken = int(woken_cpu.sum())
        record = {"step": step, "lr": t.lr_at(step), "loss": float(totals[0]), "local_loss": stats["loss"],
                  "grad_norm": grad_norm, "layer_grad_norms": layer_norms,
                  "update_ratio": tm.update_ratio(before, after), "max_attn_logit": float(peaks[0]),
                  "log_z_mean": float(totals[1]), "log_z_max": float(peaks[1]), "loss_scale": scale,
                  "skipped_step": found_inf, "zero_grad_frac": zero_frac, "sample_ids": list(ids),
                  "garbage_samples": sum(i in self.data.garbage for i in ids),
                  "woken_elements": n_woken,  # gradient elements nonzero for the first time in the run
                  "woken_update": (float((after - before)[woken_cpu].abs().median()) / t.lr_at(step)
                                   if n_woken else None),  # the median step on them, in units of lr
                  "woken_sign_agreement": (None if reference is None
                                           else tm.sign_agreement(local_grad, reference, woken)),
                  "grad_checksum": grad_checksum, "param_checksum": param_checksum}
        if self.world_size > 1:  # the cross-rank checksum, every step
            everyone = gather_objects({"checksum": param_checksum, **sums})
            record["checksums"] = [e["checksum"] for e in everyone]
            record["disagreeing_ranks"] = odd_ones_out(record["checksums"])
            record["reduction_culprits"] = reduction_culprits(everyone)
        return record

    def _fp32_gradient(self, tokens) -> torch.Tensor:
        """The exact fp32 gradient of the master weights on this batch, flat (``.grad`` is left alone)."""
        loss, _ = token_loss(self.model(tokens[:, :-1]), tokens[:, 1:], self.tcfg.z_loss)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, self.params)])

    # -- snapshots ------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything the future of the run depends on: weights, optimizer state, loss scale, data cursor (and
        which weights have had a gradient, for the telemetry and the freeze diagnostic)."""
        return copy.deepcopy({"step": self.step, "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                              "scaler": self.scaler.state_dict(), "cursor": self.loader.cursor,
                              "seen": self.seen, "frozen": self.frozen})

    def restore(self, snap: dict) -> None:
        snap = copy.deepcopy(snap)  # a snapshot may be restored more than once
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(snap["opt"])
        self.scaler.load_state_dict(snap["scaler"])
        self.loader.cursor, self.step = snap["cursor"], snap["step"]
        self.seen, self.frozen = snap["seen"], snap["frozen"]

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self, recover: bool = False) -> dict:
        """Train ``steps`` steps. With ``recover``, a loss spike rewinds to the last snapshot and skips the
        spiking batch's sample ids. ``trajectory``: the committed steps; ``history``: every step executed."""
        t = self.tcfg
        detector = SpikeDetector(t.spike_window, t.spike_factor)
        self.snapshots, history, trajectory, rewinds = {}, [], [], []
        while self.step < t.steps:
            if self.step % t.snapshot_every == 0:
                self.snapshots[self.step] = self.snapshot()
            ids = self.loader.next_ids()
            rec = self.train_step(ids)
            history.append(rec)
            self.metric(**_scalars(rec))
            if recover and detector.is_spike(rec["loss"]) and len(rewinds) < t.max_rewinds:
                back = max(s for s in self.snapshots if s <= self.step)
                rewinds.append({"spike_step": self.step, "loss": rec["loss"], "rewound_to": back,
                                "skipped_ids": list(ids)})
                self.loader.skip.update(ids)  # the bad samples never come back; the rest keep their order
                self.restore(self.snapshots[back])
                detector.truncate(back)
                del trajectory[back:]
                continue
            detector.accept(rec["loss"])
            trajectory.append(rec)
            self.step += 1
        return {"trajectory": trajectory, "history": history, "rewinds": rewinds}

    def replay(self, recorded: list[dict], from_step: int = 0) -> dict:
        """Rerun from the snapshot at ``from_step`` with transient faults off; compare fingerprints step by step.

        A step's fingerprint on a rank is (checksum of its local gradient before the all-reduce, checksum of
        its parameters after the step). On deterministic hardware (same kernels, same order) a replay
        reproduces every bit, so the first fingerprint that differs is where the original run went wrong,
        and the rank whose trace differs first is the rank it went wrong on. (On a GPU, kernels that add with
        atomics, such as the embedding's backward, are not bit-reproducible unless
        ``torch.use_deterministic_algorithms(True)``; the chapter runs on the CPU.)
        """
        self.restore(self.snapshots[from_step])
        self.faults_on = self.tcfg.fault not in TRANSIENT_FAULTS
        replayed = []
        while self.step < len(recorded):
            replayed.append(self.train_step(self.loader.next_ids()))
            self.step += 1
        self.faults_on = True
        events = lambda recs: [c for r in recs for c in (r["grad_checksum"], r["param_checksum"])]  # noqa: E731
        mine = first_divergence(events(recorded[from_step:]), events(replayed))
        everyone = gather_objects(mine)
        found = [e for e in everyone if e is not None]
        if not found:
            return {"diverged": False, "first_step": None, "ranks": [], "where": None, "event_by_rank": everyone}
        first = min(found)
        return {"diverged": True, "first_step": from_step + first // 2,
                "ranks": [r for r, e in enumerate(everyone) if e == first],
                "where": "local gradient, before the all-reduce" if first % 2 == 0 else "parameters, after the step",
                "event_by_rank": everyone, "replayed_losses": [r["loss"] for r in replayed]}


def _flip_flat(tensors, index: int, bit: int) -> None:
    """Flip one bit of element ``index`` of the concatenation of ``tensors`` (in place)."""
    for tensor in tensors:
        if index < tensor.numel():
            tm.flip_bit_(tensor, index, bit)
            return
        index -= tensor.numel()
    raise IndexError("flip_index is past the end of the model's parameters")


def _zero_where(params, mask: torch.Tensor) -> None:
    """Zero the gradient elements where the flat ``mask`` is True (Adam then leaves a weight with no history,
    m = v = 0, exactly where it is)."""
    offset = 0
    for p in params:
        p.grad.masked_fill_(mask[offset:offset + p.numel()].view_as(p.grad), 0)
        offset += p.numel()


def _scalars(rec: dict) -> dict:
    """What streams live as a metric: the numbers, not the per-rank lists."""
    return {k: v for k, v in rec.items() if isinstance(v, (int, float, bool)) or k == "sample_ids"}
