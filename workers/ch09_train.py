"""Chapter 09: train the tiny GPT on real ranks with one injected fault, and watch its telemetry.

    torchrun --nproc-per-node 2 workers/ch09_train.py --fault sum_not_average --at-step 65 --fault-rank 1

Every step streams loss, global and per-layer grad norms, update/param ratio, max attention logit, output
log Z, loss scale and the batch's sample ids (``ctx.metric``); the same telemetry comes back as columns
(``telemetry``) when the run ends. The faults, one layer each (see ``workers/gpt/train.py``):

    data            fault="garbage_batch"     recover=True: rewind to the last snapshot, skip the sample ids
    numeric         fault="high_lr"           qk_layernorm=True / z_loss=... are the mitigations
    numeric         fault="fp16_underflow"    loss_scaling=True is the mitigation
    communication   fault="sum_not_average"   the cross-rank checksum (every step at world > 1) catches it
    hardware        fault="bit_flip"          replay=True reruns from a snapshot and finds the step and rank

Diagnostics: fp32_grad_probe=True grades the gradients against exact fp32 ones; freeze_dormant_from=s gives
no update, from step s on, to the weights that had no gradient before s (see ``workers/gpt/config.py``).
"""
from workers.gpt.config import FAULTS, MODEL, split_params
from workers.gpt.detect import checksum_alarm
from workers.model import make_model
from workers.gpt.telemetry import columns
from workers.gpt.train import Trainer
from workers.runtime import at_least, batch_over_world, divides, entrypoint, one_of, refusal

STEPPED_FAULTS = ("garbage_batch", "sum_not_average", "bit_flip")  # the faults that happen at at_step
TELEMETRY = ("step", "lr", "loss", "local_loss", "grad_norm", "layer_grad_norms", "update_ratio", "max_attn_logit",
             "log_z_mean", "log_z_max", "loss_scale", "skipped_step", "zero_grad_frac", "sample_ids",
             "garbage_samples", "woken_elements", "woken_update", "woken_sign_agreement", "grad_checksum",
             "param_checksum")


def n_parameters(vocab: int, seq: int, hidden: int, heads: int, layers: int, qk_layernorm: bool) -> int:
    """Elements in the model's flat parameter vector (what flip_index indexes)."""
    cfg = MODEL.replace(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers, qk_layernorm=qk_layernorm)
    return sum(p.numel() for p in make_model(cfg).parameters())


def check_params(world_size, fault, at_step, fault_rank, steps, global_batch, hidden, heads, snapshot_every,
                 flip_bit, flip_target, flip_index, dtype, replay_from, lr, high_lr, freeze_dormant_from, vocab, seq,
                 layers, qk_layernorm, **_):
    few_steps = at_least("steps", steps)  # the clauses about steps of the run wait until there are some
    snap = at_least("snapshot_every", snapshot_every)
    why = refusal(
        one_of("fault", fault, FAULTS), few_steps, batch_over_world(global_batch, world_size),
        at_least("hidden", hidden) or divides("heads", heads, "hidden", hidden),
        f"at_step={at_step} is outside the run's steps 0..{steps - 1}: inject the fault during the run"
        if not few_steps and fault in STEPPED_FAULTS and not 0 <= at_step < steps else None,
        f"fault_rank={fault_rank} is not a rank of a world of {world_size}: use 0..{world_size - 1}"
        if fault in ("sum_not_average", "bit_flip") and not 0 <= fault_rank < world_size else None,
        "fault='sum_not_average' needs at least 2 ranks (one rank has nothing to average): use world_size=2"
        if fault == "sum_not_average" and world_size < 2 else None,
        snap and f"{snap} step",
        None if 0 <= flip_bit <= 31 else
        f"flip_bit={flip_bit} is not a bit of a 32-bit float: use 0 (lowest mantissa bit) to 31 (sign)",
        (flip := one_of("flip_target", flip_target, ("grad", "param"))) and
        f"{flip}: 'grad' flips before the all-reduce, 'param' after the step",
        one_of("dtype", dtype, ("auto", "float32", "float16")),
        (f"replay_from={replay_from} has no snapshot: use a multiple of snapshot_every={snapshot_every} "
         f"below steps={steps}")
        if not (few_steps or snap) and (replay_from % snapshot_every or not 0 <= replay_from < steps) else None,
        None if few_steps or -1 <= freeze_dormant_from < steps else
        f"freeze_dormant_from={freeze_dormant_from} is not a step of the run: use 0..{steps - 1}, or -1 for no freeze",
        None if lr > 0 else f"lr={lr} must be positive", None if high_lr > 0 else f"high_lr={high_lr} must be positive")
    if why or fault != "bit_flip":
        return why
    n = n_parameters(vocab, seq, hidden, heads, layers, qk_layernorm)  # a model of this shape: the rest is valid
    if not 0 <= flip_index < n:
        return f"flip_index={flip_index} is not an element of the model's {n} parameters: use 0..{n - 1}"
    return None


def main(ctx, fault: str = "none", at_step: int = 65, fault_rank: int = 0, steps: int = 120, global_batch: int = 16,
         lr: float = 3e-3, high_lr: float = 0.2, warmup: int = 20, qk_layernorm: bool = False, z_loss: float = 0.0,
         dtype: str = "auto", loss_scaling: bool = False, loss_multiplier: float = 2.0 ** -14,
         flip_bit: int = 20, flip_target: str = "grad", flip_index: int = 1000, recover: bool = False,
         replay: bool = False, replay_from: int = 0, skip_ids: list = (), snapshot_every: int = 10,
         spike_factor: float = 1.5, seed: int = 0, vocab: int = 32, seq: int = 32, hidden: int = 64, heads: int = 4,
         layers: int = 2, fp32_grad_probe: bool = False, freeze_dormant_from: int = -1):
    """Train ``steps`` steps with ``fault`` injected; return the telemetry, rewinds, checksum alarm and replay."""
    params = {k: v for k, v in locals().items() if k != "ctx"}
    mcfg, tcfg = split_params(params)
    skip = [int(i) for i in skip_ids]  # from a terminal the ids arrive as strings
    trainer = Trainer(mcfg, tcfg, ctx.rank, ctx.world_size, skip=skip, metric=ctx.metric, device=ctx.device)
    out = trainer.run(recover=recover)
    result = {"telemetry": columns(out["trajectory"], TELEMETRY), "rewinds": out["rewinds"],
              "executed": columns(out["history"], ("step", "loss")),  # every step run, rewound ones included
              "checksum_alarm": checksum_alarm(out["trajectory"]) if ctx.world_size > 1 else None}
    if replay:
        result["replay"] = trainer.replay(out["trajectory"], replay_from)
    return result


if __name__ == "__main__":
    entrypoint(main)
