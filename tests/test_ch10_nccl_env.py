"""validate_env (course_utils.nccl_env): each kind of mistake is found, with one sentence on what to change."""
import re
from pathlib import Path

import pytest

from course_utils import nccl_env
from course_utils.nccl_env import ERROR, WARNING, validate_env

PRODUCTION = {"NCCL_SOCKET_IFNAME": "=eth0", "NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_IB_GID_INDEX": "3",
              "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "2000",
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def _names(findings):
    return {(f.severity, f.variable) for f in findings}


def test_a_sound_production_environment_has_no_findings():
    # Without this, every other test could pass by flagging everything.
    assert validate_env(PRODUCTION) == []


def test_every_table_entry_is_typed_and_sourced():
    for v in nccl_env.VARIABLES:
        assert v.kind in nccl_env.KINDS and v.source.startswith("https://"), v
        assert v.what and v.values


def test_typo_is_told_the_nearest_real_name():
    [f] = validate_env({"NCCL_IB_QPS_PER_CONECTION": "4"})
    assert f.severity == ERROR and "NCCL_IB_QPS_PER_CONNECTION" in f.fix  # difflib's nearest real name
    [f] = validate_env({"TORCH_FR_BUFER_SIZE": "2000"})  # TORCH_FR_* names are examined too
    assert "TORCH_FR_BUFFER_SIZE" in f.fix


def test_real_but_untabled_names_are_not_called_typos():
    assert validate_env({"NCCL_IB_TIMEOUT": "22", "NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}) == []


@pytest.mark.parametrize("env, variable", [({"NCCL_DEBUG": "VERBOSE"}, "NCCL_DEBUG"),
                                           ({"NCCL_PROTO": "LL,LL256"}, "NCCL_PROTO"),
                                           ({"NCCL_IB_QPS_PER_CONNECTION": "0"}, "NCCL_IB_QPS_PER_CONNECTION"),
                                           ({"NCCL_BUFFSIZE": "4M"}, "NCCL_BUFFSIZE"),  # NCCL would read 4 bytes
                                           ({"NCCL_NTHREADS": "100"}, "NCCL_NTHREADS"),  # not a multiple of 32
                                           ({"NCCL_NTHREADS": "1024"}, "NCCL_NTHREADS"),  # above 512
                                           ({"NCCL_NTHREADS": "32"}, "NCCL_NTHREADS"),  # below 2 x warp size
                                           ({"NCCL_IB_GID_INDEX": "010"}, "NCCL_IB_GID_INDEX"),  # octal 8
                                           ({"NCCL_IB_GID_INDEX": "08"}, "NCCL_IB_GID_INDEX"),  # octal stops: 0
                                           ({"TORCH_FR_BUFFER_SIZE": "0x10"}, "TORCH_FR_BUFFER_SIZE"),  # stoi: 0
                                           ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "4"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING")])
def test_invalid_values_are_errors(env, variable):
    assert (ERROR, variable) in _names(validate_env(env))


@pytest.mark.parametrize("name, value", [("NCCL_NTHREADS", v) for v in ("64", "96", "256", "480", "512", "0")] +
                         [("NCCL_IB_GID_INDEX", "03"), ("NCCL_IB_GID_INDEX", " 3 "), ("NCCL_BUFFSIZE", "0x400000"),
                          ("TORCH_FR_BUFFER_SIZE", "02000"), ("NCCL_MIN_NCHANNELS", "+4")])
def test_values_the_readers_take_as_written_pass(name, value):
    # NCCL_NTHREADS: getNthreads (src/graph/tuning.cc) takes any multiple of WARP_SIZE 32 from 64 to 512, and 0 means
    # the default. Numbers: NCCL's strtoll(s, 0, 0) reads '03' as octal 3 (= 3) and '0x400000' as hex; PyTorch's
    # std::stoi reads '02000' as 2000. Each is what it says, so none is flagged.
    assert validate_env({name: value}) == []


def test_numbers_are_read_as_each_library_reads_them():
    assert nccl_env.read_int("NCCL_IB_GID_INDEX", "010")[0] == 8  # strtoll, base 0: octal
    assert nccl_env.read_int("TORCH_FR_BUFFER_SIZE", "010")[0] == 10  # std::stoi: decimal
    assert nccl_env.read_int("NCCL_BUFFSIZE", "4M")[:1] == (4,) and nccl_env.read_int("NCCL_BUFFSIZE", "4M")[1]
    assert nccl_env.read_int("TORCH_FR_BUFFER_SIZE", "0x10")[0] == 0


def test_accepted_list_syntaxes_are_not_errors():
    # '^' exclusion and per-collective lists are NCCL syntax; they are still debug settings (a warning only).
    for value in ("^Tree", "Ring,Tree", "allreduce:tree;allgather:ring"):
        assert {f.severity for f in validate_env({"NCCL_ALGO": value})} == {WARNING}


@pytest.mark.parametrize("name, value", [("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG", "TRACE"), ("NCCL_ALGO", "Ring"),
                                         ("NCCL_PROTO", "Simple"), ("NCCL_P2P_DISABLE", "1")])
def test_debug_settings_left_on_are_flagged_for_production(name, value):
    [f] = [f for f in validate_env({name: value}) if f.variable == name]
    assert f.severity == WARNING and f.fix.endswith(".")


def test_deprecated_name_is_flagged_and_conflicting_values_are_errors():
    assert (WARNING, "NCCL_ASYNC_ERROR_HANDLING") in _names(validate_env({"NCCL_ASYNC_ERROR_HANDLING": "1"}))
    both = validate_env({"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert (ERROR, "NCCL_ASYNC_ERROR_HANDLING") in _names(both)


def _torch_header(name):
    import torch

    return (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d" / name).read_text()


def test_the_flight_recorder_default_is_read_off_the_installed_torch():
    # torch 2.13's FlightRecorder.hpp:110-111: getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"},
    # 2000). If a torch upgrade changes the names or the default, this test says so before the validator lies.
    text = re.sub(r"\s+", " ", _torch_header("FlightRecorder.hpp"))
    want = f'getCvarInt( {{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}}, {nccl_env.FR_DEFAULT_ENTRIES})'
    assert want in text


def test_dump_on_timeout_needs_nothing_else_with_torch_2_13():
    # Unset buffer: 2000 entries, so the recorder is on; only an explicit 0, under either name, turns it off.
    assert validate_env({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}) == []
    assert validate_env({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "5000"}) == []
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        found = validate_env({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", name: "0"})
        assert (ERROR, "TORCH_NCCL_DUMP_ON_TIMEOUT") in _names(found), name
    assert validate_env({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_BUFFER_SIZE": "0"}) == []  # no dump wanted


def test_the_old_buffer_name_is_deprecated_and_must_agree_with_the_new_one():
    # FlightRecorder.hpp reads TORCH_FR_BUFFER_SIZE first and warns when it falls back to the old name.
    [f] = validate_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert f.severity == WARNING and "TORCH_FR_BUFFER_SIZE" in f.fix
    both = validate_env({"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "500"})
    assert (ERROR, "TORCH_NCCL_TRACE_BUFFER_SIZE") in _names(both)


@pytest.mark.parametrize("env, variable", [
    ({"NCCL_MIN_NCHANNELS": "16", "NCCL_MAX_NCHANNELS": "8"}, "NCCL_MIN_NCHANNELS"),
    ({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "0"}, "TORCH_NCCL_DUMP_ON_TIMEOUT"),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "NVL"}, "NCCL_P2P_LEVEL"),
    ({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT"}, "NCCL_DEBUG_SUBSYS"),
])
def test_contradictory_settings(env, variable):
    assert variable in {f.variable for f in validate_env(env)}


MESSY = [
    {"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Tree", "NCCL_IB_QPS_PER_CONECTION": "4", "NCCL_ASYNC_ERROR_HANDLING": "1",
     "TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "NCCL_NTHREADS": "100",
     "NCCL_IB_GID_INDEX": "010", "NCCL_BUFFSIZE": "4M", "TORCH_FR_BUFER_SIZE": "1", "NCCL_DEBUG_SUBSYS": "INIT",
     "NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "NVL", "NCCL_MIN_NCHANNELS": "16", "NCCL_MAX_NCHANNELS": "8",
     "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60", "NCCL_XYZZY": "1"},
    {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT", "NCCL_NTHREADS": "1024", "NCCL_MIN_NCHANNELS": "",
     "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_FR_BUFFER_SIZE_X": "1",
     "NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_PROTO": "LL256",
     "TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_IB_QPS_PER_CONNECTION": "0"},
]


@pytest.mark.parametrize("env", MESSY)
def test_each_finding_is_one_sentence_saying_what_to_change(env):
    findings = validate_env(env)
    assert len(findings) >= 10
    for f in findings:
        # Exactly one sentence: one sentence-ending mark (. ? !) followed by a space or the end, and it is the last.
        ends = re.findall(r"[.?!](?=\s|$)", f.fix)
        assert f.fix[0].isupper() and f.fix.endswith(".") and len(ends) == 1, f.fix
        assert not re.search(r"[.?!]$", f.problem) and len(re.findall(r"[.?!](?=\s)", f.problem)) == 0, f.problem
