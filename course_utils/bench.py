"""``make bench``: how fast the course answers on this machine.

- cold launch: torchrun start + imports + rendezvous + one tiny all_reduce, at world 1, 2, 4, 8;
- warm rerun: the same run again on warm ranks (what a slider change costs), median and p90 of 20;
- a LiveRun widget: from a slider change to the new figure drawn, median of 10;
- chapter 15: a composed 2x2x2x1 step against the one-process step, with the share spent communicating;
- every notebook executed headless (papermill, fresh kernel), wall time each, and every chapter's widget as the
  chapter builds it: a control moved on warm ranks (median of 3) and the same view after a cold start
  (``LiveRun.measure``; the notebook's time excludes these measurements);
- every exercise's check on warm ranks: the reference solution checked once to warm, then timed (median of 3),
  the time a learner waits for a verdict after the first (``--checks-only`` runs just this);
- with a GPU: the chapters' GPU benchmarks (attention backends and kernels), written under data/;
- this machine calibrated as a planner device, the chapters' runs measured in several launches on fresh ranks, and per
  run the planner's predicted step against the median of the launches' medians, each launch's shown beside it, and
  chapter 15's runs part by part (schedule, gradient sync, the rest; the ring's and the pipeline's waits), measured
  against predicted (``course_utils/machine_device.py``; ``--planner`` runs just this).
All numbers are CPU wall times of this machine; results also go to build/bench/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from course_utils.paths import DATA, ROOT

PLANNER_LAUNCHES = 5  # launches of the planner's runs on fresh ranks (bench_planner)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bench_launch(worlds=(1, 2, 4, 8), reruns: int = 20) -> dict:
    import course_utils as cu

    out = {}
    for w in worlds:
        t0 = time.perf_counter()
        cold = cu.run("workers.hello", world_size=w, warm=False)
        cold_total = time.perf_counter() - t0
        cu.run("workers.hello", world_size=w)  # start the warm ranks for this world size
        warm = []
        for i in range(reruns):
            t0 = time.perf_counter()
            res = cu.run("workers.hello", world_size=w, value=float(i))
            warm.append(time.perf_counter() - t0)
            assert res.launch == "warm" and res.gather("sum")[0] == i * w + w * (w - 1) / 2
        out[w] = {"cold_s": cold_total, "cold_startup_s": cold.startup_seconds,
                  "warm_median_s": statistics.median(warm), "warm_p90_s": _pct(warm, 0.9)}
        print(f"world {w}: cold launch {cold_total:5.2f} s (start {cold.startup_seconds:.2f} s) | "
              f"warm rerun median {out[w]['warm_median_s'] * 1e3:6.1f} ms, p90 {out[w]['warm_p90_s'] * 1e3:6.1f} ms",
              flush=True)
    cu.shutdown_pools()
    return out


def bench_widget(changes: int = 10) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_utils.widgets import LiveRun, slider

    def draw(res, params):
        fig, ax = plt.subplots(figsize=(4, 2))
        ax.bar(range(res.world_size), res.gather("sum"))
        return fig

    control = slider("value", 0, 0, 100)
    live = LiveRun("workers.hello", {"value": control}, draw, params={"world_size": 4}, auto_start=True)

    def settled(what: str):
        if not live.wait(600):
            raise RuntimeError(f"LiveRun {what} did not finish within 600 s: {live.status.value}")
        outcome = live.history[-1][1]
        if isinstance(outcome, BaseException):
            raise RuntimeError(f"LiveRun {what} failed: {outcome}")
        return outcome

    settled("start")
    times = []
    for i in range(1, changes + 1):
        t0 = time.perf_counter()
        control.value = i
        result = settled(f"rerun {i}")
        times.append(time.perf_counter() - t0)
        assert result.gather("sum")[0] == i * 4 + 6
    print(f"LiveRun, world 4: slider change -> figure drawn, median {statistics.median(times) * 1e3:.0f} ms, "
          f"max {max(times) * 1e3:.0f} ms", flush=True)
    import course_utils as cu

    cu.shutdown_pools()
    return {"median_s": statistics.median(times), "max_s": max(times)}


def bench_composed(steps: int = 6) -> dict:
    """Chapter 15: one optimizer step of the composed GPT at dp x tp x pp x cp = 2x2x2x1 on 8 ranks (4 micro-batches,
    float64), against the same step in this process, with the share of the composed step spent communicating:
    TP collectives (timed), waiting in pipeline receives (messages and bubble), the gradient synchronisation."""
    import torch

    import course_utils as cu
    from workers.composed.model import MODEL
    from workers.composed.train import reference_run

    params = dict(dp=2, tp=2, pp=2, cp=1, micro_batches=4, steps=steps, report=False, timed=True)
    cu.run("workers.ch15_composed", world_size=8, timeout=600, **{**params, "steps": 1})  # warm the ranks
    res = cu.run("workers.ch15_composed", world_size=8, timeout=600, **params)
    per_step = [max(r["schedule_s"][i] + r["sync_s"][i] for r in res.ranks) for i in range(1, steps)]  # step 0: warm-up
    shares = {dim: statistics.median(
        (r["comm_s"][i][dim] or 0.0) / (r["schedule_s"][i] + r["sync_s"][i]) for r in res.ranks for i in range(1, steps))
        for dim in ("tp", "pp", "dp")}
    torch.set_num_threads(1)  # each rank runs one thread (the Makefile's OMP_NUM_THREADS=1)
    reference_run(MODEL, steps=1, global_batch=8, lr=0.01)  # first-call costs (kernels, allocator)
    timed = []
    for n in (1, steps + 1):  # the difference leaves out building the model
        t0 = time.perf_counter()
        reference_run(MODEL, steps=n, global_batch=8, lr=0.01)
        timed.append(time.perf_counter() - t0)
    one = (timed[1] - timed[0]) / steps
    composed = statistics.median(per_step)
    print(f"chapter 15, 2x2x2x1 on 8 CPU ranks (gloo, float64, 4 micro-batches): step {composed * 1e3:.0f} ms "
          f"against {one * 1e3:.0f} ms in one process; of the composed step, TP collectives "
          f"{100 * shares['tp']:.0f}%, pipeline receives (latency and bubble) {100 * shares['pp']:.0f}%, "
          f"gradient sync {100 * shares['dp']:.0f}% (medians over ranks and steps)", flush=True)
    cu.shutdown_pools()
    return {"composed_step_s": composed, "one_process_step_s": one, "comm_share": shares, "layout": "2x2x2x1"}


def bench_notebooks(names: list[str] | None = None) -> dict:
    from course_utils import notebooks

    out = {}
    dest = ROOT / "build" / "bench" / "notebooks"
    dest.mkdir(parents=True, exist_ok=True)
    notebooks.sync()
    widgets_file = ROOT / "build" / "bench" / "widgets.jsonl"
    widgets_file.unlink(missing_ok=True)
    os.environ["COURSE_WIDGET_BENCH"] = str(widgets_file)  # papermill's kernels inherit it: LiveRun.wait measures
    try:
        for src in notebooks.sources():
            if names and src.stem not in names:
                continue
            nb = notebooks.notebook_for(src)
            os.environ["COURSE_BENCH_CHAPTER"] = nb.stem
            seconds = notebooks.execute(nb, dest / nb.name)
            measuring = sum(w.get("measure_s", 0.0) for w in _widget_records(widgets_file) if w["chapter"] == nb.stem)
            out[nb.stem] = seconds - measuring
            print(f"{nb.name}: headless in {out[nb.stem]:.1f} s", flush=True)
    finally:
        os.environ.pop("COURSE_WIDGET_BENCH", None)
        os.environ.pop("COURSE_BENCH_CHAPTER", None)
    print(f"all notebooks: {sum(out.values()):.0f} s", flush=True)
    widgets = _widget_records(widgets_file)
    print(widget_table(widgets), flush=True)
    return {"notebooks_s": out, "widgets": widgets}


def bench_checks(repeats: int = 3) -> dict:
    """Each exercise's check of the reference solution on warm ranks: median seconds of ``repeats`` after one warm-up."""
    import importlib

    import course_utils as cu
    from course_utils.exercises import PASS, check, exercises, warm_up

    out = {}
    for chapter in sorted({e.chapter for e in exercises()}):
        warm_up(chapter)
        solutions = importlib.import_module(f"solutions.ch{chapter}")
        for ex in exercises(chapter):
            answer = getattr(solutions, ex.function)
            first = check(ex.name, answer)
            assert first.status == PASS, first
            times = [check(ex.name, answer).seconds for _ in range(repeats)]
            out[ex.name] = {"chapter": chapter, "where": "ranks" if ex.worker else "notebook",
                            "first_s": first.seconds, "warm_median_s": statistics.median(times)}
            print(f"{chapter} {ex.name:<28} {out[ex.name]['where']:<9} first {first.seconds:5.2f} s | warm median "
                  f"{out[ex.name]['warm_median_s']:5.2f} s", flush=True)
    cu.shutdown_pools()
    return out


def bench_planner() -> dict:
    """This machine as a device of the planner: calibrate (or reuse the stored calibration), measure the chapters'
    default runs (chapter 15's layouts, chapter 13's schedules) in ``PLANNER_LAUNCHES`` launches on fresh ranks, and
    print per run the planner's predicted step against the median of the launches' medians, with the count within
    the acceptance band."""
    import course_utils as cu
    from course_utils import calibration, machine_device

    t0 = time.perf_counter()
    cal = calibration.calibrate()
    t1 = time.perf_counter()
    print(f"calibration: {cal.cpu}, {cal.cores} cores, measured {cal.measured_at} ({t1 - t0:.1f} s here; the host "
          f"{cal.host_slowdown:.2f}x slower around it than at its quickest then)", flush=True)
    # Each launch on fresh ranks: a run's median moves between launches by more than the band on a shared CPU (up to
    # 1.77 times for chapter 13's unpadded pipelines on 2 cores, 6 launches, 2026-12-07), so the prediction is held to
    # the median of PLANNER_LAUNCHES launches' medians and each launch's is shown beside it.
    launches = []
    for _ in range(PLANNER_LAUNCHES):
        cu.shutdown_pools()
        launches.append(calibration.measure_runs())
    rows = machine_device.median_of_launches(launches)
    t2 = time.perf_counter()
    print(f"measured {len(rows)} runs in {t2 - t1:.1f} s ({PLANNER_LAUNCHES} launches)", flush=True)
    compared = machine_device.with_repeats(machine_device.compare_runs(cal, rows), launches)
    t3 = time.perf_counter()
    print(machine_device.comparison_table(compared), flush=True)
    print(machine_device.parts_table(compared), flush=True)
    within = sum(r["within"] for r in compared)
    moved = [r for r in compared if not r["repeat_spread"] <= machine_device.TOLERANCE]  # NaN counts as moved
    print(f"planner: {within} of {len(compared)} runs within {machine_device.TOLERANCE:.0%} of the median of "
          f"{PLANNER_LAUNCHES} launches' medians (predictions in {t3 - t2:.1f} s); within {machine_device.TOLERANCE:.0%} "
          f"of at least one launch: "
          f"{sum(r['within_repeats'] for r in compared)}; medians that moved by more than "
          f"{machine_device.TOLERANCE:.0%} between launches: {len(moved)} "
          f"({sum(not r['within'] for r in moved)} of them outside the band)", flush=True)
    cu.shutdown_pools()
    return {"calibration_s": t1 - t0, "measure_s": t2 - t1, "predict_s": t3 - t2, "within": within,
            "runs": [{k: r[k] for k in ("chapter", "name", "world", "predicted_s", "measured_s", "ratio", "within",
                                        "dominant", "terms", "medians_s", "repeat_spread", "within_repeats",
                                        "host_slowdown")}
                     | {k: r[k] for k in ("measured_parts_s", "predicted_parts_s") if k in r}
                     for r in compared]}


def _widget_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def widget_table(records: list[dict]) -> str:
    """Per chapter widget: the control moved, warm and cold seconds from a move to the new figure."""
    from course_utils.tables import Table

    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["chapter"], r["worker"], "-", "-", r["error"], "-"])
            continue
        announced, cold = r.get("cold_announced_s"), r["cold_s"]
        ratio = f"{cold / announced:.2f}" if announced and cold else "-"
        rows.append([r["chapter"], r["worker"], r["control"], r["world_size"], _seconds(r["warm_median_s"]),
                     _seconds(cold), _seconds(announced), ratio])
    return str(Table(["chapter", "worker", "control moved", "ranks", "warm (s, median of 3)", "cold (s)",
                      "cold announced (s)", "cold / announced"], rows,
                     caption="widget: a control moved -> the new figure drawn (CPU wall time, this machine)"))


def gpu_slug(name: str) -> str:
    """File-name tag of a GPU: "h200" for an H200 (what the chapters look for first), else its name in lower case."""
    import re

    return "h200" if "H200" in name else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def gpu_commands(slug: str, day: str) -> dict[str, list[str]]:
    """The GPU measurements and where each writes: the files chapters 06, 07 and 11 read."""
    import sys

    return {"attention": [sys.executable, "-m", "workers.attention.bench", "--quick",
                          "--out", str(DATA / "attention" / f"{slug}_{day}.json")],
            "tp_block": [sys.executable, str(ROOT / "tools" / "gpu" / "tp_block_bench.py"), "--profile",
                         "--out", str(DATA / "gpu" / f"tp_block_{slug}_{day}.json")],
            "ch11_memory": ["bash", str(ROOT / "tools" / "gpu" / "ch11_memory.sh")]}


def bench_gpu() -> dict:
    """On a machine with a GPU: the GPU measurements of chapters 06, 07 and 11, each writing its JSON where the
    chapter reads it (data/attention/<gpu>_<date>.json, data/gpu/tp_block_<gpu>_<date>.json,
    data/gpu/ch11_*_<gpu>.json). About 10 minutes on an H200 (tools/gpu/run_all.sh is the same, in stages)."""
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        print("no GPU here: the GPU benchmarks (attention, TP block, memory) are skipped; "
              "the notebooks plot their committed results", flush=True)
        return {}
    out = {}
    for name, cmd in gpu_commands(gpu_slug(torch.cuda.get_device_name(0)), time.strftime("%Y-%m-%d")).items():
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, PY=sys.executable))
        out[name] = {"returncode": rc, "seconds": time.perf_counter() - t0, "command": " ".join(cmd[1:])}
        print(f"GPU bench {name}: exit {rc} in {out[name]['seconds']:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-notebooks", action="store_true")
    p.add_argument("--notebooks", nargs="*", help="only these notebooks")
    p.add_argument("--checks-only", action="store_true", help="only the exercises' checks on warm ranks")
    p.add_argument("--planner", action="store_true",
                   help="only the planner against this machine: calibrate, measure the chapters' runs, compare")
    a = p.parse_args(argv)
    from workers.provenance import record

    prov = record("python -m course_utils.bench " + " ".join(argv if argv is not None else sys.argv[1:]), device="cpu")
    print(f"CPU wall times on {prov['device']} ({os.cpu_count()} cores); gloo on CPU", flush=True)
    if a.planner:
        results = {"provenance": prov, "planner": bench_planner()}
        out = ROOT / "build" / "bench" / "planner.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"wrote {out.relative_to(ROOT)}")
        return 0
    if a.checks_only:
        results = {"provenance": prov, "checks": bench_checks()}
        out = ROOT / "build" / "bench" / "checks.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"wrote {out.relative_to(ROOT)}")
        return 0
    results = {"provenance": prov, "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
               "launch": bench_launch(), "widget": bench_widget(), "composed": bench_composed(),
               "checks": bench_checks(), "planner": bench_planner()}
    results["gpu"] = bench_gpu()
    if not a.skip_notebooks:
        results.update(bench_notebooks(a.notebooks))
    out = ROOT / "build" / "bench" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _seconds(v) -> str:
    return "-" if v is None else f"{v:.1f}"
