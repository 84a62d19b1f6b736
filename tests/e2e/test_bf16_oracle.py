"""bfloat16 serving against Hugging Face transformers: the three services serve the embedded
SmolLM2-135M-Instruct in bfloat16, and each generated position's token and logprobs are checked
against transformers run teacher-forced on the same prompt + tokens (bf16, and float32 as the bound
bf16 serving should stay near).

bf16 is what `--dtype auto` picks on a CPU with bf16 arithmetic and what the benchmarks run; the
worker has two bf16 matmul paths (oneDNN bf16 on AVX512_BF16/AMX CPUs, a float32 copy of the bf16
weights elsewhere), and both are served here: the CPU's own, and on a native-bf16 CPU also the
float32-copy path, by starting the worker as a CPU without bf16 arithmetic would see itself.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import re
import subprocess
import sys
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.model_files import resolve_model
from services.worker.config import cpu_has_native_bf16
from tests.e2e.bf16_reference import (ByteTable, Measured, Tolerances, assert_aggregates, compare,
                                      reference_logprobs, sample_from_chat)
from tests.e2e.cluster import ROOT, SpindleCluster

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.",
]
MAX_TOKENS = 24
TOP_LOGPROBS = 5

# Measured over the 6 prompts (115-125 positions), against transformers bf16 / float32, on the
# oneDNN bf16 path and on the float32-copy path:
#   argmax agreement 0.965 / 0.965 (oneDNN), 1.000 / 0.968 (float32 copy); worst rank 2;
#   worst gap below the reference's argmax 0.125 / 0.103; worst |dlogprob| 0.158 / 0.164;
#   mean |dlogprob| 0.032 / 0.020; worst top-5 overlap 4.
TOLERANCES = Tolerances(
    # bf16 logits of magnitude 16-32 are 0.125 apart, so the reference's own top two often tie or sit
    # one step apart: our token may be its runner-up, never lower than third...
    chosen_within_top=3,
    # ...and then only by a near-tie: two bf16 steps of such a logit.
    max_argmax_gap=0.25,
    # Disagreement is confined to those near-ties: 4 of 115 positions measured.
    min_argmax_fraction=0.9,
    # Two bf16 steps of a logit again; 1.5x the worst measured, and half a shift of 0.5 nats.
    max_logprob_diff=0.25,
    # The errors are rounding, mostly far below the worst: a mean near 2x the measured one means
    # a systematic error, which no single position would show.
    max_mean_logprob_diff=0.06,
    # The fifth alternative is often a near-tie with the sixth; one swap of that kind is allowed.
    min_top_overlap=3,
)
# Against transformers' own bf16 two roundings meet: ours and its own, each measured up to 0.2 from
# float32 on the served tokens. Served on a 2-core AMX Xeon, 30 runs of this module and 40
# in-process arrival patterns: ours against float32 worst 0.129-0.196 (0.25 holds); against
# transformers bf16 worst 0.150-0.275 (one run in 30 past 0.25: "List three prime numbers."
# position 10, a near-tie, when that prompt's prefill shared a step with one other prompt instead of
# following a cached prefix); transformers bf16 against float32 up to 0.153 on the same tokens. The
# batch composition moves which kernels round where, not what is computed: a replay of the failing
# run's recorded steps in one process gave its logprobs exactly. So against a bf16 reference the
# bound is the float32 one plus that reference's own drift: three bf16 steps of a logit.
# On a CPU without bf16 arithmetic (AVX2) transformers' bf16 runs on PyTorch's emulated bf16
# matmuls: measured there over the 6 prompts (2-core AMD EPYC, AVX2 only), ours against it worst
# |dlogprob| 0.263 at a near-tie, its own drift from float32 0.167; ours against float32 0.182.
BF16_REFERENCE_TOLERANCES = dataclasses.replace(TOLERANCES, max_logprob_diff=0.375)


def tolerances_for(ref_dtype: torch.dtype) -> Tolerances:
    return BF16_REFERENCE_TOLERANCES if ref_dtype == torch.bfloat16 else TOLERANCES

KV_ENV = {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_KV_CACHE_BYTES": str(64 * 2**20), "SPINDLE_MAX_MODEL_LEN": "512"}
# The worker as it starts on a CPU without bf16 arithmetic: the check is patched before the modules
# that import it load, and the C kernels are built for AVX2 (no AVX512_BF16 dot products).
NO_NATIVE_BF16_WORKER = ("import sys, services.worker.config as config; config.cpu_has_native_bf16 = lambda: False; "
                         "from services.worker.__main__ import main; sys.exit(main())")
LOADED_LINE = re.compile(r"(\d+) matmul weights prepacked, (\d+) with a float32 copy")


class NoNativeBf16Cluster(SpindleCluster):
    def start_service(self, name: str) -> subprocess.Popen:
        if name != "worker":
            return super().start_service(name)
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-c", NO_NATIVE_BF16_WORKER], cwd=ROOT, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc


@pytest.fixture(scope="module")
def model():
    return resolve_model(None, None)


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model.path)


@pytest.fixture(scope="module")
def hf_models(model):
    return {dtype: AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype).eval()
            for dtype in (torch.bfloat16, torch.float32)}


async def _chat_all(base_url: str, model_name: str) -> list[dict]:
    # Concurrent, as served under load: the decode steps run as one batch (the float32-copy path
    # takes its batched matmul only above 2 rows).
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        responses = await asyncio.gather(*[
            client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS,
                temperature=0, logprobs=True, top_logprobs=TOP_LOGPROBS, extra_body={"return_token_ids": True})
            for p in PROMPTS
        ])
    finally:
        await client.close()
    return [r.model_dump(mode="json") for r in responses]


@pytest.fixture(scope="module", params=["cpu_default", "float32_copy"])
def served(request, model, tmp_path_factory):
    """The served samples of one bf16 matmul path; the cluster runs only while they are collected."""
    if request.param == "float32_copy" and not cpu_has_native_bf16():
        pytest.skip("this CPU has no bf16 arithmetic: its own path already is the float32 copy")
    log_dir = tmp_path_factory.mktemp(request.param)
    if request.param == "float32_copy":
        cluster = NoNativeBf16Cluster(log_dir, env={**KV_ENV, "SPINDLE_CPU_KERNEL_MARCH": "x86-64-v3"})
    else:
        cluster = SpindleCluster(log_dir, env=KV_ENV)
    try:
        cluster.start()
        stats = _get_stats(cluster)
        responses = asyncio.run(_chat_all(cluster.base_url, model.name))
    finally:
        cluster.stop()
    assert stats["dtype"] == "bfloat16"
    loaded = LOADED_LINE.search((log_dir / "worker.log").read_text())
    assert loaded, cluster.log_tail("worker")
    num_packed, num_copied = int(loaded.group(1)), int(loaded.group(2))
    # The path under test is the one the worker took: 121 matmul weights (30 layers x qkv, o,
    # gate_up, down, plus the head), either all prepacked for bf16 or all with a float32 copy.
    expect_native = request.param == "cpu_default" and cpu_has_native_bf16()
    assert (num_packed, num_copied) == ((121, 0) if expect_native else (0, 121))
    return [sample_from_chat(p, r) for p, r in zip(PROMPTS, responses)]


def _get_stats(cluster: SpindleCluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=10) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def references(served, hf_models):
    return {dtype: [reference_logprobs(hf, s.prompt_token_ids, s.token_ids) for s in served]
            for dtype, hf in hf_models.items()}


def _check_all(samples, refs, tokenizer, tol: Tolerances) -> Measured:
    token_bytes = ByteTable(tokenizer)
    measured = Measured()
    for sample, ref in zip(samples, refs):
        compare(sample, ref, token_bytes, tol, measured)
    assert_aggregates(measured, tol)
    return measured


@pytest.mark.parametrize("ref_dtype", [torch.bfloat16, torch.float32], ids=["hf_bf16", "hf_float32"])
def test_bf16_serving_matches_transformers(served, references, tokenizer, ref_dtype):
    measured = _check_all(served, references[ref_dtype], tokenizer, tolerances_for(ref_dtype))
    print(f"bf16 serving vs transformers {ref_dtype}: {measured.summary()}")
    # Every prompt ran to its limit or to the end of its turn: nothing cut short unseen.
    assert all(len(s.positions) == MAX_TOKENS or s.token_ids[-1] == tokenizer.eos_token_id for s in served)


def test_prompts_are_the_chat_template_of_transformers(served, tokenizer):
    # The reference is teacher-forced on our prompt ids: they must be the conversation transformers renders.
    for prompt, sample in zip(PROMPTS, served):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert sample.prompt_token_ids == list(ids), prompt


# The comparison must fail when the served side is wrong: perturbed copies of real samples.
BF16_TOL = tolerances_for(torch.bfloat16)

def test_logprobs_shifted_by_half_a_nat_fail(served, references, tokenizer):
    samples = copy.deepcopy(served)
    for pos in samples[1].positions:
        pos.logprob -= 0.5
    with pytest.raises(AssertionError, match=rf"Write a haiku.*logprob ours .*> {BF16_TOL.max_logprob_diff}"):
        _check_all(samples, references[torch.bfloat16], tokenizer, BF16_TOL)


def test_a_small_systematic_error_fails_the_mean(served, references, tokenizer):
    # Every logprob 0.08 off the reference: within the per-position limit, over the mean one.
    refs = references[torch.bfloat16]
    samples = copy.deepcopy(served)
    for sample, ref in zip(samples, refs):
        for i, pos in enumerate(sample.positions):
            pos.logprob = float(ref[i, pos.token_id]) + 0.08
    with pytest.raises(AssertionError, match=r"mean \|dlogprob\| 0.0800 > 0.06"):
        _check_all(samples, refs, tokenizer, BF16_TOL)


def test_a_low_ranked_token_fails(served, references, tokenizer):
    refs = references[torch.bfloat16]
    samples = copy.deepcopy(served)
    pos = samples[0].positions[3]
    pos.token_id = int(torch.topk(refs[0][3], 50).indices[-1])  # the reference's 50th choice
    pos.token_bytes = ByteTable(tokenizer)(pos.token_id)
    with pytest.raises(AssertionError, match=r"capital of France\?: position 3 .*reference rank \d+ \(limit 3\)"):
        _check_all(samples, refs, tokenizer, BF16_TOL)


def test_foreign_top_logprobs_fail(served, references, tokenizer):
    refs = references[torch.bfloat16]
    token_bytes = ByteTable(tokenizer)
    samples = copy.deepcopy(served)
    pos = samples[2].positions[5]
    ranks_20_to_24 = torch.topk(refs[2][5], 25).indices[20:]
    pos.top = [(token_bytes(int(t)), lp) for t, (_, lp) in zip(ranks_20_to_24, pos.top)]
    with pytest.raises(AssertionError, match=r"prime numbers\.: position 5 .*top-5 overlap 0 < 3"):
        _check_all(samples, refs, tokenizer, BF16_TOL)


def test_bytes_of_another_token_fail(served, references, tokenizer):
    samples = copy.deepcopy(served)
    samples[3].positions[0].token_bytes += b"x"
    with pytest.raises(AssertionError, match=r"gravity in one sentence\.: position 0 .*do not belong"):
        _check_all(samples, references[torch.bfloat16], tokenizer, BF16_TOL)


def test_too_few_argmax_agreements_fail():
    measured = Measured(positions=20, argmax_hits=17)  # 0.85
    with pytest.raises(AssertionError, match=r"argmax at 0.850 of positions, < 0.9"):
        assert_aggregates(measured, TOLERANCES)
