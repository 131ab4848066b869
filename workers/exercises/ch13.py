"""Rank-side check for chapter 13's ``stage_step``: one stage's forward and backward over real send/recv.

The learner talks to its neighbours only through ``StageComm`` (Megatron's four p2p calls). ``StageComm``
keeps the message protocol in step whatever the answer does: a message the answer forgets is sent (as
zeros) or drained for it, a ``None`` is replaced, and every such slip is recorded. So a wrong answer ends in
a verdict that names the slip, never in ranks blocked on a receive that will not come.
"""
from __future__ import annotations

import torch

from workers.exercises.support import Wrong, agree, expect_close, run_exercise
from workers.pipeline.model import (FP32_TOL, PipelineConfig, global_names, loss_fn, make_batch, make_model,
                                   micro_batches, partition_table, stage_module)
from workers.pipeline.p2p import P2P
from workers.pipeline.reference import reference_step

ORDER = ("recv_forward", "send_forward", "recv_backward", "send_backward")  # one micro-batch, one stage


class StageComm:
    """This stage's view of one micro-batch: ``input()`` (first stage), ``loss(output)`` (last stage), and
    ``recv_forward()``, ``send_forward(t)``, ``recv_backward()``, ``send_backward(t)``."""

    def __init__(self, p2p: P2P, stage: int, num_stages: int, x: torch.Tensor, target: torch.Tensor, m: int):
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self._p2p, self._x, self._target, self._m = p2p, x, target, m
        self._needed = [s for s in ORDER if not (self.is_first and s in ("recv_forward", "send_backward"))
                        and not (self.is_last and s in ("send_forward", "recv_backward"))]
        self._done: list[str] = []
        self.slips: list[str] = []

    def input(self) -> torch.Tensor:
        return self._x  # [micro_batch, hidden]

    def loss(self, output: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, self._target) / self._m  # this micro-batch's share of the global-batch loss

    def _step(self, name: str, tensor=None):
        if name not in self._needed:
            self.slips.append(f"stage {self.stage} called {name}, which this stage has no neighbour for")
            return None
        if name in self._done:
            self.slips.append(f"stage {self.stage} called {name} twice for one micro-batch")
            return None
        for earlier in self._needed[:self._needed.index(name)]:  # keep the protocol whole, note the slip
            if earlier not in self._done:
                self._auto(earlier)
        self._done.append(name)
        return self._real(name, tensor)

    def _real(self, name, tensor):
        if name == "recv_forward":
            return self._p2p.recv_forward().detach()  # plain data: requires_grad is the learner's job
        if name == "recv_backward":
            return self._p2p.recv_backward()
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != self._p2p.shape:
            what = "None" if tensor is None else f"a {type(tensor).__name__} of shape {getattr(tensor, 'shape', '?')}"
            if name == "send_backward" and tensor is None:
                self.slips.append(f"stage {self.stage} sent None as its input's gradient: the received activation is "
                                  "plain data, so autograd computed no gradient for it; call requires_grad_() on it "
                                  "before the forward, then send x.grad")
            else:
                self.slips.append(f"stage {self.stage} passed {what} to {name}: send a tensor of shape "
                                  f"{list(self._p2p.shape)}")
            tensor = torch.zeros(self._p2p.shape)
        (self._p2p.send_forward if name == "send_forward" else self._p2p.send_backward)(tensor)
        return None

    def _auto(self, name):
        self._done.append(name)
        if name == "send_backward":
            self.slips.append(f"stage {self.stage} never sent the gradient of its input back to stage "
                              f"{self.stage - 1} (send_backward): the earlier stages' weights get no gradient")
        elif name == "send_forward":
            self.slips.append(f"stage {self.stage} never sent its output to stage {self.stage + 1} (send_forward)")
        else:
            self.slips.append(f"stage {self.stage} skipped {name}: it must use what its neighbour sends")
        self._real(name, torch.zeros(self._p2p.shape) if name.startswith("send") else None)

    def recv_forward(self):
        return self._step("recv_forward")

    def send_forward(self, output):
        self._step("send_forward", output)

    def recv_backward(self):
        return self._step("recv_backward")

    def send_backward(self, input_grad):
        self._step("send_backward", input_grad)

    def finish(self):
        for name in self._needed:
            if name not in self._done:
                self._auto(name)
        self._p2p.finish()


def check_stage_step(ctx, answer) -> None:
    p, stage = ctx.world_size, ctx.rank
    cfg = PipelineConfig(layers=2 * p, hidden=8, micro_batch_size=3, micro_batches=3, seed=4)
    device = ctx.comm_device("send")  # the whole check on a device gloo can send from
    module = stage_module(cfg, stage, p).to(device)
    x, y = make_batch(cfg)
    slips = []
    for i, (xi, yi) in enumerate(zip(micro_batches(cfg, x), micro_batches(cfg, y))):
        p2p = P2P(stage - 1 if stage else None, stage + 1 if stage < p - 1 else None, (cfg.micro_batch_size, cfg.hidden),
                  device, device)
        comm = StageComm(p2p, stage, p, xi.to(device), yi.to(device), cfg.micro_batches)
        try:
            answer(module, comm)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - report it, after keeping the neighbours in step
            comm.slips.append(f"stage {stage} raised {type(exc).__name__}: {exc}")
        comm.finish()
        slips += [f"micro-batch {i}: {s}" for s in comm.slips]

    def protocol_kept():
        if slips:
            raise Wrong(slips[0])

    agree(protocol_kept)
    want = reference_step(cfg)["grads"]
    names = global_names(cfg, stage, p, module)
    last_only, own_loss = _what_mistakes_give(cfg, stage, p, list(names))

    def gradients_right():
        for name, param in names.items():
            if param.grad is None:
                raise Wrong(f"stage {stage}'s {name} has no gradient: run the backward on every stage")
            got = param.grad.detach().cpu()
            if not torch.isfinite(got).all():  # before the hints: a NaN matches none of them, and no hint fits it
                raise Wrong(f"stage {stage}'s gradient of {name} holds NaN or infinity at "
                            f"{(~torch.isfinite(got)).nonzero()[0].tolist()}: a finite model and loss give finite "
                            "gradients; look for a division by zero or a tensor used before it was filled")
            if torch.allclose(got, want[name], **FP32_TOL):
                continue
            if torch.allclose(got, last_only[name], **FP32_TOL):
                raise Wrong(f"stage {stage}'s gradient of {name} is the last micro-batch's alone: the gradients of "
                            f"the {cfg.micro_batches - 1} earlier micro-batches were lost. Do not zero the gradients "
                            "(zero_grad) or overwrite .grad in the step of one micro-batch: the m micro-batches' "
                            "gradients add up in .grad until the optimizer step, and the trainer zeroes them once "
                            "per step")
            if own_loss is not None and torch.allclose(got, own_loss[name], **FP32_TOL):
                raise Wrong(f"stage {stage}'s gradient of {name} is that of a loss of its own (output.sum()): "
                            "backpropagate the gradient received from the next stage "
                            "(torch.autograd.backward(output, grad)), not a loss of your own")
            expect_close(got, want[name], f"stage {stage}'s gradient of {name}", **FP32_TOL, hints=[
                (lambda g, w: stage < p - 1, "it differs from the unsplit model's. Check that the backward uses the "
                 "gradient received from the next stage (torch.autograd.backward(output, grad)), not a loss of "
                 "its own, and that the m micro-batches' gradients accumulate in .grad (no zero_grad inside the "
                 "step)"),
            ])

    agree(gradients_right)


def _what_mistakes_give(cfg: PipelineConfig, stage: int, p: int, names: list[str]):
    """This stage's gradients (by global name) under two mistakes, from the unsplit model in this process:
    only the last micro-batch's (gradients zeroed or overwritten every micro-batch), and, for a stage before
    the last, a made-up loss ``output.sum()`` backpropagated instead of the received gradient."""
    model = make_model(cfg)
    params = dict(model.named_parameters())
    first, end = partition_table(cfg.layers, p)[stage]
    x, y = make_batch(cfg)
    own = {n: torch.zeros_like(params[n]) for n in names} if stage < p - 1 else None
    last = {}
    for i, (xi, yi) in enumerate(zip(micro_batches(cfg, x), micro_batches(cfg, y))):
        h = xi
        for layer in list(model)[:end]:
            h = layer(h)
        if i == cfg.micro_batches - 1:
            out = h
            for layer in list(model)[end:]:
                out = layer(out)
            grads = torch.autograd.grad(loss_fn(out, yi) / cfg.micro_batches, [params[n] for n in names],
                                        retain_graph=own is not None)
            last = {n: g.detach() for n, g in zip(names, grads)}
        if own is not None:
            for n, g in zip(names, torch.autograd.grad(h.sum(), [params[n] for n in names])):
                own[n] += g.detach()
    return last, own


CHECKS = {"stage_step": check_stage_step}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
