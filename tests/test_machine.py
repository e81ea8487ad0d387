"""Figures name their machine: CPU model, the instruction sets that matter, cores, measured matmul rate."""

from pathlib import Path

import pytest
import torch

from vanilla_transformer.machine import (
    ISA_FLAGS,
    cpu_flags,
    cpu_model,
    deepspeed_refused,
    describe_gpu,
    describe_machine,
    format_gpu,
    format_machine,
    one_process_of_several,
    processes_without_a_gpu,
)

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


def test_a_machine_whose_flags_cannot_be_read_is_described_by_torchs_kernels():
    """Without /proc/cpuinfo (Windows, macOS) no flag is read: the line said "no AVX2" of an AVX-512
    machine (in the model card's hardware row); torch's choice of kernels says what it runs."""
    description = {"cpu": "Intel64 Family 6", "cores": 2, "torch_threads": 2, "isa": []}
    line = format_machine({**description, "torch_cpu_capability": "AVX512"})
    assert line == "Intel64 Family 6, 2 cores (2 threads), no AVX2 flag read (torch's CPU kernels: AVX512)"
    assert line.replace("AVX512", "DEFAULT") == format_machine(
        {**description, "torch_cpu_capability": "DEFAULT"}
    )


def test_training_leaves_apples_mps_device_for_the_cpu(monkeypatch):
    """Accelerate and Trainer take MPS where it is, and training's float64 sums failed there at the first
    update: training runs on the CPU instead (decoding may use MPS)."""
    from vanilla_transformer import machine

    for device, leaves in (("mps", True), ("cuda", False), (None, False)):
        chosen = None if device is None else torch.device(device)
        monkeypatch.setattr(
            torch.accelerator, "current_accelerator", lambda check_available=False, c=chosen: c
        )
        assert machine.training_leaves_mps() is leaves


def test_a_gpu_is_named_with_its_measured_rate():
    """Training on a GPU records the GPU and its matmul rate in the training precision (the CPU's rate
    says nothing about a GPU run's time)."""
    description = describe_machine(measure=False) | {
        "gpu": "Some GPU",
        "gpu_matmul_tflops": 712.4,
        "gpu_matmul_dtype": "bfloat16",
    }
    assert format_gpu(description) == "Some GPU, measured bfloat16 matmul 712 TFLOP/s"
    assert format_machine(description).endswith("; Some GPU, measured bfloat16 matmul 712 TFLOP/s")
    assert format_gpu({"gpu": "Some GPU"}) == "Some GPU"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_this_gpu_is_described():
    description = describe_gpu("cuda", torch.bfloat16)
    assert description["gpu"] == torch.cuda.get_device_name(0)
    assert description["gpu_matmul_tflops"] > 0 and description["gpu_matmul_dtype"] == "bfloat16"


def test_more_processes_than_gpus_is_refused_with_the_fix():
    """`accelerate launch --multi_gpu --num_processes 2` on a one-GPU machine put both processes on one
    GPU, which NCCL refused with a message that named neither the flag nor the fix."""
    launch = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    message = processes_without_a_gpu(launch, gpus=1)
    assert message and "2 processes" in message and "1 GPU:" in message
    assert "--num_processes 1" in message and "--nproc_per_node 1" in message
    assert "CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu" in message
    assert processes_without_a_gpu(launch, gpus=2) is None  # one GPU each
    assert processes_without_a_gpu(launch, gpus=0) is None  # CPU processes (gloo)
    for flag in ("True", "1", "on"):  # torchrun with ACCELERATE_USE_CPU set: CPU processes
        assert processes_without_a_gpu(launch | {"ACCELERATE_USE_CPU": flag}, gpus=1) is None
    assert processes_without_a_gpu(launch | {"ACCELERATE_USE_CPU": "False"}, gpus=1) == message
    assert processes_without_a_gpu({}, gpus=1) is None  # one process
    # Several machines: only this machine's processes need this machine's GPUs.
    assert processes_without_a_gpu({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, gpus=4) is None


def test_a_cpu_launch_of_several_processes_that_started_one_is_named():
    """`accelerate launch --cpu --num_processes 2` starts one process (Accelerate's CPU launcher starts
    several only through mpirun): the run trained alone, and nothing said so."""
    launch = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    message = one_process_of_several(launch)
    assert message and "one process" in message
    assert "CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes N" in message
    assert one_process_of_several({"ACCELERATE_USE_CPU": "True"}) is None  # --cpu, one process asked for
    assert one_process_of_several(launch | {"WORLD_SIZE": "2"}) is None  # torchrun's processes
    assert one_process_of_several(launch | {"PMI_SIZE": "2"}) is None  # mpirun's (--mpirun_hostfile)
    assert one_process_of_several(launch | {"ACCELERATE_USE_CPU": "False"}) is None


def test_deepspeed_is_refused_with_what_to_launch_instead():
    """Under `accelerate launch --use_deepspeed`, train.py stopped inside Accelerate's `prepare` on GPUs
    (batches of no fixed sentence count) and silently ran DDP on CPUs."""
    message = deepspeed_refused({"ACCELERATE_USE_DEEPSPEED": "true"})
    assert message and message.startswith("scripts/train.py does not run under DeepSpeed")
    assert "configs/accelerate/fsdp.yaml" in message and "--multi_gpu" in message
    assert deepspeed_refused({"ACCELERATE_USE_DEEPSPEED": "false"}) is None
    assert deepspeed_refused({}) is None


def test_matmul_rate_is_two_n_cubed_over_the_median_time(monkeypatch):
    """2 n^3 operations per n x n product, over the median of the timed calls after the first (any
    positive figure passed before, a rate half the true one included)."""
    from types import SimpleNamespace

    from vanilla_transformer import machine

    ticks = iter([0.0, 10.0, 10.5, 20.0, 20.25, 30.0, 31.0])  # the first call untimed; 0.5, 0.25, 1 s
    monkeypatch.setattr(machine, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert machine.matmul_rate(size=64, repeats=3) == 2 * 64**3 / 0.5


def test_matmul_rate_times_the_product_it_is_given():
    """Another kernel's rate (the benchmark's oneDNN row): `product` is what is called, on two
    size x size matrices, once untimed and `repeats` times timed."""
    from vanilla_transformer import machine

    shapes = []

    def product(a, b):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return a @ b

    assert machine.matmul_rate(size=32, repeats=2, product=product) > 0
    assert shapes == [((32, 32), (32, 32))] * 3


def test_the_source_commit_is_this_checkouts_alone(tmp_path):
    """A measurement records the commit of the code measured: this checkout's HEAD (marked where the
    tree differs from it), and nothing for a copy outside it, also one inside another repository (a
    virtual environment in a user's own project), whose HEAD is not this code's."""
    import importlib.util
    import shutil
    import subprocess

    from vanilla_transformer import machine

    def commit_of(folder):
        spec = importlib.util.spec_from_file_location("copied_machine", folder / "machine.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.source_commit()

    repository = Path(machine.__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repository, capture_output=True, text=True)
    if head.returncode == 0:  # run from a checkout (CI's clone)
        assert machine.source_commit().removesuffix("+modified") == head.stdout.strip()
    elsewhere = tmp_path / "project" / ".venv" / "vanilla_transformer"
    elsewhere.mkdir(parents=True)
    shutil.copy(machine.__file__, elsewhere / "machine.py")
    assert commit_of(elsewhere) is None  # no repository around it
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    subprocess.run(
        ["git", "-c", "user.name=u", "-c", "user.email=u@e", "commit", "-q", "--allow-empty", "-m", "theirs"],
        cwd=tmp_path / "project",
        check=True,
    )
    assert commit_of(elsewhere) is None  # another repository's commit is not this code's

    # A checkout of its own: its commit, "+modified" for a change to the code, not to a measurement's output.
    checkout = tmp_path / "checkout"
    (checkout / "vanilla_transformer").mkdir(parents=True)
    (checkout / "docs").mkdir()
    shutil.copy(machine.__file__, checkout / "vanilla_transformer" / "machine.py")
    (checkout / "vanilla_transformer" / "other.py").write_text("x = 1\n")
    (checkout / "docs" / "benchmark.json").write_text("{}")
    git = ["git", "-c", "user.name=u", "-c", "user.email=u@e"]
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run([*git, "add", "."], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "code"], cwd=checkout, check=True)
    ours = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True
    ).stdout.strip()
    assert commit_of(checkout / "vanilla_transformer") == ours
    (checkout / "docs" / "benchmark.json").write_text('{"rerun": true}')
    assert commit_of(checkout / "vanilla_transformer") == ours
    (checkout / "vanilla_transformer" / "other.py").write_text("x = 2\n")
    assert commit_of(checkout / "vanilla_transformer") == ours + "+modified"
