"""`python -m services.common.model_fetch`: folders appear complete or not at all, the tokenizer
folder holds the small files and no weights, reruns leave finished folders alone, and `wait`
returns once a folder is complete."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from services.common import model_fetch
from services.common.model_fetch import fetch_model, is_complete, main, wait_for_model, write_tokenizer_dir

SMALL_FILES = {
    "config.json": json.dumps({"model_type": "llama", "eos_token_id": 2}),
    "generation_config.json": json.dumps({"temperature": 0.6}),
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "special_tokens_map.json": "{}",
    "chat_template.jinja": "{{ messages }}",
}
WEIGHTS = {"model-00001-of-00002.safetensors": "w1", "model-00002-of-00002.safetensors": "w2",
           "model.safetensors.index.json": "{}"}


def make_model(folder: Path, files: dict[str, str] | None = None) -> Path:
    for name, text in {**SMALL_FILES, **WEIGHTS, **(files or {})}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_a_local_folder_is_copied_and_its_tokenizer_files_split_off(tmp_path):
    source = make_model(tmp_path / "src", {"additional_chat_templates/tool_use.jinja": "{{ tools }}",
                                           "README.md": "card"})
    model_dir = tmp_path / "models" / "Llama"
    assert main(["fetch", f"--source={source}", f"--model-dir={model_dir}",
                 f"--tokenizer-root={tmp_path / 'tokenizer'}"]) == 0
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(["README.md", "additional_chat_templates",
                                                                  *SMALL_FILES, *WEIGHTS])
    tokenizer_dir = tmp_path / "tokenizer" / "Llama"
    assert sorted(p.name for p in tokenizer_dir.iterdir()) == sorted([*SMALL_FILES, "additional_chat_templates"])
    assert (tokenizer_dir / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"
    assert (tokenizer_dir / "generation_config.json").read_text() == SMALL_FILES["generation_config.json"]
    # Readable by pods running as another user; no temporary folder left behind.
    assert stat.S_IMODE((tokenizer_dir / "tokenizer.json").stat().st_mode) == 0o644
    assert stat.S_IMODE(model_dir.stat().st_mode) == 0o755
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["Llama"]


def test_a_finished_folder_is_left_as_it_is(tmp_path):
    model_dir = make_model(tmp_path / "models" / "m")
    (model_dir / "marker").write_text("first run")
    fetch_model(str(make_model(tmp_path / "other", {"config.json": "{}"})), model_dir)
    assert (model_dir / "marker").read_text() == "first run"
    assert (model_dir / "config.json").read_text() == SMALL_FILES["config.json"]


def test_a_failed_build_leaves_no_folder_and_a_rerun_clears_its_leftovers(tmp_path, monkeypatch):
    model_dir = tmp_path / "models" / "m"
    source = make_model(tmp_path / "src")

    def broken_copy(_source):
        def build(tmp):
            (tmp / "config.json").write_text("{}")
            raise OSError("disk full")
        return build

    monkeypatch.setattr(model_fetch, "_copy_folder", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        fetch_model(str(source), model_dir)
    assert not model_dir.exists()
    (tmp_path / "models" / ".m.tmp-killed").mkdir()  # what a killed run leaves
    monkeypatch.undo()
    fetch_model(str(source), model_dir)
    assert is_complete(model_dir)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]


def test_a_source_without_config_json_is_refused(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="config.json"):
        fetch_model(str(source), tmp_path / "models" / "m")
    assert not (tmp_path / "models" / "m").exists()


def test_a_half_filled_folder_is_not_overwritten(tmp_path):
    model_dir = tmp_path / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "model.safetensors").write_text("partial")
    with pytest.raises(FileExistsError):
        fetch_model(str(make_model(tmp_path / "src")), model_dir)
    assert main(["fetch", f"--source={tmp_path / 'src'}", f"--model-dir={model_dir}"]) == 1


def test_a_tokenizer_folder_needs_tokenizer_files(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_text("w")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        write_tokenizer_dir(model_dir, tmp_path / "tokenizer" / "m")
    assert not (tmp_path / "tokenizer" / "m").exists()


def test_a_repository_id_is_downloaded_with_weights_and_tokenizer_patterns_only(tmp_path, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, *, revision, local_dir, allow_patterns, ignore_patterns):
        calls.append((repo_id, revision, allow_patterns, ignore_patterns))
        make_model(Path(local_dir), {".cache/huggingface/download/x.lock": ""})
        return str(local_dir)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    model_dir = tmp_path / "models" / "Llama-3.1-8B-Instruct"
    fetch_model("meta-llama/Llama-3.1-8B-Instruct", model_dir, revision="main")
    ((repo_id, revision, allow, ignore),) = calls
    assert (repo_id, revision) == ("meta-llama/Llama-3.1-8B-Instruct", "main")
    assert "*.safetensors" in allow and "*.bin" not in allow and "*.pth" not in allow
    assert ignore == ["original/*"]
    assert not (model_dir / ".cache").exists()
    assert is_complete(model_dir)


def test_a_gguf_file_of_a_repository_is_converted(tmp_path, monkeypatch):
    converted = []

    def fake_download(repo_id, filename, *, revision, local_dir):
        path = Path(local_dir) / filename
        path.write_text("gguf")
        return str(path)

    def fake_convert(gguf_path, out_dir):
        converted.append(gguf_path.name)
        make_model(out_dir)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    monkeypatch.setattr(model_fetch, "convert_gguf", fake_convert)
    model_dir = tmp_path / "models" / "q"
    assert main(["fetch", "--source=org/repo-GGUF", "--gguf-file=model.Q4_K_M.gguf", f"--model-dir={model_dir}",
                 "--revision=", f"--tokenizer-root={tmp_path / 'tok'}"]) == 0
    assert converted == ["model.Q4_K_M.gguf"]
    assert is_complete(model_dir) and is_complete(tmp_path / "tok" / "q")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["q"]  # the GGUF download is gone


def test_wait_returns_once_the_folder_is_complete(tmp_path):
    folder = tmp_path / "m"
    looks = []

    def fake_sleep(seconds):
        looks.append(seconds)
        if len(looks) == 3:
            make_model(folder.parent / "src")
            folder.parent.joinpath("src").rename(folder)

    assert wait_for_model(folder, poll_interval_s=2.0, sleep=fake_sleep) is True
    assert looks == [2.0, 2.0, 2.0]


def test_wait_gives_up_at_its_timeout(tmp_path):
    now = [0.0]

    def fake_sleep(seconds):
        now[0] += seconds

    assert wait_for_model(tmp_path / "m", timeout_s=10.0, poll_interval_s=4.0, sleep=fake_sleep,
                          clock=lambda: now[0]) is False
    assert now[0] == 12.0
    make_model(tmp_path / "m")
    assert main(["wait", f"--dir={tmp_path / 'm'}", "--timeout-s=1"]) == 0
    assert main(["wait", f"--dir={tmp_path / 'none'}", "--timeout-s=0.01", "--poll-interval-s=0.01"]) == 1
