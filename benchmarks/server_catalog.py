"""Every server the harness can run, by name: Spindle's configurations (float32, bf16, int8, the
fake model) over HTTP, the HTTP peers (transformers serve, llama.cpp) and the in-process ones
(OpenVINO GenAI, HF generate), each with a note of how it runs and a reason when it cannot."""
from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import openvino_peer, peers
from benchmarks.repeats import log
from benchmarks.servers import ProcessServer, Server, SpindleServer, free_port, transformers_serve_dtype


# The rows with the int8 KV cache: their weights' variables (those of the row without the cache)
# and what their weights are.
KV8_ROWS = {"spindle-bf16-kv8": ({}, "bfloat16 weights"),
            "spindle-int8-kv8": ({"SPINDLE_QUANTIZATION": "int8"},
                                 "weight-only int8 matmul weights, bfloat16 activations"),
            "spindle-w8a8-kv8": ({"SPINDLE_QUANTIZATION": "w8a8", "SPINDLE_W8A8_GROUP_SIZE": "32"},
                                 "int8 matmul weights, W8A8 in groups of 32")}

# The W8A8 rows: their --w8a8-group-size and how their activations are quantized. Explicit, not
# auto: auto takes one scale per row where the CPU has AMX-INT8, and a row must be the same
# configuration (and accuracy) on every machine. Groups need the int8 tiles (AVX512_VNNI and
# AVX512_BF16); where they are missing the row does not start and says so.
W8A8_GROUPS = {"spindle-w8a8": ("32", "in groups of 32 (asymmetric weights; as OpenVINO's int8)"),
               "spindle-w8a8-rows": ("0", "per row (symmetric weights)")}


def model_folder() -> str:
    from services.common.model_files import resolve_model

    return str(resolve_model(None, None).path)


def gguf_path() -> str:
    from services.common.model_files import embedded_gguf_path

    return str(embedded_gguf_path())


def transformers_serve(dtype: str) -> Server:
    """`dtype` auto: the faster of bfloat16 and float32 on this CPU (servers.transformers_serve_dtype)."""
    is_auto, dtype = dtype == "auto", transformers_serve_dtype() if dtype == "auto" else dtype
    path = model_folder()
    command = [str(peers.venv_dir("transformers-serve") / "bin" / "transformers"), "serve", "--continuous-batching",
               "--host", "127.0.0.1", "--port", str(port := free_port()), "--dtype", dtype, "--device", "cpu",
               "--log-level", "warning", path]
    # It refuses stream_options and ignores logit_bias under continuous batching, but takes a
    # per-request generation config: an EOS id outside the vocabulary forces max_tokens tokens.
    force = {"generation_config": json.dumps({"do_sample": False, "eos_token_id": 10**6}), "stream_options": None}
    return ProcessServer("transformers-serve", command, port, path, force, forces_length=True,
                         note=f"transformers {peers.installed_version('transformers-serve')}, {dtype}"
                              + (" (auto: the faster dtype on this CPU)" if is_auto else ""))


def llama_cpp_server() -> Server:
    port = free_port()
    command = [str(peers.venv_python("llama-cpp")), str(Path(__file__).parent / "llama_cpp_launcher.py"),
               "--model", gguf_path(), "--port", str(port), "--n-ctx", "8192"]
    return ProcessServer("llama-cpp", command, port, "SmolLM2-135M-Instruct",
                         {"logit_bias": {"2": -100.0}, "stream_options": None}, forces_length=True,
                         note=f"llama-cpp-python {peers.installed_version('llama-cpp')}, GGUF Q4_1 weights, "
                              "one request at a time")


def openvino_server(name: str, max_num_seqs: int) -> Server:
    variant = openvino_peer.VARIANTS[name.removeprefix("openvino-")]
    server = Server(name, note=f"OpenVINO GenAI {peers.installed_version('openvino').split()[0]}, {variant.description}, "
                                f"in-process ContinuousBatchingPipeline, max_num_seqs {max_num_seqs}")
    server.info = {"variant": variant.name, "max_num_seqs": max_num_seqs}
    return server


def make_servers(names: list[str], dtype: str, install: bool, bf16_max_concurrency: int = 8,
                 hf_max_concurrency: int | None = None, transformers_dtype: str = "auto",
                 openvino_max_num_seqs: int = 256) -> list[Server]:
    servers: list[Server] = []
    for name in names:
        interval = re.fullmatch(r"(spindle.*)-si(\d+)", name)
        if interval:  # any Spindle row with --stream-interval N: its name ends in -siN
            base_name, stream_interval = interval.groups()
            (server,) = make_servers([base_name], dtype, install, bf16_max_concurrency)
            server.name = name
            server.env = {**server.env, "SPINDLE_STREAM_INTERVAL": stream_interval}
            server.note += f"; streamed responses sent every {stream_interval} tokens (--stream-interval)"
            servers.append(server)
        elif name == "spindle":
            servers.append(SpindleServer("spindle", env={"SPINDLE_DTYPE": dtype}, note=dtype))
        elif name == "spindle-fake":  # the harness's own check: no model, tokens at once
            servers.append(SpindleServer("spindle-fake", env={"SPINDLE_FAKE_MODEL": "true"}, note="fake model"))
        elif name == "spindle-bf16":
            from services.worker.config import cpu_has_native_bf16

            matmuls = ("native bfloat16 matmuls" if cpu_has_native_bf16()
                       else "batches multiply on a float32 copy of the weights: no bfloat16 arithmetic on this CPU")
            server = SpindleServer("spindle-bf16", env={"SPINDLE_DTYPE": "bfloat16"},
                                   note=f"bfloat16 weights and KV cache ({matmuls}); c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name == "spindle-bf16-gemv":  # the same without the column tiles, for the comparison
            server = SpindleServer(name, env={"SPINDLE_DTYPE": "bfloat16", "SPINDLE_CPU_GEMM_TILES": "false"},
                                   note="bfloat16 as spindle-bf16 with --cpu-gemm-tiles false: the plain GEMV up "
                                        f"to 8 rows, oneDNN above; c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name == "spindle-bf16-onednn":  # the same without the AMX GEMM, for the comparison
            server = SpindleServer(name, env={"SPINDLE_DTYPE": "bfloat16", "SPINDLE_CPU_AMX_GEMM": "false"},
                                   note="bfloat16 as spindle-bf16 with --cpu-amx-gemm false: oneDNN's GEMM above the "
                                        f"column tiles' rows (the same as spindle-bf16 without AMX-BF16); "
                                        f"c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name == "spindle-bf16-avx512-attention":  # the same with attention off the AMX tiles
            server = SpindleServer(name, env={"SPINDLE_DTYPE": "bfloat16", "SPINDLE_CPU_AMX_ATTENTION": "false"},
                                   note="bfloat16 as spindle-bf16 with --cpu-amx-attention false: prefill and decode "
                                        "attention on the AVX-512 kernels (the same as spindle-bf16 without "
                                        f"AMX-BF16); c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name == "spindle-bf16-layered":  # the same with every decode step's layers called from Python
            server = SpindleServer(name, env={"SPINDLE_DTYPE": "bfloat16", "SPINDLE_CPU_FUSED_DECODE": "false"},
                                   note="bfloat16 as spindle-bf16 with --cpu-fused-decode false: decode steps "
                                        f"layer by layer from Python; c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name == "spindle-bf16-kv8-full-head":  # spindle-bf16-kv8 with every greedy step on the bf16 head
            env = {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_KV_CACHE_DTYPE": "int8",
                   "SPINDLE_CPU_GREEDY_HEAD_SCREEN": "false"}
            server = SpindleServer(name, env=env,
                                   note="bfloat16 with the int8 KV cache as spindle-bf16-kv8, with "
                                        "--cpu-greedy-head-screen false: greedy steps read the whole bfloat16 LM "
                                        f"head; c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name == "spindle-int8":
            server = SpindleServer("spindle-int8", env={"SPINDLE_DTYPE": "bfloat16", "SPINDLE_QUANTIZATION": "int8"},
                                   note="weight-only int8 matmul weights (per-channel scales), bfloat16 activations "
                                        f"and KV cache; c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name in W8A8_GROUPS:
            group_size, activations = W8A8_GROUPS[name]
            env = {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_QUANTIZATION": "w8a8", "SPINDLE_W8A8_GROUP_SIZE": group_size}
            server = SpindleServer(name, env=env,
                                   note="int8 matmul weights (per-channel scales); matmuls quantize their "
                                        f"bfloat16 activations {activations} (W8A8, the CPU's int8 dot products); "
                                        f"c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name in KV8_ROWS:  # as OpenVINO's CPU plugin keeps its cache: 8-bit
            weight_env, weights = KV8_ROWS[name]
            env = {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_KV_CACHE_DTYPE": "int8", **weight_env}
            server = SpindleServer(name, env=env,
                                   note=f"{weights}, int8 KV cache (rows about their midpoint: a scale and a "
                                        f"midpoint per token and KV head); c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name in ("transformers-serve", "llama-cpp", "openvino-bf16", "openvino-int8"):
            peer = "openvino" if name.startswith("openvino-") else name
            why = peers.install(peer, log=log) if install else (
                "" if peers.is_installed(peer) else "not installed (python -m benchmarks.peers install " + peer + ")")
            if why:
                servers.append(Server(name, skip_reason=why))
            elif peer == "openvino":
                servers.append(openvino_server(name, openvino_max_num_seqs))
            else:
                servers.append(transformers_serve(transformers_dtype) if name == "transformers-serve"
                               else llama_cpp_server())
        elif name == "hf-generate":
            limit = f"; c<={hf_max_concurrency} only" if hf_max_concurrency else ""
            servers.append(Server("hf-generate", note=f"static batches (batch = c), {dtype}{limit}",
                                  max_concurrency=hf_max_concurrency))
        else:
            raise SystemExit(f"unknown server {name!r}")
    return servers
