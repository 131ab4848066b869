"""A pipeline-parallel training step on real ranks: GPipe, 1F1B, interleaved 1F1B, or a zero-bubble schedule
(ZB-H1, ZB-H2, ZB-V, DualPipeV) over real send/recv.

    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule 1f1b --micro-batches 8
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --pp 2 --forward-ms 5 --backward-ms 10
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule interleaved --virtual-stages 2
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule zb-h1 --dtype float64
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule dualpipev --virtual-stages 2 --layers 16

The degrees are the course's one layout's (``workers/layout/rules.py``): ``pp`` p stages (0: the whole world)
split ``layers`` into p contiguous stages; a world larger than p runs world / p identical pipelines side by side
(the layout's dp: ranks 0..p-1, p..2p-1, ...: each the same model on the same batch), so p = 1, 2 and 4 all run on
one set of 4 warm ranks. ``virtual_stages`` v > 1 (interleaved only) cuts the model into p * v chunks instead,
chunk c of stage s holding virtual stage c * p + s. Each rank returns its stage's timeline, peak stashed
activations, p2p counts, losses (last stage), gradients of the last step and weights after ``steps`` SGD steps,
under the whole model's parameter names (``workers/pipeline/reference.py`` is the single-process ground truth).

The zero-bubble schedules (``workers/pipeline/zero_bubble.py``) split each backward into B (the input gradient) and
W (the weight gradient), computed by hand (``split_backward.py``); ``backward_ms`` pads B to (1 - ``w_share``) of it
and W to ``w_share`` of it, so the chapter's 20 / 40 ms at the default 0.5 give the paper's T_F = T_B = T_W. ZB-V and DualPipeV hold two chunks per rank in a V
(``virtual_stages=2``): rank s holds virtual stages s and 2p-1-s, so rank p-1 hands its chunk 0's output to its
chunk 1 without a message, and the loss, the last virtual stage, is on rank 0: its losses come back from stage 0
(``loss_stage``). ``dtype="float64"`` runs every stage in double precision, for comparisons to 1e-12.
"""
from workers.layout.rules import equal_stages_problem, problem
from workers.pipeline.model import PipelineConfig
from workers.pipeline.trainer import layout_of, train
from workers.runtime import at_least, entrypoint, one_of, refusal

DTYPES = ("float32", "float64")


def check_params(world_size, schedule="1f1b", micro_batches=8, pp=0, virtual_stages=1, layers=8, hidden=16,
                 micro_batch_size=4, forward_ms=0.0, backward_ms=0.0, w_share=0.5, steps=1, lr=0.1, dtype="float32",
                 **_):
    # The layout's rules (the one rule set: degrees against the world, the schedule and its chunks per rank,
    # micro-batches, layers per chunk), then what this chapter adds: equal stages, and its own parameters.
    if pp < 0:
        degrees = f"pp={pp} must be at least 0 (0: the whole world)"
    else:
        layout = layout_of(world_size, pp, virtual_stages, micro_batches, schedule)
        # the rule set names layers itself when chunks cannot be equal or outnumber them; equal stages otherwise
        equal = (equal_stages_problem(layout, layers)
                 if 1 <= layout.pp * max(virtual_stages, 1) <= layers and virtual_stages >= 1 else None)
        plain = ("virtual_stages=1 would make it plain 1F1B: choose schedule='1f1b', or virtual_stages=2 or more"
                 if schedule == "interleaved" and virtual_stages == 1 else None)
        degrees = refusal(problem(layout, world_size, PipelineConfig(layers=layers) if layers >= 1 else None),
                          plain, equal)
    return refusal(degrees, one_of("dtype", dtype, DTYPES), at_least("layers", layers), at_least("hidden", hidden),
                   at_least("micro_batch_size", micro_batch_size),
                   None if 0 <= forward_ms <= 200 and 0 <= backward_ms <= 400 else
                   f"forward_ms={forward_ms} and backward_ms={backward_ms} must be between 0 and 200 / 400 ms",
                   None if isinstance(w_share, (int, float)) and 0 <= w_share <= 1 else
                   f"w_share={w_share!r} must be between 0 and 1 (the weight gradient's share of a backward)",
                   at_least("steps", steps), None if lr > 0 else f"lr={lr} must be positive")


def main(ctx, schedule: str = "1f1b", micro_batches: int = 8, pp: int = 0, virtual_stages: int = 1, layers: int = 8,
         hidden: int = 16, micro_batch_size: int = 4, forward_ms: float = 0.0, backward_ms: float = 0.0, steps: int = 1,
         lr: float = 0.1, seed: int = 0, dtype: str = "float32", w_share: float = 0.5):
    """``steps`` SGD steps of the pipelined MLP with ``schedule`` over ``micro_batches`` micro-batches
    (``workers/pipeline/trainer.py``)."""
    return train(ctx, schedule=schedule, micro_batches=micro_batches, pp=pp, virtual_stages=virtual_stages,
                 layers=layers, hidden=hidden, micro_batch_size=micro_batch_size, forward_ms=forward_ms,
                 backward_ms=backward_ms, steps=steps, lr=lr, seed=seed, dtype=dtype, w_share=w_share)


if __name__ == "__main__":
    entrypoint(main)
