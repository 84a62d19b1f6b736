"""Factories for worker tests: tiny random HF models, a model runner on them, and a minimal
scheduler stand-in that hands out blocks and chunks prefills under a token budget."""
from __future__ import annotations

from pathlib import Path

import torch

from services.common.messages import NewRequestData, SamplingParams, SchedulerOutput
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import RunnerConfig
from services.worker.kv_cache import KVCacheLayout
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner
from services.worker.platforms.cpu import CpuPlatform

VOCAB_SIZE = 512


def save_llama_head_dim_64(path: Path, sharpen_attention: bool = True) -> Path:
    """A 2-layer random Llama with head_dim 64 (hidden 256, 4 query heads, 2 KV heads), the shape
    the compiled decode and prefill kernels' fast paths serve; with `sharpen_attention` its query
    and key weights scaled 4x for sharper attention than the random init's near-uniform one. Saved
    as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for layer in model.model.layers if sharpen_attention else ():
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(str(path))
    return path


def save_tiny_model(path: Path, arch: str) -> Path:
    """A 2-layer random model with GQA (4 query heads, 2 KV heads), saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            # Default init gives near-uniform attention, which would hide position and masking bugs:
            # sharpen it so each token attends to a few others.
            attn.q_proj.weight.mul_(8.0)
            attn.k_proj.weight.mul_(8.0)
            if attn.q_proj.bias is not None:  # Qwen2: random init leaves biases at zero; make them matter
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return path


def make_runner(model_dir: Path, block_size: int = 4, num_blocks: int = 128, max_num_seqs: int = 16,
                dtype: torch.dtype = torch.float32, float32_copy: bool = False) -> ModelRunner:
    hf_config = load_config(model_dir)
    backend = TorchAttentionBackend()
    platform = CpuPlatform(dtype, backend, TorchLayerOps(), float32_copy=float32_copy)
    model = load_model(model_dir, platform, config=hf_config)
    attn = model.attention_layers()
    layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, block_size, dtype)
    config = RunnerConfig(block_size=block_size, max_model_len=hf_config.max_position_embeddings,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    runner = ModelRunner(model, config, torch.device("cpu"), backend, layout, vocab_size=hf_config.vocab_size,
                         eos_token_ids=(2,))
    runner.initialize_kv_cache(num_blocks)
    return runner


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class MiniScheduler:
    """Schedules like vLLM V1 in miniature: running requests first, then new ones; each request's
    num_computed_tokens catches up with its length under `token_budget` tokens per step."""

    def __init__(self, block_size: int, token_budget: int):
        self.block_size = block_size
        self.token_budget = token_budget
        self.next_block = 1  # block 0 is the null block
        self.requests: dict[str, dict] = {}
        self.waiting: list[str] = []
        self.step_id = 0

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: SamplingParams | None = None) -> None:
        self.requests[req_id] = dict(tokens=list(prompt), num_prompt=len(prompt), computed=0, blocks=[],
                                     max_tokens=max_tokens, params=params or SamplingParams(temperature=0.0),
                                     sent=False)
        self.waiting.append(req_id)

    def outputs(self, req_id: str) -> list[int]:
        r = self.requests[req_id]
        return r["tokens"][r["num_prompt"]:]

    def is_done(self) -> bool:
        return all(len(self.outputs(i)) >= r["max_tokens"] for i, r in self.requests.items())

    def _alloc(self, r: dict, upto: int) -> list[int]:
        need = -(-upto // self.block_size) - len(r["blocks"])
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        r["blocks"] += new
        return new

    def schedule(self) -> SchedulerOutput:
        budget, so = self.token_budget, SchedulerOutput(step_id=self.step_id)
        finished = {i for i, r in self.requests.items() if len(self.outputs(i)) >= r["max_tokens"] and not r.get("gone")}
        for i in finished:
            self.requests[i]["gone"] = True
        so.finished_req_ids = finished
        for req_id, r in self.requests.items():
            if r.get("gone") or budget == 0:
                continue
            n = min(len(r["tokens"]) - r["computed"], budget)
            if n <= 0:
                continue
            new_blocks = self._alloc(r, r["computed"] + n)
            if not r["sent"]:
                so.scheduled_new_reqs.append(NewRequestData(req_id, r["tokens"][: r["num_prompt"]], r["params"],
                                                            list(r["blocks"]), r["computed"]))
                r["sent"] = True
            else:
                c = so.scheduled_cached_reqs
                c.req_ids.append(req_id), c.resumed_from_preemption.append(False)
                c.new_block_ids.append(new_blocks), c.num_computed_tokens.append(r["computed"])
                c.resumed_token_ids.append([])
            so.num_scheduled_tokens[req_id] = n
            budget -= n
        # the batch order is new requests first, then cached ones, as the codec restores it
        order = [n.req_id for n in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
        so.num_scheduled_tokens = {i: so.num_scheduled_tokens[i] for i in order}
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.step_id += 1
        return so

    def update(self, so: SchedulerOutput, out) -> None:
        assert out.req_ids == list(so.num_scheduled_tokens)
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            r = self.requests[req_id]
            r["computed"] += so.num_scheduled_tokens[req_id]
            complete = r["computed"] == len(r["tokens"])
            assert bool(sampled) == complete, (req_id, sampled, r["computed"], len(r["tokens"]))
            r["tokens"] += sampled

    def run(self, runner: ModelRunner, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if self.is_done():
                return
            so = self.schedule()
            self.update(so, runner.execute_model(so))
        raise AssertionError("requests did not finish")
