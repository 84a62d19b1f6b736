"""OpenVINO GenAI's greedy tokens on given prompts, run in the peer's venv (`benchmarks.engine_drift`).

    benchmarks/.peers/openvino/bin/python -m benchmarks.openvino_greedy --model-dir DIR --variant int8 \
        --ir-root benchmarks/.peers/openvino/ir --prompts prompts.json --max-tokens 64 --out out.json

Each prompt (token ids) runs alone through the same `ContinuousBatchingPipeline` the benchmark
drives (`openvino_peer.make_pipeline`, the CPU plugin's defaults: its u8 KV cache and, on int8
weights, activations quantized on the fly), greedy for `--max-tokens` tokens with EOS ignored.
Only the standard library is imported at the top, as in `openvino_peer`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.openvino_peer import VARIANTS, PipelineSettings, export_ir, greedy_config, make_pipeline, tensor_input


def greedy_tokens(pipe, prompt_ids: list[int], max_tokens: int) -> list[int]:
    results = pipe.generate([tensor_input({"prompt_ids": prompt_ids})], [greedy_config(max_tokens)])
    return [int(t) for t in results[0].m_generation_ids[0]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--ir-root", required=True)
    parser.add_argument("--prompts", required=True, help="JSON: a list of prompts, each a list of token ids")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import openvino

    variant = VARIANTS[args.variant]
    ir_dir, _ = export_ir(Path(args.model_dir), Path(args.ir_root), variant)
    pipe = make_pipeline(ir_dir, variant, PipelineSettings(cache_size_gb=1))
    prompts = json.loads(Path(args.prompts).read_text())
    core = openvino.Core()
    out = {"variant": variant.name, "openvino": openvino.__version__,
           "kv_cache_precision": core.get_property("CPU", "KV_CACHE_PRECISION").get_type_name(),
           "dynamic_quantization_group_size": int(core.get_property("CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE")),
           "outputs": [greedy_tokens(pipe, p, args.max_tokens) for p in prompts]}
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
