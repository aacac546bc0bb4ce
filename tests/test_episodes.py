"""Episodes (rollout.episodes, environments.native, environments.tools): the bookkeeping of turns and
observations, token for token, driven here with vLLM's finished requests written by hand; the
real engine drives the same code in test_rollout_episodes.py."""

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest

from common.config import ConfigError, load_config
from tests.helpers import base_config, chatml_tokenizer

EOS = 2  # the demo tokenizer's


def fake_output(tokens, finish_reason="stop", prompt_token_ids=()):
    """A finished vLLM request of one completion: its ids, a logprob for each, why it stopped (and
    the prompt's ids, as vLLM reports them)."""
    logprobs = [{token: SimpleNamespace(logprob=-0.1 * (i + 1))} for i, token in enumerate(tokens)]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason=finish_reason)],
                           prompt_token_ids=list(prompt_token_ids))


def make_episodes(tmp_path, tokenizer, environment, rows, *overrides, tools=(), answering=None):
    """Episodes of ``environment`` (a factory's spec), or of the ``Environment`` ``answering`` makes of a row."""
    from common.prompts import prompt_token_ids
    from environments.native import Environments
    from rollout.episodes import Episodes, Renderer
    from environments.tools import load_tools

    config = load_config(None, [*([f"rollout.environment={environment}"] if environment else []),
                                "rollout.max_new_tokens=8", "rollout.max_model_len=64", *overrides],
                         base=base_config(tmp_path, {"policy": "/unused", "reward": "/unused", "prompts": "/unused"}))
    environments = (Environments(None, {}, answering=answering) if answering is not None
                    else Environments.load(config.rollout.environment, load_tools(list(tools))))
    environments.read_calls_with(config.rollout.tool_parser, tokenizer)
    prompts = [prompt_token_ids(row, tokenizer, None, environments.tool_schemas) for row in rows]
    return Episodes(config, environments, Renderer(tokenizer, environments.tool_schemas), tokenizer, rows, prompts,
                    list(range(len(rows))), lambda _, max_tokens: max_tokens, logging.getLogger("test"))


def settle(episodes, seconds=5.0):
    """Let the environments' threads answer (each call ends in well under a second here)."""
    deadline = time.monotonic() + seconds
    while episodes.waiting and time.monotonic() < deadline:
        episodes.advance(time.monotonic(), timeout=0.05)


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from demos.parity import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def test_an_episode_is_the_policys_turns_and_the_observations_token_for_token(tmp_path, demo_tokenizer):
    """Three turns of the counting environment, the weights changing after the first: the response
    is turn 1 + observation 1 + turn 2 + observation 2 + turn 3, the observations tokenized alone;
    the loss mask is 1 on the turns, the logprobs vLLM's there and 0 on the observations, each
    turn's reward on its last token; the versions are the first turn's and the last's."""
    tok = demo_tokenizer
    episodes = make_episodes(tmp_path, tok, "tests.environments:counting", [{"prompt": "even 1 2 3 :"}])
    episodes.start(prompt_index=7, row=0)
    settle(episodes)
    turns = [[10, 12, EOS], [11, 13, 15, EOS], [4, EOS]]  # ids of digits, then <eos>
    observations = [tok("odd 1 :", add_special_tokens=False)["input_ids"],
                    tok("even 2 :", add_special_tokens=False)["input_ids"]]
    expected_context = list(tok("even 1 2 3 :")["input_ids"])
    for number, turn in enumerate(turns):
        (episode, ids, max_tokens), = episodes.take_ready(version=number)
        assert ids == expected_context and max_tokens == min(8, 64 - len(ids))
        episodes.turn_finished(episode, fake_output(turn), version=number)
        settle(episodes)
        expected_context += turn + (observations[number] if number < 2 else [])
    samples, dropped = episodes.finished()
    assert dropped == [] and episodes.active == 0
    sample, = samples
    assert sample.prompt_index == 7 and sample.finish_reason == "done"
    assert sample.prompt_tokens.tolist() == tok("even 1 2 3 :")["input_ids"]
    response = turns[0] + observations[0] + turns[1] + observations[1] + turns[2]
    assert sample.response_tokens.tolist() == response
    mask = [1] * 3 + [0] * len(observations[0]) + [1] * 4 + [0] * len(observations[1]) + [1] * 2
    assert sample.loss_mask.tolist() == mask
    vllm = [-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3, -0.4], [-0.1, -0.2]
    logprobs = vllm[0] + [0] * len(observations[0]) + vllm[1] + [0] * len(observations[1]) + vllm[2]
    np.testing.assert_allclose(sample.behavior_logprobs, logprobs, rtol=1e-6)
    rewards = np.zeros(len(response))
    ends = np.flatnonzero(np.diff([*mask, 0]) == -1)  # each turn's last token
    rewards[ends] = [0.1 * 2, 0.1 * 3, 0.1 * 1]  # the counting environment: 0.1 a word of the turn
    np.testing.assert_allclose(sample.turn_rewards, rewards, rtol=1e-6)
    assert (sample.behavior_version, sample.last_behavior_version) == (0, 2)
    messages = __import__("json").loads(sample.messages)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == "odd 1 :" and messages[1]["content"] == "4 6"
    assert episodes.record()["turns_per_episode"] == 3


@pytest.mark.parametrize("environment, reason, turns", [
    ("Raises", "env_error", 1),
    ("Hangs", "env_deadline", 1),
    ("Garbage", "env_error", 1),
    ("DoneAtOnce", "done", 1),
])
@pytest.mark.parametrize("failed_episode_reward", [None, -0.75])
def test_an_environment_that_fails_ends_its_episode_with_the_reason(tmp_path, demo_tokenizer, environment,
                                                                       reason, turns, failed_episode_reward):
    """An episode its environment ended (env_error, env_deadline) has no reward to train on: its
    group is dropped (reported with the reason, for its credits), or, with
    ``rollout.failed_episode_reward``, what the policy said is a sample trained at that reward on
    its last token. An episode that ended well is trained either way."""
    episodes = make_episodes(tmp_path, demo_tokenizer, f"tests.environments:{environment}",
                             [{"prompt": "odd 1 :"}], "rollout.env_step_deadline_s=0.3",
                             f"rollout.failed_episode_reward={'null' if failed_episode_reward is None else -0.75}")
    episodes.start(0, 0)
    settle(episodes)
    (episode, _, _), = episodes.take_ready(0)
    episodes.turn_finished(episode, fake_output([10, EOS]), 0)
    settle(episodes)
    samples, dropped = episodes.finished()
    assert episodes.record()[f"episodes_ended_{reason}"] == 1
    if reason != "done" and failed_episode_reward is None:
        assert samples == [] and dropped == [(0, reason)]
        return
    (sample,) = samples
    assert sample.finish_reason == reason and dropped == []
    assert sample.response_tokens.tolist() == [10, EOS] and sample.loss_mask.tolist() == [1, 1]
    if reason != "done":
        assert sample.turn_rewards.tolist() == [0.0, -0.75]


def test_an_episode_without_a_policy_token_is_dropped_with_its_group(tmp_path, demo_tokenizer):
    """Two episodes a prompt: one's reset raises, so the other's sample cannot travel alone (a batch
    holds whole groups): both are reported dropped, each with its reason, for their credits."""
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:reset_raises_once",
                             [{"prompt": "odd 1 :"}], "rollout.samples_per_prompt=2")
    episodes.start(3, 0)
    settle(episodes)
    for _ in range(3):  # the counting one's turns
        (episode, _, _), = episodes.take_ready(0)
        episodes.turn_finished(episode, fake_output([10, EOS]), 0)
        settle(episodes)
    samples, dropped = episodes.finished()
    assert samples == [] and sorted(dropped) == [(3, "env_error"), (3, "group_incomplete")]


def test_turns_and_tokens_are_bounded(tmp_path, demo_tokenizer):
    """max_turns ends the counting episode after 2 turns; a turn cut at max_new_tokens ends it
    ("length", no step); an observation that would leave no room in max_model_len ends it too."""
    prompt = [{"prompt": "odd 1 :"}]
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:counting", prompt, "rollout.max_turns=2")
    episodes.start(0, 0)
    for _ in range(2):
        settle(episodes)
        (episode, _, _), = episodes.take_ready(0)
        episodes.turn_finished(episode, fake_output([10, EOS]), 0)
    settle(episodes)
    assert [s.finish_reason for s in episodes.finished()[0]] == ["max_turns"]

    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:counting", prompt)
    episodes.start(0, 0)
    settle(episodes)
    (episode, _, _), = episodes.take_ready(0)
    episodes.turn_finished(episode, fake_output([10] * 8, "length"), 0)
    assert not episodes.waiting and episode.environment.inner.turn == 0  # no step for a cut turn
    assert [s.finish_reason for s in episodes.finished()[0]] == ["length"]

    prompt_length = len(demo_tokenizer("odd 1 :")["input_ids"])  # 4
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:counting", prompt,
                             f"rollout.max_model_len={prompt_length + 4}", "rollout.max_new_tokens=4")
    episodes.start(0, 0)
    settle(episodes)
    (episode, _, max_tokens), = episodes.take_ready(0)
    assert max_tokens == 4
    episodes.turn_finished(episode, fake_output([10, EOS]), 0)  # 2 left: "odd 1 :" is 3
    settle(episodes)
    (sample,), _ = episodes.finished()
    assert sample.finish_reason == "token_budget" and sample.response_tokens.tolist() == [10, EOS]


# --------------------------------------------------------------------------- tools


def test_tool_calls_are_read_by_vllms_parser_and_every_failure_is_a_message(tmp_path):
    """hermes (the default) reads each <tool_call> of a turn; a call that fails in any way is a
    message the policy reads; a turn whose calls cannot be read is one malformed call."""
    from environments.tools import ToolCallParser, call_tool, load_tools

    tools = load_tools(["tests.environments:add", "tests.environments:broken", "tests.environments:unserialisable"])
    parse = ToolCallParser("hermes", chatml_tokenizer(str(tmp_path)), [tool.schema for tool in tools.values()]).parse
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "unserialisable", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    answers = [call_tool(tools, call) for call in parse(text)]
    assert [error and error.kind for _, error in answers] == [None, None, "malformed", "unknown_tool", "raised",
                                                              "unserialisable", "raised"]
    assert answers[4][1].tool == "broken" and answers[4][1].arguments == {"x": 1}
    assert 'raise ValueError("broken on purpose")' in answers[4][1].detail  # the traceback, for the log
    assert answers[0][0] == "42" and answers[1][0] == "3"
    assert "unknown tool 'mul'" in answers[3][0] and "broken on purpose" in answers[4][0]
    assert "missing 1 required positional argument: 'b'" in answers[6][0]
    assert parse("no call here") == []
    unread = parse('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call><tool_call>{not json}</tool_call>')
    assert [(call.name, call.error) for call in unread] == [(None, "malformed tool call: the hermes parser could "
                                                                   "not read it")]


FAMILY_CALLS = {  # what a model of each family writes to call add(17, 25), in its own format
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 17, "b": 25}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 17, "b": 25}}]',
    "pythonic": "[add(a=17, b=25)]",
}
FAMILY_MALFORMED = {"hermes": '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
                    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": ',
                    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": ]'}


@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_each_familys_parser_reads_its_own_call_format(tmp_path, family):
    """vLLM's parser named as `vllm serve --tool-call-parser` takes it reads a call written in its
    family's format (on a tokenizer holding the family's special tokens) as the same call, and a
    call begun and left unreadable as one malformed call."""
    from environments.tools import ToolCall, ToolCallParser, load_tools

    tokenizer = chatml_tokenizer(str(tmp_path))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]"]})
    tools = load_tools(["tests.environments:add"])
    parser = ToolCallParser(family, tokenizer, [tool.schema for tool in tools.values()])
    assert parser.parse(FAMILY_CALLS[family]) == [ToolCall("add", {"a": 17, "b": 25})]
    assert parser.parse("The answer is 42.") == []
    if family in FAMILY_MALFORMED:
        assert [call.name for call in parser.parse(FAMILY_MALFORMED[family])] == [None]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_an_episode_in_each_familys_template_is_what_the_template_renders_of_its_conversation(tmp_path, family):
    """On a tokenizer of each family's shape (its special tokens and chat template): the policy's
    call in the family's format is read by its parser and answered, the tool's result rendered by
    the template between the turns; the whole token stream decodes to what the template renders of
    the conversation (the policy's turns as it wrote them), token for token."""
    from tests.helpers import FAMILY_TOKENS, family_tokenizer

    tok = family_tokenizer(str(tmp_path / "tok"), family)
    end = tok.convert_tokens_to_ids(FAMILY_TOKENS[family][2])
    question = [{"role": "user", "content": "What is 17 plus 25?"}]
    episodes = make_episodes(tmp_path, tok, None, [{"messages": question}], f"rollout.tool_parser={family}",
                             "rollout.max_model_len=512", "rollout.max_new_tokens=64", tools=["tests.environments:add"])
    episodes.start(0, 0)
    settle(episodes)
    call, answer = FAMILY_CALLS[family], "The answer is 42."
    for turn in (call, answer):
        (episode, ids, _), = episodes.take_ready(0)
        episodes.turn_finished(episode, fake_output(tok(turn, add_special_tokens=False)["input_ids"] + [end]), 0)
        settle(episodes)
    (sample,), dropped = episodes.finished()
    assert dropped == [] and sample.finish_reason == "done"
    assert episodes.record()["tool_calls_per_episode"] == 1
    conversation = [*question, {"role": "assistant", "content": call}, {"role": "tool", "content": "42"},
                    {"role": "assistant", "content": answer}]
    rendered = tok.apply_chat_template(conversation, tools=episodes.renderer.tools, tokenize=False)
    if family == "hermes":  # ChatML closes the last turn with "\n" after <|im_end|>: the policy stops before it
        rendered = rendered.removesuffix("\n")
    assert tok.decode([*sample.prompt_tokens, *sample.response_tokens]) == rendered
    assert sample.loss_mask.tolist().count(0) == len(sample.response_tokens) - 2 * 1 - len(
        tok(call, add_special_tokens=False)["input_ids"]) - len(tok(answer, add_special_tokens=False)["input_ids"])


def test_a_tool_parser_that_is_not_vllms_or_does_not_fit_the_tokenizer_is_a_config_error(tmp_path):
    from environments.tools import ToolCallParser

    tokenizer = chatml_tokenizer(str(tmp_path))
    with pytest.raises(ConfigError, match="rollout.tool_parser: 'hermez' is not one of vLLM's tool-call parsers "
                                          r"\(.*hermes.*\)"):
        ToolCallParser("hermez", tokenizer, None)
    with pytest.raises(ConfigError, match="rollout.tool_parser: llama3_json does not fit the policy's tokenizer"):
        ToolCallParser("llama3_json", tokenizer, None)
    with pytest.raises(ConfigError, match=r"rollout.reasoning_parser: 'qwen4' is not one of vLLM's reasoning parsers "
                                          r"\(.*qwen3.*\)"):
        ToolCallParser("hermes", tokenizer, None, "qwen4")


def test_a_tools_schema_comes_from_its_docstring_or_its_signature():
    from environments.tools import json_schema
    from tests.environments import add, broken

    assert json_schema(add)["function"]["parameters"] == {
        "type": "object", "properties": {"a": {"type": "integer", "description": "the first"},
                                         "b": {"type": "integer", "description": "the second"}},
        "required": ["a", "b"]}
    assert json_schema(broken)["function"] == {"name": "broken", "description": "broken",
                                               "parameters": {"type": "object", "properties": {"x": {}},
                                                              "required": ["x"]}}


def test_a_tool_name_twice_or_a_missing_tool_is_an_error_naming_the_key():
    from common.config import ConfigError
    from environments.tools import load_tools

    with pytest.raises(ConfigError, match=r"rollout.tools\[1\]: 'tests.environments:add' is named 'add'"):
        load_tools(["tests.environments:add", "tests.environments:add"])
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\]: cannot import 'tests.environments:nope'"):
        load_tools(["tests.environments:nope"])


def test_with_a_chat_template_the_ids_are_the_template_rendering_of_the_whole_conversation(tmp_path):
    """A chat model with tools (ChatML, Qwen's shape): the policy calls a tool, reads its answer and
    answers. The episode's ids (prompt, turns as sampled, observations as rendered alone) equal the
    template's rendering of the whole conversation, tokenized in one piece; the tool message is
    the tool's result; a turn without a call ends the episode."""
    import json

    tok = chatml_tokenizer(str(tmp_path / "tokenizer"))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    from environments.tools import load_tools

    tools = load_tools(["tests.environments:add"])
    schemas = [tool.schema for tool in tools.values()]
    question = [{"role": "user", "content": "What is 17 plus 25?"}]
    rows = [{"messages": question}]
    episodes = make_episodes(tmp_path, tok, "null", rows, "rollout.max_model_len=512",
                             tools=["tests.environments:add"])
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    answer = "The answer is 42."
    episodes.start(0, 0)
    settle(episodes)
    for text in (call, answer):
        (episode, _, _), = episodes.take_ready(0)
        episodes.turn_finished(episode, fake_output(tok(text, add_special_tokens=False)["input_ids"] + [end]), 0)
        settle(episodes)
    (sample,), _ = episodes.finished()
    conversation = [*question, {"role": "assistant", "content": call},
                    {"role": "tool", "name": "add", "content": "42"}, {"role": "assistant", "content": answer}]
    whole = tok(tok.apply_chat_template(conversation, tools=schemas, tokenize=False), add_special_tokens=False)["input_ids"]
    assert [*sample.prompt_tokens.tolist(), *sample.response_tokens.tolist()] == whole[:-1]  # but the last "\n"
    assert sample.finish_reason == "done"
    assert json.loads(sample.messages)[2:] == conversation[2:]
    record = episodes.record()
    assert record["tool_calls_per_episode"] == 1 and record["tool_errors"] == 0


def test_a_chat_template_that_cannot_carry_a_conversation_is_named(tmp_path):
    """A template that refuses a user turn followed by an assistant turn cannot render observations
    between turns: the rollout says so at start, naming the key."""
    from common.config import ConfigError
    from rollout.episodes import Renderer

    tok = chatml_tokenizer(str(tmp_path / "tokenizer"))
    tok.chat_template = "{{ raise_exception('only one user message, please') }}"
    with pytest.raises(ConfigError, match="models.policy: its chat template cannot render .*only one user message"):
        Renderer(tok, None)


# --------------------------------------------------------------------------- environments that fail


def test_an_environment_that_fails_every_episode_backs_off_is_logged_once_and_ends_the_run(
        tmp_path, demo_tokenizer, monkeypatch, caplog):
    """Every reset raises: new episodes wait longer and longer before their environment is made, the
    failure is logged once with its traceback and data row (its repeats only counted), and
    rollout.env_failure_limit failures in a row end the run with the reason."""
    from rollout import episodes as module
    from rollout.episodes import EnvironmentFailing

    monkeypatch.setattr(module, "BACKOFF_FIRST_S", 0.001)
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:always_fails_reset",
                             [{"prompt": "odd 1 :", "answer": "x"}], "rollout.env_failure_limit=10")
    delays = []
    with caplog.at_level(logging.INFO, logger="test"), pytest.raises(EnvironmentFailing) as ended:
        for index in range(20):
            delays.append(episodes.backoff_s())
            episodes.start(index, 0)
            settle(episodes)
            assert episodes.finished() == ([], [(index, "env_error")])
            episodes.record()  # the rollout's metrics records between episodes: the ends said still add up
    assert index == 9 and "10 episodes in a row ended by their environment" in str(ended.value)
    assert "rollout.env_failure_limit 10" in str(ended.value) and "env_error 10" in str(ended.value)
    assert delays == [0, 0, 0, 0, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "no sandbox to be had" in errors[0].getMessage() and "Traceback" in errors[0].getMessage()
    assert '{"prompt": "odd 1 :", "answer": "x"}' in errors[0].getMessage()  # the data row
    assert any("10 times so far" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_an_episode_that_ends_well_resets_the_count_of_failures(tmp_path, demo_tokenizer):
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:reset_raises_once",
                             [{"prompt": "odd 1 :"}], "rollout.env_failure_limit=2", "rollout.max_turns=1")
    import tests.environments as environments

    environments._made = __import__("itertools").count()  # the first environment made fails, the rest count
    episodes.start(0, 0)
    settle(episodes)
    assert episodes.failed_in_a_row == 1
    episodes.start(1, 0)
    settle(episodes)
    (episode, _, _), = episodes.take_ready(0)
    episodes.turn_finished(episode, fake_output([10, EOS]), 0)
    settle(episodes)
    assert episodes.failed_in_a_row == 0 and [s.finish_reason for s in episodes.finished()[0]] == ["max_turns"]


def test_a_context_started_over_makes_the_turns_before_a_part_of_the_same_episode(tmp_path, demo_tokenizer):
    """A Restart (an agent program that compacted its conversation): the turns before are a sample of
    their own, the episode's first part (finish reason "restart", its own versions); the new
    context's prompt and the turns after it are its last part, with the episode's reward."""
    tok = demo_tokenizer
    episodes = make_episodes(tmp_path, tok, "tests.environments:compacts_its_context", [{"prompt": "even 1 2 3 :"}])
    episodes.start(0, 0)
    settle(episodes)
    for version, turn in enumerate([[10, 12, EOS], [11, EOS]]):
        (episode, ids, _), = episodes.take_ready(version)
        if version == 1:
            assert ids == tok("odd 1 :")["input_ids"]  # the new context, rendered as a reset's
        episodes.turn_finished(episode, fake_output(turn), version)
        settle(episodes)
    (before, after), dropped = episodes.finished()
    assert dropped == [] and (before.finish_reason, after.finish_reason) == ("restart", "done")
    assert [(s.episode_index, s.part_index, s.episode_parts, s.final) for s in (before, after)] == [
        (0, 0, 2, False), (0, 1, 2, True)]
    assert before.prompt_tokens.tolist() == tok("even 1 2 3 :")["input_ids"]
    assert before.response_tokens.tolist() == [10, 12, EOS] and before.loss_mask.tolist() == [1, 1, 1]
    assert before.turn_rewards.tolist() == [0.0, 0.0, 0.0] and before.behavior_version == 0
    assert after.prompt_tokens.tolist() == tok("odd 1 :")["input_ids"]
    assert after.response_tokens.tolist() == [11, EOS] and after.loss_mask.tolist() == [1, 1]
    assert after.turn_rewards.tolist() == [0.0, 1.0] and after.behavior_version == 1
    record = episodes.record()
    assert (record["episode_splits"], record["episodes"], record["turns_per_episode"], record["env_reward"]) == (
        1, 1, 2, 1.0)


def test_a_context_rewritten_past_the_limit_leaves_the_part_before_as_the_episodes_last(tmp_path, demo_tokenizer):
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:compacts_past_the_limit",
                             [{"prompt": "even 1 2 3 :"}], "rollout.samples_per_prompt=2")
    episodes.start(0, 0)
    settle(episodes)
    for episode, _, _ in episodes.take_ready(0):
        episodes.turn_finished(episode, fake_output([10, EOS]), 0)
    settle(episodes)
    samples, dropped = episodes.finished()
    assert dropped == [] and [(s.episode_index, s.part_index, s.episode_parts) for s in samples] == [
        (0, 0, 1), (1, 0, 1)]
    assert all(s.finish_reason == "token_budget" and s.turn_rewards.tolist() == [0.0, 0.5] for s in samples)
    assert episodes.record()["env_reward"] == 0.5


def test_the_runs_end_closes_the_environments_of_episodes_under_way_and_of_resets_under_way(tmp_path, demo_tokenizer):
    """An OpenEnv session or an agent program must not outlive the run: close() ends each episode's
    environment not yet ended, and one whose reset is under way once its reset is over (a session
    it opens is closed, not left behind by a close that came first)."""
    from tests.environments import CLOSED, SESSIONS

    CLOSED.clear()
    SESSIONS.clear()
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:closes",
                             [{"prompt": "even 1 :"}, {"prompt": "odd 3 :", "slow": True}])
    episodes.start(0, 0)
    settle(episodes)
    assert len(episodes.ready) == 1  # made, waiting for its turn
    episodes.close()
    assert sorted(CLOSED) == ["even 1 :"]
    episodes.start(1, 1)
    assert len(episodes.waiting) == 1  # its reset sleeps on
    reset, environment = episodes.waiting[0].pending, episodes.waiting[0].environment
    while environment.inner is None:  # built, its reset under way
        time.sleep(0.01)
    episodes.close()  # its environment is closed once its reset is over (the first's is not closed twice)
    reset.result(timeout=5.0)
    assert sorted(CLOSED) == ["even 1 :", "odd 3 :"] and not SESSIONS


def test_a_turn_cut_at_its_calls_own_max_tokens_is_answered_and_one_cut_by_the_run_ends_the_episode(
        tmp_path, demo_tokenizer):
    from tests.environments import asks_for_two_tokens

    for run_cap, answered in [(8, True), (2, False)]:  # the call asks for 2 tokens
        episodes = make_episodes(tmp_path, demo_tokenizer, None, [{"prompt": "odd 1 :"}],
                                 f"rollout.max_new_tokens={run_cap}", answering=asks_for_two_tokens)
        episodes.start(0, 0)
        settle(episodes)
        (episode, _, max_tokens), = episodes.take_ready(0)
        assert max_tokens == 2
        episodes.turn_finished(episode, fake_output([10, 11], "length"), 0)
        settle(episodes)
        if answered:  # cut at the call's own cap: its answer, finish reason "length"
            assert episode.environment.finish_reasons == ["length"] and episode.ended == "done"
        else:  # cut where the run cuts turns: the episode ends there
            assert episode.environment.finish_reasons == [] and episode.ended == "length"


def test_an_agent_programs_figures_are_averaged_over_the_episodes_that_gave_them(tmp_path, demo_tokenizer):
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:reports", [{"prompt": "odd 1 :"}],
                             "rollout.samples_per_prompt=2")
    episodes.start(0, 0)
    settle(episodes)
    (first, _, _), (second, _, _) = episodes.take_ready(0)
    episodes.turn_finished(first, fake_output([10, EOS]), 0)
    episodes.turn_finished(second, fake_output([10, 10, 10, EOS]), 0)
    settle(episodes)
    lengths = [len(demo_tokenizer.decode(ids, skip_special_tokens=True)) for ids in ([10, EOS], [10, 10, 10, EOS])]
    assert episodes.record()["agent_calls"] == sum(lengths) / 2


@pytest.mark.parametrize("answer, reason", [
    ((None, 0.0, "False"), "step's done is 'False' \\(str\\), not True or False"),
    ((None, "0.5", False), "step's reward is '0.5' \\(str\\), not a number"),
    ((None, True, False), "step's reward is True \\(bool\\), not a number"),
    ({}, "step returned a dict without done, observation, reward"),
    ({"observation": None, "reward": 0.0, "done": True, "info": 1}, "with unknown keys info"),
])
def test_a_step_of_the_wrong_types_is_refused_not_coerced(answer, reason):
    from environments.interface import BadStep, Step, as_step

    with pytest.raises(BadStep, match=reason):
        as_step(answer)
    assert as_step({"observation": "x", "reward": 1, "done": np.bool_(True)}) == Step("x", 1.0, True)
    import torch

    assert as_step((None, torch.tensor(0.25), False)).reward == 0.25  # a 0-d tensor is a number
    with pytest.raises(BadStep, match="not one number"):
        as_step((None, torch.tensor([0.25, 1.0]), False))


def test_text_from_reset_is_a_user_message_through_the_template_as_text_from_step_is(tmp_path):
    tok = chatml_tokenizer(str(tmp_path / "tok"))
    episodes = make_episodes(tmp_path, tok, "tests.environments:text_reset", [{"prompt": "ignored"}])
    episodes.start(0, 0)
    settle(episodes)
    (episode, ids, _), = episodes.take_ready(0)
    first = [{"role": "user", "content": "What is 17 plus 25?"}]
    assert ids == tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert episode.messages == first


def test_environment_calls_reuse_idle_threads_and_one_that_hangs_holds_only_its_own():
    """``in_thread``'s workers: a call that never returns keeps its thread, the next call runs at
    once on another; a finished call's thread takes the next call (no thread started for it); a
    thread idle for ``IDLE_S`` ends."""
    import threading

    from environments.threads import _Workers

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    workers = _Workers()
    workers.IDLE_S = 2.0
    hang, ran = threading.Event(), {}

    def call(name: str, done: threading.Event, block: bool = False):
        def run() -> None:
            ran[name] = threading.current_thread()
            if block:
                hang.wait(10)
            done.set()
        return run

    hung, first, second = threading.Event(), threading.Event(), threading.Event()
    workers.submit(call("hung", hung, block=True))
    workers.submit(call("first", first))
    assert first.wait(5) and not hung.is_set()
    until(lambda: workers.idle == 1, "the first call's thread waits for another")
    workers.submit(call("second", second))
    assert second.wait(5)
    assert ran["second"] is ran["first"] and ran["first"] is not ran["hung"]
    until(lambda: not ran["first"].is_alive(), "a thread idle past IDLE_S ends")
    assert ran["hung"].is_alive() and workers.idle == 0
    hang.set()
    assert hung.wait(5)


def test_an_environment_with_the_runs_tools_starts_from_its_own_messages(tmp_path, demo_tokenizer):
    """rollout.tools beside an environment whose reset gives the first messages: the episode starts
    from them, rendered with the run's tools (it ended env_error before: the renderer was handed the
    tools' functions for schemas)."""
    episodes = make_episodes(tmp_path, demo_tokenizer, "tests.environments:starts_with_messages",
                             [{"prompt": "even 2 :"}], tools=["tests.environments:add"])
    episodes.start(0, 0)
    settle(episodes)
    (episode, ids, _), = episodes.take_ready(0)
    assert episode.ended is None and ids == episodes.renderer.prompt_ids([{"role": "user", "content": "odd 1 :"}])
    assert episode.renderer is episodes.renderer  # the run's, its tools rendered
