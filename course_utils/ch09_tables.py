"""Chapter 09's tables as data: the triage table (symptom -> first check -> tool -> mitigation) and the
Llama 3 interruption table, each with a plain-text renderer (deterministic, so nbval can compare it).

Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, section 3.3.4 ("Reliability and
operational challenges"), Table 5: root-cause categories of the 419 unexpected interruptions during a 54-day
snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs (466 interruptions in all, 47 of them planned).
Counts and percentages are copied as published; they were checked against two independent reproductions of
the table (glennklockwood.com/garden/component-reliability, and DatacenterDynamics' report of July 2024).

One thing the data shows when you add it up: the counts sum to 419, but the published percentages sum to
94.9%, because the first row prints 30.1% where 148/419 is 35.3%. Every other row is its count over 419,
rounded. (The paper's "GPU issues ... 58.7%" is the sum of the printed GPU percentages, 30.1 included.)
``percent_of_total`` recomputes them from the counts.
"""
from __future__ import annotations

LLAMA3_SOURCE = ('Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), sec. 3.3.4, Table 5: '
                 "unexpected interruptions in a 54-day snapshot of 405B pre-training on 16,384 H100 GPUs")
LLAMA3_TOTAL_UNEXPECTED = 419
LLAMA3_TOTAL_INTERRUPTIONS = 466  # 47 planned + 419 unexpected
LLAMA3_DAYS = 54

# (component, category, interruptions, percent as published)
LLAMA3_INTERRUPTIONS = [
    ("Faulty GPU", "GPU", 148, 30.1),
    ("GPU HBM3 Memory", "GPU", 72, 17.2),
    ("Software Bug", "Dependency", 54, 12.9),
    ("Network Switch/Cable", "Network", 35, 8.4),
    ("Host Maintenance", "Unplanned Maintenance", 32, 7.6),
    ("GPU SRAM Memory", "GPU", 19, 4.5),
    ("GPU System Processor", "GPU", 17, 4.1),
    ("NIC", "Host", 7, 1.7),
    ("NCCL Watchdog Timeouts", "Unknown", 7, 1.7),
    ("Silent Data Corruption", "GPU", 6, 1.4),
    ("GPU Thermal Interface + Sensor", "GPU", 6, 1.4),
    ("SSD", "Host", 3, 0.7),
    ("Power Supply", "Host", 3, 0.7),
    ("Server Chassis", "Host", 2, 0.5),
    ("IO Expansion Board", "Host", 2, 0.5),
    ("Dependency", "Dependency", 2, 0.5),
    ("CPU", "Host", 2, 0.5),
    ("System Memory", "Host", 2, 0.5),
]


def percent_of_total(count: int, total: int = LLAMA3_TOTAL_UNEXPECTED) -> float:
    return 100.0 * count / total


def by_category(rows=LLAMA3_INTERRUPTIONS) -> dict[str, int]:
    """Interruptions per category, largest first."""
    totals: dict[str, int] = {}
    for _, category, count, _ in rows:
        totals[category] = totals.get(category, 0) + count
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def interruption_table(rows=LLAMA3_INTERRUPTIONS) -> str:
    lines = [f"{'component':<31} {'category':<22} {'count':>5} {'published %':>11} {'count/419 %':>11}"]
    for component, category, count, published in rows:
        lines.append(f"{component:<31} {category:<22} {count:>5} {published:>11.1f} {percent_of_total(count):>11.1f}")
    lines.append(f"{'total':<31} {'':<22} {sum(r[2] for r in rows):>5} {sum(r[3] for r in rows):>11.1f} "
                 f"{sum(percent_of_total(r[2]) for r in rows):>11.1f}")
    return "\n".join(lines)


# The chapter's four layers, each fault the notebook injects, and what to do about it.
TRIAGE = [
    {"layer": "data", "symptom": "one-step loss spike, grad norm jumps, then recovers (or not)",
     "first_check": "sample ids of the spiking batch: is the same batch bad on replay?",
     "tool": "per-batch sample-id log; loss-spike detector", "mitigation": "rewind to the last snapshot, skip those ids",
     "fault": "garbage_batch"},
    {"layer": "numeric", "symptom": "max attention logit grows without bound; loss plateaus or diverges at high LR",
     "first_check": "max attention logit and output log Z per step",
     "tool": "attention-logit / log Z telemetry", "mitigation": "qk-layernorm; z-loss; lower LR or longer warm-up",
     "fault": "high_lr"},
    {"layer": "numeric", "symptom": "fp16 loss falls too slowly, then turns up with no spike; most gradients 0",
     "first_check": "fraction of zero gradient elements; per-layer grad norms; the loss scale",
     "tool": "zero-gradient and first-nonzero counters; loss-scale log",
     "mitigation": "dynamic loss scaling (or bf16)",
     "fault": "fp16_underflow"},
    {"layer": "communication", "symptom": "ranks' weights drift apart; one rank's loss differs; no error",
     "first_check": "cross-rank parameter checksum every step",
     "tool": "all-gathered bitwise checksum; reduced-gradient projection check",
     "mitigation": "fix the reduction (average, not sum); restart from the last agreeing checkpoint",
     "fault": "sum_not_average"},
    {"layer": "hardware", "symptom": "nothing visible, or a sudden NaN/spike not tied to data; not reproducible",
     "first_check": "deterministic replay from a snapshot: which step, which rank differs?",
     "tool": "per-step fingerprints (bitwise checksums) and replay: a software fault reproduces, this does not",
     "mitigation": "drain the node, rewind to the last good snapshot", "fault": "bit_flip"},
]


def triage_table(rows=TRIAGE) -> str:
    keys = ("layer", "symptom", "first_check", "tool", "mitigation")
    out = []
    for row in rows:
        out.append(f"[{row['layer']}] fault={row['fault']}")
        out.extend(f"    {k.replace('_', ' '):<12} {row[k]}" for k in keys[1:])
    return "\n".join(out)
