"""Prompt files as users bring them: JSON lines or Parquet, text or chat, some too long."""

import json
import logging

import pytest

from common.config import ConfigError, load_config
from common.prompts import prompt_token_ids, read_rows
from tests.helpers import base_config

ROWS = [{"prompt": "even 1 2 :"},
        {"messages": [{"role": "user", "content": "odd 3 4"}], "answer": "odd"},
        {"prompt": " ".join(["even"] * 80)},  # too long for max_model_len 64 - 8 new tokens
        {"messages": [{"role": "system", "content": "even"}, {"role": "user", "content": "odd 5"}]}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_json_lines_and_parquet_give_the_same_rows(tmp_path):
    import pyarrow
    import pyarrow.parquet

    flat = [{"prompt": "even 1 :", "answer": "2"}, {"prompt": "odd 2 :", "answer": "3"}]
    parquet = tmp_path / "prompts.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(flat), parquet)
    assert read_rows(str(parquet)) == read_rows(write_jsonl(tmp_path / "p.jsonl", flat)) == flat


@pytest.mark.parametrize("line, message", [
    ('{"text": "no prompt"}', 'line 2 has no "prompt" and no "messages" \\(its keys: text\\)'),
    ('{"messages": [{"role": "user", "text": "hi"}]}',
     'line 2 has no "content" in "messages"\\[0\\] \\(its keys: role, text\\)'),
    ("not json", "line 2 is not JSON"),
])
def test_a_bad_row_is_named_with_its_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "even"}\n' + line + "\n")
    with pytest.raises(ConfigError, match="data.prompts: .*" + message):
        read_rows(str(path))


def test_chat_prompts_are_the_chat_templates_tokens_and_long_ones_are_skipped(tmp_path, tiny_assets, chat_policy):
    from rollout.main import prompts_that_fit

    policy, tokenizer = chat_policy
    path = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    config = load_config(None, ["rollout.max_model_len=64", "rollout.max_new_tokens=8", "data.system_prompt=odd"],
                         base=base_config(tmp_path, tiny_assets, models={"policy": policy}, data={"prompts": path}))
    token_ids, data_rows, skipped, _ = prompts_that_fit(config, tokenizer, logging.getLogger("test"))
    assert data_rows == [0, 1, 3] and skipped == 1
    assert token_ids[0] == tokenizer("even 1 2 :")["input_ids"]  # text: as is, with <bos>
    # a chat: the template's ids with the generation prompt, the system prompt put first
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "odd"}, ROWS[1]["messages"][0]],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]
    assert token_ids[1] == expected == tokenizer("odd : odd 3 4 :", add_special_tokens=False)["input_ids"]
    # a chat with a system message of its own keeps it
    assert token_ids[2] == tokenizer("even : odd 5 :", add_special_tokens=False)["input_ids"]


def test_a_chat_without_a_chat_template_and_nothing_that_fits_are_clear_errors(tmp_path, tiny_assets):
    from transformers import AutoTokenizer

    from rollout.main import prompts_that_fit

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])  # no chat template
    with pytest.raises(ConfigError, match="chat template"):
        prompt_token_ids(ROWS[1], tokenizer)
    path = write_jsonl(tmp_path / "prompts.jsonl", [ROWS[2]])
    config = load_config(None, ["rollout.max_model_len=64", "rollout.max_new_tokens=8"],
                         base=base_config(tmp_path, tiny_assets, data={"prompts": path}))
    with pytest.raises(ConfigError, match="none of the 1 prompts .* fits in .* = 56 tokens"):
        prompts_that_fit(config, tokenizer, logging.getLogger("test"))


def test_a_prompt_is_as_long_as_the_tools_its_environment_renders_into_it(tmp_path):
    """A verifiers ToolEnv passes its tools with every call, and the chat template renders their
    schemas into the prompt the engine generates from: the prompt-length filter counts them, as
    the rollout's endpoint receives them (issue 52)."""
    import asyncio

    import verifiers
    from openai import AsyncOpenAI
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from common import verifiers_data
    from environments import verifiers_envs
    from common.prompts import prompts_within
    from environments.agents import _tools_of
    from tests.helpers import chatml_tokenizer

    spec = "verifiers:demos.agent_verifiers"
    tools = verifiers_envs.tool_schemas(spec)
    client = verifiers.OpenAIChatCompletionsClient(AsyncOpenAI(api_key="-", base_url="http://127.0.0.1:9/v1"))
    sent = asyncio.run(client.to_native_tools(verifiers_data.load("demos.agent_verifiers").tool_defs))
    request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": "-"}], tools=sent)
    assert tools == _tools_of(request) and [tool["function"]["name"] for tool in tools] == ["calculator"]
    assert verifiers_envs.tool_schemas(spec, {"tools": False}) is None  # its SingleTurnEnv: no tools
    assert verifiers_envs.tool_schemas("my_env:make") is None  # not a verifiers environment

    tokenizer = chatml_tokenizer(str(tmp_path))
    rows = read_rows(spec)[:1]
    length = len(prompt_token_ids(rows[0], tokenizer, tools=tools))
    assert length > len(prompt_token_ids(rows[0], tokenizer)) + 20  # the schema's JSON
    assert prompts_within(rows, tokenizer, length, None, "data.prompts", spec, tools)[1] == [0]
    with pytest.raises(ConfigError, match="none of the 1 prompts"):
        prompts_within(rows, tokenizer, length - 1, None, "data.prompts", spec, tools)
