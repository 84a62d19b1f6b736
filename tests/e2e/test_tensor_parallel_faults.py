"""A tensor-parallel rank lost mid-stream: every in-flight request ends with an error naming the
rank, health turns 503, a restarted rank whose dtype differs from rank 0's is refused at the
handshake, and once a matching rank 1 is back the engine serves again (the surviving rank 0 forms
a new process group with it) without restarting the scheduler or the frontend."""
from __future__ import annotations

import threading

import openai
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.e2e.cluster import SpindleCluster
from tests.e2e.parity import assert_greedy_match, hf_greedy
from tests.e2e.probes import health_status, wait_until
from tests.e2e.test_tiny_models import build_tiny_model

LONG_MAX_TOKENS = 3000  # thousands of steps: still running when rank 1 is killed


def _long_context_tiny_qwen2(path):
    model_dir = build_tiny_model(path, "qwen2")
    config = AutoConfig.from_pretrained(model_dir)
    config.max_position_embeddings = 4096
    config.save_pretrained(model_dir)
    return model_dir


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _start_streams(cluster, model_name: str, num_streams: int) -> tuple[list[threading.Event], list[threading.Event], list[dict]]:
    firsts, dones, results = [], [], []
    for i in range(num_streams):
        first, done, result = threading.Event(), threading.Event(), {}

        def run(first=first, done=done, result=result, i=i):
            try:
                stream = _client(cluster).completions.create(
                    model=model_name, prompt=[5 + i] * 20, max_tokens=LONG_MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
                for chunk in stream:
                    first.set()
                result["finished"] = True
            except Exception as exc:  # recorded for the test to assert on
                result["error"] = exc
            finally:
                first.set()
                done.set()

        threading.Thread(target=run, daemon=True).start()
        firsts.append(first), dones.append(done), results.append(result)
    return firsts, dones, results


def test_killed_rank_fails_requests_then_a_restarted_rank_rejoins(tmp_path):
    model_dir = _long_context_tiny_qwen2(tmp_path / "tiny")
    cluster = SpindleCluster(tmp_path, env={"SPINDLE_MODEL": str(model_dir), "SPINDLE_ENGINE_WAIT_TIMEOUT": "1"},
                             tensor_parallel_size=2)
    cluster.start()
    try:
        scheduler_pid, frontend_pid = cluster.procs["scheduler"].pid, cluster.procs["frontend"].pid
        firsts, dones, results = _start_streams(cluster, model_dir.name, 3)
        assert all(f.wait(120) for f in firsts) and not any("error" in r for r in results), results
        cluster.procs["worker1"].kill()
        assert all(d.wait(30) for d in dones), "a request on a lost rank hung"
        for result in results:
            assert "error" in result, "a request whose rank died must fail, not complete"
            assert "rank 1" in str(result["error"]), result["error"]
        wait_until(lambda: health_status(cluster) == 503, "health did not turn 503", timeout_s=10)

        # A rank 1 in bfloat16 does not match rank 0's float32: refused, and the engine stays down.
        cluster.service_env["worker1"] = {**cluster.service_env["worker1"], "SPINDLE_DTYPE": "bfloat16"}
        cluster.start_service("worker1")
        refusal = "rank 1 at " + cluster.worker_addrs[1] + " refused: its dtype 'bfloat16' differs from rank 0's 'float32'"
        wait_until(lambda: refusal in cluster.log_tail("scheduler", 20000), "the mismatched rank was not refused",
                    timeout_s=120)
        assert health_status(cluster) == 503
        cluster.stop_service("worker1")

        del cluster.service_env["worker1"]["SPINDLE_DTYPE"]
        cluster.start_service("worker1")
        cluster.wait_healthy(timeout_s=120)
        prompt = [7] * 30
        resp = _client(cluster).completions.create(model=model_dir.name, prompt=prompt, max_tokens=16, temperature=0,
                                                   extra_body={"return_token_ids": True})
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        assert_greedy_match(resp.choices[0].token_ids, hf_greedy(hf, prompt, 16), "after the rank rejoined")
        assert (cluster.procs["scheduler"].pid, cluster.procs["frontend"].pid) == (scheduler_pid, frontend_pid)
        assert cluster.procs["scheduler"].poll() is None and cluster.procs["frontend"].poll() is None
    finally:
        cluster.stop()
