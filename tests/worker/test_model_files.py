"""Model resolution: the embedded default model (converted once into the cache, then reused) and
the conversion lock."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.common import model_files
from services.common.model_files import DEFAULT_MODEL_NAME, ensure_converted, resolve_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def default_model():
    # The real cache (SPINDLE_CACHE_DIR or ~/.cache/spindle): converted once (~30 s), reused after.
    return resolve_model(None, None)


def _chat_prompt(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_default_model_is_a_complete_hf_folder(default_model):
    from transformers import AutoTokenizer

    assert default_model.name == DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (default_model.path / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(str(default_model.path))
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert resolve_model(None, None) == default_model  # second call reuses the cache


def test_default_model_answers_paris_with_transformers(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model.path))
    model = AutoModelForCausalLM.from_pretrained(str(default_model.path), dtype=torch.float32)
    prompt = _chat_prompt(tokenizer)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    assert tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True) == ANSWER


def test_default_model_answers_paris_through_the_worker(default_model):
    """SmolLM2 (tied embeddings, 30 layers) through our loader, paged attention and runner."""
    from transformers import AutoTokenizer

    from services.worker.config import WorkerConfig
    from services.worker.worker import Worker
    from tests.worker.harness import MiniScheduler

    worker = Worker(WorkerConfig(dtype="float32", kv_cache_bytes=64 * 2**20, max_model_len=1024))
    worker.load_model()
    worker.initialize_kv_cache(0)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model.path))
    scheduler = MiniScheduler(block_size=16, token_budget=16)  # the prompt takes 3 chunks
    scheduler.add("q", _chat_prompt(tokenizer), max_tokens=8)
    scheduler.run(worker.model_runner)
    assert tokenizer.decode(scheduler.outputs("q"), skip_special_tokens=True).startswith(ANSWER)


def test_gguf_path_resolves_to_a_cache_folder_named_after_the_file(tmp_path, monkeypatch):
    calls = []
    converting, finish = threading.Event(), threading.Event()

    def held_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        converting.set()
        assert finish.wait(30), "the conversion was never let finish"
        (out_dir / "config.json").write_text("{}")
        (out_dir / model_files._DONE_MARKER).write_text("done")

    # Each non-blocking lock attempt's result; a False is followed by the blocking wait on the lock.
    attempts, refused = [], threading.Event()
    real_try_lock = model_files._try_lock

    def observed_try_lock(lock) -> bool:
        got = real_try_lock(lock)
        attempts.append(got)
        if not got:
            refused.set()
        return got

    monkeypatch.setattr(model_files, "convert_gguf", held_convert)
    monkeypatch.setattr(model_files, "_try_lock", observed_try_lock)
    gguf = tmp_path / "tiny-model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(str(gguf), tmp_path / "cache")))
               for _ in range(2)]
    threads[0].start()
    assert converting.wait(30), "the first caller never started converting"
    # The first caller holds the lock inside the conversion: the second finds it taken and waits.
    threads[1].start()
    assert refused.wait(30), "the second caller never reached the lock"
    assert attempts == [True, False] and results == []
    finish.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(calls) == 1  # the second caller waited on the lock and found the folder done
    assert results[0] == results[1]
    assert results[0].name == "tiny-model.Q8_0"
    assert results[0].path.parent == tmp_path / "cache" / "models"
    assert results[0].path.name.startswith("tiny-model.Q8_0-")
    assert not [p for p in results[0].path.parent.iterdir() if p.name.startswith(".tiny") and p.is_dir()]


def test_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_files, "convert_gguf", broken)
    with pytest.raises(RuntimeError):
        ensure_converted(tmp_path / "x.gguf", tmp_path / "models" / "x")
    assert not (tmp_path / "models" / "x").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".x.lock"]


def test_folder_and_bad_paths(tmp_path, tiny_llama_dir):
    resolved = resolve_model(str(tiny_llama_dir), tmp_path)
    assert resolved.path == tiny_llama_dir.resolve() and resolved.name == tiny_llama_dir.name
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path), tmp_path)
