"""Agent programs (rollout.agent) against the rollout's OpenAI endpoint, the engine's turns given
by hand: what a program sends is the episode's observation, what it returns its reward; a call
with a key the rollout did not give, or of an episode that ended, is refused. The program's
calls through a real engine, token for token as native episodes: tests/test_agent_demo.py."""

import json
import os
import re
import sys
import threading
import time

import openai
import pytest

from environments.interface import BadStep, PastDeadline, Step
from tests.environments import ADD
from tests.helpers import chatml_tokenizer, first_of, step_of
from tests.test_episodes import FAMILY_CALLS, FAMILY_MALFORMED


@pytest.fixture
def programs(tmp_path):
    """Each test's AgentPrograms of ``spec``, closed after it (its endpoint with it)."""
    from environments.agents import AgentPrograms
    from environments.tools import ToolCallParser

    made = []

    def make(spec: "str | list[str]", deadline_s: float = 10.0, parser: str = "hermes", reasoning: str | None = None,
             processes: int = 0, cores: list[int] | None = None):
        tokenizer = chatml_tokenizer(str(tmp_path))
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]", "<think>",
                                                                    "</think>"]})
        made.append(AgentPrograms(spec, ToolCallParser(parser, tokenizer, None, reasoning), deadline_s, deadline_s,
                                  processes=processes, cores=cores))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_a_programs_calls_are_its_observations_and_its_return_the_reward(programs):
    episode = programs("tests.environments:asks_twice").make({"prompt": "What is 17 plus 25?"})
    assert first_of(episode) == [{"role": "user", "content": "What is 17 plus 25?"}]
    assert episode.tools[0]["function"]["name"] == "add"
    step = step_of(episode, '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>', [])
    assert not step.done and [(m["role"], m["content"]) for m in step.observation] == [("tool", "42")]
    assert step.observation[0]["tool_call_id"] == episode.sent[1]["tool_calls"][0]["id"]  # the call it answers
    assert episode.sent[1]["content"] == "" and episode.sent[1]["tool_calls"][0]["function"] == {
        "name": "add", "arguments": '{"a": 17, "b": 25}'}
    assert step_of(episode, "42", []) == Step(None, 1.0, done=True, metrics={"calls": 2.0})


@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_a_call_in_each_familys_format_reaches_the_program_as_openai_tool_calls(programs, family):
    """The policy's call written in its family's format comes back through the endpoint as OpenAI
    ``tool_calls`` read by vLLM's parser for that family; a call begun and left unreadable comes
    back as the turn's text with ``tool_call_error``, and counts as a tool error."""
    from environments.interface import Turn
    from tests.environments import SEEN

    agent = programs("tests.environments:calls_add", parser=family)
    tokenizer = agent.parser.tokenizer

    def step(episode, text: str) -> Step:
        """The policy's turn as the rollout gives it: the engine's ids (the family's markers are
        special tokens, then the end of the turn), their text without special tokens."""
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        return step_of(episode, tokenizer.decode(ids, skip_special_tokens=True), [], Turn(5, ids, [-0.1] * len(ids)))

    episode = agent.make({"id": f"{family}-call", "prompt": "What is 17 plus 25?"})
    first_of(episode)
    assert step(episode, FAMILY_CALLS[family]) == Step(None, 1.0, done=True, tool_calls=1)
    assert SEEN[f"{family}-call"]["calls"] == [("add", {"a": 17, "b": 25})]
    assert SEEN[f"{family}-call"]["tool_call_error"] is None
    episode = agent.make({"id": f"{family}-answer", "prompt": "What is 17 plus 25?"})
    first_of(episode)
    step(episode, "42")
    assert SEEN[f"{family}-answer"] == {"calls": [], "content": "42", "tool_call_error": None, "reasoning": None}
    if family in FAMILY_MALFORMED:
        episode = agent.make({"id": f"{family}-malformed", "prompt": "What is 17 plus 25?"})
        first_of(episode)
        assert [error.kind for error in step(episode, FAMILY_MALFORMED[family]).tool_errors] == ["malformed"]
        assert SEEN[f"{family}-malformed"] == {
            "calls": [], "content": FAMILY_MALFORMED[family],
            "tool_call_error": f"malformed tool call: the {family} parser could not read it", "reasoning": None}


def test_reasoning_is_set_apart_by_vllms_reasoning_parser_before_calls_are_read(programs):
    """rollout.reasoning_parser: the reply carries the turn's reasoning apart from its content, and
    calls are read in the content (where vLLM's parser for the family ends the reasoning)."""
    from tests.environments import SEEN

    agent = programs("tests.environments:calls_add", reasoning="qwen3")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    for name, turn, seen in [
            ("thinks-then-calls", f"<think>17 and 25: add them</think>{call}",
             {"calls": [("add", {"a": 17, "b": 25})], "content": None, "reasoning": "17 and 25: add them"}),
            ("thinks-then-answers", "<think>17 plus 25 is 42</think>42",
             {"calls": [], "content": "42", "reasoning": "17 plus 25 is 42"})]:
        episode = agent.make({"id": name, "prompt": "What is 17 plus 25?"})
        first_of(episode)
        step_of(episode, turn, [])
        assert {key: SEEN[name][key] for key in seen} == seen
    assert agent.parser.parse("<think>17 plus 25 is 42</think>42") == []
    assert [c.name for c in agent.parser.parse(f"<think>17 and 25</think>{call}")] == ["add"]


def test_a_streamed_call_gets_the_whole_turn_as_chunks(programs):
    """stream: true is answered as OpenAI's server streams: the turn (its content, its tool calls
    with their indices), the finish reason, the token counts, then [DONE]."""
    from environments.interface import Turn
    from tests.environments import SEEN

    agent = programs("tests.environments:streams")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    for name, row, turn, seen in [
            ("chat-call", {}, call, {"content": "", "calls": [("add", {"a": 17, "b": 25})],
                                     "finish_reason": "tool_calls"}),
            ("chat-answer", {}, "42", {"content": "42", "calls": [], "finish_reason": "stop"}),
            ("completion", {"completions": True}, " 42", {"content": " 42", "calls": [], "finish_reason": "stop"})]:
        episode = agent.make({"id": name, "prompt": "What is 17 plus 25?", **row})
        first_of(episode)
        ids = agent.parser.tokenizer(turn, add_special_tokens=False)["input_ids"]
        step_of(episode, turn, [], Turn(5, ids, [-0.1] * len(ids)))
        assert SEEN[name] == {**seen, "usage": len(ids)}


def test_a_command_in_a_process_of_its_own_is_a_program_too(programs):
    """rollout.agent_command: the row on stdin, the endpoint and the episode's key in OPENAI_BASE_URL
    and OPENAI_API_KEY (and ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY: Anthropic's client reads them
    alone), the reward on stdout's last line; one that fails says why with its stderr."""
    agent = programs([sys.executable, os.path.join(os.path.dirname(__file__), "agent_command.py")])
    for row in ({}, {"anthropic": True}):
        episode = agent.make({"prompt": "What is 17 plus 25?", **row})
        assert first_of(episode) == [{"role": "user", "content": "What is 17 plus 25?"}]
        assert step_of(episode, "42", []) == Step(None, 1.0, done=True)
        assert episode.process.returncode == 0
    failing = agent.make({"prompt": "What is 17 plus 25?", "fail": True})
    with pytest.raises(RuntimeError, match="exited with 3; its stderr ends:\nno model to call today"):
        first_of(failing)


def test_an_agent_commands_output_is_kept_to_its_last_part_and_its_wait_bounded():
    """A command that writes without end holds COMMAND_OUTPUT_KEPT characters of each stream, the
    last ones (where its reward is); one that does not end is given up on at its deadline."""
    import subprocess

    from environments.agents import COMMAND_OUTPUT_KEPT, _communicate

    writes = ("import sys; row = sys.stdin.readline(); sys.stderr.write('e' * (9 << 20));"
              "[sys.stdout.write('x' * (1 << 20)) for _ in range(16)]; print(); print(row.strip())")
    process = subprocess.Popen([sys.executable, "-c", writes], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    out, err = _communicate(process, '{"reward": 0.5}\n', 60.0)
    assert process.returncode == 0 and len(out) == len(err) == COMMAND_OUTPUT_KEPT
    assert out.endswith('x\n{"reward": 0.5}\n') and set(err) == {"e"}
    sleeps = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _communicate(sleeps, "{}\n", 0.5)
    assert time.monotonic() - started < 5.0
    sleeps.kill()


def test_programs_in_processes_of_their_own_answer_as_in_threads_and_a_dead_process_fails_its_episodes(programs):
    """rollout.agent_processes: the same episodes, their programs in another process on the cores
    asked for, their calls answered over its connection as the endpoint answers (a stream, a
    refusal); a program's error comes back with its type, message, traceback and where it was
    raised; a process killed under an episode fails that episode, and the next one gets a new
    process; an ended episode's program is cancelled."""
    import signal
    import traceback

    from environments.agent_processes import ProgramError

    agent = programs("tests.environments:in_its_process", processes=1, cores=[0])
    first = agent.make({"prompt": "one"})
    assert first_of(first) == [{"role": "user", "content": "one"}]
    step = step_of(first, "fine", [])
    assert (step.reward, step.done) == (1.0, True) and step.metrics["cores"] == 1
    pid = int(step.metrics["pid"])
    assert pid != os.getpid()
    failing = agent.make({"prompt": "two", "fail": True})
    first_of(failing)
    with pytest.raises(ProgramError, match="^ValueError: no luck with two$") as raised:
        step_of(failing, "fine", [])
    told = "".join(traceback.format_exception(raised.value))
    assert "in in_its_process" in told and "tests/environments.py" in told  # the program's own frames
    assert raised.value.where[0].endswith("tests/environments.py")  # what the rollout's failure log keys on
    ended = agent.make({"prompt": "three"})
    first_of(ended)
    process = agent.processes.processes[0]
    assert ended.key in process.running
    ended.close()  # the episode ends under its program: it is cancelled, and the process serves on
    assert ended.key not in process.running
    killed = agent.make({"prompt": "four"})
    first_of(killed)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=f"process {pid} exited .*while it ran this episode's program"):
        step_of(killed, "fine", [])
    again = agent.make({"prompt": "five"})
    first_of(again)
    step = step_of(again, "fine", [])
    assert step.reward == 1.0 and step.metrics["pid"] not in (pid, os.getpid())
    streamed = agent.make({"prompt": "six", "stream": True})  # the calls come over the process's connection
    first_of(streamed)
    assert step_of(streamed, "fine", []).metrics["chunks"] == 2  # the turn, then its finish reason
    refused = agent.make({"prompt": "seven", "ask": {"n": 2}})
    with pytest.raises(ProgramError, match="BadRequestError: .*n is 2: an episode's call asks for one completion"):
        first_of(refused)

    # its process's own deadline ends it as the loop's would (env_deadline), not as the program's error;
    # waited on without the loop's deadline, which would otherwise be seen first
    hung = programs("tests.environments:in_its_process", deadline_s=1.0, processes=1).make({"prompt": "8", "hang": 1})
    assert hung.begin_reset().result(timeout=60.0) == [{"role": "user", "content": "8"}]
    with pytest.raises(PastDeadline, match="ran past rollout.agent_deadline_s 1$"):
        hung.begin_step("fine", []).result(timeout=10.0)
    for processes in (0, 1):  # a TimeoutError of the program's own is its error, in a thread or a process
        own = programs("tests.environments:in_its_process", processes=processes).make({"prompt": "9", "own": 1})
        assert own.begin_reset().result(timeout=60.0) == [{"role": "user", "content": "9"}]
        with pytest.raises(ProgramError if processes else TimeoutError, match="mine, not the deadline") as raised:
            own.begin_step("fine", []).result(timeout=10.0)
        assert not isinstance(raised.value, PastDeadline)
    plain = programs("tests.environments:in_its_process_plain", processes=1).make({"prompt": "six"})
    first_of(plain)
    step = step_of(plain, "fine", [])
    assert step.reward == 1.0 and step.metrics["pid"] != os.getpid()



def test_a_row_no_message_holds_fails_its_episode_alone_and_the_process_serves_on(programs):
    """A data row a program process cannot be sent (an integer past msgpack's 64 bits) fails its own
    episode, saying why; the process's writer goes on, and the next episode is served."""
    agent = programs("tests.environments:in_its_process", processes=1)
    with pytest.raises(TypeError, match="the episode's data row cannot go to its program's process "
                                        r"\(OverflowError"):
        first_of(agent.make({"prompt": "big", "n": 2 ** 70}))
    served = agent.make({"prompt": "next", "n": {0: (1, 2)}})  # a key as text, a tuple as a list: as JSON takes them
    assert first_of(served) == [{"role": "user", "content": "next"}]
    assert step_of(served, "fine", []).reward == 1.0

def test_one_agent_program_and_one_that_exists(tmp_path):
    from common.config import ConfigError, load_config
    from launch.preflight import check_run_data

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    run = [f"data.prompts={prompts}", f"models.policy={tmp_path}"]
    with pytest.raises(ConfigError, match="rollout.agent and rollout.agent_command each name the agent program"):
        load_config(None, [*run, "rollout.agent=tests.environments:asks_twice", "rollout.agent_command=[python]"])
    with pytest.raises(ConfigError, match="rollout.agent_processes runs rollout.agent's programs"):
        load_config(None, [*run, "rollout.agent_command=[python]", "rollout.agent_processes=2"])
    with pytest.raises(ConfigError, match="cores: unknown role 'agents'"):
        load_config(None, [*run, "placement.cores.agents=[0]"])
    with pytest.raises(ConfigError, match="rollout.agent_command runs its own tools"):
        load_config(None, [*run, "rollout.agent_command=[python]", "rollout.tools=[tests.environments:add]"])
    config = load_config(None, [*run, "rollout.agent_command=[no-such-agent-program, --fast]"])
    with pytest.raises(ConfigError, match="rollout.agent_command: 'no-such-agent-program' is not a program"):
        check_run_data(config)


def test_a_programs_return_is_a_reward_its_figures_or_none_where_others_score():
    from environments.agents import _reward

    assert _reward(0.5, False) == (0.5, {}) and _reward({"reward": 1, "calls": 3}, False) == (1.0, {"calls": 3.0})
    assert _reward(None, True) == (0.0, {})  # the reward model or reward functions score the conversation
    with pytest.raises(BadStep, match="returned null, not a finite number \\(None is for runs where models.reward"):
        _reward(None, False)
    with pytest.raises(BadStep, match="returned 'calls': \"three\", not a finite number"):
        _reward({"reward": 1.0, "calls": "three"}, False)


def test_an_episodes_client_sends_what_the_sdks_own_copy_sends_without_a_thread_per_episode(monkeypatch):
    """Each episode's client is a copy of one kept client with the episode's key. The SDK's own copy
    looks the platform up again in a thread at its first call (``asyncify(get_platform)``); tether's
    copy is given it: the same request, headers and all, and no thread."""
    import asyncio

    import httpx
    import openai._base_client as base_client

    from environments.program_runs import episode_client

    reply = {"id": "c", "object": "chat.completion", "created": 0, "model": "policy", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}]}
    seen = []

    def answer(request):
        seen.append({name: value for name, value in request.headers.items()
                     if name not in ("x-stainless-retry-count", "idempotency-key")})
        return httpx.Response(200, json=reply)

    threads = []
    asyncify = base_client.asyncify
    monkeypatch.setattr(base_client, "asyncify", lambda function: threads.append(function) or asyncify(function))

    async def calls() -> None:
        client = openai.AsyncOpenAI(base_url="http://tether/v1", api_key="-", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
        for own in (client.with_options(api_key="key-1"), episode_client(client, "key-2"),
                    episode_client(client, "key-3")):
            await own.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2 + 2"}])

    asyncio.run(calls())
    assert len(threads) == 1  # the SDK's own copy alone
    assert [headers.pop("authorization") for headers in seen] == ["Bearer key-1", "Bearer key-2", "Bearer key-3"]
    assert seen[0] == seen[1] == seen[2] and "x-stainless-os" in seen[0]


def test_a_rewritten_context_starts_over_and_a_reward_that_is_not_a_number_ends_the_episode(programs):
    from environments.interface import Restart

    episode = programs("tests.environments:rewrites_its_context").make({"prompt": "hello"})
    first_of(episode)
    step = step_of(episode, "hi", [])
    assert step.observation == Restart([{"role": "user", "content": "something else"}])
    assert step_of(episode, "fine", []) == Step(None, 1.0, done=True)
    episode = programs("tests.environments:says_yes").make({"prompt": "hello"})
    first_of(episode)
    with pytest.raises(BadStep, match='returned "yes", not a finite number'):
        step_of(episode, "hi", [])


def test_the_endpoint_refuses_keys_it_did_not_give_and_episodes_that_ended(programs):
    agent = programs("tests.environments:asks_twice")
    client = openai.OpenAI(base_url=agent.endpoint.base_url, api_key="not-a-key", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError, match="unknown key"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    episode = agent.make({"prompt": "hi"})
    episode.close()  # what the rollout does when an episode ends
    own = openai.OpenAI(base_url=agent.endpoint.base_url, api_key=episode.key, max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError, match="this episode has ended"):  # told apart from a stranger's key
        own.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    waiting = agent.make({"prompt": "hi"})
    errors = []

    def call() -> None:
        try:
            openai.OpenAI(base_url=agent.endpoint.base_url, api_key=waiting.key, max_retries=0, timeout=10) \
                .chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as error:
            errors.append(error)

    taken = waiting._expect(lambda kind, call: call)  # as the rollout's loop waits for a program's call
    caller = threading.Thread(target=call)
    caller.start()
    pending = taken.result(timeout=10)  # the call, waiting for the policy's turn
    waiting.call = pending
    waiting.close()  # the episode ended (max_turns, a turn cut at max_new_tokens)
    caller.join(timeout=10)
    assert [error.status_code for error in errors] == [404] and "ended" in str(errors[0])


REFUSED = [  # what a call asks for, and what the endpoint says
    ({"n": 2}, "n is 2: an episode's call asks for one completion"),
    ({"temperature": 0.5}, "temperature 0.5: this run samples at sampling.temperature 1.0"),
    ({"top_p": 0.9}, "top_p 0.9: this run samples at sampling.top_p 1.0"),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs: the engine records the logprob of the token it sampled"),
    ({"tools": [ADD], "tool_choice": "required"}, "tool_choice 'required'"),
    ({"stop": ["\n"]}, "stop: the run's turns end where the policy ends them"),
    ({"max_tokens": -1}, "max_tokens -1: a turn has at least one token"),
    ({"presence_penalty": 0.5}, "presence_penalty: the run samples each turn as sampling says"),
    ({"response_format": {"type": "json_object"}}, "response_format: the run samples each turn as sampling says"),
]


def test_a_call_that_asks_for_another_distribution_or_several_completions_is_refused(programs):
    """A call is a turn of the episode's one token stream, sampled as the learner recomputes it."""
    from common.config import SamplingConfig

    agent = programs("tests.environments:asks_twice")
    agent.sampling = SamplingConfig()
    client = openai.OpenAI(base_url=agent.endpoint.base_url, api_key=agent.make({}).key, max_retries=0, timeout=10)
    for asked, refused in REFUSED:
        with pytest.raises(openai.BadRequestError, match=re.escape(refused)):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], **asked)
    # what the run samples with may be said
    episode = agent.make({})
    ended: list[int] = []

    def call() -> None:
        try:
            openai.OpenAI(base_url=agent.endpoint.base_url, api_key=episode.key, max_retries=0, timeout=10) \
                .chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                         temperature=1.0, top_p=1.0)
        except openai.NotFoundError as error:
            ended.append(error.status_code)

    taken = episode._expect(lambda kind, call: (kind, call))
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    kind, episode.call = taken.result(timeout=10)
    assert kind == "call"
    episode.close()  # the call was taken: the episode's end answers it
    caller.join(timeout=10)
    assert ended == [404]


def test_a_reply_carries_the_engines_logprobs_and_token_ids_and_the_call_bounds_the_turn(programs):
    """The turn's logprobs are the engine's (the run's distribution), its tokens decoded one by one;
    a call's max_tokens caps the turn the rollout generates for it."""
    from environments.interface import Turn
    from tests.environments import SEEN

    agent = programs("tests.environments:asks_for_logprobs")
    episode = agent.make({"id": "logprobs", "prompt": "What is 17 plus 25?"})
    first_of(episode)
    assert episode.turn_max_tokens == 5
    tokenizer = agent.parser.tokenizer
    ids = tokenizer("42", add_special_tokens=False)["input_ids"]
    turn = Turn(prompt_length=11, token_ids=ids, logprobs=[-0.25 * (i + 1) for i in range(len(ids))])
    assert step_of(episode, "42", [], turn) == Step(None, 1.0, done=True)
    pieces = [tokenizer.decode([token]) for token in ids]
    assert SEEN["logprobs"] == {"logprobs": [(piece, -0.25 * (i + 1)) for i, piece in enumerate(pieces)],
                                "token_ids": ids, "usage": (11, len(ids)), "finish_reason": "stop"}


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_completions_program_adds_its_texts_ids_and_the_engines_are_never_retokenized(programs, as_ids):
    """The completions API: the first prompt tokenized whole (with the tokenizer's special tokens,
    as vLLM's server does); a later prompt must extend the episode, and only what it adds is
    tokenized (or taken as ids); the turn's own ids stay the engine's."""
    from environments.interface import TokenIds, Turn
    from tests.environments import SEEN

    agent = programs("tests.environments:completes_twice")
    tokenizer = agent.parser.tokenizer
    prompt = "17 plus 25 is"
    row = {"id": f"completions-{as_ids}", "prompt": prompt}
    if as_ids:
        row |= {"ids": tokenizer(prompt)["input_ids"], "more_ids": tokenizer(" and then", add_special_tokens=False)[
            "input_ids"]}
    episode = agent.make(row)
    first = first_of(episode)
    assert isinstance(first, TokenIds) and first == tokenizer(prompt)["input_ids"]
    assert episode.turn_max_tokens == 8
    # the engine's ids for " 42", as it might have split them (not as the tokenizer would)
    generated = tokenizer(" 4", add_special_tokens=False)["input_ids"] + tokenizer("2", add_special_tokens=False)[
        "input_ids"]
    step = step_of(episode, " 42", [], Turn(len(first), generated, [-0.5] * len(generated)))
    assert isinstance(step.observation, TokenIds)
    assert step.observation == tokenizer(" and then", add_special_tokens=False)["input_ids"]
    assert episode.ids == [*first, *generated, *step.observation]
    assert step_of(episode, " 43", [], Turn(len(episode.ids), [7], [-1.0])) == Step(None, 1.0, done=True)
    assert SEEN[row["id"]] == {"texts": [" 42", " 43"], "logprobs": [-0.5] * len(generated), "token_ids": generated}


def test_a_tool_renders_alike_in_native_episodes_and_in_an_agent_programs_calls(programs):
    """The chat template writes each tool's JSON into the prompt (CHATML_TOOLS_TEMPLATE): the native
    path's schema of a tool (``rollout.tools``) and the schema an agent program passes for the same
    function (transformers' get_json_schema, as vLLM's request model reads it) render to the same
    ids. get_json_schema's ``return`` key, which vLLM's request model drops, is left out natively too."""
    from transformers.utils import get_json_schema

    from rollout.episodes import Renderer
    from environments.tools import Tool
    from tests.environments import add

    agent = programs("tests.environments:passes_get_json_schema")
    tokenizer = agent.parser.tokenizer
    episode = agent.make({"prompt": "What is 17 plus 25?"})
    first = first_of(episode)
    assert "return" in get_json_schema(add)["function"]
    native = Renderer(tokenizer, [Tool.load("tests.environments:add", "environments.tools").schema]).prompt_ids(first)
    theirs = Renderer(tokenizer, episode.tools).prompt_ids(first)
    assert '"name": "add"' in tokenizer.decode(native) and native == theirs


@pytest.mark.parametrize("writes_stop", [True, False])
def test_a_completions_program_keeping_its_own_transcript_trains_what_its_transcript_tokenizes_to(programs,
                                                                                                   writes_stop):
    """A completion's text omits the stop token the engine sampled ("<|im_end|>"). A program that
    writes it back after the turn writes what the stream holds already, and one that does not
    leaves it out of the stream: either way the episode's stream is, id for id, what the program's
    own transcript tokenizes to (it was once "...<|im_end|><|im_end|>\n...")."""
    from environments.interface import Turn
    from tests.environments import SEEN

    agent = programs("tests.environments:keeps_a_chatml_transcript")
    tokenizer = agent.parser.tokenizer
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    row = {"id": f"transcript-{writes_stop}", "prompt": "17 plus 25?", "turns": 3, "writes_stop": writes_stop}
    episode = agent.make(row)
    stream = list(first_of(episode))  # as rollout.episodes keeps it: the policy's ids, the observations' after them
    for number, text in enumerate([" 42", " 43 then", " 44"]):
        generated = tokenizer(text, add_special_tokens=False)["input_ids"] + ([stop] if number < 2 else [])
        stream += generated
        step = step_of(episode, text, [], Turn(len(stream) - len(generated), generated, [-0.5] * len(generated)))
        if not step.done:
            del stream[len(stream) - step.observation.unsaid:]
            stream += step.observation
            assert step.observation.unsaid == (0 if writes_stop else 1)
    assert step.done and "<|im_end|><|im_end|>" not in SEEN[row["id"]]
    assert stream == tokenizer(SEEN[row["id"]])["input_ids"]


def test_a_completions_prompt_that_does_not_extend_the_episode_starts_it_over(programs):
    from environments.interface import Restart, TokenIds

    agent = programs("tests.environments:rewrites_its_prompt")
    episode = agent.make({"prompt": "17 plus 25 is"})
    first_of(episode)
    step = step_of(episode, " 42", [])
    assert step.observation == Restart(TokenIds(agent.parser.tokenizer("something else")["input_ids"]))
    assert step_of(episode, " 43", []) == Step(None, 1.0, done=True)


def test_a_completions_prompt_the_engine_could_not_take_is_refused_and_ends_the_episode(programs):
    """An empty prompt or ids past the vocabulary would fail in the engine's hands: the call is
    refused (by vLLM's validation, or by the episode with 400) and the episode ends (env_error)."""
    agent = programs("tests.environments:completes_twice")
    for prompt, said in [([], "prompt"), ([10 ** 6], "ids past the vocabulary"),
                         ("", "must be provided and non-empty")]:
        episode = agent.make({"id": "bad-prompt", "prompt": prompt})
        with pytest.raises((BadStep, openai.BadRequestError), match=said):
            first_of(episode)


def test_a_turn_cut_at_its_calls_max_tokens_answers_the_call_with_length(programs):
    from environments.interface import Turn
    from tests.environments import SEEN

    agent = programs("tests.environments:asks_for_logprobs")
    episode = agent.make({"id": "cut", "prompt": "What is 17 plus 25?"})
    first_of(episode)
    ids = agent.parser.tokenizer("17 plus", add_special_tokens=False)["input_ids"]
    step_of(episode, "17 plus", [], Turn(11, ids, [-0.1] * len(ids), "length"))
    assert SEEN["cut"]["finish_reason"] == "length"


def program_episodes(tmp_path, rows: list[dict], *overrides: str):
    """The rollout's episodes (``rollout.episodes``) of tests.environments:does_as_its_row_says on
    ``rows``, its turns given by hand: (episodes, their AgentPrograms, the tokenizer); close the programs."""
    import logging

    from common.config import load_config
    from common.prompts import prompt_token_ids
    from environments.agents import agent_programs
    from environments.native import Environments
    from rollout.episodes import Episodes, Renderer
    from tests.helpers import base_config

    tokenizer = chatml_tokenizer(str(tmp_path))
    config = load_config(None, ["rollout.agent=tests.environments:does_as_its_row_says", "rollout.max_model_len=64",
                                *overrides],
                         base=base_config(tmp_path, {"policy": "/unused", "reward": "/unused", "prompts": "/unused"}))
    programs = agent_programs(config, tokenizer)
    episodes = Episodes(config, Environments.load(None, {}, programs), Renderer(tokenizer, None), tokenizer, rows,
                        [prompt_token_ids(row, tokenizer, None, None) for row in rows], list(range(len(rows))),
                        lambda _, max_tokens: max_tokens, logging.getLogger("test"))
    return episodes, programs, tokenizer


def test_the_rollouts_loop_waits_on_programs_itself_and_ends_one_that_raises_or_hangs(tmp_path, caplog):
    """The rollout's loop (``rollout.episodes``) takes a program's calls with no thread of its own
    between them: one that returns ends "done" with its reward, one that raises ends env_error, one
    that makes no call within ``rollout.agent_deadline_s`` ends env_deadline then, long before
    ``env_step_deadline_s``; the run's end closes a reset under way at once, its key refused after."""
    from environments.agents import ENDED
    from rollout.episodes import CLOSE_DEADLINE_S
    from tests.test_episodes import fake_output, settle

    rows = [{"prompt": "a", "do": "answer"}, {"prompt": "b", "do": "raise"}, {"prompt": "c", "do": "hang"},
            {"prompt": "d", "do": "hang"}]
    episodes, programs, tokenizer = program_episodes(tmp_path, rows, "rollout.agent_deadline_s=1",
                                                     "rollout.env_step_deadline_s=20", "rollout.max_new_tokens=8")
    try:
        for index in range(2):
            episodes.start(index, index)
        settle(episodes)
        turns = episodes.take_ready(0)  # in the order the programs' threads made their calls
        assert sorted(episode.group.prompt_index for episode, _, _ in turns) == [0, 1]
        answer = tokenizer("42", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for episode, _, _ in turns:
            episodes.turn_finished(episode, fake_output(answer), 0)
        settle(episodes)
        samples, dropped = episodes.finished()
        assert [(s.prompt_index, s.finish_reason, float(s.turn_rewards.sum())) for s in samples] == [
            (0, "done", 1.0)] and dropped == [(1, "env_error")]  # no reward to train a failed episode at
        started = time.monotonic()
        episodes.start(2, 2)
        settle(episodes, seconds=10.0)
        assert 1.0 <= time.monotonic() - started < 5.0  # ended at its program's deadline
        assert episodes.finished() == ([], [(2, "env_deadline")])
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("env_deadline")]
        assert said and all("rollout.agent_deadline_s" in line and "env_step_deadline_s" not in line for line in said)
        while len(programs.idle) < 2 and time.monotonic() - started < 5.0:  # cancelled there, its thread freed
            time.sleep(0.05)
        assert len(programs.idle) == 2
        episodes.start(3, 3)
        (waiting,) = episodes.waiting
        key = waiting.environment.key
        closing = time.monotonic()
        episodes.close()
        assert time.monotonic() - closing < CLOSE_DEADLINE_S / 2 and programs.lookup(key) is ENDED
    finally:
        programs.close()


def test_a_turn_cut_at_max_new_tokens_answers_its_call_and_the_programs_return_scores_the_episode(tmp_path, caplog):
    """A turn the run cuts at ``rollout.max_new_tokens`` answers the program's call with finish_reason
    "length"; a later call is answered at once with nothing (the episode has no more turns, and a
    program that reads no finish_reason still ends) and the program's return is the episode's
    reward, on its last token, the episode ended "length" (``learner.truncation_penalty`` applies),
    even where the program then fails. Two calls at once from one episode are refused with 409, and
    the program that made them fails its episode (its group dropped, no reward being known)."""
    from tests.environments import SEEN
    from tests.test_episodes import fake_output, settle

    rows = [{"prompt": "cut-and-call", "do": "call_after_cut"}, {"prompt": "both", "do": "gather"},
            {"prompt": "cut-and-raise", "do": "raise_after_cut"}]
    episodes, programs, tokenizer = program_episodes(tmp_path, rows, "rollout.max_new_tokens=4")

    def cut(index: int):
        """Row ``index``'s episode, its first turn cut at max_new_tokens: what ``finished`` gives then."""
        episodes.start(index, index)
        settle(episodes)
        (episode, _, _), = episodes.take_ready(0)
        episodes.turn_finished(episode, fake_output([10, 11, 12, 13], finish_reason="length"), 0)
        settle(episodes)
        return episodes.finished()

    try:
        (sample,), dropped = cut(0)
        assert (sample.finish_reason, sample.turn_rewards.tolist(), dropped) == ("length", [0, 0, 0, 0.25], [])
        assert SEEN["cut-and-call"] == ("", "length")  # the later call: answered at once, with nothing
        episodes.start(1, 1)
        settle(episodes)
        (episode, _, _), = episodes.take_ready(0)  # the call that came first
        waited = time.monotonic()
        while not episode.environment.events and time.monotonic() - waited < 5:  # the second refused, it raised
            time.sleep(0.01)
        episodes.turn_finished(episode, fake_output([10, tokenizer.eos_token_id]), 0)
        settle(episodes)
        assert episodes.finished() == ([], [(1, "env_error")])
        assert "Error code: 409" in caplog.text and "its calls made one after another" in caplog.text
        # cut, and then its program fails: still ended "length" at 0 (the penalty applies), not dropped
        (sample,), dropped = cut(2)
        assert (sample.finish_reason, sample.turn_rewards.tolist(), dropped) == ("length", [0, 0, 0, 0], [])
    finally:
        programs.close()


def test_plain_programs_that_hang_past_their_episodes_hold_a_bounded_number_of_threads(programs, monkeypatch):
    """A plain function cannot be stopped: one that blocks past its episode's end keeps its thread.
    At HELD_THREADS_LIMIT such threads a new episode fails at once, saying why, rather than a
    thread more being made; a program that returns at last frees its thread for the next."""
    from environments import agents

    monkeypatch.setattr(agents, "HELD_THREADS_LIMIT", 2)
    agent = programs("tests.environments:sleeps_then_asks", deadline_s=0.3)
    for _ in range(2):
        hung = agent.make({"sleep": 2.0})
        with pytest.raises(PastDeadline):
            first_of(hung)
        hung.close()  # as the rollout's loop ends it (env_deadline)
    with pytest.raises(RuntimeError, match="2 agent program threads still run programs whose episodes ended"):
        first_of(agent.make({"sleep": 0.0}))
    time.sleep(2.5)  # the two return (their late calls refused): their threads are free again
    assert len(agent.idle) == 2
    fresh = agent.make({"sleep": 0.0})
    assert first_of(fresh) == [{"role": "user", "content": "hi"}]


def test_streamed_calls_leave_nothing_pending_when_the_programs_close(tmp_path):
    """A streamed call leaves the SDK's stream generator on its program thread's loop: the loop is
    closed with it closed, and the process exits without "Task was destroyed but it is pending"."""
    import subprocess

    script = f"""
from environments.agents import AgentPrograms
from environments.tools import ToolCallParser
from tests.helpers import chatml_tokenizer, first_of, step_of
agent = AgentPrograms("tests.environments:streams", ToolCallParser("hermes", chatml_tokenizer({str(tmp_path)!r}), None),
                      10.0, 10.0)
for completions in (False, True):
    episode = agent.make({{"id": f"streamed-{{completions}}", "prompt": "17 plus 25", "completions": completions}})
    first_of(episode)
    step_of(episode, "42", [])
agent.close()
print("closed")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0 and "closed" in result.stdout, result.stderr[-2000:]
    assert "Task was destroyed" not in result.stderr, result.stderr[-2000:]


def test_a_call_nothing_answers_is_answered_504_at_the_endpoints_deadline():
    """The endpoint's handler never waits without end: a call whose episode neither answers nor
    ends (a bug) gets 504 at ``answer_deadline_s``."""
    from environments.endpoint import Endpoint

    class Silent:
        @staticmethod
        def offer(call):
            return None  # taken, and never answered

    import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401 (imported before the clock starts)

    endpoint = Endpoint(lambda key: Silent(), answer_deadline_s=0.3)
    try:
        client = openai.OpenAI(base_url=endpoint.base_url, api_key="k", max_retries=0, timeout=10)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="did not answer this call within 0.3s") as refused:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 504 and time.monotonic() - started < 5.0
    finally:
        endpoint.close()


def test_a_program_thread_whose_client_cannot_be_built_fails_its_episodes_saying_why(programs, monkeypatch):
    """A program thread that cannot build its OpenAI client (a broken openai install, a bad proxy
    setting) does not die silently, leaving its episodes to their deadline: each fails at once
    (env_error), saying why."""
    from environments import agents

    def broken(*arguments, **options):
        raise ImportError("no module named 'openai'")

    monkeypatch.setattr(agents, "_client", broken)
    episode = programs("tests.environments:asks_twice", deadline_s=30.0).make({"prompt": "hi"})
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="OpenAI client could not be built .ImportError: no module named 'openai'"):
        first_of(episode)
    assert time.monotonic() - started < 5.0


def test_a_call_taken_as_its_episode_ends_is_answered_and_a_call_message_of_the_wrong_types_refused(programs):
    """The episode's end may come between a call's arrival and its taking (close() looks for a
    call to refuse before the call is the episode's): the call is refused all the same, never left
    waiting. A program process's call message whose fields are not of their types is not a
    message of the protocol."""
    import asyncio

    import msgpack

    from environments.agent_processes import pack, unpack
    from environments.endpoint import Call, HTTPError
    from protocol.codec import ProtocolError
    from protocol.schema import SCHEMA_VERSION

    episode = programs("tests.environments:asks_twice").make({"prompt": "hi"})
    loop = asyncio.new_event_loop()
    call = Call(None, loop.create_future(), loop)

    def taken_after_the_end(kind: str, value: Call) -> None:
        episode.close()  # the loop ended the episode (its deadline) as the call came in
        episode.call = value  # what _take does with it next

    episode._expect(taken_after_the_end)
    assert episode.event("call", call)
    answer = loop.run_until_complete(asyncio.wait_for(call.future, 5.0))
    loop.close()
    assert answer == HTTPError(404, "this episode has ended")
    message = {"kind": "call", "key": "k", "id": 1, "path": "/v1/chat/completions", "body": "{}"}
    assert unpack(pack(message), ("call",)) == message
    with pytest.raises(ProtocolError, match="a program_call message where a return or raise message was expected"):
        unpack(pack(message), ("return", "raise"))
    for field, wrong in [("path", []), ("id", "1"), ("body", {"messages": []})]:
        with pytest.raises(ProtocolError, match=f"program_call: field '{field}' must be"):
            pack({**message, field: wrong})  # not sent
        fields = {name: value for name, value in {**message, field: wrong}.items() if name != "kind"}
        sent = msgpack.packb({"schema": SCHEMA_VERSION, "type": "program_call", "id": 0, "fields": fields,
                              "tensors": []})
        with pytest.raises(ProtocolError, match=f"program_call: field '{field}' must be"):
            unpack(sent, ("call",))  # nor taken, from a process that sends it anyway


def _tool_loop(agent, row: dict) -> list:
    """An episode of ``agent`` on ``row`` with the turns given by hand (a call of add, then "42"):
    its first observation, the one after the call (tool_call_id left out: each answer's own),
    and its end."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    episode = agent.make({"prompt": "What is 17 plus 25?", **row})
    first = first_of(episode)
    step = step_of(episode, call, [])
    assert step.observation[0]["tool_call_id"] == episode.sent[-2]["tool_calls"][0]["id"]  # the call it answers
    after = [{k: v for k, v in message.items() if k != "tool_call_id"} for message in step.observation]
    return [first, after, step_of(episode, "42", []), episode.tools]


@pytest.mark.parametrize("row, processes", [({"id": "by-id"}, 0), ({"id": "whole", "whole": True}, 0),
                                           ({"id": "streamed", "stream": True}, 0), ({"id": "in-a-process"}, 1)])
def test_a_responses_api_program_makes_the_episode_a_chat_program_makes(programs, row, processes):
    """The Responses API (as the OpenAI Agents SDK calls it): a second call that names the first
    response (previous_response_id) and adds the call's output, or sends every item again, or
    streams, or comes from a program process's connection, gives the episode the chat-completions
    program gives: the same observations, no context restart, the same tools rendered and the same
    reward; the answers read as the API's."""
    from tests.environments import SEEN

    assert _tool_loop(programs("tests.environments:responds_twice", processes=processes), row) == _tool_loop(
        programs("tests.environments:asks_twice"), {})
    if processes:  # SEEN is the program process's
        return
    assert SEEN[row["id"]] == [{"status": "completed", "text": "", "calls": [("add", {"a": 17, "b": 25})]},
                               {"status": "completed", "text": "42", "calls": []}]


@pytest.mark.parametrize("row", [{"id": "claude"}, {"id": "claude-streamed", "stream": True}])
def test_an_anthropic_sdk_program_makes_the_episode_a_chat_program_makes(programs, row):
    """The Messages API through Anthropic's SDK (its x-api-key, its base URL without /v1): a system
    prompt, tool_use answered with tool_result, streamed or not, gives the episode a chat program
    with the same system message gives, and the answers read as Anthropic's."""
    from tests.environments import SEEN

    claude, chat = _tool_loop(programs("tests.environments:claude_asks_twice"), row), _tool_loop(
        programs("tests.environments:asks_twice"), {})
    assert claude[0] == [{"role": "system", "content": "Add with the tool."}, *chat[0]]
    assert claude[1:] == chat[1:]
    first, last = SEEN[row["id"]]
    assert first["stop_reason"] == "tool_use" and [(b["type"], b["name"], b["input"]) for b in first["blocks"]] == [
        ("tool_use", "add", {"a": 17, "b": 25})]
    assert last == {"stop_reason": "end_turn", "blocks": [{"type": "text", "text": "42"}]}


RESPONSES_REFUSED = [  # a Responses API call's fields, and what the endpoint says
    ({"tools": [{"type": "web_search"}]}, "tools of type web_search: an episode's turn calls the program's function"),
    ({"previous_response_id": "resp_elsewhere"}, "previous_response_id resp_elsewhere: no response of this episode"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format json_object: the run samples each turn as sampling"),
    ({"temperature": 0.5}, "temperature 0.5: this run samples at sampling.temperature 1.0"),
    ({"top_logprobs": 2}, "top_logprobs: the engine records the logprob of the token it sampled"),
    ({"tools": [{"type": "function", **ADD["function"]}], "tool_choice": "required"}, "tool_choice 'required'"),
    ({"tools": [{"type": "function", **ADD["function"]}], "tool_choice": {"type": "function", "name": "add"}},
     "tool_choice function: the policy calls a tool or not as it samples"),
    ({"input": 3}, "not a Responses API request"),
]


def test_responses_and_messages_calls_an_episode_may_not_make_are_refused_saying_why(programs):
    """The new APIs are held to what a chat call is held to (one turn of the run's distribution),
    and to what they add: built-in tools, another episode's response, formats; a key is read from
    Anthropic's x-api-key as from OpenAI's Authorization."""
    import anthropic

    from common.config import SamplingConfig

    agent = programs("tests.environments:asks_twice")
    agent.sampling = SamplingConfig()
    key = agent.make({}).key
    client = openai.OpenAI(base_url=agent.endpoint.base_url, api_key=key, max_retries=0, timeout=10)
    for asked, refused in RESPONSES_REFUSED:
        with pytest.raises(openai.BadRequestError, match=re.escape(refused)):
            client.responses.create(**{"model": "policy", "input": "hi", **asked})
    claude = anthropic.Anthropic(base_url=agent.endpoint.root_url, api_key=key, max_retries=0, timeout=10)
    for asked, refused in [({"stop_sequences": ["\n"]}, "stop: the run's turns end where the policy ends them"),
                           ({"max_tokens": 0}, "max_tokens must be positive"),
                           ({"tool_choice": {"type": "any"}, "tools": [{"name": "add", "input_schema": {
                               "type": "object"}}]}, "tool_choice 'required'"),
                           ({"messages": "hi"}, "not an Anthropic Messages API request")]:
        with pytest.raises(anthropic.BadRequestError, match=re.escape(refused)):
            claude.messages.create(**{"model": "policy", "max_tokens": 8, "messages": [
                {"role": "user", "content": "hi"}], **asked})
    stranger = anthropic.Anthropic(base_url=agent.endpoint.root_url, api_key="not-a-key", max_retries=0, timeout=10)
    with pytest.raises(anthropic.AuthenticationError, match="unknown key"):
        stranger.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


def test_a_smolagents_agent_rewrites_its_memory_each_step_so_each_call_starts_a_sample(programs):
    """smolagents' ToolCallingAgent (demos.agent_frameworks.smolagents) sends its memory again as
    text each step (the turn as "Calling tools: [...]", the tool's output as a user's
    "Observation:"): each call after the first is a context restart, trained as a sample of its
    own from the conversation it sent, and the reward comes back with the program's return."""
    from environments.interface import Restart

    agent = programs("demos.agent_frameworks:smolagents", deadline_s=60.0)
    episode = agent.make({"prompt": "add 1 2 + 3 4 :", "answer": "46"})
    first = first_of(episode)
    assert [message["role"] for message in first] == ["system", "user"] and "adder" in first[0]["content"]
    step = step_of(episode, '<tool_call>\n{"name": "adder", "arguments": {"expression": "12 + 34"}}\n</tool_call>', [])
    assert isinstance(step.observation, Restart) and step.tool_calls == 1
    assert [(m["role"], m["content"].split("\n")[0]) for m in step.observation.first[1:]] == [
        ("user", "New task:"), ("assistant", "Calling tools:"), ("user", "Observation:")]
    assert step.observation.first[-1]["content"] == "Observation:\n46"
    end = step_of(episode, '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "4 6"}}\n</tool_call>', [])
    assert end.done and end.reward == 1.0


def test_an_answer_that_cannot_be_written_in_its_api_fails_the_call_with_500_and_the_endpoint_serves_on(
        programs, monkeypatch):
    """Should the answer of a Responses call fail to be written, the program's call gets a 500
    saying why (it never waits on), its episode ends with the program's error, and the next
    episode is served."""
    import environments.agent_apis

    agent = programs("tests.environments:responds_twice")
    episode = agent.make({"id": "unwritten", "prompt": "What is 17 plus 25?"})
    first_of(episode)

    def broken(*_):
        raise RuntimeError("no writer for this answer")

    with monkeypatch.context() as patched:
        patched.setattr(environments.agent_apis, "answer", broken)
        with pytest.raises(openai.InternalServerError, match=re.escape(
                "the rollout could not answer this call (RuntimeError: no writer for this answer)")):
            step_of(episode, "42", [])
    assert _tool_loop(agent, {"id": "after"})[2].reward == 1.0


@pytest.mark.parametrize("row", [{"id": "system-item", "system": True},
                                 {"id": "instructed", "instructions": "Add with the tool."}])
def test_a_responses_api_chain_by_id_keeps_its_system_item_and_leaves_its_instructions_to_each_call(programs, row):
    """previous_response_id carries the conversation on with the system message a program sent as
    an input item (OpenAI's API drops only the instructions a response was given, and a call gives
    its own): the second call extends the first, no context restart, as a chat program's does."""
    system = [{"role": "system", "content": "Add with the tool."}]
    responses, chat = _tool_loop(programs("tests.environments:responds_twice"), row), _tool_loop(
        programs("tests.environments:asks_twice"), {})
    assert responses[0] == [*system, *chat[0]] and responses[1:] == chat[1:]


def test_a_call_an_anthropic_answer_cannot_carry_is_answered_as_text_and_counted_malformed(programs):
    """A parser reads any JSON value as a call's arguments; a tool_use block's input is an object:
    a call whose arguments are not one comes back to an Anthropic program as the turn's text, and
    the episode counts it a malformed call, as a call the parser cannot read."""
    from tests.environments import SEEN

    episode = programs("tests.environments:claude_calls_once").make({"id": "not-an-object", "prompt": "17 + 25?"})
    first_of(episode)
    turn = '<tool_call>\n{"name": "add", "arguments": "17 and 25"}\n</tool_call>'
    step = step_of(episode, turn, [])
    assert step.done and step.reward == 1.0 and [error.kind for error in step.tool_errors] == ["malformed"]
    assert "are not a JSON object" in step.tool_errors[0].detail
    assert SEEN["not-an-object"] == {"stop_reason": "end_turn", "blocks": [{"type": "text", "text": turn}]}


def test_a_key_in_x_api_key_is_an_episodes_key_as_a_bearer_is():
    """Anthropic's Messages API sends its key as x-api-key (Anthropic's docs, Claude Code): the
    endpoint reads it as it reads a Bearer token (a stranger's key 401, an ended episode's 404)."""
    import httpx

    from environments.endpoint import Endpoint, HTTPError

    class Ended:
        @staticmethod
        def offer(call):
            return HTTPError(404, "this episode has ended")

    endpoint = Endpoint(lambda key: Ended if key == "ended-key" else None)
    try:
        body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        stranger = httpx.post(f"{endpoint.root_url}/v1/messages", json=body, headers={"x-api-key": "who"}, timeout=10)
        ended = httpx.post(f"{endpoint.root_url}/v1/messages", json=body, headers={"x-api-key": "ended-key"},
                           timeout=10)
        assert (stranger.status_code, ended.status_code) == (401, 404) and "ended" in ended.text
    finally:
        endpoint.close()


def test_tool_call_arguments_compare_as_json_and_render_as_the_program_wrote_them():
    """A program that writes a call's arguments back in its own spacing (LangChain, Anthropic's
    converter) extends the episode; the messages keep its text."""
    from environments.agents import _plain, _same

    def message(arguments: str) -> dict:
        return _plain({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]})

    ours, theirs = message('{"a": 17, "b": 25}'), message('{"a":17,"b":25}')
    assert _same([theirs], [ours]) and theirs["tool_calls"][0]["function"]["arguments"] == '{"a":17,"b":25}'
    assert not _same([message('{"a": 17, "b": 26}')], [ours]) and not _same([], [ours])


def test_a_responses_api_image_part_is_kept_as_chats_image_url_part():
    """A Responses call's ``input_image`` (a policy that sees) reaches the episode as the
    ``image_url`` part a chat call's image is, beside its text; it is never dropped as textless."""
    from environments.agent_apis import as_chat
    from environments.agents import _plain

    url = "data:image/png;base64,iVBORw0KGgo="
    body = json.dumps({"model": "policy", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What colour?"}, {"type": "input_image", "image_url": url}]}]}).encode()
    chat, _ = as_chat("responses", body, {})
    assert [_plain(message) for message in chat.messages] == [{"role": "user", "content": [
        {"type": "text", "text": "What colour?"}, {"type": "image_url", "image_url": {"url": url}}]}]
