"""Environments and tools the episode tests name in their configs ("tests.environments:..."),
written in the demo's vocabulary (digits, even, odd, ':') so its tiny policy can read them."""

import asyncio
import itertools
import json
import math
import time
from concurrent.futures import Future

from environments.interface import Step

TURNS = 3  # the counting task's episodes


class Counting:
    """Answers each turn with the turn's number and the parity to write next, rewards a turn by
    its length, and ends after TURNS turns."""

    def __init__(self, row: dict) -> None:
        self.row, self.turn = row, 0

    def step(self, response: str, messages: list[dict]) -> Step:
        self.turn += 1
        return Step(f"{'odd' if self.turn % 2 else 'even'} {self.turn} :", reward=0.1 * len(response.split()),
                    done=self.turn >= TURNS)


class Raises(Counting):
    def step(self, response, messages):
        raise RuntimeError("the sandbox fell over")


class Hangs(Counting):
    def step(self, response, messages):
        time.sleep(30)  # far past the tests' env_step_deadline_s


class Garbage(Counting):
    def step(self, response, messages):
        return 42


class DoneAtOnce(Counting):
    def step(self, response, messages):
        return Step(None, reward=1.0, done=True)


class ResetRaises(Counting):
    def reset(self):
        raise RuntimeError("no sandbox to be had")


class CompactsOnce(Counting):
    """Counts, but answers its first turn with its conversation rewritten (a summary in its place, as
    an agent program that compacts its context), so its episode comes in two parts."""

    def step(self, response, messages):
        from environments.interface import Restart

        if self.turn == 0:
            self.turn += 1
            return Step(Restart([{"role": "user", "content": "odd 1 :"}]), reward=0.5)
        return super().step(response, messages)


class StartsWithMessages(Counting):
    """Counting, its first messages its own (in place of the row's prompt)."""

    def reset(self):
        return [{"role": "user", "content": "odd 1 :"}]


def starts_with_messages(row: dict) -> StartsWithMessages:
    return StartsWithMessages(row)


MIXED = [Counting] * 5 + [CompactsOnce, Raises, Hangs, Garbage, DoneAtOnce, ResetRaises]


_made = itertools.count()


def reset_raises_once(row: dict) -> Counting:
    """The first environment made fails at its reset, every later one counts."""
    return ResetRaises(row) if next(_made) == 0 else Counting(row)


def counting(row: dict) -> Counting:
    return Counting(row)


def mixed(row: dict) -> Counting:
    """Episodes that go well and episodes whose environment fails each way, by the prompt's digits."""
    return MIXED[sum(int(word) for word in row["prompt"].split() if word.isdigit()) % len(MIXED)](row)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x):
    raise ValueError("broken on purpose")


def unserialisable():
    return object()


def always_fails_reset(row: dict) -> Counting:
    """An environment that cannot be had: every reset raises."""
    return ResetRaises(row)


class TextReset(Counting):
    def reset(self):
        return "What is 17 plus 25?"


def text_reset(row: dict) -> Counting:
    return TextReset(row)


# --------------------------------------------------------------------------- agent programs (rollout.agent)

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


async def asks_twice(client, row: dict) -> dict:
    """Asks, runs the call its reply makes, asks again; the reward and a figure of its own."""
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(add(**arguments))})
    final = (await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])).choices[0].message
    return {"reward": 1.0 if final.content == "42" else 0.0, "calls": 2}


SEEN: dict[str, dict] = {}  # what calls_add's replies held, by the row's id, for the test to read


async def responds_twice(client, row: dict) -> dict:
    """asks_twice against the Responses API: the second call names the first response
    (previous_response_id) and adds the call's output alone, or where the row says ``"whole"``
    sends the whole conversation's items again; streamed where the row says ``"stream"``. What each
    answer held goes to SEEN."""
    tool = {"type": "function", **ADD["function"]}
    stream, seen = bool(row.get("stream")), []

    async def create(**fields):
        if not stream:
            response = await client.responses.create(model="policy", tools=[tool], **fields)
        else:
            events = await client.responses.create(model="policy", tools=[tool], stream=True, **fields)
            response = None
            async for event in events:
                response = event.response if event.type in ("response.completed", "response.incomplete") else response
        seen.append({"status": response.status, "text": response.output_text,
                     "calls": [(item.name, json.loads(item.arguments)) for item in response.output
                               if item.type == "function_call"]})
        return response

    asked = [*([{"role": "system", "content": "Add with the tool."}] if row.get("system") else []),
             {"role": "user", "content": row["prompt"]}]
    first = await create(input=asked, instructions=row.get("instructions"))
    outputs = [{"type": "function_call_output", "call_id": item.call_id, "output": str(add(**json.loads(item.arguments)))}
               for item in first.output if item.type == "function_call"]
    if row.get("whole"):
        final = await create(input=[*asked, *(item.model_dump(exclude_none=True) for item in first.output), *outputs])
    else:
        final = await create(input=outputs, previous_response_id=first.id, instructions=row.get("instructions"))
    SEEN[row["id"]] = seen
    return {"reward": 1.0 if final.output_text == "42" else 0.0, "calls": 2}


async def claude_calls_once(client, row: dict) -> float:
    """One Messages API call with the add tool; what the answer held goes to SEEN."""
    import anthropic

    async with anthropic.AsyncAnthropic(base_url=str(client.base_url).removesuffix("/").removesuffix("/v1"),
                                        api_key=client.api_key, max_retries=0) as claude:
        tool = {"name": "add", "input_schema": ADD["function"]["parameters"]}
        message = await claude.messages.create(model="policy", max_tokens=64, tools=[tool],
                                               messages=[{"role": "user", "content": row["prompt"]}])
    SEEN[row["id"]] = {"stop_reason": message.stop_reason,
                       "blocks": [block.model_dump(exclude_none=True) for block in message.content]}
    return 1.0


async def claude_asks_twice(client, row: dict) -> dict:
    """asks_twice written with Anthropic's SDK against the Messages API: a system prompt, the add
    tool, the tool_use it gets answered with a tool_result; streamed where the row says
    ``"stream"``. What each answer held goes to SEEN."""
    import anthropic

    claude = anthropic.AsyncAnthropic(base_url=str(client.base_url).removesuffix("/").removesuffix("/v1"),
                                      api_key=client.api_key, max_retries=0)
    tool = {"name": "add", "description": ADD["function"]["description"], "input_schema": ADD["function"]["parameters"]}
    messages, seen = [{"role": "user", "content": row["prompt"]}], []

    async def create():
        fields = dict(model="policy", max_tokens=64, system="Add with the tool.", tools=[tool], messages=messages)
        if row.get("stream"):
            async with claude.messages.stream(**fields) as events:
                message = await events.get_final_message()
        else:
            message = await claude.messages.create(**fields)
        seen.append({"stop_reason": message.stop_reason, "blocks": [block.model_dump(exclude_none=True)
                                                                    for block in message.content]})
        return message

    try:
        first = await create()
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                          for block in first.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": str(add(**block.input))}
            for block in first.content if block.type == "tool_use"]})
        final = await create()
    finally:
        await claude.close()
    SEEN[row["id"]] = seen
    text = "".join(block.text for block in final.content if block.type == "text")
    return {"reward": 1.0 if text == "42" else 0.0, "calls": 2}


async def calls_add(client, row: dict) -> float:
    """Asks once with the add tool and keeps what the reply held."""
    reply = (await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                                  tools=[ADD])).choices[0].message
    SEEN[row["id"]] = {"calls": [(call.function.name, json.loads(call.function.arguments))
                                 for call in reply.tool_calls or []],
                       "content": reply.content, "tool_call_error": getattr(reply, "tool_call_error", None),
                       "reasoning": getattr(reply, "reasoning", None)}
    return 1.0


async def asks_for_logprobs(client, row: dict) -> float:
    """One call asking for at most 5 tokens, their logprobs and ids; keeps what the reply held."""
    response = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=5, logprobs=True,
        extra_body={"return_token_ids": True})
    choice = response.choices[0]
    SEEN[row["id"]] = {"logprobs": [(entry.token, entry.logprob) for entry in choice.logprobs.content],
                       "token_ids": choice.token_ids, "usage": (response.usage.prompt_tokens,
                                                                response.usage.completion_tokens),
                       "finish_reason": choice.finish_reason}
    return 1.0


async def completes_twice(client, row: dict) -> float:
    """Completions: a prompt, then the prompt, the completion and more text (or their ids, where the
    row says ``ids``); keeps what the replies held."""
    tokenizer = row.get("ids")
    first = await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=8, logprobs=0,
                                            extra_body={"return_token_ids": True})
    text = row["prompt"] + first.choices[0].text + " and then"
    prompt = text if not tokenizer else row["ids"] + first.choices[0].token_ids + row["more_ids"]
    second = await client.completions.create(model="policy", prompt=prompt, max_tokens=8)
    SEEN[row["id"]] = {"texts": [first.choices[0].text, second.choices[0].text],
                       "logprobs": first.choices[0].logprobs.token_logprobs, "token_ids": first.choices[0].token_ids}
    return 1.0


async def keeps_a_chatml_transcript(client, row: dict) -> float:
    """Completions over a ChatML transcript the program keeps itself, as a program against vLLM's
    server keeps one: each answer's text, then its turn's end written back where the row says
    ``writes_stop`` (the answer's text omits the stop token) and a user's turn; keeps the whole
    transcript."""
    transcript = f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    for turn in range(row["turns"]):
        answer = await client.completions.create(model="policy", prompt=transcript, max_tokens=8)
        transcript += answer.choices[0].text
        if turn < row["turns"] - 1:
            transcript += ("<|im_end|>" if row["writes_stop"] else "") + "\n<|im_start|>user\nand then?<|im_end|>\n"
            transcript += "<|im_start|>assistant\n"
    SEEN[row["id"]] = transcript
    return 1.0


async def passes_get_json_schema(client, row: dict) -> float:
    """One call with the add tool as transformers' get_json_schema writes it (a ``return`` key and all)."""
    from transformers.utils import get_json_schema

    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                         tools=[get_json_schema(add)])
    return 1.0


def sleeps_then_asks(client, row: dict) -> float:
    """A plain function that blocks ``row["sleep"]`` seconds (a tool without a deadline), then calls."""
    time.sleep(row["sleep"])
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return 1.0


async def streams(client, row: dict) -> float:
    """One streamed call (chat, or completions where the row says so); keeps what the stream held."""
    seen = {"content": "", "calls": [], "finish_reason": None, "usage": None}
    if row.get("completions"):
        stream = await client.completions.create(model="policy", prompt=row["prompt"], stream=True,
                                                 stream_options={"include_usage": True})
    else:
        stream = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}], tools=[ADD], stream=True,
            stream_options={"include_usage": True})
    async for chunk in stream:
        seen["usage"] = chunk.usage.completion_tokens if chunk.usage else seen["usage"]
        for choice in chunk.choices:
            seen["content"] += choice.text if row.get("completions") else (choice.delta.content or "")
            for call in getattr(getattr(choice, "delta", None), "tool_calls", None) or []:
                seen["calls"].append((call.function.name, json.loads(call.function.arguments)))
            seen["finish_reason"] = choice.finish_reason or seen["finish_reason"]
    SEEN[row["id"]] = seen
    return 1.0


def rewrites_its_prompt(client, row: dict) -> float:
    client.completions.create(model="policy", prompt=row["prompt"])
    client.completions.create(model="policy", prompt="something else")
    return 1.0


def rewrites_its_context(client, row: dict) -> float:
    """A plain function: its second call starts the conversation over."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "something else"}])
    return 1.0


class CompactsItsContext:
    """Turn 1 answered, then its context rewritten (a summary in place of the conversation), then
    the episode ends with its reward: as an agent program that compacts its context does."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, response: str, messages: list[dict]) -> Step:
        from environments.interface import Restart

        self.turns += 1
        if self.turns == 1:
            return Step(Restart([{"role": "user", "content": "odd 1 :"}]))
        return Step(None, 1.0, done=True)


class AsksForTwoTokens:
    """An ``Environment`` of its own, as an agent program's call with max_tokens 2: its turns are
    capped there, and a turn cut at the cap is its answer (its finish reason "length"), not the
    episode's end."""
    tools = None
    deadline = math.inf
    turn_max_tokens = 2

    def __init__(self) -> None:
        self.finish_reasons: list[str] = []

    def begin_reset(self) -> Future:
        return _answered(None)

    def begin_step(self, response: str, messages: list[dict], turn=None) -> Future:
        self.finish_reasons.append(turn.finish_reason)
        return _answered(Step(None, 1.0, done=True))

    def begin_last(self, response: str, messages: list[dict], turn=None) -> Future:
        return _answered(Step(done=True))

    def close(self) -> None:
        return None


def _answered(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def asks_for_two_tokens(row: dict) -> AsksForTwoTokens:
    return AsksForTwoTokens()


def compacts_its_context(row: dict) -> CompactsItsContext:
    return CompactsItsContext()


class CompactsPastTheLimit:
    """Turn 1 answered (with a turn reward), then its context rewritten to one too long for the run:
    the episode ends before its new context's first turn."""

    def step(self, response: str, messages: list[dict]) -> Step:
        from environments.interface import Restart

        return Step(Restart([{"role": "user", "content": "odd 1 " * 100}]), 0.5)


def compacts_past_the_limit(row: dict) -> CompactsPastTheLimit:
    return CompactsPastTheLimit()


async def says_yes(client, row: dict):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return "yes"


class Reports:
    """Ends at its first step with the reward and a figure of its own, as an agent program's episode does."""

    def step(self, response: str, messages: list[dict]) -> Step:
        return Step(None, 1.0, done=True, metrics={"calls": float(len(response))})


def reports(row: dict) -> Reports:
    return Reports()


async def in_its_process(client, row: dict) -> dict:
    """One call (with what the row's ``ask`` adds; streamed where it says ``stream``); then the
    process it ran in, the cores it had and the stream's chunks, or the error the row asks for."""
    import os

    messages = [{"role": "user", "content": row["prompt"]}]
    chunks = 0
    if row.get("stream"):
        async for _ in await client.chat.completions.create(model="policy", messages=messages, stream=True):
            chunks += 1
    else:
        await client.chat.completions.create(model="policy", messages=messages, **row.get("ask", {}))
    if row.get("fail"):
        raise ValueError(f"no luck with {row['prompt']}")
    if row.get("hang"):
        await asyncio.sleep(3600)
    if row.get("own"):  # its own deadline around something of its own, passed
        try:
            await asyncio.wait_for(asyncio.sleep(3600), 0.01)
        except TimeoutError:
            raise TimeoutError("mine, not the deadline") from None
    return {"reward": 1.0, "pid": os.getpid(), "cores": sum(1 << core for core in os.sched_getaffinity(0)),
            "chunks": chunks}


def in_its_process_plain(client, row: dict) -> dict:
    """in_its_process as a plain function (the process runs it in a thread)."""
    import os

    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return {"reward": 1.0, "pid": os.getpid()}


CLOSED: list[str] = []  # the rows whose environment was closed


class Closes(Counting):
    """Counting, its close noted in CLOSED; a row with ``slow`` takes 0.3 s to reset, and opens a
    session as its reset ends (as an OpenEnv episode's does), which its close ends: SESSIONS holds
    the rows whose session is open."""

    def reset(self):
        time.sleep(0.3 if self.row.get("slow") else 0.0)
        SESSIONS.add(self.row["prompt"])
        return None

    def close(self) -> None:
        CLOSED.append(self.row["prompt"])
        SESSIONS.discard(self.row["prompt"])


SESSIONS: set[str] = set()


def closes(row: dict) -> Closes:
    return Closes(row)


SQUARE = (0, 200, 0)  # the square ShowsASquare shows


class ShowsASquare:
    """Answers the policy's first turn with an image (a green square) and a question, for a policy
    that sees; ends the episode at its second turn."""

    def __init__(self, row: dict) -> None:
        self.turn = 0

    def step(self, response: str, messages: list[dict]) -> Step:
        from PIL import Image

        self.turn += 1
        if self.turn > 1:
            return Step(None, reward=1.0, done=True)
        square = Image.new("RGB", (40, 40), SQUARE)
        return Step([{"role": "user", "content": [{"type": "image", "image": square},
                                                  {"type": "text", "text": "and this?"}]}], reward=0.5)


def shows_a_square(row: dict) -> ShowsASquare:
    return ShowsASquare(row)


class ShowsAPlaceholder(ShowsASquare):
    """Shows a square beside text that holds the image placeholder itself."""

    def step(self, response: str, messages: list[dict]) -> Step:
        step = super().step(response, messages)
        if step.observation:
            step.observation[0]["content"].append({"type": "text", "text": "<image>"})
        return step


def shows_a_placeholder(row: dict) -> ShowsAPlaceholder:
    return ShowsAPlaceholder(row)


OTHER_SQUARE = (200, 0, 200)  # the second square looks_at_squares shows


def square_url(colour: tuple[int, int, int]) -> str:
    """A 40-pixel square of ``colour`` as a PNG ``data:`` URL, as an OpenAI client sends an image."""
    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (40, 40), colour).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


async def looks_at_squares(client, row: dict) -> float:
    """An agent program that shows a policy that sees a square with its question, then another
    beside the policy's reply (OpenAI's image_url parts)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": row.get("prompt", "colour:")},
                                             {"type": "image_url", "image_url": {"url": square_url(SQUARE)}}]}]
    reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
    messages += [reply.model_dump(exclude_none=True),
                 {"role": "user", "content": [{"type": "image_url", "image_url": {"url": square_url(OTHER_SQUARE)}},
                                              {"type": "text", "text": "and this?"}]}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


async def does_as_its_row_says(client, row: dict) -> float:
    """Makes no call for 30 s (``do: hang``), or one call and then raises (``raise``) or returns 1.0;
    ``call_after_cut``: where its answer was cut ("length"), calls again, keeps that answer and
    returns 0.25; ``raise_after_cut``: raises where it was cut; ``gather``: two calls at once."""
    import asyncio

    if row["do"] == "hang":
        await asyncio.sleep(30)
    messages = [{"role": "user", "content": row["prompt"]}]
    if row["do"] == "gather":
        await asyncio.gather(*(client.chat.completions.create(model="policy", messages=messages) for _ in range(2)))
    answer = await client.chat.completions.create(model="policy", messages=messages)
    if row["do"] == "raise" or row["do"] == "raise_after_cut" and answer.choices[0].finish_reason == "length":
        raise ValueError(f"no luck with {row['prompt']}")
    if row["do"] == "call_after_cut" and answer.choices[0].finish_reason == "length":
        later = await client.chat.completions.create(model="policy", messages=[
            *messages, answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}])
        SEEN[row["prompt"]] = (later.choices[0].message.content, later.choices[0].finish_reason)
        return 0.25
    return 1.0
