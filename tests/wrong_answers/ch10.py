"""Plausible wrong answers for chapter 10, each with a fragment of the message the check must give."""
import math

from tests.wrong_answers import tries


def ring_time_n_minus_1_steps(n, size_bytes, alpha, bandwidth):
    if n == 1:
        return 0.0
    return (n - 1) * alpha + 2 * (n - 1) / n * size_bytes / bandwidth  # counted only the reduce-scatter's steps


def ring_time_no_factor_two(n, size_bytes, alpha, bandwidth):
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + (n - 1) / n * size_bytes / bandwidth  # an all-gather's bandwidth term


def ring_time_whole_buffer_per_step(n, size_bytes, alpha, bandwidth):
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) * size_bytes / bandwidth


def ring_time_no_latency(n, size_bytes, alpha, bandwidth):
    return 2 * (n - 1) / n * size_bytes / bandwidth


def ring_time_one_rank_pays(n, size_bytes, alpha, bandwidth):
    return 2 * max(n - 1, 1) * alpha + 2 * (n - 1) / n * size_bytes / bandwidth  # n=1 still pays latency


def ring_time_undefined_for_one_rank(n, size_bytes, alpha, bandwidth):
    if n == 1:
        return math.nan  # "no ring with one rank": but the time to reduce alone is 0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size_bytes / bandwidth


def ring_time_integer_factor(n, size_bytes, alpha, bandwidth):
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) // n * size_bytes / bandwidth  # // : the factor becomes 1


def _reference_fix(fixed):
    for name in ("NCCL_DEBUG", "NCCL_ALGO"):
        fixed.pop(name, None)
    fixed["NCCL_IB_QPS_PER_CONNECTION"] = fixed.pop("NCCL_IB_QPS_PER_CONECTION")
    fixed["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = fixed.pop("NCCL_ASYNC_ERROR_HANDLING")
    fixed.pop("TORCH_NCCL_TRACE_BUFFER_SIZE")
    return fixed


def fix_env_in_place(env):
    return _reference_fix(env)  # right values, but the caller's dict is edited


def fix_env_int_value(env):
    fixed = _reference_fix(dict(env))
    fixed["NCCL_IB_QPS_PER_CONNECTION"] = 4  # the number measured earlier, written as an int
    return fixed


def fix_env_int_buffer_size(env):
    fixed = _reference_fix(dict(env))
    fixed["TORCH_FR_BUFFER_SIZE"] = 2000  # the recorder back on, with an int
    return fixed


def fix_env_only_debug(env):
    fixed = dict(env)
    fixed["NCCL_DEBUG"] = "WARN"
    fixed.pop("NCCL_ALGO", None)
    return fixed  # the typo, the deprecated names and the recorder turned off remain


def fix_env_drops_everything(env):
    return {}  # throws away the system configuration with the debugging


def _renamed(env):
    fixed = {k: v for k, v in env.items() if k not in ("NCCL_DEBUG", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    fixed["NCCL_IB_QPS_PER_CONNECTION"] = fixed.pop("NCCL_IB_QPS_PER_CONECTION")
    fixed["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = fixed.pop("NCCL_ASYNC_ERROR_HANDLING")
    return fixed


def fix_env_keeps_algo(env):
    return _renamed(env)  # NCCL_ALGO=Tree still forced


def fix_env_deletes_async(env):
    fixed = {k: v for k, v in env.items() if k not in ("NCCL_DEBUG", "NCCL_ALGO", "NCCL_ASYNC_ERROR_HANDLING")}
    fixed["NCCL_IB_QPS_PER_CONNECTION"] = fixed.pop("NCCL_IB_QPS_PER_CONECTION")
    fixed.pop("TORCH_NCCL_TRACE_BUFFER_SIZE")
    return fixed


def fix_env_recorder_still_off(env):
    fixed = _renamed(env)
    fixed.pop("NCCL_ALGO")
    fixed["TORCH_FR_BUFFER_SIZE"] = env["TORCH_NCCL_TRACE_BUFFER_SIZE"]  # renamed, but still 0
    return fixed


def fix_env_drops_the_dump(env):
    fixed = _renamed(env)
    fixed.pop("NCCL_ALGO")
    fixed.pop("TORCH_NCCL_DUMP_ON_TIMEOUT")  # no more contradiction, and no more dump either
    fixed["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "0"
    return fixed


def fix_env_old_buffer_name(env):
    fixed = _renamed(env)
    fixed.pop("NCCL_ALGO")
    fixed["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"  # the advice for torch before 2.13: works, but the name is deprecated
    return fixed


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("ragged")(ring_time_one_rank_pays)
tries("non-finite")(ring_time_undefined_for_one_rank)
tries("sizes")(ring_time_integer_factor)
tries("mutation")(fix_env_in_place)
tries("output")(fix_env_int_value)


WRONG = [
    ("ring_allreduce_time", ring_time_n_minus_1_steps, "2(n-1) steps"),
    ("ring_allreduce_time", ring_time_no_factor_two, "missing its factor 2"),
    ("ring_allreduce_time", ring_time_whole_buffer_per_step, "not the whole S"),
    ("ring_allreduce_time", ring_time_no_latency, "latency term 2(n-1) x alpha is missing"),
    ("ring_allreduce_time", ring_time_one_rank_pays, "the time is 0"),
    ("ring_allreduce_time", ring_time_integer_factor, "integer division"),
    ("ring_allreduce_time", ring_time_undefined_for_one_rank, "you returned nan, not a finite number of seconds"),
    ("fix_nccl_env", fix_env_only_debug, "rename it to TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ("fix_nccl_env", fix_env_drops_everything, "it is system configuration"),
    ("fix_nccl_env", fix_env_keeps_algo, "NCCL_ALGO"),
    ("fix_nccl_env", fix_env_deletes_async, "rename it to TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ("fix_nccl_env", fix_env_recorder_still_off, "TORCH_FR_BUFFER_SIZE=0 turns off the flight recorder"),
    ("fix_nccl_env", fix_env_drops_the_dump, "keep TORCH_NCCL_DUMP_ON_TIMEOUT=1"),
    ("fix_nccl_env", fix_env_old_buffer_name, "deprecated in favour of TORCH_FR_BUFFER_SIZE"),
    ("fix_nccl_env", fix_env_in_place, "changed the environment it was given"),
    ("fix_nccl_env", fix_env_int_value, "NCCL_IB_QPS_PER_CONNECTION=4 is of type int, not str"),
    ("fix_nccl_env", fix_env_int_buffer_size, "an environment holds strings only"),
]
