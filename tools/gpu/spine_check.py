"""Issue 2's GPU check, for a session that has the H200 (run through the device tool; never in CI).

    python tools/gpu/spine_check.py --out "$OUT/spine_h200.json"

Runs every chapter 01-03 worker with its defaults at world 1 (the runtime must pick NCCL on cuda:0) and at
world 2 (one GPU, two ranks: the runtime must pick gloo on CUDA tensors), then forces NCCL at world 2 to
record the error NCCL gives for two ranks on one GPU. Writes device, versions, date, command and every
outcome as JSON; exits non-zero if a worker failed or a backend choice was not the expected one.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    import course_utils as cu
    from course_utils.doctor import report
    from workers.provenance import record

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "data" / "gpu" / "spine_h200.json")
    p.add_argument("--chapters", default="01,02,03")
    p.add_argument("--expect", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: a rehearsal on a machine with no GPU (tools/gpu/compat_check.sh), every rank on gloo/cpu")
    a = p.parse_args()
    workers = sorted(f"workers.{q.stem}" for ch in a.chapters.split(",") for q in (ROOT / "workers").glob(f"ch{ch}_*.py")
                     if "entrypoint(main)" in q.read_text())
    expected = {1: ("nccl", ["cuda:0"]), 2: ("gloo", ["cuda:0", "cuda:0"])}
    if a.expect == "cpu":
        expected = {1: ("gloo", ["cpu"]), 2: ("gloo", ["cpu", "cpu"])}
    runs, ok = [], True
    for world, (backend, devices) in expected.items():
        for worker in workers:
            t0 = time.perf_counter()
            try:
                # Warm ranks: the placement is chosen once per world size, when its ranks start, and reported
                # with every run; one cold start per world size keeps the whole check to a couple of minutes.
                res = cu.run(worker, world_size=world, timeout=300)
                row = {"worker": worker, "world_size": world, "backend": res.backend, "devices": res.devices,
                       "placement": res.placement, "seconds": time.perf_counter() - t0, "ok": True}
                row["ok"] = res.backend == backend and res.devices == devices
            except Exception as exc:  # noqa: BLE001 - record and go on
                row = {"worker": worker, "world_size": world, "ok": False, "error": str(exc)[:2000]}
            ok &= row["ok"]
            runs.append(row)
            print(json.dumps(row)[:400], flush=True)
    cu.shutdown_pools()
    try:
        cu.run("workers.hello", world_size=2, env={"COURSE_BACKEND": "nccl"}, timeout=120, warm=False)
        forced = {"error": None, "note": "NCCL accepted two ranks on one GPU (unexpected)"}
    except Exception as exc:  # noqa: BLE001
        forced = {"error": str(exc)[:3000]}
    print("forced NCCL at world 2:", (forced["error"] or "")[:300], flush=True)
    out = {"provenance": record(" ".join(["python tools/gpu/spine_check.py"] + sys.argv[1:])),
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
           "doctor": report(), "runs": runs,
           "forced_nccl_world2": forced, "all_ok": ok}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}; all_ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
