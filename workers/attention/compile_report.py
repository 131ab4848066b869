"""What ptxas made of each GPU launch config, on a machine without a GPU (for docs/attention_kernel_notes.md).

    python -m workers.attention.compile_report --head-dims 64,128 --out build/compile_report.json

Compiles every config of ``triton_kernels.GPU_CONFIGS`` for sm_90 (bf16, N = 4096 specialisation), causal and
not, and prints registers per thread, register spills (the stack frame ptxas reserved for them), shared memory,
and how many matmuls became Hopper wgmma. Compile facts, not timings: they say which configs can run well, not which is fastest.
Each compile takes 5-40 s on one CPU core.
"""
from __future__ import annotations

import argparse
import json
import platform
import time


def report(head_dims=(64, 128), causal_flags=(False, True), kernels=("fwd", "dkdv", "dq"), configs=None) -> dict:
    import triton

    from workers.attention import triton_kernels as tk

    rows = []
    for name in kernels:
        for cfg in (configs or tk.GPU_CONFIGS)[name]:
            for head_dim in head_dims:
                for causal in causal_flags:
                    t0 = time.perf_counter()
                    ck = tk.compile_for_gpu(name, cfg, head_dim=head_dim, causal=causal, arch=90)
                    rows.append({"kernel": name, **cfg, "head_dim": head_dim, "causal": causal,
                                 **tk.resource_usage(ck), "wgmma": ck.asm["ttgir"].count("warp_group_dot "),
                                 "compile_s": round(time.perf_counter() - t0, 1)})
                    print(json.dumps(rows[-1]), flush=True)
    return {"triton": triton.__version__, "python": platform.python_version(), "arch": "sm_90", "dtype": "bf16",
            "date": time.strftime("%Y-%m-%d"), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.attention.compile_report", description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--causal", default="both", choices=("both", "true", "false"))
    p.add_argument("--kernels", default="fwd,dkdv,dq")
    p.add_argument("--default-only", action="store_true", help="only the first config of each kernel (no autotune)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from workers.attention import triton_kernels as tk

    configs = {k: v[:1] for k, v in tk.GPU_CONFIGS.items()} if a.default_only else None
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[a.causal]
    out = report(tuple(int(d) for d in a.head_dims.split(",")), causal, tuple(a.kernels.split(",")), configs)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    spilled = [r for r in out["rows"] if r["spill_stack_bytes"]]
    print(f"{len(out['rows'])} kernels compiled with Triton {out['triton']}; "
          f"{len(spilled)} spill registers to local memory")
    for r in spilled:
        print(f"  spills: {r['kernel']} {r['BLOCK_M']}x{r['BLOCK_N']} {r['num_warps']} warps {r['num_stages']} stages, "
              f"d={r['head_dim']} causal={r['causal']}: {r['spill_stack_bytes']} bytes of spill stack")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
