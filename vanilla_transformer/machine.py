"""What machine a figure was measured on: CPU model, the instruction sets that matter, cores, matmul rate.

Machines of one kind differ by about 3x in matrix-multiply rate and in which vector instructions they
have, so a time or a speed ratio means little without them. Everything here is read off the running
machine or measured on it.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import str_to_bool

# CPU flags (as /proc/cpuinfo spells them) that decide which kernels torch, MKL and oneDNN can use.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def _cpuinfo_text(cpuinfo: str | None) -> str:
    """`cpuinfo`, or /proc/cpuinfo's text when None ("" where it cannot be read)."""
    if cpuinfo is not None:
        return cpuinfo
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_field(name: str, cpuinfo: str) -> str | None:
    """The first value of `name` ("model name", "cpu family", "flags", ...) in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name with its family and model numbers (Linux: /proc/cpuinfo's text), else what
    `platform` knows.

    Virtual machines often name only the vendor's line ("AMD EPYC"), which covers CPUs three times apart
    in speed; the numbers tell them apart (family 23 is AMD's Zen 1 and 2, family 25 Zen 3 and 4)."""
    cpuinfo = _cpuinfo_text(cpuinfo)  # read once for the three fields
    name = _cpuinfo_field("model name", cpuinfo)
    if not name:
        return platform.processor() or platform.machine()
    family, model = _cpuinfo_field("cpu family", cpuinfo), _cpuinfo_field("model", cpuinfo)
    return f"{name} (family {family} model {model})" if family and model else name


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of `ISA_FLAGS` this CPU has, from /proc/cpuinfo's text (empty where it cannot be read)."""
    flags = (_cpuinfo_field("flags", _cpuinfo_text(cpuinfo)) or "").split()
    return [flag for flag in ISA_FLAGS if flag in flags]


def synchronize(device: str) -> None:
    """Wait for the work queued on `device` (CUDA and MPS queue it: timings would count launches only)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("mps"):
        torch.mps.synchronize()


def matmul_rate(
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int = 2048,
    repeats: int = 3,
    product: Callable[[torch.Tensor, torch.Tensor], object] = torch.matmul,
) -> float:
    """Measured FLOP/s of `product` (by default `torch.matmul`) on two size x size matrices (median of
    `repeats`, after one)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    times = []
    for index in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        product(a, b)
        synchronize(device)
        if index:
            times.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(times)


def resident_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident memory now (VmRSS) or its peak so far (VmHWM), from /proc/self/status;
    None where that file does not exist (not Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{field}:")), None)


def reset_peak_resident() -> None:
    """Make VmHWM start again from the current resident memory (Linux: write 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def describe_machine(measure: bool = True) -> dict[str, Any]:
    """CPU model, ISA flags, logical cores, torch threads and CPU capability, and (with `measure`) the
    float32 matmul rate measured now in GFLOP/s (2048 x 2048 products, half a second on 2 cores)."""
    description: dict[str, Any] = {
        "cpu": cpu_model(),
        "isa": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    if measure:
        description["matmul_gflops"] = round(matmul_rate() / 1e9, 1)
    return description


def describe_gpu(device: torch.device | str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The GPU's name and its matmul rate measured now in `dtype` (the precision training computes in),
    in TFLOP/s: 4096 x 4096 products, milliseconds on a data-centre GPU."""
    device = torch.device(device)
    return {
        "gpu": torch.cuda.get_device_name(device),
        "gpu_matmul_tflops": round(matmul_rate(str(device), dtype, size=4096) / 1e12, 1),
        "gpu_matmul_dtype": str(dtype).removeprefix("torch."),
    }


def format_machine(description: dict[str, Any]) -> str:
    """One line: 'AMD EPYC, 2 cores (2 threads), avx2 fma avx512f, measured float32 matmul 178 GFLOP/s', then
    the GPU and its measured matmul rate where the description has one."""
    # No flag read: /proc/cpuinfo has none of them, or there is none (Windows, macOS): torch's own choice
    # of kernels says what the CPU runs ("no AVX2" stood in the card of an AVX-512 machine under Windows)
    capability = description.get("torch_cpu_capability") or "unknown"
    isa = " ".join(description.get("isa") or []) or f"no AVX2 flag read (torch's CPU kernels: {capability})"
    threads = description["torch_threads"]
    line = f"{description['cpu']}, {description['cores']} cores ({threads} threads), {isa}"
    if "matmul_gflops" in description:
        line += f", measured float32 matmul {description['matmul_gflops']:.0f} GFLOP/s"
    return line + (f"; {format_gpu(description)}" if "gpu" in description else "")


def format_gpu(description: dict[str, Any]) -> str:
    """'<GPU name>, measured <dtype> matmul <rate> TFLOP/s' (the rate and its dtype where measured)."""
    line = description["gpu"]
    if "gpu_matmul_tflops" in description:
        rate = description["gpu_matmul_tflops"]
        line += f", measured {description['gpu_matmul_dtype']} matmul {rate:.0f} TFLOP/s"
    return line


def processes_without_a_gpu(environ: Mapping[str, str] | None = None, gpus: int | None = None) -> str | None:
    """Why this launch cannot give each of its processes a GPU of its own, or None when it can.

    `accelerate launch --multi_gpu --num_processes N` (or torchrun) on a machine with fewer than N GPUs
    puts two processes on one GPU, which NCCL refuses with an error that names neither the flag nor the
    fix. Processes on CPUs (no GPU visible, or `ACCELERATE_USE_CPU` set) are fine. Like Accelerate, which
    gives local process i GPU i modulo the GPUs it sees, this assumes that a machine's processes all see
    its GPUs (as under `accelerate launch` and torchrun)."""
    environ = os.environ if environ is None else environ
    try:  # processes on this machine (torchrun sets it)
        local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return None  # not a launcher's value: nothing to judge by
    try:  # read as Accelerate reads it
        on_cpus = bool(str_to_bool(environ.get("ACCELERATE_USE_CPU", "false").strip()))
    except ValueError:
        on_cpus = False
    if local <= 1 or on_cpus:
        return None
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
    if gpus == 0 or gpus >= local:
        return None
    return (
        f"{local} processes were launched on this machine, but it sees {gpus} GPU{'s' * (gpus != 1)}: each "
        f"process needs a GPU of its own. Launch at most {gpus} per machine (accelerate launch "
        f"--num_processes {gpus} on one machine, torchrun --nproc_per_node {gpus}), or hide the GPUs to run "
        "the processes on CPUs: CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu ..."
    )


def deepspeed_refused(environ: Mapping[str, str] | None = None) -> str | None:
    """Why scripts/train.py cannot run this launch, if it asks for DeepSpeed; else None.

    `accelerate launch --use_deepspeed` (or a config with `distributed_type: DEEPSPEED`) sets
    `ACCELERATE_USE_DEEPSPEED`. The training loop is built on what DDP and FSDP give it: batches of a
    token budget (DeepSpeed needs a fixed number of sentences per batch), whole weights in each checkpoint
    (averaged at the end, and resumed exactly) and its own gradient accumulation. Under DeepSpeed,
    Accelerate stopped it at `prepare` with a message about batch sizes on GPUs, and on CPUs ignored the
    request and ran DDP."""
    environ = os.environ if environ is None else environ
    try:
        asked = bool(str_to_bool(environ.get("ACCELERATE_USE_DEEPSPEED", "false").strip()))
    except ValueError:
        asked = False
    if not asked:
        return None
    return (
        "scripts/train.py does not run under DeepSpeed: its batches hold a number of tokens, not of "
        "sentences, and its checkpoints whole weights, which it averages and resumes from. Shard with FSDP "
        "instead (accelerate launch --config_file configs/accelerate/fsdp.yaml; its "
        "fsdp_reshard_after_forward true shards as ZeRO-3 does, false as ZeRO-2), or replicate with DDP "
        "(accelerate launch --multi_gpu); scripts/finetune.py (transformers' Trainer) takes DeepSpeed."
    )


def distributed_accelerator() -> bool:
    """Whether processes here run on an accelerator that Accelerate (and Trainer) distribute over: a
    CUDA GPU, or another one torch knows (XPU, NPU, HPU, ...), but not Apple's MPS, which has no
    process group. One that is there: torch's CUDA build (PyPI's default on Linux) names CUDA as its
    accelerator on a machine without a GPU, where several CPU processes once each ran alone as rank 0."""
    current = torch.accelerator.current_accelerator(check_available=True)
    return current is not None and current.type != "mps"


def training_leaves_mps() -> bool:
    """Whether training should run on the CPU although Accelerate and Trainer would take Apple's MPS
    device: its loss and token sums are kept in float64, which MPS lacks (a TypeError from inside at the
    first update). Decoding and evaluation may still use it (`--device mps`)."""
    current = torch.accelerator.current_accelerator(check_available=True)
    return current is not None and current.type == "mps"


def one_process_of_several(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this process runs alone although its launch asked for several, or None.

    `accelerate launch --cpu --num_processes N` starts one process whatever N is (its CPU launcher starts
    several only through mpirun), without a word: it sets the rendezvous address (`MASTER_ADDR`) that a
    launch of several processes gets, and no process count (`WORLD_SIZE`, or mpirun's)."""
    environ = os.environ if environ is None else environ
    try:
        on_cpus = bool(str_to_bool(environ.get("ACCELERATE_USE_CPU", "false").strip()))
    except ValueError:
        on_cpus = False
    counted = any(
        name in environ for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    )
    if not on_cpus or "MASTER_ADDR" not in environ or counted:
        return None
    return (
        "accelerate launch --cpu started this one process, whatever its --num_processes says: the run "
        "trains in one process. For N processes on CPUs: CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu "
        "--num_processes N ..."
    )


CODE_PATHS = ("vanilla_transformer", "scripts", "tools", "pyproject.toml")  # what a measurement runs


def source_commit() -> str | None:
    """The git commit of this package's code, "+modified" where its code differs from it, for
    the record of a measurement (None outside this project's git checkout: an installed copy, also one
    inside another repository, a virtual environment in the user's project, say)."""
    here = Path(__file__).resolve().parent

    def git(*arguments: str) -> list[str]:
        done = subprocess.run(["git", *arguments], cwd=here, capture_output=True, text=True, timeout=30)
        if done.returncode:
            raise subprocess.SubprocessError(done.stderr)
        return done.stdout.splitlines()

    try:
        top, commit = git("rev-parse", "--show-toplevel", "HEAD")
        if Path(top).resolve() != here.parent:
            return None
        # the code's files only: a benchmark's own outputs (docs/*.json, plots) are tracked too
        changed = git(
            "status", "--porcelain", "--untracked-files=no", "--", *(f":/{path}" for path in CODE_PATHS)
        )
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return commit + ("+modified" if changed else "")


__all__ = [
    "cpu_flags",
    "cpu_model",
    "deepspeed_refused",
    "describe_gpu",
    "describe_machine",
    "distributed_accelerator",
    "format_gpu",
    "format_machine",
    "matmul_rate",
    "one_process_of_several",
    "processes_without_a_gpu",
    "reset_peak_resident",
    "resident_bytes",
    "source_commit",
    "training_leaves_mps",
]
