"""Tool calls on the local pair: the tiny model's chat template lists the tools
and writes calls as <tool_call> JSON, and the pair runs vLLM's `hermes` tool-call parser, so the
OpenAI SDK's tool calls work as they do against the GB10 pair (there: the DeepSeek V4 parser).

A named or `required` tool choice is forced by vLLM's structured output (a JSON schema of the
tool's parameters), so even the random-weight model returns a parsed call; `auto` answers 200
with a call only when the model writes one. The pair is the shared `local_pair`."""

from __future__ import annotations

import json

import pytest

from dspark.local import cluster as local
from dspark.local import model as local_model

CITIES = ["Paris", "Oslo"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        # An enum and no other property: the forced JSON is short whatever the weights.
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}},
]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
MAX_TOKENS = 96  # a forced call is about 10-20 tokens (compact JSON); the CPU pair is slow


# --- the template and the arguments, no server ----------------------------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("model")
    local_model.write(d)
    return AutoTokenizer.from_pretrained(str(d))


def test_template_lists_tools_and_writes_calls_the_hermes_parser_reads(hf_tokenizer):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    convo = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = hf_tokenizer.apply_chat_template(convo, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    system, rest = text.split("</s>", 1)
    assert system.startswith("<s><|system|>\nYou are terse.\n\n")
    listed = system.split("<tools>\n", 1)[1].split("</tools>", 1)[0].splitlines()
    assert [json.loads(x) for x in listed] == TOOLS
    assert rest == ("<|user|>\nWeather in Paris?</s>"
                    '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                    '\n</tool_call></s>'
                    "<|user|>\n<tool_response>\nsunny\n</tool_response></s><|assistant|>\n")
    # What the template writes is what vLLM's hermes parser reads back.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(local_model.TOOL_CALL_PARSER)(hf_tokenizer)
    written = rest.split("<|assistant|>\n", 1)[1].split("</s>", 1)[0]
    got = parser.extract_tool_calls(written, ChatCompletionRequest(model="m", messages=CHAT, tools=TOOLS))
    assert got.tools_called and [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls] \
        == [("get_weather", {"city": "Oslo"})]
    # Without tools nothing changes: the plain conversation renders as before.
    assert hf_tokenizer.apply_chat_template(CHAT, tokenize=False) == \
        "<s><|system|>\nYou are terse.</s><|user|>\nWeather in Paris?</s>"


def test_local_pair_args_turn_on_the_hermes_parser_and_the_gb10_defaults_keep_deepseek_v4(tmp_path):
    from dspark.config.schema import SEED_EXTRA_ARGS

    args = local.cluster_dict(tmp_path)["serving"]["extra_args"]
    i = args.index("--tool-call-parser")
    assert args[i + 1] == "hermes" and "--enable-auto-tool-choice" in args
    seed = SEED_EXTRA_ARGS
    assert seed[seed.index("--tool-call-parser") + 1] == "deepseek_v4"


# --- the OpenAI SDK against the real pair -----------------------------------------------------------

@pytest.fixture(scope="module")
def client(local_pair):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=local_pair.api_url + "/v1", api_key="none", timeout=300, max_retries=0)


def one_call(reply) -> tuple[str, dict]:
    calls = reply.choices[0].message.tool_calls
    assert calls and len(calls) >= 1, reply
    return calls[0].function.name, json.loads(calls[0].function.arguments)


def test_a_named_tool_choice_returns_that_parsed_call(client):
    reply = client.chat.completions.create(
        model=local.SERVED_NAME, messages=CHAT, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    name, args = one_call(reply)
    assert name == "get_time" and args["city"] in CITIES and set(args) == {"city"}, reply


def array_ends(tokenizer) -> dict[str, int]:
    """A logit bias for every token that is nothing but closing brackets and ends a JSON array."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return {str(i): 100 for i, t in enumerate(vocab) if t.endswith("]") and set(t) <= set("}]")}


def test_required_tool_choice_returns_a_parsed_call_of_a_given_tool(client, hf_tokenizer):
    # vLLM forces `required` as a JSON array of calls with no upper bound: the random weights would
    # decide how many calls follow the first (at temperature 0 they fill max_tokens). The grammar
    # allows `]` only once a whole call is written, so a bias towards it ends the array there.
    reply = client.chat.completions.create(
        model=local.SERVED_NAME, messages=CHAT, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
        tool_choice="required", logit_bias=array_ends(hf_tokenizer))
    name, args = one_call(reply)
    assert name in ("get_weather", "get_time") and args["city"] in CITIES, reply
    assert reply.choices[0].finish_reason == "tool_calls", reply


def test_auto_tool_choice_answers(client):
    # The random model rarely writes <tool_call>: a reply of text is the expected answer; a call,
    # should it write one, must name a given tool.
    reply = client.chat.completions.create(
        model=local.SERVED_NAME, messages=CHAT, tools=TOOLS, max_tokens=8, tool_choice="auto")
    msg = reply.choices[0].message
    assert msg.role == "assistant" and reply.usage.completion_tokens >= 1
    for call in msg.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")
