"""Chapter 03, notebook side: compare what the ranks computed with the single-process reference, and draw it.

The ground truth is ``workers/parallel/reference.py`` (plain autograd through explicit concatenation and
sums, all ranks simulated in one process); this module only lines the ranks' results up against it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils.plots import log2_axis
from course_utils.tables import Table
from workers.parallel.reference import (compare, layouts, linear_reference, mlp_reference,
                                        replicated_loss_reference)

FP64_TOL = {"atol": 1e-12, "rtol": 1e-12}  # float64 through a sum of a few terms in another order

SHORT = {  # the names a table has room for
    "copy_to_tensor_model_parallel_region": "copy_to (f)",
    "reduce_from_tensor_model_parallel_region": "reduce_from (g)",
    "scatter_to_tensor_model_parallel_region": "scatter_to (last dim)",
    "gather_from_tensor_model_parallel_region": "gather_from (last dim)",
    "scatter_to_sequence_parallel_region": "scatter_to_sequence",
    "gather_from_sequence_parallel_region": "gather_from_sequence",
    "reduce_scatter_to_sequence_parallel_region": "reduce_scatter_to_sequence",
    "all_to_all": "all_to_all",
}


# -- every mapping vs the reference -----------------------------------------------------------------------

def groups_of(res) -> list[list[int]]:
    """The tensor-parallel groups of a run, as lists of global ranks."""
    seen = []
    for d in res.ranks:
        if d["group_ranks"] not in seen:
            seen.append(d["group_ranks"])
    return seen


def mapping_rows(res) -> list[dict]:
    """One row per (group, mapping): errors of outputs and input gradients against the reference."""
    rows = []
    for ranks in groups_of(res):
        for name in res[ranks[0]]["records"]:
            records = [res[r]["records"][name] for r in ranks]
            c = compare(name, records, **records[0]["options"])
            in_layout, out_layout = layouts(name, records[0]["options"].get("tensor_parallel_output_grad", True))
            rows.append({"group": "[" + ",".join(map(str, ranks)) + "]", "mapping": SHORT.get(name, name),
                         "layouts": f"{in_layout} -> {out_layout}", "output_error": c["output_error"],
                         "grad_error": c["grad_error"], "exact": c["exact"], "grad_ratio": c["grad_ratio"],
                         "why": c["why"]})
    return rows


def mapping_table(res) -> str:
    return str(Table.of(mapping_rows(res), ["group", "mapping", "layouts", "output_error", "grad_error", "exact"],
                        formats={"output_error": "{:.1e}", "grad_error": "{:.1e}"}))


def communication_table(log: list[dict]) -> str:
    rows = [{"mapping": SHORT.get(e["mapping"], e["mapping"]), "pass": e["pass"], "collective": e["collective"],
             "shape": "x".join(map(str, e["shape"])), "bytes": e["bytes"]} for e in log]
    return str(Table.of(rows, ["mapping", "pass", "collective", "shape", "bytes"]))


def draw_mapping(res, name: str, group: int = 0):
    """Rank by rank: input, output, the gradient arriving at the output, the gradient of the input."""
    ranks = groups_of(res)[group]
    records = [res[r]["records"][name] for r in ranks]
    panels = ("input", "output", "grad_output", "grad_input")
    titles = ("x (input)", "y = forward(x)", "dL/dy (arrives)", "dL/dx (backward)")
    lim = max(float(rec[p].abs().max()) for rec in records for p in panels) or 1.0
    fig, axes = plt.subplots(len(ranks), 4, figsize=(8.5, 0.4 + 1.55 * len(ranks)), squeeze=False)
    for i, rec in enumerate(records):
        for j, p in enumerate(panels):
            ax = axes[i][j]
            data = rec[p].detach().double().numpy()
            ax.imshow(data, cmap="coolwarm", vmin=-lim, vmax=lim, aspect="auto")
            if data.size <= 72:
                for (a, b), v in np.ndenumerate(data):
                    ax.text(b, a, f"{v:g}", ha="center", va="center", fontsize=6)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            ax.set_xlabel(f"{data.shape[0]}x{data.shape[1]}", fontsize=7, labelpad=1)
            if i == 0:
                ax.set_title(titles[j], fontsize=9)
            if j == 0:
                ax.set_ylabel(f"rank {ranks[i]}", fontsize=9)
    in_layout, out_layout = layouts(name, records[0]["options"].get("tensor_parallel_output_grad", True))
    fig.suptitle(f"{name}: {in_layout} -> {out_layout}, {len(ranks)} ranks (measured)", fontsize=10)
    fig.tight_layout()
    return fig


# -- gradcheck ------------------------------------------------------------------------------------------

def gradcheck_rows(results: dict) -> list[dict]:
    """``results``: variant -> RunResult of workers.ch03_gradcheck. One row per circuit and variant (all ranks)."""
    rows = []
    for variant, res in results.items():
        per_rank = res.gather("gradcheck")
        for circuit in per_rank[0]:
            passed = [v[circuit]["passed"] for v in per_rank]
            ratios = [v[circuit]["grad_ratio"] for v in per_rank]
            rows.append({"variant": variant, "circuit": circuit, "ranks": res[0].get("tp", res.world_size),
                         "gradcheck": "pass" if all(passed) else ("FAIL" if not any(passed) else "mixed"),
                         "ratio": ", ".join(f"{r:.3g}" for r in ratios)})
    return rows


def draw_gradcheck(rows: list[dict]):
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    circuits = list(dict.fromkeys(r["circuit"] for r in rows))
    grid = np.zeros((len(circuits), len(variants)))
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.75 * len(circuits)))
    for r in rows:
        i, j = circuits.index(r["circuit"]), variants.index(r["variant"])
        passed = r["gradcheck"] == "pass"
        grid[i, j] = 1.0 if passed else 0.0
        ratios = r["ratio"].split(", ")
        if len(set(ratios)) == 1:
            shown = f"ratio {ratios[0]}"
        else:  # one value per rank, two to a line: a single line would run into the next cell
            shown = "ratios\n" + "\n".join(" / ".join(ratios[k:k + 2]) for k in range(0, len(ratios), 2))
        ax.text(j, i, f"{'pass' if passed else 'FAIL'}\n{shown}", ha="center", va="center", fontsize=8.5,
                linespacing=1.1)
    ax.imshow(grid, cmap="RdYlGn", vmin=-0.3, vmax=1.3, aspect="auto")
    ax.set_xticks(range(len(variants)), variants, fontsize=9, rotation=12, ha="right")
    ax.set_yticks(range(len(circuits)), circuits, fontsize=8.5)
    ax.grid(False)
    ax.set_title(f"torch.autograd.gradcheck in groups of {rows[0]['ranks']} real ranks (float64); each column swaps in one "
                 "wrong mapping\n(ratio: <v, J u> from backward / from finite differences, per rank)", fontsize=10)
    fig.tight_layout()
    return fig


# -- the scaling trap -----------------------------------------------------------------------------------

def scaling_rows(results: dict, x: torch.Tensor, w: torch.Tensor) -> list[dict]:
    """``results``: n -> RunResult of workers.ch03_scaling_trap; ``x``, ``w``: its unsharded problem.

    For each group size n and each backward of the all-reduce: the ratio of the gradient norms to the
    single-process reference, for the weight (all shards of group 0) and for the input (rank 0).
    """
    rows = []
    for n, res in sorted(results.items()):
        params = res.ranks[0]
        want = replicated_loss_reference(x, w)
        group0 = [r for r, d in enumerate(res.ranks) if r < params["tp"]]
        for name in params["results"]:
            grad_w = torch.cat([res[r]["results"][name]["grad_weight"] for r in group0])  # shards, in row order
            grad_x = res[0]["results"][name]["grad_input"]
            rows.append({
                "n": n, "backward": name,
                "loss_equal": abs(res[0]["results"][name]["loss"] - want["loss"]) < 1e-9,
                "grad_weight_ratio": grad_w.norm().item() / want["grad_weight"].norm().item(),
                "grad_input_ratio": grad_x.norm().item() / want["grad_input"].norm().item(),
                "weight_matches": torch.allclose(grad_w, want["grad_weight"], **FP64_TOL),
                "weight_matches_n_times": torch.allclose(grad_w, n * want["grad_weight"], **FP64_TOL),
            })
    return rows


def scaling_table(rows: list[dict]) -> str:
    return str(Table.of(rows, ["n", "backward", "loss_equal", "grad_weight_ratio", "grad_input_ratio", "weight_matches"],
                        formats={"grad_weight_ratio": "{:.6f}", "grad_input_ratio": "{:.6f}"}))


def draw_scaling(rows: list[dict]):
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ns = sorted({r["n"] for r in rows})
    for name, marker, size in zip(dict.fromkeys(r["backward"] for r in rows), ("o", "s", "^"), (7, 10, 5)):
        mine = [r for r in rows if r["backward"] == name]
        ax.plot([r["n"] for r in mine], [r["grad_weight_ratio"] for r in mine], marker=marker, ms=size,
                label=name, alpha=0.85)
    ax.plot(ns, ns, "k:", lw=1, label="ratio = n")
    log2_axis(ax, ns, "tensor-parallel ranks n (real gloo ranks)")
    log2_axis(ax, ns, axis="y")
    ax.set_ylabel("|dL/dW| / |dL/dW| single process")
    ax.set_title("Replicated loss behind an all-reduce: gradient scale vs n")
    ax.legend(fontsize=8)
    return fig


# -- row parallel ---------------------------------------------------------------------------------------

def row_parallel_rows(res, problem: dict, mode: str, input_is_parallel: bool = False) -> list[dict]:
    """Max |distributed - single process| for the output and every gradient, over the ranks of group 0."""
    tp = res[0]["tp"]
    ranks = range(tp)
    if mode == "row":
        want = linear_reference(problem["x"], problem["weight"], problem["bias"], problem["grad_output"])
    else:
        want = mlp_reference(problem["x"], problem["w_in"], problem["w_out"], problem["bias"], problem["grad_output"])

    def blocks(key, dim):
        return torch.cat([res[r][key] for r in ranks], dim=dim)

    got = {"output": res[0]["output"], "grad_bias": res[0]["grad_bias"]}
    if mode == "row":
        got["grad_weight"] = blocks("grad_weight", 0)  # row shards stacked back in order
        got["grad_input"] = blocks("grad_input", 1) if input_is_parallel else res[0]["grad_input"]
    else:
        got["grad_w_in"] = blocks("grad_w_in", 1)  # column shards
        got["grad_w_out"] = blocks("grad_w_out", 0)  # row shards
        got["grad_input"] = res[0]["grad_input"]
    replicated_ok = all(torch.equal(res[r]["output"], res[0]["output"]) for r in ranks)
    rows = []
    for key, value in got.items():
        err = (value.double() - want[key]).abs().max().item()
        rows.append({"tensor": key, "shape": "x".join(map(str, value.shape)), "max_abs_error": err,
                     "within_1e-12": err <= 1e-12 * max(1.0, want[key].abs().max().item())})
    rows.append({"tensor": "output identical on all ranks", "shape": "", "max_abs_error": 0.0 if replicated_ok
                 else float("nan"), "within_1e-12": replicated_ok})
    return rows


def count_collectives(log: list[dict]) -> dict:
    out = {"forward": [], "backward": []}
    for e in log:
        out[e["pass"]].append(f"{e['collective']} ({SHORT.get(e['mapping'], e['mapping'])})")
    return out
