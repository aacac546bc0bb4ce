"""The agent demo (``tether demo --agent``): a task the demo's tiny policy cannot solve alone but
can with a tool.

A prompt asks for the sum of two 3-digit numbers written digit by digit, ``add 3 7 4 + 5 8 9 :``.
A 64-wide, 2-layer model does not learn to add such numbers from a few hundred SFT steps; it does
learn to copy digits. The ``calculator`` tool adds them: the policy writes a ``<tool_call>`` with
the digits (the JSON form of Qwen's and Hermes' templates, in this vocabulary), reads the tool's
``<tool_response>`` and writes the answer. The SFT traces use the tool only sometimes
(``SFT_TOOL_RATE``) and otherwise answer at once, right in the data but a guess for the model: RL
on the exact answer has to learn to call the tool. The tool's latency is long-tailed (0 to 200 ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from pathlib import Path

BOS, EOS = 1, 2
CALL = ["<tool_call>", '{"name":', '"calculator",', '"arguments":', '{"expression":', '"']
CALL_END = ['"}}', "</tool_call>"]
VOCAB = ["<pad>", "<bos>", "<eos>", "add", "+", ":", "<tool_response>", "</tool_response>", *CALL, *CALL_END,
         *(str(d) for d in range(10))]
ASSETS_VERSION = "agent-v1"  # bump to rebuild cached assets when the recipe changes
SFT_TOOL_RATE = 0.3  # of SFT traces that call the tool; the others answer at once
MAX_LATENCY_S = 0.2


def make_row(rng: random.Random) -> dict:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return {"prompt": f"add {' '.join(str(a))} + {' '.join(str(b))} :", "answer": str(a + b)}


# --------------------------------------------------------------------------- the tool and the reward


def calculator(expression: str) -> str:
    """Add two whole numbers.

    Args:
        expression: two numbers and a plus sign between them, such as "374 + 589"
    """
    time.sleep(min(MAX_LATENCY_S, random.expovariate(1 / 0.03)))  # a tool's latency: mostly short, a long tail
    return add(expression)


def add(expression: str) -> str:
    """The calculator's answer, at once."""
    left, plus, right = expression.replace(" ", "").partition("+")
    if not plus or not left.isdigit() or not right.isdigit():
        raise ValueError(f"expected two numbers joined by '+', got {expression!r}")
    return str(int(left) + int(right))


def exact_answer(messages: list[dict] | None, response: str, row: dict) -> float:
    """1 when the policy's last turn, its digits read as one number, is the sum; else 0."""
    last = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "") if messages else response
    return float("".join(ch for ch in last if ch.isdigit()) == row["answer"] and "<tool_call>" not in last)


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Add two whole numbers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": 'two numbers and '
                                                                   'a plus sign between them, such as "374 + 589"'}},
                   "required": ["expression"]}}}


async def openai_agent(client, row: dict) -> float:
    """The task as an agent program written against the OpenAI API (``rollout.agent``): ask, run
    the calculator for each call the reply makes, ask again, up to four replies; the exact answer
    is the reward. Nothing in it is tether's."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(4):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                      max_tokens=20)).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:  # the tool's latency awaited, as an async program does: the loop serves other episodes meanwhile
                content = await asyncio.to_thread(calculator, **json.loads(call.function.arguments))
            except Exception as error:
                content = f"error: {call.function.name} raised {type(error).__name__}: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return exact_answer([{"role": m["role"], "content": m.get("content") or ""} for m in messages], "", row)


async def completions_agent(client, row: dict) -> float:
    """The task against the completions API, as a program that keeps its own transcript writes it:
    the prompt, each completion appended to it, the calculator's results after a turn's calls (in
    the <tool_response> form the policy learned), up to four completions. A completion's text omits
    the token the policy stopped at ("<eos>" here, "<|im_end|>" in ChatML): the transcript writes it
    back after a turn that stopped, as the policy learned to end a turn, and as a ChatML
    transcript's "<|im_end|>" is written back."""
    prompt, last = row["prompt"], ""
    for _ in range(4):
        choice = (await client.completions.create(model="policy", prompt=prompt, max_tokens=20)).choices[0]
        last = choice.text
        prompt += last + ("<eos>" if choice.finish_reason == "stop" else "")
        calls = re.findall(r"<tool_call>(.*?)</tool_call>", last, re.S)
        if not calls:
            break
        results = []
        for call in calls:
            try:
                results.append(await asyncio.to_thread(calculator, **json.loads(call)["arguments"]))
            except Exception as error:
                results.append(f"error: calculator raised {type(error).__name__}: {error}")
        prompt += "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)
    return exact_answer(None, last, row)


def openenv_app():
    """The task's calculator as an OpenEnv environment (``tether demo --agent --openenv``), written
    with openenv's own server API: an MCP environment of the one tool, whose episodes are sessions
    of their own; the exact answer stays the reward function's (``scorer.reward_functions``)."""
    from fastmcp import FastMCP
    from openenv.core.env_server import (CallToolAction, CallToolObservation, MCPEnvironment, Observation, State,
                                         create_app)

    class Calculator(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            mcp = FastMCP("calculator")

            @mcp.tool(name="calculator", description="Add two whole numbers.")
            async def add(expression: str) -> str:
                return await asyncio.to_thread(calculator, expression)  # its latency off the server's loop

            super().__init__(mcp)
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
            self._state = State(episode_id=episode_id, step_count=0)
            return Observation(done=False, reward=None)

        def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
            return Observation(done=False, reward=0.0)

        @property
        def state(self) -> State:
            return self._state

    return create_app(Calculator, CallToolAction, CallToolObservation, env_name="calculator",
                      max_concurrent_envs=4096)


def serve_openenv() -> tuple[str, object]:
    """``openenv_app`` served by uvicorn in a thread of this process on 127.0.0.1: its URL, and
    the server (``should_exit = True`` stops it)."""
    import logging

    from environments.endpoint import serve_in_thread

    app = openenv_app()
    # a malformed call is the policy's, counted in the rollout's tool_errors: not the server's to print
    for name in ("fastmcp", "fastmcp.server.server"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    server, _, port = serve_in_thread(app, "openenv", ws_ping_interval=None)
    return f"http://127.0.0.1:{port}", server


# --------------------------------------------------------------------------- models


def build_tokenizer(directory: str):
    """Words split on whitespace and every digit a word of its own (a tool's "963" reads as 9 6 3),
    decoded with spaces between words: a tool call decodes to JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                  pre_tokenizers.Digits(individual_digits=True)])
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<pad>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def sft_trace(row: dict, rng: random.Random, tokenizer) -> tuple[list[int], list[int]]:
    """A trace's ids after the prompt and its loss mask (0 at the tool's response, which the
    rollout renders the same way: rollout.episodes.Renderer's text form)."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    answer = ids(" ".join(row["answer"])) + [EOS]
    if rng.random() >= SFT_TOOL_RATE:
        return answer, [1] * len(answer)
    expression = row["prompt"].removeprefix("add ").removesuffix(" :")
    call = ids(f'{" ".join(CALL)} {expression} {" ".join(CALL_END)}') + [EOS]
    result = ids(f"<tool_response>\n{row['answer']}\n</tool_response>")
    return call + result + answer, [1] * len(call) + [0] * len(result) + [1] * len(answer)


def train_sft(directory: str, tokenizer, steps: int, seed: int, log=print):
    """Next-token SFT on the traces; the loss covers the policy's tokens only."""
    import torch
    from transformers import LlamaForCausalLM

    from demos.parity import tiny_llama_config

    def example(rng: random.Random) -> tuple[list[int], list[int]]:
        row = make_row(rng)
        prompt = tokenizer(row["prompt"])["input_ids"]
        trace, mask = sft_trace(row, rng, tokenizer)
        return prompt + trace, [-100] * len(prompt) + [t if m else -100 for t, m in zip(trace, mask)]

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(VOCAB)))
    fit_next_token(model, example, steps, seed, log)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def fit_next_token(model, example, steps: int, seed: int, log=print) -> None:
    """The agent demo's SFT: ``steps`` AdamW steps (3e-3, 30 steps of warm-up, then a linear decay) on
    batches of 64 ``example(rng)`` -> (token ids, labels: -100 where no loss is taken)."""
    import torch

    from common.sequences import pad_rows

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 30) * max(0.05, 1 - step / steps))
    for step in range(steps):
        rows, labels = zip(*(example(rng) for _ in range(64)))
        input_ids, attention_mask = pad_rows(list(rows), 0)
        label_ids, _ = pad_rows(list(labels), 0)
        label_ids[attention_mask == 0] = -100
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=label_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  sft step {step + 1}/{steps} loss {loss.item():.3f}")


def write_rows(path: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(count):
            file.write(json.dumps(make_row(rng)) + "\n")


def build_assets(directory: str | os.PathLike, sft_steps: int = 800, seed: int = 0, log=print) -> dict[str, str]:
    """Tokenizer, SFT policy, train and held-out prompts (with their answers); cached by
    ``ASSETS_VERSION`` and the arguments. No reward model: the exact answer is the reward."""
    from demos.parity import built_once

    directory = Path(directory)
    recipe = {"version": ASSETS_VERSION, "sft_steps": sft_steps, "seed": seed}
    paths = {"policy": str(directory / "sft"), "prompts": str(directory / "prompts.jsonl"),
             "eval_prompts": str(directory / "eval_prompts.jsonl")}

    def build() -> None:
        tokenizer = build_tokenizer(paths["policy"])
        train_sft(paths["policy"], tokenizer, sft_steps, seed, log)
        write_rows(paths["prompts"], 4096, seed + 10)
        write_rows(paths["eval_prompts"], 256, seed + 20)

    return built_once(directory, recipe, paths, "agent demo assets", build, log)


# --------------------------------------------------------------------------- the run and its report


def evaluate_policy(config, checkpoint: str, eval_prompts: str) -> dict[str, float]:
    """Held-out exact answers, tool calls and turns per episode of ``checkpoint``: the evaluator's
    episodes (vLLM, seeded) on ``eval_prompts``."""
    import logging

    from common.model_dirs import resolve_models
    from evaluator.main import evaluate

    config = resolve_models(config.model_copy(update={"data": config.data.model_copy(
        update={"prompts": eval_prompts})}), "scorer")
    figures, _, _ = evaluate(config, checkpoint, logging.getLogger("agent-demo"))
    return {"exact_answer": figures["gold_reward"], "tool_calls_per_episode": figures["tool_calls_per_episode"],
            "turns_per_episode": figures["turns_per_episode"], "kl_to_reference": figures["kl_to_reference"],
            "episodes_failed": figures["episodes_failed"]}


OPENAI_AGENT = ["rollout.tools=[]", "rollout.agent=demos.agent:openai_agent", "run_dir=runs/demo-agent-openai",
                "rollout.env_step_deadline_s=30"]  # a call waits its turn among the engine's others


def openenv_overrides(url: str) -> list[str]:
    """The demo's episodes against the OpenEnv server at ``url`` instead of tether's own tool."""
    return ["rollout.tools=[]", f"rollout.environment=openenv:{url}", "run_dir=runs/demo-agent-openenv"]


def run_demo(assets: Path, overrides: list[str], openai: bool = False, openenv: bool = False) -> int:
    """Build the assets (once), run PPO on episodes with the calculator, report held-out exact
    answers of the SFT and the PPO policy (target: +0.3). ``openai``: the episodes are
    ``openai_agent``'s, a program calling the rollout's OpenAI endpoint, instead of tether's own;
    ``openenv``: the calculator is an OpenEnv server's tool (``openenv_app``, served here). An
    agent framework's episodes: ``demos.agent_frameworks.overrides``."""
    from demos.parity import run_and_compare

    started = time.monotonic()
    paths = build_assets(assets / "assets-agent")
    config_path = Path(__file__).resolve().parent.parent / "configs" / "demo-agent.yaml"
    server = None
    variant = OPENAI_AGENT if openai else []
    if openenv:
        url, server = serve_openenv()
        variant = openenv_overrides(url)
    try:
        return run_and_compare(
            config_path, [f"models.policy={paths['policy']}", f"data.prompts={paths['prompts']}", *variant, *overrides],
            paths["policy"], lambda config, policy: evaluate_policy(config, policy, paths["eval_prompts"]),
            [("exact_answer", "exact", ".3f"), ("tool_calls_per_episode", "tools", ".2f"),
             ("turns_per_episode", "turns", ".2f"), ("kl_to_reference", "kl", ".3f")],
            "exact_answer", 0.3, paths["eval_prompts"], started)
    finally:
        if server is not None:
            server.should_exit = True
