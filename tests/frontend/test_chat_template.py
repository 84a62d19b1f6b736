"""Chat templates with tools, on the embedded default model's real tokenizer (SmolLM2, ChatML)."""
from __future__ import annotations

import copy
import json

import pytest

from services.frontend.chat_template import (
    ChatTemplate,
    default_tools_template,
    load_chat_template,
    template_renders_tools,
)
from services.frontend.tokenizer import load_tokenizer

SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}}}

TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. The functions are "
    "described as JSON schemas within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments within "
    "<tool_call></tool_call> XML tags, one block per call:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Capital?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "Multi\nline\n\n  text"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "system", "content": "late system"}, {"role": "user", "content": "c"}],
    [{"role": "assistant", "content": "I speak first."}],
    [{"role": "user", "content": "{{ not a template }} {% raw %}"}],
]


class OtherModelTokenizer:
    """The real tokenizer under another model's chat template."""

    def __init__(self, tokenizer, chat_template):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    from services.common.model_files import resolve_model

    return load_tokenizer(resolve_model(None, None).path)


@pytest.fixture(scope="module")
def chat_template(tokenizer):
    return ChatTemplate.build(tokenizer, None)


def own_render(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_without_tools_the_shipped_template_renders_as_the_model_does(tokenizer, chat_template, messages):
    expected = own_render(tokenizer, messages)
    shipped = tokenizer.apply_chat_template(messages, chat_template=default_tools_template(),
                                            add_generation_prompt=True, tokenize=False)
    assert shipped == expected
    assert chat_template.render(tokenizer, messages, None) == expected
    assert chat_template.render(tokenizer, messages, []) == expected


def test_the_model_template_is_chosen_and_the_shipped_one_for_tools(tokenizer, chat_template):
    assert not template_renders_tools(tokenizer.chat_template)
    assert chat_template.template == tokenizer.chat_template
    assert chat_template.tool_template == default_tools_template()
    assert chat_template.default_system_message == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_tools_are_listed_in_the_default_system_turn(tokenizer, chat_template):
    prompt = chat_template.render(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n"
        + TOOLS_SECTION + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_follow_the_callers_system_message(tokenizer, chat_template):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"}]
    prompt = chat_template.render(tokenizer, messages, [WEATHER_TOOL])
    assert prompt == ("<|im_start|>system\nBe terse.\n\n" + TOOLS_SECTION
                      + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_every_tool_is_listed(tokenizer, chat_template):
    prompt = chat_template.render(tokenizer, [{"role": "user", "content": "?"}], [WEATHER_TOOL, TIME_TOOL])
    listed = prompt.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in listed] == [WEATHER_TOOL, TIME_TOOL]


def test_tool_calls_and_results_render_in_order(tokenizer, chat_template):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    prompt = chat_template.render(tokenizer, messages, [WEATHER_TOOL])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n" + TOOLS_SECTION
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        + '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        + "</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\nIt is 18 C and sunny.<|im_end|>\n"
        + "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_parallel_calls_and_their_results_share_turns(tokenizer, chat_template):
    messages = [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            call("a", "get_weather", '{"city": "Oslo", "unit": "°C"}'), call("b", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "a", "content": "-3"},
        {"role": "tool", "tool_call_id": "b", "content": "08:15"},
    ]
    prompt = chat_template.render(tokenizer, messages, [WEATHER_TOOL, TIME_TOOL])
    assert prompt.endswith(
        "<|im_start|>user\nWeather and time in Oslo?<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo", "unit": "°C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n-3\n</tool_response>\n<tool_response>\n08:15\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_tool_history_without_tools_uses_the_shipped_template(tokenizer, chat_template):
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [call("b", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "b", "content": "08:15"},
    ]
    assert chat_template.render(tokenizer, messages, None) == (
        SMOLLM2_SYSTEM + "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n08:15\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_callers_messages_are_left_as_they_were(tokenizer, chat_template):
    messages = [{"role": "user", "content": "Time?"},
                {"role": "assistant", "content": None, "tool_calls": [call("b", "get_time", '{"tz": "UTC"}')]}]
    before = copy.deepcopy(messages)
    chat_template.render(tokenizer, messages, [TIME_TOOL])
    assert messages == before


def test_arguments_already_an_object_are_accepted(tokenizer, chat_template):
    as_dict = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}
    as_text = {"role": "assistant", "content": None, "tool_calls": [call("b", "get_time", '{"tz": "UTC"}')]}
    user = {"role": "user", "content": "Time?"}
    assert chat_template.render(tokenizer, [user, as_dict], None) == chat_template.render(tokenizer, [user, as_text], None)


@pytest.mark.parametrize("arguments, problem", [
    ('{"city": ', "is not valid JSON"), ("[1, 2]", "must be a JSON object"), ('"Paris"', "must be a JSON object")])
def test_invalid_arguments_are_refused_with_the_field(tokenizer, chat_template, arguments, problem):
    messages = [{"role": "user", "content": "?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [call("a", "get_time", "{}"), call("b", "get_weather", arguments)]}]
    with pytest.raises(ValueError, match=r"'messages\[1\]\.tool_calls\[1\]\.function\.arguments' " + problem):
        chat_template.render(tokenizer, messages, [WEATHER_TOOL])


def test_a_tool_call_without_a_function_is_refused(tokenizer, chat_template):
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function"}]}]
    with pytest.raises(ValueError, match=r"'messages\[0\]\.tool_calls\[0\]\.function' must be an object"):
        chat_template.render(tokenizer, messages, None)


OPERATOR_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_an_operator_template_renders_every_request(tokenizer, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(OPERATOR_TEMPLATE, encoding="utf-8")
    chat_template = ChatTemplate.build(tokenizer, str(path))
    assert chat_template.template == chat_template.tool_template == OPERATOR_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_template.render(tokenizer, messages, None) == "[user] Hi\n[assistant]"
    assert chat_template.render(tokenizer, messages, [WEATHER_TOOL, TIME_TOOL]) == (
        "[user] Hi\ntools: get_weather, get_time\n[assistant]")


def test_an_operator_template_without_tools_is_kept_for_tools(tokenizer, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    chat_template = ChatTemplate.build(tokenizer, str(path))
    assert chat_template.render(tokenizer, [{"role": "user", "content": "Hi"}], [WEATHER_TOOL]) == "Hi"


def test_template_errors_become_value_errors(tokenizer, tmp_path):
    path = tmp_path / "strict.jinja"
    path.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}",
                    encoding="utf-8")
    chat_template = ChatTemplate.build(tokenizer, str(path))
    with pytest.raises(ValueError, match="The chat template refused these messages: system first"):
        chat_template.render(tokenizer, [{"role": "user", "content": "Hi"}], None)


def test_load_chat_template_reads_the_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(OPERATOR_TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == OPERATOR_TEMPLATE


def test_load_chat_template_accepts_transformers_generation_blocks(tmp_path):
    path = tmp_path / "t.jinja"
    text = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    path.write_text(text, encoding="utf-8")
    assert load_chat_template(str(path)) == text


@pytest.mark.parametrize("content, problem", [
    (None, "Cannot read the chat template file"),
    (b"\xff\xfe{{", "Cannot read the chat template file"),
    (b" \n", "is empty"),
    (b"{% for m in messages %}{{ m }}", "is not valid Jinja: Unexpected end of template"),
    (b"{{ messages | }}", r"is not valid Jinja: .* \(line 1\)"),
])
def test_bad_template_files_are_refused(tmp_path, content, problem):
    path = tmp_path / "bad.jinja"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=problem):
        load_chat_template(str(path))


def test_build_refuses_a_bad_template_file(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="Cannot read the chat template file"):
        ChatTemplate.build(tokenizer, str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("template, expected", [
    ("{{ messages }}", False),
    ("{% if tools %}{{ tools | tojson }}{% endif %}", True),
    ("{% if tools is defined %}x{% endif %}", True),
    ("{% for m in messages %}{% for t in m.tools %}{{ t }}{% endfor %}{% endfor %}", False),
    ("{% set tools = [] %}{{ tools }}", False),
])
def test_template_renders_tools(template, expected):
    assert template_renders_tools(template) is expected


def test_template_renders_tools_on_the_shipped_template():
    assert template_renders_tools(default_tools_template())


def test_template_renders_tools_refuses_invalid_jinja():
    with pytest.raises(ValueError, match="not valid Jinja"):
        template_renders_tools("{% if tools %}")


LLAMA2_LIKE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
               "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
CHATML_WITHOUT_DEFAULT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_model_template_that_renders_tools_is_kept_for_tools(tokenizer):
    chat_template = ChatTemplate.build(OtherModelTokenizer(tokenizer, OPERATOR_TEMPLATE), None)
    assert chat_template.tool_template == OPERATOR_TEMPLATE
    assert chat_template.render(tokenizer, [{"role": "user", "content": "Hi"}], [TIME_TOOL]) == (
        "[user] Hi\ntools: get_time\n[assistant]")


def test_a_named_tool_use_template_is_taken_for_tools(tokenizer):
    named = {"default": LLAMA2_LIKE, "tool_use": OPERATOR_TEMPLATE}
    chat_template = ChatTemplate.build(OtherModelTokenizer(tokenizer, named), None)
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_template.render(tokenizer, messages, None) == "[INST] Hi [/INST]"
    assert chat_template.render(tokenizer, messages, [TIME_TOOL]) == "[user] Hi\ntools: get_time\n[assistant]"


def test_a_chatml_model_without_default_system_gets_none_with_tools(tokenizer):
    chat_template = ChatTemplate.build(OtherModelTokenizer(tokenizer, CHATML_WITHOUT_DEFAULT), None)
    assert chat_template.default_system_message == ""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert chat_template.render(tokenizer, messages, None) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert chat_template.render(tokenizer, messages, [WEATHER_TOOL]) == (
        "<|im_start|>system\n" + TOOLS_SECTION
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_are_refused_for_a_model_whose_template_cannot_render_them(tokenizer):
    chat_template = ChatTemplate.build(OtherModelTokenizer(tokenizer, LLAMA2_LIKE), None)
    assert chat_template.tool_template is None
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_template.render(tokenizer, messages, None) == "[INST] Hi [/INST]"
    with pytest.raises(ValueError, match="cannot render tools"):
        chat_template.render(tokenizer, messages, [TIME_TOOL])


def test_a_model_without_a_template_is_refused(tokenizer):
    chat_template = ChatTemplate.build(OtherModelTokenizer(tokenizer, None), None)
    with pytest.raises(ValueError, match="no chat template"):
        chat_template.render(tokenizer, [{"role": "user", "content": "Hi"}], None)
