"""What every rank-side exercise checker shares: run the learner's function, turn the outcome into a verdict.

A check is ``fn(ctx, answer) -> None`` that raises ``Wrong("what is wrong and what to try")`` when the
answer is wrong. Every rank runs the same check (collectives stay in step) and sends its own verdict.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class Wrong(AssertionError):
    """The answer ran but gave a wrong result; the message is shown to the learner.

    ``rank``: the (global) rank that saw it, when it is not the rank raising (``agree`` shares one rank's finding
    with every rank, and the verdict then names that rank, once)."""

    def __init__(self, message: str = "", rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def verdict(status: str, message: str, rank: int | None = None) -> dict:
    """A rank's verdict; ``rank``: the rank whose finding it reports, when that is another rank (``agree``)."""
    return {"verdict": {"status": status, "message": message, **({} if rank is None else {"rank": rank})}}


def agree(check: Callable[[], None], group=None) -> None:
    """Run one stage of a check on every rank, then share the verdicts: if any rank found the answer wrong,
    every rank raises the lowest such rank's message, naming that rank (its global rank) as the one that saw it.

    Without this, a rank that found a mistake would stop while the others went on into the learner's next
    collective and waited there until the timeout, hiding the real message behind a hang.
    """
    try:
        check()
        mine = None
    except Wrong as exc:
        mine = str(exc) or "wrong"
    messages = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, mine, group=group)
    members = dist.get_process_group_ranks(group) if group is not None else range(len(messages))
    for rank, message in zip(members, messages):
        if message is not None:
            raise Wrong(message, rank=rank)


def run_exercise(ctx, checks: dict[str, Callable], exercise: str, answer) -> dict:
    if exercise not in checks:
        raise KeyError(f"no rank-side check for exercise {exercise!r}; known: {sorted(checks)}")
    try:
        checks[exercise](ctx, answer)
    except NotImplementedError:
        return verdict("todo", "not attempted yet: replace the `raise NotImplementedError` with your code")
    except Wrong as exc:
        return verdict("fail", str(exc), getattr(exc, "rank", None))
    return verdict("pass", "correct")


def expect_finite(tensor: torch.Tensor, what: str) -> None:
    """Raise Wrong naming a NaN or infinity in ``tensor``: checked before any comparison, so that a NaN is told
    as a NaN instead of as a large error or a misleading hint (every input a check makes is finite)."""
    if not torch.isfinite(tensor.detach()).all():
        raise Wrong(f"{what} holds NaN or inf, from finite inputs")


def expect_close(got, want, what: str, *, atol: float = 1e-6, rtol: float = 1e-5, hints=()) -> None:
    """Raise Wrong with a helpful message if ``got`` differs from ``want``.

    ``hints`` is a list of ``(predicate(got, want) -> bool, message)``: the first that matches explains
    the likely mistake (for example: got == want * world_size -> "you summed but did not average").
    """
    if not isinstance(got, torch.Tensor):
        raise Wrong(f"{what}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape:
        raise Wrong(f"{what}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
    got_c, want_c = got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)
    if torch.allclose(got_c, want_c, atol=atol, rtol=rtol):
        return
    for predicate, message in hints:
        try:
            if predicate(got_c, want_c):
                raise Wrong(f"{what}: {message}")
        except Wrong:
            raise
        except Exception:  # noqa: BLE001 - a hint that does not apply
            continue
    err = (got_c - want_c).abs().max().item()
    tolerance = "must be exact" if not atol and not rtol else f"tolerance {atol:g} + {rtol:g}*|expected|"
    raise Wrong(f"{what}: max abs error {err:.3g} ({tolerance}); "
                f"first values got {_head(got_c)} expected {_head(want_c)}")


def _head(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in t.flatten()[:4].tolist()) + (", ...]" if t.numel() > 4 else "]")


def scaled_by(factor: float):
    """Hint predicate: got == want * factor."""
    return lambda got, want: torch.allclose(got, want * factor, atol=1e-6, rtol=1e-5)
