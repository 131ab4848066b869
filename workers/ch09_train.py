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
from workers.gpt.config import FAULTS, GPTConfig, split_params
from workers.gpt.detect import checksum_alarm
from workers.gpt.model import make_model
from workers.gpt.telemetry import columns
from workers.gpt.train import Trainer
from workers.runtime import entrypoint

STEPPED_FAULTS = ("garbage_batch", "sum_not_average", "bit_flip")  # the faults that happen at at_step
TELEMETRY = ("step", "lr", "loss", "local_loss", "grad_norm", "layer_grad_norms", "update_ratio", "max_attn_logit",
             "log_z_mean", "log_z_max", "loss_scale", "skipped_step", "zero_grad_frac", "sample_ids",
             "garbage_samples", "woken_elements", "woken_update", "woken_sign_agreement", "grad_checksum",
             "param_checksum")


def n_parameters(vocab: int, seq: int, hidden: int, heads: int, layers: int, qk_layernorm: bool) -> int:
    """Elements in the model's flat parameter vector (what flip_index indexes)."""
    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers, qk_layernorm=qk_layernorm)
    return sum(p.numel() for p in make_model(cfg).parameters())


def check_params(world_size, fault, at_step, fault_rank, steps, global_batch, hidden, heads, snapshot_every,
                 flip_bit, flip_target, flip_index, dtype, replay_from, lr, high_lr, freeze_dormant_from, vocab, seq,
                 layers, qk_layernorm, **_):
    if fault not in FAULTS:
        return f"fault={fault!r} is not one of {', '.join(FAULTS)}: pick one of those"
    if steps < 1:
        return f"steps={steps} trains nothing: use at least 1 step"
    if global_batch < world_size or global_batch % world_size:
        return (f"global_batch={global_batch} does not split into {world_size} equal shards of samples: "
                f"choose a multiple of {world_size}")
    if hidden % heads:
        return f"hidden={hidden} is not divisible by heads={heads}: choose heads that divide {hidden}"
    if fault in STEPPED_FAULTS and not 0 <= at_step < steps:
        return f"at_step={at_step} is outside the run's steps 0..{steps - 1}: inject the fault during the run"
    if fault in ("sum_not_average", "bit_flip") and not 0 <= fault_rank < world_size:
        return f"fault_rank={fault_rank} is not a rank of a world of {world_size}: use 0..{world_size - 1}"
    if fault == "sum_not_average" and world_size < 2:
        return "fault='sum_not_average' needs at least 2 ranks (one rank has nothing to average): use world_size=2"
    if snapshot_every < 1:
        return f"snapshot_every={snapshot_every} must be at least 1 step"
    if not 0 <= flip_bit <= 31:
        return f"flip_bit={flip_bit} is not a bit of a 32-bit float: use 0 (lowest mantissa bit) to 31 (sign)"
    if flip_target not in ("grad", "param"):
        return f"flip_target={flip_target!r} must be 'grad' (before the all-reduce) or 'param' (after the step)"
    if fault == "bit_flip":
        n = n_parameters(vocab, seq, hidden, heads, layers, qk_layernorm)
        if not 0 <= flip_index < n:
            return f"flip_index={flip_index} is not an element of the model's {n} parameters: use 0..{n - 1}"
    if dtype not in ("auto", "float32", "float16"):
        return f"dtype={dtype!r} must be 'auto', 'float32' or 'float16'"
    if replay_from % snapshot_every or not 0 <= replay_from < steps:
        return (f"replay_from={replay_from} has no snapshot: use a multiple of snapshot_every={snapshot_every} "
                f"below steps={steps}")
    if not -1 <= freeze_dormant_from < steps:
        return (f"freeze_dormant_from={freeze_dormant_from} is not a step of the run: use 0..{steps - 1}, "
                "or -1 for no freeze")
    if lr <= 0 or high_lr <= 0:
        return f"learning rates must be positive (lr={lr}, high_lr={high_lr})"
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
