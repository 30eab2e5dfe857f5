"""Chat templates render as transformers renders them: the same text as its
render_jinja_template for templates of several families (ChatML, Qwen2.5's Hermes tools,
Llama 3.1's JSON tools with tojson options, Mistral's alternation check, a generation tag, a
documents template, extra template kwargs), with tools, tool calls, tool results and documents.
The templates are written here (no hub); transformers is a test dependency only."""

from __future__ import annotations

import pytest

from firsttoken.errors import InvalidInputError
from firsttoken.tokenizer import ChatTemplate

BOS, EOS = "<s>", "</s>"

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 (the upstream template, verbatim)

LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "Given the following functions, respond with a JSON for a function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson(separators=(",", ":"), sort_keys=true) }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501 (the upstream template, verbatim)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}"
)

GENERATION_TAG = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

DOCUMENTS = (
    "{% if documents %}{{ 'Documents:\n' }}{% for doc in documents %}"
    "{{ loop.index0 }}. {{ doc.title }}: {{ doc.text }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'assistant: <think></think>' }}"
    "{% elif add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city, with <html> & 'quotes' — and non-ASCII: café",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [
    {"role": "system", "content": "Be brief & <precise>."},
    {"role": "user", "content": "Hi, what's the weather in Zürich?"},
]
TOOL_ROUND = CHAT + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    ]},
    {"role": "tool", "tool_call_id": "a", "content": '{"sky": "sunny", "temp": 21}'},
]
ALTERNATING = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "How are you?"},
]

CASES = {
    "chatml": (CHATML, CHAT[1:], {}),
    "chatml with system": (CHATML, CHAT, {}),
    "qwen2.5 plain": (QWEN25, CHAT, {}),
    "qwen2.5 tools": (QWEN25, CHAT, {"tools": [WEATHER]}),
    "qwen2.5 tool round": (QWEN25, TOOL_ROUND, {"tools": [WEATHER]}),
    "llama3.1 tools": (LLAMA31, CHAT, {"tools": [WEATHER]}),
    "llama3.1 tool round": (LLAMA31, TOOL_ROUND, {"tools": [WEATHER]}),
    "llama3.1 date kwarg": (LLAMA31, CHAT, {"template_kwargs": {"date_string": "01 Dec 2026"}}),
    "mistral": (MISTRAL, ALTERNATING, {}),
    "generation tag": (GENERATION_TAG, ALTERNATING[:2], {}),
    "documents": (DOCUMENTS, CHAT[1:], {"documents": [{"title": "Alps", "text": "High <mountains>."}]}),
    "thinking off kwarg": (DOCUMENTS, CHAT[1:], {"template_kwargs": {"enable_thinking": False}}),
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_rendering_equals_transformers(case, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    source, messages, options = CASES[case]
    ours = ChatTemplate(source, BOS, EOS).render(
        messages,
        add_generation_prompt,
        tools=options.get("tools"),
        documents=options.get("documents"),
        template_kwargs=options.get("template_kwargs"),
    )
    (theirs,), _ = render_jinja_template(
        conversations=[messages],
        tools=options.get("tools"),
        documents=options.get("documents"),
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS,
        eos_token=EOS,
        **options.get("template_kwargs", {}),
    )
    assert ours == theirs
    if "tools" in options:
        assert "café" in ours and "<html> &" in ours  # tojson: no ASCII or HTML escaping


def test_tool_support_is_read_from_the_template():
    assert ChatTemplate(QWEN25, BOS, EOS).renders_tools
    assert ChatTemplate(LLAMA31, BOS, EOS).renders_tools
    assert not ChatTemplate(CHATML, BOS, EOS).renders_tools


def test_raise_exception_and_reserved_kwargs_are_input_errors():
    with pytest.raises(InvalidInputError, match="alternate"):
        ChatTemplate(MISTRAL, BOS, EOS).render(ALTERNATING[1:])
    with pytest.raises(InvalidInputError) as raised:
        ChatTemplate(CHATML, BOS, EOS).render(CHAT, template_kwargs={"add_generation_prompt": False})
    assert raised.value.field == "chat_template_kwargs"
