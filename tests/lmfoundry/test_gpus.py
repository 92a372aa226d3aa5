"""The one GPU table: the architecture names each command accepts are part of the CLI contract."""

from __future__ import annotations

from lmfoundry.gpus import ARCH_NAMES, ARCH_OF_CAPABILITY, ARCHITECTURES, COMPILE_ARCH_NAMES, SM_NAME
from lmfoundry.gpus import parse_arch as doctor_arch
from lmfoundry.gpus import parse_compile_arch as compile_arch


def test_doctor_and_compile_arch_names_are_the_documented_sets():
    assert ARCH_NAMES == {
        "volta": 70, "turing": 75, "ampere": 80, "ada": 89, "lovelace": 89, "hopper": 90, "blackwell": 100,
        "v100": 70, "t4": 75, "a100": 80, "a10": 86, "a10g": 86, "a40": 86, "l4": 89, "l40": 89, "l40s": 89,
        "rtx4090": 89, "h100": 90, "h200": 90, "gh200": 90, "b200": 100, "gb200": 100, "rtx5090": 120,
    }
    assert COMPILE_ARCH_NAMES == {
        "ampere": 80, "sm_80": 80, "sm80": 80, "a100": 80, "ada": 89, "sm_89": 89, "sm89": 89, "l4": 89,
        "l40s": 89, "hopper": 90, "sm_90": 90, "sm_90a": 90, "sm90": 90, "h100": 90, "h200": 90,
    }


def test_rows_are_consistent():
    caps = [a.capability for a in ARCHITECTURES]
    assert caps == sorted(set(caps))
    for a in ARCHITECTURES:
        assert set(a.compile_names) <= set(a.names)
        assert not a.compile_names or a.compile_target
        assert ARCH_OF_CAPABILITY[a.capability] == a.family and SM_NAME[a.capability] == a.sm
    assert SM_NAME[90] == "sm_90a" and SM_NAME[80] == "sm_80" and SM_NAME[89] == "sm_89"


def test_both_parsers_read_the_table():
    assert doctor_arch("L40S") == ("l40s", 89) and doctor_arch("sm_90a") == ("sm_90", 90)
    assert compile_arch(" Hopper ") == 90 and compile_arch("a100") == 80
