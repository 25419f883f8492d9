"""Chat templates of reasoning-model families, for the tests (no real checkpoint's
template is available offline: neither mlx-lm's, transformers' nor any installed
package ships one). Each follows its family's published template in what matters
here: how the generation prompt opens or closes the reasoning, the thinking
switch it reads, how past reasoning and tool calls are rendered. The long
system texts and the rest (multimodal parts, builtin tools, date handling) are
left out.
"""

from __future__ import annotations

#: Qwen3 (hybrid thinking): tools in the system turn, calls in <tool_call> tags, tool results in a
#: user turn's <tool_response> tags; an assistant turn after the last user query renders its
#: reasoning_content in <think> tags; enable_thinking=false closes an empty think block in the
#: generation prompt.
QWEN3 = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{% set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}{% set ns.last_query_index = index %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ content }}<|im_end|>
{% elif message.role == 'assistant' %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}{% set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}<|im_start|>assistant
<think>
{{ reasoning_content.strip('\\n') }}
</think>

{{ content.lstrip('\\n') }}
{%- else %}<|im_start|>assistant
{{ content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if (loop.first and content) or not loop.first %}{{ '\\n' }}{% endif %}
{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

#: Qwen3-Thinking-2507 (and DeepSeek-R1's way): the same, but the generation prompt always
#: opens the think block, and there is no switch.
QWEN3_THINKING = QWEN3.replace(
    """{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}""",
    """<think>
{% endif %}""",
)

#: gpt-oss (harmony): a system message with the reasoning effort, the tools in a developer
#: message (TypeScript-like, in the functions namespace), calls as assistant messages to
#: functions.NAME on the commentary channel, past reasoning from ``thinking`` on the analysis
#: channel; the generation prompt is ``<|start|>assistant``.
GPT_OSS = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if messages[0].role in ['system', 'developer'] or tools %}<|start|>developer<|message|>
{%- if messages[0].role in ['system', 'developer'] %}# Instructions

{{ messages[0].content }}
{% endif %}
{%- if tools %}
# Tools

## functions

namespace functions {
{% for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions{% endif %}<|end|>{% endif %}
{%- set ns = namespace(last_call='') %}
{%- for message in messages %}
{%- if message.role in ['system', 'developer'] and loop.first %}
{%- elif message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{%- if message.content and message.thinking %}{{ raise_exception('Cannot pass both content and thinking in an assistant message with tool calls!') }}
{%- elif message.content %}<|start|>assistant<|channel|>analysis<|message|>{{ message.content }}<|end|>
{%- elif message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>
{%- endif %}<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>
{%- set ns.last_call = call.name %}
{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'tool' %}<|start|>functions.{{ ns.last_call }} to=assistant<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

#: Gemma 4: enable_thinking puts <|think|> atop the system turn; the model thinks in a
#: <|channel>thought ... <channel|> block; past turns' thinking is stripped; with thinking off,
#: the generation prompt closes an empty thought block.
GEMMA4 = """{{ bos_token }}
{%- if enable_thinking or tools or messages[0].role == 'system' %}<|turn>system
{% if enable_thinking %}<|think|>{% endif %}
{%- if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}
{%- for tool in tools or [] %}<|tool>declaration:{{ tool.function.name }}{description:<|"|>{{ tool.function.description }}<|"|>}<tool|>{% endfor %}<turn|>
{% endif %}
{%- for message in messages %}{% if not (loop.first and message.role == 'system') %}
{%- set role = 'model' if message.role == 'assistant' else message.role %}<|turn>{{ role }}
{% for tool_call in message.tool_calls or [] %}<|tool_call>call:{{ tool_call.function.name }}{
{%- for key, value in tool_call.function.arguments | dictsort %}{{ key }}:<|"|>{{ value }}<|"|>{% if not loop.last %},{% endif %}{% endfor %}}<tool_call|>{% endfor %}
{%- if role == 'model' and '<channel|>' in message.content %}{{ message.content.split('<channel|>')[-1] | trim }}
{%- else %}{{ message.content | trim }}{% endif %}<turn|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|turn>model
{% if not enable_thinking | default(false) %}<|channel>thought
<channel|>{% endif %}{% endif %}"""

#: Each family's marker tokens (what its tokenizer declares).
QWEN3_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
GPT_OSS_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)
GEMMA4_TOKENS = (
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|think|>",
    "<|tool_call>",
    "<tool_call|>",
)
