"""The worker's grammars on a random model with SmolLM2's vocabulary: the constraint decides the
output (a random model never writes a matching text by itself), compiles run off the step and are
reported once, chunked prefill and preemption keep the grammar, and a request whose grammar and
other settings leave no token fails alone."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from services.common.messages import CachedRequestData, SamplingParams, SchedulerOutput
from services.common.model_files import resolve_model
from services.common.structured_outputs import StructuredOutputsParams
from services.worker.structured_output.grammar_compiler import GrammarCompiler
from tests.worker.harness import MiniScheduler, make_runner

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-smol")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(resolve_model(None).path)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def runner_for(model_dir, **kwargs):
    runner = make_runner(model_dir, **kwargs)
    runner.eos_token_ids = (EOS,)
    runner.grammar_compiler = GrammarCompiler(model_dir, VOCAB, (EOS,))
    return runner


def text_until_eos(tokenizer, tokens: list[int]) -> tuple[str, bool]:
    ended = EOS in tokens
    return tokenizer.decode(tokens[: tokens.index(EOS)] if ended else tokens), ended


PROMPT = [1, 504, 3458, 282, 2670, 314]


def run(model_dir, params: SamplingParams, max_tokens: int = 24, token_budget: int = 64, **kwargs):
    runner = runner_for(model_dir, **kwargs)
    sched = MiniScheduler(block_size=4, token_budget=token_budget)
    sched.add("r", PROMPT, max_tokens, params)
    sched.run(runner)
    return sched.outputs("r")


def test_regex_and_choice_decide_the_output_and_unconstrained_text_differs(model_dir, tokenizer):
    free = run(model_dir, SamplingParams(temperature=0.0))
    free_text, _ = text_until_eos(tokenizer, free)
    assert not re.fullmatch(r"[a-z]{3,8}", free_text)
    text, ended = text_until_eos(tokenizer, run(model_dir, SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams("regex", "[a-z]{3,8}"))))
    assert ended and re.fullmatch(r"[a-z]{3,8}", text)
    text, ended = text_until_eos(tokenizer, run(model_dir, SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams("choice", json.dumps(["yes", "no", "maybe"])))))
    assert ended and text in ("yes", "no", "maybe")


@pytest.mark.parametrize("token_budget", (64, 2), ids=("one-prefill", "chunked-prefill"))
def test_json_schema_output_validates_seeded_and_greedy(model_dir, tokenizer, token_budget):
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "kind": {"enum": ["a", "b"]}},
              "required": ["n", "kind"], "additionalProperties": False}
    for temperature, seed in ((0.0, None), (1.0, 7)):
        params = SamplingParams(temperature=temperature, seed=seed,
                                structured_outputs=StructuredOutputsParams("json", json.dumps(schema)))
        text, ended = text_until_eos(tokenizer, run(model_dir, params, max_tokens=48, token_budget=token_budget))
        assert ended, text
        jsonschema.validate(json.loads(text), schema)


def test_compiles_are_announced_run_off_the_step_and_reported_once(model_dir):
    runner = runner_for(model_dir)
    params = StructuredOutputsParams("regex", "[0-9]+")
    bad = StructuredOutputsParams("grammar", "root ::= undefined_rule")
    out = runner.execute_model(SchedulerOutput(step_id=0, grammars_to_compile={params.key: params, bad.key: bad}))
    reported_ok, reported_bad = list(out.compiled_grammar_keys), dict(out.failed_grammars)
    step = 1
    while len(reported_ok) + len(reported_bad) < 2:
        out = runner.execute_model(SchedulerOutput(step_id=step))
        reported_ok += out.compiled_grammar_keys
        reported_bad.update(out.failed_grammars)
        step += 1
        assert step < 2000
    assert reported_ok == [params.key]
    assert list(reported_bad) == [bad.key] and 'Rule "undefined_rule" is not defined' in reported_bad[bad.key]
    out = runner.execute_model(SchedulerOutput(step_id=step, grammars_to_compile={params.key: params}))
    assert out.compiled_grammar_keys == [params.key]  # cached: reported at once, nothing compiled


def test_a_resumed_request_continues_its_grammar_after_a_dropped_token(model_dir, tokenizer):
    """Preempted with a token in flight: the scheduler resends one token fewer than the worker sampled;
    the matcher rolls back and the request still ends in a matching text."""
    runner = runner_for(model_dir)
    params = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams("regex", "[a-z]{6}"))
    sched = MiniScheduler(block_size=4, token_budget=64)
    sched.add("r", PROMPT, 12, params)
    for _ in range(4):  # prefill + 3 decode steps
        so = sched.schedule()
        sched.update(so, runner.execute_model(so))
    outputs = sched.outputs("r")
    assert len(outputs) == 4
    kept = PROMPT + outputs[:3]  # the fourth token is dropped, as in flight when preempted
    runner.execute_model(SchedulerOutput(step_id=99, preempted_req_ids={"r"}))
    resumed = CachedRequestData(req_ids=["r"], resumed_from_preemption=[True], new_block_ids=[[60, 61, 62]],
                                num_computed_tokens=[0], resumed_token_ids=[kept])
    tokens = list(kept)
    out = runner.execute_model(SchedulerOutput(scheduled_cached_reqs=resumed, num_scheduled_tokens={"r": len(kept)},
                                               total_num_scheduled_tokens=len(kept), step_id=100))
    tokens += out.sampled_token_ids[0]
    for step in range(101, 110):
        cached = CachedRequestData(req_ids=["r"], resumed_from_preemption=[False], new_block_ids=[[]],
                                   num_computed_tokens=[len(tokens) - 1], resumed_token_ids=[])
        out = runner.execute_model(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1},
                                                   total_num_scheduled_tokens=1, step_id=step))
        tokens += out.sampled_token_ids[0]
        if tokens[-1] == EOS:
            break
    text, ended = text_until_eos(tokenizer, tokens[len(PROMPT):])
    assert ended and re.fullmatch(r"[a-z]{6}", text), text


def test_a_grammar_left_without_an_allowed_token_fails_its_request_alone(model_dir):
    """min_tokens bans EOS where the grammar allows only EOS: the request fails, the other runs."""
    runner = runner_for(model_dir)
    sched = MiniScheduler(block_size=4, token_budget=64)
    sched.add("stuck", PROMPT, 8, SamplingParams(
        temperature=0.0, min_tokens=8, structured_outputs=StructuredOutputsParams("choice", '["x"]')))
    sched.add("free", PROMPT, 8)
    failed = {}
    for _ in range(8):
        so = sched.schedule()
        so.num_scheduled_tokens = {r: n for r, n in so.num_scheduled_tokens.items() if r not in failed}
        out = runner.execute_model(so)
        failed.update(out.failed_reqs)
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            if req_id not in failed:
                r = sched.requests[req_id]
                r["computed"] += so.num_scheduled_tokens[req_id]
                r["tokens"] += sampled
        if "stuck" in failed:
            sched.requests["stuck"]["gone"] = True
    assert list(failed) == ["stuck"] and "grammar allows no token" in failed["stuck"]
    assert len(sched.outputs("free")) == 8


def test_a_model_without_a_tokenizer_fails_constraints_with_a_reason(model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "vocab*",
                                                                  "merges*", "chat_template*"))
    compiler = GrammarCompiler(bare, VOCAB, (EOS,))
    params = StructuredOutputsParams("regex", "a")
    compiler.submit({params.key: params})
    compiled, failed = compiler.take_results(wait_s=30)
    assert compiled == [] and "tokenizer" in failed[params.key]
