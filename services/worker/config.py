"""Worker configuration: built once from flags and `SPINDLE_*` variables, frozen, validated."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.flags import add_common_flags, add_flag
from services.common.service_auth import (
    NO_SERVICE_AUTH,
    SCHEDULER_IDENTITY,
    ServiceAuthConfig,
    add_service_auth_flags,
    service_auth_config_from_args,
)
from services.common.telemetry import TelemetryConfig, add_telemetry_flags, telemetry_config_from_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 2**30
QUANTIZATIONS = ("none", "int8", "w8a8")
# Those that hold the matmul weights as int8 with a scale per output channel (layers/int8_linear.py).
INT8_WEIGHT_QUANTIZATIONS = ("int8", "w8a8")
# auto: the model's dtype; int8: 8-bit keys and values with a float32 scale per token and KV head
# (attention/int8_kv_cache.py), half of bfloat16's cache bytes (CPU only).
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class RunnerConfig:
    """The part of the configuration the model runner needs, with values resolved for the model."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class WorkerConfig:
    worker_addr: str = "127.0.0.1:50053"
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None
    cache_dir: str | None = None
    dtype: str = "auto"  # auto, float32, bfloat16, float16
    device: str = "auto"  # auto, cpu, cuda
    kv_cache_bytes: int = 1 * GiB
    gpu_memory_utilization: float = 0.9  # on a GPU: share of device memory for weights, activations, KV
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    num_threads: int | None = None  # None: torch's default
    attention_backend: str = "auto"  # auto: CUDA kernels on a GPU, compiled kernels on a CPU; torch
    # CPU without native bf16: 16-bit weights also kept as float32 for batched matmuls (3x weight memory).
    cpu_float32_copy: bool = True
    # bfloat16 on a CPU: decode matmuls of up to 8 rows on the compiled GEMV, which reads the plain
    # weight kept beside oneDNN's packed copy (on a CPU with native bf16, 2x the matmul weight memory);
    # --quantization int8: up to 16 rows on the int8 GEMV, which reads the int8 weight itself.
    cpu_gemv: bool = True
    # Decode steps of up to the GEMVs' row limit run all decoder layers in one compiled call
    # (models/decode_stack.py), where every layer is on a GEMV; same kernels, same results.
    cpu_fused_decode: bool = True
    cpu_gemm_tiles: bool = True
    # bfloat16 on a CPU with AMX-BF16: matmuls above the column tiles' rows on the AMX kernel
    # (layers/amx_gemm.py) up to each weight shape's measured limit, in place of oneDNN's GEMM; weight-only
    # int8 above the int8 GEMV's rows likewise, on int8 panels.
    cpu_amx_gemm: bool = True
    # bfloat16 on a CPU with AMX-BF16: attention on the tile unit where head_dim is 64 (attention/amx_attention.py):
    # prefills, and decodes on a bfloat16 or (with AMX-INT8) int8 cache in blocks of 16k tokens; else the AVX-512 /
    # vector passes.
    cpu_amx_attention: bool = True
    # The packed weights decode steps stream (column tiles, AMX GEMM) on transparent huge pages
    # (layers/weight_memory.py), where the kernel allows them.
    cpu_huge_pages: bool = True
    # bfloat16 weights, no --quantization: steps whose rows are all greedy (no logprobs, no logits
    # processors) take their tokens from an int8 copy of the LM head, checked on the bfloat16 weight
    # where the int8 error bound leaves a token in reach (layers/greedy_head.py); the same tokens.
    cpu_greedy_head_screen: bool = True
    # none; int8: weight-only int8 matmul weights with per-channel scales (CPU only; layers/int8_linear.py);
    # w8a8: the same weights, and matmuls quantize their activations to int8 too (layers/w8a8.py).
    quantization: str = "none"
    # w8a8 on the int8 column tiles: activations quantized in groups of this many input values (a
    # multiple of 4), with asymmetric weights; 0: one scale per row, as oneDNN's int8 GEMM takes them
    # (symmetric weights); -1 (auto): DEFAULT_W8A8_GROUP_SIZE where the tiles take every matmul, per
    # row elsewhere.
    w8a8_group_size: int = -1
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    log_level: str = "INFO"
    shutdown_timeout: float = 30.0
    fake_model: bool = False  # no weights; each step returns a fixed token (engine-overhead benchmark)
    # With fake_model: a prompt holding this token id makes that step and every later one fail, as a
    # sticky device fault does (the fault-handling tests); -1: never.
    fake_fault_token_id: int = -1
    # A step running longer turns health NOT_SERVING (services/worker/step_watchdog.py); 0: never.
    step_timeout_s: float = 30.0
    # This many failed steps in a row (a sticky device fault fails every step) turn the worker
    # broken: health NOT_SERVING, its step stream ended, so liveness restarts it; 0: never.
    max_consecutive_failed_steps: int = 3
    telemetry: TelemetryConfig = TelemetryConfig()  # traces endpoint and metrics port
    auth: ServiceAuthConfig = NO_SERVICE_AUTH  # who may call this worker: its scheduler
    # Tensor parallelism (services/worker/parallel/): this worker is rank `tensor_parallel_rank` of
    # `tensor_parallel_size`; rank 0 serves the group's rendezvous store on `tensor_parallel_port`;
    # a collective (and the rendezvous) not done within `tensor_parallel_timeout_s` fails the step.
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    tensor_parallel_port: int = 29500
    tensor_parallel_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: expected auto or one of {sorted(DTYPES)}")
        if self.attention_backend not in ("auto", "torch"):
            raise ValueError(f"--attention-backend {self.attention_backend!r}: expected auto or torch")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization!r}: expected one of {QUANTIZATIONS}")
        if self.quantization != "none" and self.tensor_parallel_size > 1:
            # Each rank would quantize its shard from float weights and the vocabulary-split head its
            # slice: untested, so refused rather than served.
            raise ValueError(f"--quantization {self.quantization} is not supported with --tensor-parallel-size > 1 yet")
        if self.w8a8_group_size < -1 or (self.w8a8_group_size > 0 and self.w8a8_group_size % 4):
            raise ValueError(f"--w8a8-group-size {self.w8a8_group_size}: expected -1 (auto), 0 (per row) "
                             "or a positive multiple of 4")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size > 1:  # untested together: refused
            raise ValueError("--kv-cache-dtype int8 is not supported with --tensor-parallel-size > 1 yet")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "torch":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} needs the compiled CPU kernels: "
                             "not with --attention-backend torch")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: expected auto, cpu or cuda")
        for name in ("kv_cache_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_consecutive_failed_steps < 0:
            raise ValueError(f"--worker-max-consecutive-failed-steps must be >= 0, got {self.max_consecutive_failed_steps}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.tensor_parallel_size < 1 or not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-rank {self.tensor_parallel_rank} must be in [0, "
                             f"--tensor-parallel-size {self.tensor_parallel_size})")
        if not 0 < self.tensor_parallel_port < 65536:
            raise ValueError(f"--tensor-parallel-port must be a port number, got {self.tensor_parallel_port}")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"--tensor-parallel-timeout-s must be > 0, got {self.tensor_parallel_timeout_s}")


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MiB', '2G' -> bytes (K/M/G are binary here, as memory sizes are)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512MiB, 2GiB)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** " KMGT".index(unit.upper() or " "))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.worker", description="Spindle worker service")
    add_flag(parser, "--worker-addr", default="127.0.0.1:50053", help="gRPC listen address")
    add_flag(parser, "--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    add_flag(parser, "--served-model-name", help="model name reported to the scheduler")
    add_flag(parser, "--cache-dir", help="where converted models go (default ~/.cache/spindle)")
    add_flag(parser, "--dtype", default="auto", choices=["auto", *DTYPES],
             help="weights and KV cache dtype; auto = bfloat16 on a GPU or a CPU with native bf16, else float32")
    add_flag(parser, "--device", default="auto", choices=["auto", "cpu", "cuda"], help="device to run on")
    add_flag(parser, "--kv-cache-bytes", type=parse_bytes, default=1 * GiB, help="KV cache budget on a CPU")
    add_flag(parser, "--gpu-memory-utilization", type=float, default=0.9,
             help="on a GPU: share of device memory for weights, activations and the KV cache (sized by profiling)")
    add_flag(parser, "--block-size", type=int, default=16, help="tokens per KV cache block")
    add_flag(parser, "--max-model-len", type=int, help="longest sequence (default: the model's limit)")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=2048, help="most tokens in one step")
    add_flag(parser, "--max-num-seqs", type=int, default=256, help="most requests in one step")
    add_flag(parser, "--num-threads", type=int, help="torch intra-op threads (default: torch's choice)")
    add_flag(parser, "--attention-backend", default="auto", choices=["auto", "torch"],
             help="auto: CUDA kernels on a GPU, the compiled CPU kernels (paged decode, fused norm and "
                  "activation) on a CPU; torch: PyTorch only")
    add_flag(parser, "--cpu-float32-copy", type=bool, default=True,
             help="bfloat16/float16 on a CPU without native bf16: keep a float32 copy of the matmul weights "
                  "for batches of more than 2 rows (3x the weight memory; batched decode about 1.9x faster)")
    add_flag(parser, "--cpu-gemv", type=bool, default=True,
             help="bfloat16 on a CPU: decode matmuls of up to 8 rows on the compiled GEMV kernel (batch-1 "
                  "decode about 1.25x faster; with native bf16 it keeps the plain weights beside the packed "
                  "ones: 2x the matmul weight memory); with --quantization int8, the int8 GEMV kernel for "
                  "up to 16 rows (no extra memory)")
    add_flag(parser, "--cpu-gemm-tiles", type=bool, default=True,
             help="bfloat16 on a CPU with AVX512_BF16 (and --cpu-gemv): hold each matmul weight in column tiles "
                  "in place of the GEMV's plain copy and multiply every matmul of up to 256 rows there (32-row "
                  "decode matmuls about 1.4x faster than oneDNN's); false keeps the plain GEMV for 8 rows. "
                  "With --quantization w8a8 on AVX512_VNNI: int8 column tiles for every row count "
                  "(bit-identical to oneDNN's int8 GEMM, faster); false keeps the int8 GEMV up to 16 rows "
                  "and oneDNN's GEMM above")
    add_flag(parser, "--cpu-amx-gemm", type=bool, default=True,
             help="bfloat16 on a CPU with AMX-BF16: matmuls above the column tiles' rows on Spindle's AMX kernel "
                  "up to the rows where oneDNN's GEMM wins, timed once per weight shape and kept in the cache "
                  "folder (30 layers' matmuls at 16-48 rows 1.2-1.5x faster than oneDNN's on a 2-core Sapphire "
                  "Rapids; one more copy of the matmul weights); with --quantization int8, the int8 weights on "
                  "the same kernel from the rows where it beats the int8 GEMV (a 20-row decode step's matmuls "
                  "1.35x faster than bfloat16's there; one more copy of the int8 weights); false leaves them to "
                  "oneDNN (int8: the int8 GEMV, int8pack_mm and the widened GEMM)")
    add_flag(parser, "--cpu-amx-attention", type=bool, default=True,
             help="bfloat16 on a CPU with AMX-BF16: attention on the AMX tile unit where head_dim is 64: prefills, "
                  "and decodes on a bfloat16 cache, or an int8 one (AMX-INT8), with --block-size a multiple of 16 "
                  "(decode attention 1.1x the AVX-512 kernels at 48 requests of 375 tokens on a 2-core Sapphire "
                  "Rapids, both caches); false keeps the AVX-512 kernels")
    add_flag(parser, "--cpu-huge-pages", type=bool, default=True,
             help="the packed weights decode steps stream (column tiles, the AMX GEMM) on transparent huge pages "
                  "where the kernel allows them (always or madvise): no TLB miss every 4 KiB (30 layers' matmuls "
                  "at 40 rows 1.13x on a 2-core Sapphire Rapids VM); false keeps them on small pages")
    add_flag(parser, "--cpu-greedy-head-screen", type=bool, default=True,
             help="bfloat16 weights: all-greedy steps (no logprobs or logits processors) read the LM head in "
                  "int8 and compute again from the bfloat16 head only the tokens the int8 error bound leaves in "
                  "reach of the maximum: the same tokens, half the head's bytes; false reads the whole bfloat16 head")
    add_flag(parser, "--cpu-fused-decode", type=bool, default=True,
             help="decode steps of a few rows (all matmuls on the GEMVs above) run every decoder layer in one "
                  "compiled call instead of nine kernel calls a layer from Python (the same kernels and results)")
    add_flag(parser, "--quantization", default="none", choices=list(QUANTIZATIONS),
             help="int8: weight-only int8 matmul weights (the LM head too) with a scale per output channel, "
                  "activations in --dtype; half of bf16's weight memory; CPU only (GGUF Q8_0 weights read "
                  "from the file); w8a8: the same int8 weights, and matmuls quantize their activations to "
                  "int8 (see --w8a8-group-size) and multiply on the CPU's int8 dot products (needs "
                  "AVX512_VNNI, AVX_VNNI or AMX; refused elsewhere)")
    add_flag(parser, "--w8a8-group-size", type=int, default=-1,
             help="--quantization w8a8 on the int8 column tiles: quantize activations in groups of this many "
                  "input values, a scale each (a multiple of 4), the weights then asymmetric per channel as "
                  "OpenVINO's. Groups of 32 kept 22.0 of 64 greedy tokens against float32 on 32 chat prompts "
                  "(OpenVINO int8 20.9) where one scale per row kept 11.8, for 1.2-1.4x the matmul time from "
                  "8 rows; 0: one scale per row, symmetric weights (all oneDNN's int8 GEMM takes); -1: auto, "
                  "32 where the tiles take every matmul (AVX512_VNNI, bfloat16, --cpu-gemm-tiles, no "
                  "AMX-INT8), per row elsewhere")
    add_flag(parser, "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
             help="auto: keys and values in --dtype; int8: 8-bit keys and values with a scale per token and "
                  "KV head, half of bfloat16's cache bytes, so decode attention reads half as much (CPU only, "
                  "with the compiled kernels)")
    add_flag(parser, "--fake-model", type=bool, default=False,
             help="load no weights; every step returns a fixed token at once (measures engine overhead)")
    add_flag(parser, "--fake-model-fault-token-id", type=int, default=-1,
             help="with --fake-model: a prompt holding this token id makes its step and every later one fail, "
                  "as a sticky device fault does (for fault-handling tests; -1: never)")
    # The scheduler reads the same flag (and SPINDLE_WORKER_STEP_TIMEOUT_S) for its own timeout.
    add_flag(parser, "--worker-step-timeout-s", type=float, default=30.0,
             help="seconds one step may run before health turns NOT_SERVING (so a liveness probe restarts a "
                  "hung worker); must exceed the slowest legitimate step; 0 disables it")
    add_flag(parser, "--worker-max-consecutive-failed-steps", type=int, default=3,
             help="failed steps in a row after which the worker reports NOT_SERVING and ends its step stream "
                  "(a sticky device fault), so liveness restarts it; 0 never")
    # The scheduler reads the same SPINDLE_TENSOR_PARALLEL_SIZE for the number of ranks it drives.
    add_flag(parser, "--tensor-parallel-size", type=int, default=1,
             help="worker ranks that split one model (each its own worker service); 1: no tensor parallelism")
    add_flag(parser, "--tensor-parallel-rank", type=int, default=0, help="this worker's rank, 0 to size - 1")
    add_flag(parser, "--tensor-parallel-port", type=int, default=29500,
             help="port of the process group's rendezvous store, served by rank 0 on its host")
    add_flag(parser, "--tensor-parallel-timeout-s", type=float, default=20.0,
             help="seconds a collective or the rendezvous may wait for the other ranks before the step "
                  "fails (a dead or hung rank); keep it below the scheduler's --worker-step-timeout-s")
    add_telemetry_flags(parser, default_metrics_port=9093)
    add_service_auth_flags(parser, accepts_token_of="worker", default_allowed_clients=SCHEDULER_IDENTITY)
    add_common_flags(parser)
    return parser


def config_from_args(argv: list[str] | None = None) -> WorkerConfig:
    args = build_parser().parse_args(argv)
    return WorkerConfig(
        worker_addr=args.worker_addr,
        model=args.model or None,
        served_model_name=args.served_model_name or None,
        cache_dir=args.cache_dir or None,
        dtype=args.dtype,
        device=args.device,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        cpu_float32_copy=args.cpu_float32_copy,
        cpu_gemv=args.cpu_gemv,
        cpu_fused_decode=args.cpu_fused_decode,
        cpu_gemm_tiles=args.cpu_gemm_tiles,
        cpu_amx_gemm=args.cpu_amx_gemm,
        cpu_amx_attention=args.cpu_amx_attention,
        cpu_huge_pages=args.cpu_huge_pages,
        cpu_greedy_head_screen=args.cpu_greedy_head_screen,
        quantization=args.quantization,
        w8a8_group_size=args.w8a8_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        fake_model=args.fake_model,
        fake_fault_token_id=args.fake_model_fault_token_id,
        step_timeout_s=args.worker_step_timeout_s,
        max_consecutive_failed_steps=args.worker_max_consecutive_failed_steps,
        telemetry=telemetry_config_from_args(args),
        auth=service_auth_config_from_args(args),
        tensor_parallel_size=args.tensor_parallel_size,
        tensor_parallel_rank=args.tensor_parallel_rank,
        tensor_parallel_port=args.tensor_parallel_port,
        tensor_parallel_timeout_s=args.tensor_parallel_timeout_s,
    )


def cpu_has_native_bf16() -> bool:
    return _cpu_has_any("amx_bf16", "avx512_bf16")


def cpu_has_amx_bf16() -> bool:
    return _cpu_has_any("amx_bf16")


def cpu_has_amx_int8() -> bool:
    return _cpu_has_any("amx_int8")


def cpu_has_int8_dot() -> bool:
    """VNNI or AMX-INT8: int8 dot products summed into int32, which W8A8's `torch._int_mm` needs to
    run at speed (without them oneDNN's int8 GEMM was 14x slower than float32 here)."""
    return _cpu_has_any("amx_int8", "avx512_vnni", "avx_vnni")


def _cpu_has_any(*flags: str) -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(rf"\b({'|'.join(flags)})\b", cpuinfo))


def resolve_device(name: str, tensor_parallel_rank: int = 0) -> torch.device:
    """auto: the GPU when PyTorch sees one (the CuPy kernels run there), else the CPU. A rank of a
    tensor-parallel group that sees several GPUs (ranks started side by side on one machine) takes
    GPU `rank mod count`; one that sees a single GPU (a container given one) takes that one."""
    has_cuda = torch.cuda.is_available()
    if name == "cuda" and not has_cuda:
        raise ValueError(
            "--device cuda: no CUDA device visible to PyTorch (a CPU build of torch, or no driver); "
            "use --device cpu"
        )
    if name == "cuda" or (name == "auto" and has_cuda):
        device = torch.device("cuda", tensor_parallel_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)  # NCCL's communicator and the CuPy kernels use the current device
        return device
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32
