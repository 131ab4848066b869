"""Reference answers for chapter 10's exercises (self-contained functions with the notebook's names)."""


def ring_allreduce_time(n, size_bytes, alpha, bandwidth):
    """2(n-1) steps of latency alpha, and each rank sends 2(n-1) chunks of S/n at bandwidth B."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size_bytes / bandwidth


def fix_nccl_env(env):
    """Drop the debug-only settings, rename the deprecated and misspelt names, turn the flight recorder back on."""
    fixed = dict(env)
    for name in ("NCCL_DEBUG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG_SUBSYS"):
        fixed.pop(name, None)
    if "NCCL_IB_QPS_PER_CONECTION" in fixed:
        fixed["NCCL_IB_QPS_PER_CONNECTION"] = fixed.pop("NCCL_IB_QPS_PER_CONECTION")
    if "NCCL_ASYNC_ERROR_HANDLING" in fixed:
        fixed["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = fixed.pop("NCCL_ASYNC_ERROR_HANDLING")
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" in fixed:  # torch 2.13 calls it TORCH_FR_BUFFER_SIZE
        fixed.setdefault("TORCH_FR_BUFFER_SIZE", fixed.pop("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if fixed.get("TORCH_FR_BUFFER_SIZE", "").strip() == "0":
        del fixed["TORCH_FR_BUFFER_SIZE"]  # unset: torch 2.13's flight recorder keeps 2000 entries, so the dump works
    return fixed
