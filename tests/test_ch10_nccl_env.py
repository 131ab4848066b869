"""validate_env (course_utils.nccl_env): each kind of mistake is found, with one sentence on what to change."""
import pytest

from course_utils import nccl_env
from course_utils.nccl_env import ERROR, WARNING, validate_env

PRODUCTION = {"NCCL_SOCKET_IFNAME": "=eth0", "NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_IB_GID_INDEX": "3",
              "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
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


def test_typo_gets_a_did_you_mean():
    [f] = validate_env({"NCCL_IB_QPS_PER_CONECTION": "4"})
    assert f.severity == ERROR and "NCCL_IB_QPS_PER_CONNECTION" in f.fix  # difflib's nearest real name


def test_real_but_untabled_names_are_not_called_typos():
    assert validate_env({"NCCL_IB_TIMEOUT": "22", "NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}) == []


@pytest.mark.parametrize("env, variable", [({"NCCL_DEBUG": "VERBOSE"}, "NCCL_DEBUG"),
                                           ({"NCCL_PROTO": "LL,LL256"}, "NCCL_PROTO"),
                                           ({"NCCL_IB_QPS_PER_CONNECTION": "0"}, "NCCL_IB_QPS_PER_CONNECTION"),
                                           ({"NCCL_BUFFSIZE": "4M"}, "NCCL_BUFFSIZE"),
                                           ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "4"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING")])
def test_invalid_values_are_errors(env, variable):
    assert (ERROR, variable) in _names(validate_env(env))


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


@pytest.mark.parametrize("env, variable", [
    ({"NCCL_MIN_NCHANNELS": "16", "NCCL_MAX_NCHANNELS": "8"}, "NCCL_MIN_NCHANNELS"),
    ({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}, "TORCH_NCCL_DUMP_ON_TIMEOUT"),  # PyTorch docs: needs a trace buffer > 0
    ({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "NVL"}, "NCCL_P2P_LEVEL"),
    ({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT"}, "NCCL_DEBUG_SUBSYS"),
])
def test_contradictory_settings(env, variable):
    assert variable in {f.variable for f in validate_env(env)}


def test_each_finding_is_one_sentence_saying_what_to_change():
    messy = {"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Tree", "NCCL_IB_QPS_PER_CONECTION": "4",
             "NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    findings = validate_env(messy)
    assert len(findings) >= 5
    for f in findings:
        assert f.fix[0].isupper() and f.fix.endswith(".") and f.fix.count(". ") == 0, f.fix
