"""Figures name their machine: CPU model, the instruction sets that matter, cores, measured matmul rate."""

import torch

from vanilla_transformer.machine import ISA_FLAGS, cpu_flags, cpu_model, describe_machine, format_machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse avx avx2 fma bmi2 sha_ni
processor\t: 1
"""


def test_flags_are_read_off_cpuinfo():
    assert cpu_flags(CPUINFO) == ["avx2", "fma"]
    assert cpu_flags("") == []
    assert cpu_flags(CPUINFO.replace("avx2 fma", "avx2 fma avx512f avx512_bf16 amx_tile")) == [
        "avx2",
        "fma",
        "avx512f",
        "avx512_bf16",
        "amx_tile",
    ]


def test_model_name_carries_family_and_model_numbers():
    # Virtual machines may name only the vendor's line; the numbers tell a Zen 1 from a Zen 3.
    assert cpu_model(CPUINFO) == "AMD EPYC 7B13 (family 25 model 1)"
    assert cpu_model(CPUINFO.replace("25", "23").replace(" 7B13", "")) == "AMD EPYC (family 23 model 1)"
    assert cpu_model("model name\t: Some CPU\n") == "Some CPU"  # no numbers: the name alone


def test_this_machine_is_described_consistently_with_torch():
    description = describe_machine()
    assert set(description["isa"]) <= set(ISA_FLAGS)
    capability = description["torch_cpu_capability"]
    if capability in ("AVX2", "AVX512"):  # torch dispatches to AVX2 kernels only where the CPU has AVX2
        assert "avx2" in description["isa"]
    if capability == "AVX512":
        assert "avx512f" in description["isa"]
    assert description["torch_threads"] == torch.get_num_threads()
    assert description["matmul_gflops"] > 0
    line = format_machine(description)
    assert line.startswith(f"{description['cpu']}, {description['cores']} cores")
    assert f"{description['matmul_gflops']:.0f} GFLOP/s" in line
    assert "GFLOP/s" not in format_machine(describe_machine(measure=False))
