"""The model's two ends split by vocabulary, run on this rank and held to the same ends in one process.

    tokens [b, s] -> embedding -> x [s, b, h] -> LM head -> logits [s, b, V/t] -> loss (mean over the b s tokens)

Every rank builds the same dense ends from one seed (``build_dense``: an ``nn.Embedding`` and an LM head, separate
or tied), keeps its block of the vocabulary (``VocabParallelEmbedding``; the head a ``ColumnParallelLinear`` over
the vocabulary, or ``parallel_lm_logits`` with the embedding's rows when tied), and runs forward and backward on the
whole batch. It returns its loss, every gradient (its rows of the embedding and of the head, the head's input x,
its columns of the logits) with the dense indices they hold, the bytes of its logits against the dense logits'
(both measured: ``numel * element_size``), and the collectives the ledger saw.

``verdict`` compares all of it with the dense ends computed on the rank in float64 and, when they differ, names the
mistake from what the group sees together (the tools a learner has, no fault's name):

* ranks whose losses differ: each normalised over its own words (``sum_exp_not_reduced``);
* a loss that is not finite (the same on every rank): an exponential overflowed, the max was not subtracted
  (``max_not_subtracted``);
* the gradient of a token's logits, summed over the whole vocabulary, is ``softmax - onehot`` summed: 1 - 1 = 0
  exactly. t - 1 means every rank subtracted a one-hot (``target_not_masked``);
* a gradient that sums to 0 with a wrong loss: the shards were shifted by different maxima (``max_not_reduced``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.parallel.comm_stats import CommLedger, name_scopes, region
from workers.parallel.faults import inject
from workers.parallel.layers import ColumnParallelLinear, group_size_rank
from workers.parallel.vocab import CROSS_ENTROPY, VocabParallelEmbedding, parallel_lm_logits, \
    vocab_parallel_cross_entropy, vocab_range

# |got - want| <= RTOL * (largest |want| of the tensor): float64 sums of a few dozen terms in another order agree
# to within 6.7e-16 of their size, float32 ranks with the float64 reference to within 2.5e-7 (measured at tp 1, 2, 4,
# logits ~1 and ~1e3, native and ATEN_CPU_CAPABILITY=default kernels): margins of 1000 and 40
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}
MISTAKES = {
    "max_not_subtracted": "the loss is not finite: exp() overflowed; subtract each token's largest logit, all-reduced "
                          "(MAX) over the group, before exp",
    "sum_exp_not_reduced": "the ranks' losses differ: each rank normalised over its own words (its softmax sums to 1 "
                           "on every rank); all-reduce (SUM) the sum of exponentials over the group",
    "target_not_masked": "the gradient of each token's logits sums to 1 - t over the vocabulary, not 0: every rank "
                         "subtracted a one-hot; zero the target's logit (and its one-hot) on the ranks that do not "
                         "hold the target",
    "max_not_reduced": "the loss is wrong but the softmax still sums to 1: the shards were shifted by different "
                       "maxima; all-reduce (MAX) the max over the group before subtracting it",
}


class LMEnds(nn.Module):
    """The dense ends: ``embed`` and ``head`` (``head.weight`` *is* ``embed.weight`` when tied, as in the GPT)."""

    def __init__(self, vocab: int, hidden: int, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.tied = tied

    def forward(self, tokens: torch.Tensor, logit_scale: float = 1.0):
        x = self.embed(tokens).transpose(0, 1)  # [b, s, h] -> [s, b, h]
        return x, self.head(x) * logit_scale  # [s, b, V]


def build_dense(vocab: int, hidden: int, seed: int = 0, tied: bool = False) -> LMEnds:
    """The same dense ends on every rank and in a test, without touching the caller's RNG. Rows N(0, 1) and a head
    N(0, 1/h): logits of order 1, so ``logit_scale`` sets their size."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dense = LMEnds(vocab, hidden, tied)
        nn.init.normal_(dense.embed.weight)
        if not tied:
            nn.init.normal_(dense.head.weight, std=hidden ** -0.5)
    return dense.to(torch.float64)


def make_tokens(vocab: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, each ``[b, s]``: when b s >= vocab every word is a token and a target, so every rank's
    shard holds some of both; the rest drawn at random."""
    g = torch.Generator().manual_seed(seed + 1)

    def draw():
        every = torch.randperm(vocab, generator=g)
        rest = torch.randint(vocab, (max(0, batch * seq - vocab),), generator=g)
        return torch.cat([every, rest])[:batch * seq][torch.randperm(batch * seq, generator=g)].view(batch, seq)
    return draw(), draw()


class ParallelLMEnds(nn.Module):
    """This rank's block of the vocabulary of ``dense``: tokens ``[b, s]`` in, ``(x [s, b, h], logits [s, b, V/t])``."""

    def __init__(self, dense: LMEnds, group=None):
        super().__init__()
        self.group, self.tied = group, dense.tied
        self.embed = VocabParallelEmbedding.from_dense(dense.embed, group)
        if not self.tied:  # the head's rows are words: the same contiguous block as the embedding's
            self.head = ColumnParallelLinear.from_dense(dense.head, group)

    def forward(self, tokens: torch.Tensor, logit_scale: float = 1.0):
        x = self.embed(tokens).transpose(0, 1)  # [b, s, h] -> [s, b, h]
        logits = parallel_lm_logits(x, self.embed.weight, self.group) if self.tied else self.head(x)
        return x, logits * logit_scale  # [s, b, V/t]


def _record(value: torch.Tensor, dim: int = -1, index: torch.Tensor | None = None) -> dict:
    index = torch.empty(0, dtype=torch.long) if index is None else index
    return {"dim": dim, "index": index, "value": value.detach()}


def forward_backward(*, vocab: int, hidden: int, seq: int, batch: int, seed: int = 0, group=None, device="cpu",
                     dtype=torch.float64, tied: bool = False, logit_scale: float = 1.0, fault: str = "") -> dict:
    """One forward and backward of this rank's ends; everything needed to compare them with the dense ends."""
    tp, rank = group_size_rank(group)
    dense = build_dense(vocab, hidden, seed, tied)
    model = name_scopes(ParallelLMEnds(dense, group)).to(device=device, dtype=dtype)  # scopes "embed", "head"
    tokens, targets = (t.to(device) for t in make_tokens(vocab, batch, seq, seed))
    start, end = vocab_range(vocab, tp, rank)
    words = torch.arange(start, end)
    with inject(fault), CommLedger() as ledger:
        x, logits = model(tokens, logit_scale)
        x.retain_grad()
        logits.retain_grad()
        token_losses = region("loss", vocab_parallel_cross_entropy, logits, targets.t(), group=group)  # [s, b]
        loss = token_losses.mean()
        loss.backward()
    grads = {"embed.weight": _record(model.embed.weight.grad, 0, words), "input": _record(x.grad),
             "logits": _record(logits.grad, 2, words)}
    if not tied:
        grads["head.weight"] = _record(model.head.weight.grad, 0, words)
    loss_reduces = [r for r in ledger.records() if r["mapping"].startswith(CROSS_ENTROPY)]
    with torch.no_grad():
        dense_logits = dense.to(device)(tokens, logit_scale)[1].to(dtype)  # what one process would hold
    return {"loss": loss.item(), "token_losses": token_losses.detach(), "logits": _record(logits, 2, words),
            "grads": grads,
            "vocab_range": [start, end], "tokens": tokens.cpu(), "targets": targets.cpu(),
            "logits_shape": list(logits.shape),
            "logits_bytes": logits.numel() * logits.element_size(),
            "dense_logits_bytes": dense_logits.numel() * dense_logits.element_size(),
            "loss_all_reduces": [{"what": r["mapping"].split(".")[-1], "collective": r["collective"],
                                  "pass": r["pass"], "shape": r["shape"], "bytes": r["bytes"]} for r in loss_reduces],
            "comm_summary": ledger.summary()}


def dense_reference(vocab: int, hidden: int, seq: int, batch: int, seed: int = 0, tied: bool = False,
                    logit_scale: float = 1.0, device="cpu") -> dict:
    """The dense ends in float64 in one process: the loss per token ``[s, b]`` and every gradient, whole."""
    dense = build_dense(vocab, hidden, seed, tied).to(device)
    tokens, targets = (t.to(device) for t in make_tokens(vocab, batch, seq, seed))
    x, logits = dense(tokens, logit_scale)
    x.retain_grad()
    logits.retain_grad()
    token_losses = F.cross_entropy(logits.reshape(-1, vocab), targets.t().reshape(-1), reduction="none")
    token_losses.mean().backward()
    grads = {"embed.weight": dense.embed.weight.grad, "input": x.grad, "logits": logits.grad}
    if not tied:
        grads["head.weight"] = dense.head.weight.grad
    return {"token_losses": token_losses.detach().view(seq, batch), "logits": logits.detach(), "grads": grads}


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest |want|; NaN and infinity count as infinitely wrong."""
    diff = (got.to(torch.float64) - want).abs().nan_to_num(nan=float("inf"))
    return (diff.max() / want.abs().max().clamp_min(1e-300)).item()


def verdict(record: dict, *, vocab: int, hidden: int, seq: int, batch: int, seed: int = 0, tied: bool = False,
            logit_scale: float = 1.0, group=None, dtype=torch.float64) -> dict:
    """This rank's ``forward_backward`` against the dense ends, judged with the group: the same verdict everywhere.

    ``{"ok", "mistake" (one of MISTAKES, or "" when equal or not recognised), "why", "errors" (the group's largest
    relative error of the logits, the loss and each gradient, ``"grad <name>"``), "ranks_agree", "grad_row_sum"}``.
    Uses a few collectives of its own (not in the ledger): every rank of the group must call it.
    """
    tp, _ = group_size_rank(group)
    losses, grads = record["token_losses"], record["grads"]
    device = losses.device
    want = dense_reference(vocab, hidden, seq, batch, seed, tied, logit_scale, device)

    def mine(full, item):
        return full if item["dim"] < 0 else full.index_select(item["dim"], item["index"].to(device))
    errors = {"logits": _error(record["logits"]["value"], mine(want["logits"], record["logits"])),
              "loss": _error(losses, want["token_losses"])}
    errors.update({f"grad {name}": _error(item["value"], mine(want["grads"][name], item))
                   for name, item in grads.items()})
    finite = torch.isfinite(losses).all() and torch.isfinite(grads["logits"]["value"]).all()
    # group-wide: the worst error of each tensor, whether anything is not finite, whether the ranks' losses agree,
    # and each token's gradient summed over the whole vocabulary (times the b s tokens the mean divided by)
    worst = torch.tensor(list(errors.values()) + [0.0 if finite else 1.0], dtype=torch.float64, device=device)
    same = losses.to(torch.float64).nan_to_num(nan=0.0)  # infinities stay apart: +-1.8e308
    high, low = same.clone(), -same
    row_sum = grads["logits"]["value"].to(torch.float64).sum(dim=-1).nan_to_num(nan=0.0) * (seq * batch)  # [s, b]
    if dist.is_initialized() and tp > 1:
        for t, op in ((worst, dist.ReduceOp.MAX), (high, dist.ReduceOp.MAX), (low, dist.ReduceOp.MAX),
                      (row_sum, dist.ReduceOp.SUM)):
            dist.all_reduce(t, op=op, group=group)
    errors = dict(zip(errors, worst[:-1].tolist()))
    finite, agree = worst[-1].item() == 0.0, torch.equal(high, -low)

    def near(k: int) -> bool:  # the sums are whole numbers up to rounding: 0, 1 - t or t - 1
        return (row_sum - k).abs().max().item() < 0.5
    ok = finite and all(e <= RTOL[dtype] for e in errors.values())
    if ok:
        mistake, why = "", "equals the dense loss and every gradient"
    elif not agree:  # first: a rank whose own words all underflow next to the group's max takes log(0) = -inf
        mistake = "sum_exp_not_reduced"
    elif not errors["logits"] <= RTOL[dtype]:  # wrong before the loss starts: not the loss's mistake
        mistake = ""
        why = (f"the logits already differ from the dense ones (relative error {errors['logits']:.3g}) before the "
               "loss: look at the embedding's all-reduce (g, reduce_from_tensor_model_parallel_region) and the head")
    elif not finite:
        mistake = "max_not_subtracted"
    elif tp > 1 and near(1 - tp):
        mistake = "target_not_masked"
    elif near(0) and not errors["loss"] <= RTOL[dtype]:
        mistake = "max_not_reduced"
    else:
        mistake = ""
        wrong = ", ".join(f"{n} (relative error {e:.3g})" for n, e in errors.items() if not e <= RTOL[dtype])
        why = (f"{wrong} differ from the dense ends while the logits and the loss are right: look at the backward "
               "of the collectives before the loss (the head's f, copy_to_tensor_model_parallel_region)")
    if mistake:
        why = MISTAKES[mistake]
    return {"ok": ok, "mistake": mistake, "why": why, "errors": errors, "ranks_agree": agree,
            "grad_row_sum": row_sum.mean().item()}
