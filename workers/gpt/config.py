"""What defines a chapter 09 run: the model (the course's ``GPTConfig``, ``MODEL`` here), and how it is trained."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from workers.model.gpt import GPTConfig

FAULTS = ("none", "garbage_batch", "high_lr", "fp16_underflow", "sum_not_average", "bit_flip")


# Chapter 09's model: the course's GPT at its default size (vocab 32, seq 32, hidden 64, 4 heads, 2 layers, untied)
# with its attention written out, so every step can read the largest pre-softmax logit.
MODEL = GPTConfig(logit_probe=True)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 120
    global_batch: int = 16  # samples per optimizer step, over all ranks together
    lr: float = 3e-3
    high_lr: float = 0.2  # the learning rate fault="high_lr" trains with
    warmup: int = 20  # linear warm-up steps, then constant
    weight_decay: float = 0.0
    z_loss: float = 0.0  # coefficient of the PaLM auxiliary loss mean(log Z)^2 (Chowdhery et al. 2022, sec. 5)
    seed: int = 0
    data_seed: int = 1234
    snapshot_every: int = 10  # in-memory snapshot of model + optimizer + data cursor every k steps
    dtype: str = "auto"  # "float16": fp16 model copy for forward/backward, fp32 masters; "auto": fp16 iff the fault is
    loss_multiplier: float = 2.0 ** -14  # fault="fp16_underflow" only: puts our gradients where a large model's sit
    loss_scaling: bool = False  # dynamic loss scaling for fp16 (the GradScaler recipe, by hand)
    init_loss_scale: float = 2.0 ** 16
    # the injected fault
    fault: str = "none"
    at_step: int = 65  # not a multiple of snapshot_every, so a rewind has steps to redo
    fault_rank: int = 0
    flip_bit: int = 20  # which bit of the fp32 word the bit flip toggles (31 sign, 30-23 exponent, 22-0 mantissa)
    flip_target: str = "grad"  # "grad": before the all-reduce (spreads to every rank); "param": after the step
    flip_index: int = 1000  # which element of the flat gradient / parameter vector
    # diagnostics: grade each step's gradient against the exact fp32 gradient of the same batch; and from step
    # freeze_dormant_from on (-1: never), give no update to the weights whose gradient was exactly 0 at every
    # earlier step (the counterfactual that shows what their first gradients do)
    fp32_grad_probe: bool = False
    freeze_dormant_from: int = -1
    # detection and recovery
    spike_window: int = 10
    spike_factor: float = 1.5
    max_rewinds: int = 3

    @property
    def fp16(self) -> bool:
        return self.dtype == "float16" or (self.dtype == "auto" and self.fault == "fp16_underflow")

    @property
    def grad_multiplier(self) -> float:
        """What the loss is multiplied by before backward (and the gradients divided by after), loss scale aside.

        Our tiny model's gradients have a median near 6e-4, far above fp16's smallest subnormal 2^-24 ~ 6e-8;
        a large model averages over far more tokens and wider layers, and many of its gradients sit near or
        below that floor. Multiplying the loss by 2^-14 moves our gradients there. It is exact in fp32 (a
        power of two, far from fp32's range limits), so only the fp16 backward is affected.
        """
        return self.loss_multiplier if self.fault == "fp16_underflow" else 1.0

    @property
    def base_lr(self) -> float:
        return self.high_lr if self.fault == "high_lr" else self.lr

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup`` steps, then constant."""
        return self.base_lr * min(1.0, (step + 1) / max(self.warmup, 1))

    def replace(self, **changes) -> "TrainConfig":
        return TrainConfig(**{**asdict(self), **changes})


def split_params(params: dict) -> tuple[GPTConfig, TrainConfig]:
    """A worker's flat keyword parameters -> the two configs (unknown names are the caller's business)."""
    train_names = {f.name for f in fields(TrainConfig)}
    return (MODEL.with_params(params),
            TrainConfig(**{k: v for k, v in params.items() if k in train_names}))
