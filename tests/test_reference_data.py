"""Reference data copied into data/reference/: unchanged from its source, with provenance, and shown as such."""
import hashlib
import json

import pytest

from course_utils import reference_data


COPIED = sorted(p.stem for p in reference_data.REFERENCE_DIR.glob("*.json"))


@pytest.mark.parametrize("name", COPIED)
def test_every_copied_reference_is_its_source_unchanged(name):
    ref = reference_data.load(name)
    prov = ref.pop("provenance")
    assert prov.pop("file") == f"data/reference/{name}.json"  # added by load(), for label(); not in the file
    # The shared files' bytes are json.dumps(data, indent=1): the hash proves every number was copied as is.
    assert hashlib.sha256(json.dumps(ref, indent=1).encode()).hexdigest() == prov["source_sha256"]
    assert prov["date"] and "H200" in prov["device"] and prov["versions"]


def test_block_baseline_says_it_is_not_the_course_block():
    assert "NOT the course's" in reference_data.load("h200_block_fp8_baseline")["provenance"]["block"]


def test_block_baseline_table_and_fp8_summary_quote_the_file():
    ref = reference_data.load("h200_block_fp8_baseline")
    table = reference_data.block_baseline_table(ref)
    assert len(table.splitlines()) == len(ref["block"]) + 2
    assert "620" in table and "87%" in table  # s=1024 eager: 620.08 TFLOP/s, 86.7% of the matmul
    assert reference_data.fp8_gemm_summary(ref).endswith("1.78x")
    assert reference_data.label(ref) == ("NVIDIA H200 · torch 2.11.0+cu130 · 2026-11-29 "
                                         "(data/reference/h200_block_fp8_baseline.json)")


def test_unknown_reference_names_the_known_ones():
    with pytest.raises(FileNotFoundError, match="h200_attention_baseline"):
        reference_data.load("no_such_file")
