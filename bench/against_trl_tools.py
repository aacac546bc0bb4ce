"""tether's GRPO on a multi-turn tool task, at k = 0 and k = 2, against TRL's GRPOTrainer with
``tools=``: whole-run wall time, steady episodes/s and held-out exact answers, side by side in one
process, round after round (this machine's speed drifts), medians printed with issue 37's limits.

The task is the agent demo's (demos/agent.py: the sum of two 3-digit numbers, the ``calculator``
tool with its 0-200 ms latency, the exact answer the only reward) through a chat template, so
that both trainers run it as a chat with tools: a ChatML-shaped template in the demo's word
vocabulary (``TEMPLATE``; the tool's result comes back in a user turn, as Qwen's does), and an
SFT policy built here on its renderings (30% of the traces call the tool, as the demo's). TRL
needs to read the policy's tool calls back from its tokens: the tokenizer is given ``RESPONSE_TEMPLATE`` (the
transformers response-parsing spec TRL's own Qwen template follows), in this bench only. tether
runs the same config and tools as `tether demo --agent` (vLLM's hermes parser reads the calls),
with nothing changed for the bench.

Both: 40 steps of 32 episodes (8 prompts, 4 episodes each: GRPO's groups), one optimizer step a
batch, one pass, at most 4 assistant turns an episode (TRL: 3 tool-calling iterations), 20 new
tokens a turn, temperature 1, AdamW at a constant 5e-4, the KL to the reference in the loss at
0.02 (k3). tether runs every role as its process (vLLM generates); TRL generates with
transformers' ``generate`` in its one process and calls the tool there, one call after another (an
async tool's calls are gathered within an episode, not across episodes); tether's rollout runs an
episode's tool in a thread while the engine generates the others. ``--tool-latency none`` gives
both the calculator without its latency (the same answers at once), to compare what is left:
generation, training and the turns' bookkeeping. Each side is one command
timed from before it starts. Steady episodes/s: the episodes trained after the first step over
the time after it. Held-out exact answers: tether's evaluator (vLLM, seeded) on both outputs.

TRL is installed for this bench only (not a dependency of tether), beside the environment:

    pip install --target /tmp/trl --no-deps trl==1.16.0 datasets multiprocess
    python bench/against_trl_tools.py --trl-path /tmp/trl [--rounds 2] [--sides k0,k2,TRL] [--tool-latency none]
    python bench/against_trl_tools.py --sides k2,base-k2 --baseline /tmp/tether-before --tool-latency none
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

STEPS, PROMPTS_PER_STEP, GROUP, NEW_TOKENS, TURNS, LR, KL = 40, 8, 4, 20, 4, 5e-4, 0.02
BATCH = PROMPTS_PER_STEP * GROUP
STEADY_LIMIT, WALL_LIMIT = 1.5, 1.0  # issue 37: steady episodes/s at k = 2 >= 1.5x TRL's; whole run <= TRL's
ASSETS_VERSION = "agent-chat-v2"
CHAT_WORDS = ["<|im_start|>", "user", "assistant"]
# ChatML's shape with words for newlines (the demo's tokenizer splits on whitespace): a tool call
# as Hermes and Qwen write it, its arguments as JSON, the tool's result in a user turn
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m.role == 'user' %}<|im_start|> user {{ m.content }} <eos> "
            "{% elif m.role == 'assistant' %}<|im_start|> assistant {% if m.content %}{{ m.content }} {% endif %}"
            "{% for call in m.tool_calls or [] %}<tool_call> {\"name\": \"{{ call.function.name }}\", \"arguments\": "
            "{{ call.function.arguments | tojson }}} </tool_call> {% endfor %}<eos> "
            "{% elif m.role == 'tool' %}<|im_start|> user <tool_response> {{ m.content }} </tool_response> <eos> "
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
# how transformers' parse_response reads an assistant turn of TEMPLATE (TRL's qwen3_template, re-spaced)
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|> assistant", "fields": {
    "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                   "transform": {"type": "function", "function": "{content}"}},
    "content": {"close_pattern": r"<eos>\s*", "content": "text"}}}


# --------------------------------------------------------------------------- the chat policy


def build_tokenizer(directory: str):
    """The agent demo's word tokenizer with ChatML's words and ``TEMPLATE``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from demos.agent import VOCAB

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate([*VOCAB, *CHAT_WORDS])}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                  pre_tokenizers.Digits(individual_digits=True)])
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<pad>", chat_template=TEMPLATE)
    tokenizer.save_pretrained(directory)
    return tokenizer


def conversation(row: dict, rng: random.Random) -> list[dict]:
    """An SFT trace as a chat: the answer at once, or (30% of them, as the demo's traces) a
    calculator call, its result and the answer."""
    from demos.agent import SFT_TOOL_RATE

    messages = [{"role": "user", "content": row["prompt"]}]
    if rng.random() < SFT_TOOL_RATE:
        expression = " " + row["prompt"].removeprefix("add ").removesuffix(" :") + " "
        messages += [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
            {"role": "tool", "name": "calculator", "content": row["answer"]}]
    return [*messages, {"role": "assistant", "content": " ".join(row["answer"])}]


def trace_ids(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """The chat's token ids through ``TEMPLATE`` and its labels: each assistant turn after its
    header, -100 elsewhere."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    tokens: list[int] = []
    labels: list[int] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
            tokens += ids(head[len(rendered):])
            labels += [-100] * (len(tokens) - len(labels))
            rendered = head
        text = tokenizer.apply_chat_template(messages[:index + 1], tokenize=False)
        piece = ids(text[len(rendered):])
        tokens += piece
        labels += piece if message["role"] == "assistant" else [-100] * len(piece)
        rendered = text
    return tokens, labels


def write_chats(path: str, count: int, seed: int) -> None:
    """The demo's rows as chats: the prompt a user turn (the policy's template renders it)."""
    from demos.agent import make_row

    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(count):
            row = make_row(rng)
            chat = [{"role": "user", "content": row["prompt"]}]
            file.write(json.dumps({"messages": chat, "answer": row["answer"]}) + "\n")


def build_assets(directory: str, sft_steps: int = 800, seed: int = 0) -> dict[str, str]:
    """Tokenizer, SFT chat policy, train and held-out prompts; cached by the recipe."""
    from demos.agent import fit_next_token, make_row
    from demos.parity import built_once, tiny_llama_config

    paths = {"policy": f"{directory}/sft", "prompts": f"{directory}/prompts.jsonl",
             "eval_prompts": f"{directory}/eval_prompts.jsonl"}

    def build() -> None:
        import torch
        from transformers import LlamaForCausalLM

        tokenizer = build_tokenizer(paths["policy"])

        def example(rng: random.Random) -> tuple[list[int], list[int]]:
            return trace_ids(conversation(make_row(rng), rng), tokenizer)

        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))
        fit_next_token(model, example, sft_steps, seed)
        model.save_pretrained(paths["policy"])
        write_chats(paths["prompts"], 4096, seed + 10)
        write_chats(paths["eval_prompts"], 256, seed + 20)

    recipe = {"version": ASSETS_VERSION, "sft_steps": sft_steps, "seed": seed}
    return built_once(Path(directory), recipe, paths, "chat agent assets", build, log=lambda *_: None)


def calculator(expression: str) -> str:
    """Add two whole numbers.

    Args:
        expression: two numbers and a plus sign between them, such as "374 + 589"
    """
    from demos.agent import add

    return add(expression)  # demos.agent.calculator without its latency: ``--tool-latency none``


# --------------------------------------------------------------------------- the two trainers


def tether_overrides(paths: dict[str, str], run_dir: str, latency: str = "demo") -> dict:
    tools = "[demos.agent:calculator]" if latency == "demo" else "[against_trl_tools:calculator]"
    return {"run_dir": run_dir, "rollout.tools": tools, "models.policy": paths["policy"],
            "data.prompts": paths["prompts"],
            "rollout.samples_per_prompt": GROUP, "rollout.prompts_per_generate": PROMPTS_PER_STEP * 2,
            "rollout.max_new_tokens": NEW_TOKENS, "rollout.max_turns": TURNS, "learner.total_steps": STEPS,
            "learner.batch_size": BATCH, "learner.minibatch_size": BATCH, "learner.ppo_epochs": 1,
            "learner.actor_lr": LR, "learner.lr_schedule": "constant", "learner.advantage_estimator": "grpo",
            "learner.kl_in": "loss", "learner.kl_coef": KL, "learner.kl_estimator": "k3"}


def run_tether(paths: dict[str, str], run_dir: str, staleness: int, latency: str, repo: str = REPO) -> dict:
    """`tether run` of the task at ``staleness`` from the checkout ``repo``."""
    from against_trl_grpo import tether_run

    overrides = {**tether_overrides(paths, run_dir, latency), "buffer.max_staleness": staleness}
    return tether_run(os.path.join(repo, "configs", "demo-agent.yaml"), overrides, run_dir, BATCH, repo, bench_path())


def bench_path(*more: str) -> dict[str, str]:
    """The environment with this folder (and ``more``) on the path: the roles import this module's
    ``calculator``."""
    here = os.path.dirname(os.path.abspath(__file__))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, *more, os.environ.get("PYTHONPATH")]))}


def run_trl(paths: dict[str, str], output: str, trl_path: str, latency: str) -> dict:
    from against_trl_grpo import trl_run

    return trl_run([os.path.abspath(__file__), "--trl-run", json.dumps(paths), "--tool-latency", latency], output,
                   BATCH, bench_path(trl_path))


def trl_main(paths: dict[str, str], output: str, latency: str) -> None:
    """GRPOTrainer with ``tools=[calculator]`` and the settings above, in this process; each
    optimizer step's end time to ``output``-times.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from against_trl_grpo import step_times
    from demos import agent

    tool = agent.calculator if latency == "demo" else calculator
    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    tokenizer.response_template = RESPONSE_TEMPLATE  # what TRL needs to read the policy's tool calls
    with open(paths["prompts"]) as file:
        rows = [json.loads(line) for line in file if line.strip()]
    used = [rows[i % len(rows)] for i in range(STEPS * PROMPTS_PER_STEP)]
    data = Dataset.from_list([{"prompt": row["messages"], "answer": row["answer"]} for row in used])

    def exact_answer(completions, answer, **_) -> list[float]:
        """demos.agent.exact_answer on TRL's messages: the last assistant turn's digits, no call in it."""
        rewards = []
        for messages, expected in zip(completions, answer):
            last = next((m for m in reversed(messages) if m["role"] == "assistant"), {})
            digits = "".join(ch for ch in last.get("content") or "" if ch.isdigit())
            rewards.append(float(digits == expected and not last.get("tool_calls")))
        return rewards

    torch.manual_seed(0)
    config = GRPOConfig(output_dir=output + "-trainer", per_device_train_batch_size=PROMPTS_PER_STEP,
                        gradient_accumulation_steps=GROUP, num_generations=GROUP, generation_batch_size=BATCH,
                        max_completion_length=TURNS * NEW_TOKENS, max_tool_calling_iterations=TURNS - 1,
                        temperature=1.0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, beta=KL,
                        num_train_epochs=1, max_steps=STEPS, save_strategy="no", report_to="none",
                        logging_steps=10, use_cpu=True, dataloader_num_workers=0, seed=0)
    callback = step_times()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(paths["policy"]), reward_funcs=exact_answer,
                          args=config, train_dataset=data, processing_class=tokenizer, tools=[tool],
                          callbacks=[callback])
    trainer.train()
    trainer.save_model(output)
    tokenizer.save_pretrained(output)
    with open(output + "-times.json", "w") as file:
        json.dump(callback.times, file)


def held_out(paths: dict[str, str], checkpoint: str) -> float:
    """Held-out exact answers of ``checkpoint``: tether's evaluator on the demo's config."""
    from common.config import load_config
    from demos.agent import evaluate_policy

    config = load_config(os.path.join(REPO, "configs", "demo-agent.yaml"),
                         [f"{key}={value}" for key, value in tether_overrides(paths, tempfile.mkdtemp()).items()])
    return evaluate_policy(config, checkpoint, paths["eval_prompts"])["exact_answer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", default="k0,k2,TRL", help="of k0, k2 (tether at that staleness), TRL, and "
                        "base-k0, base-k2 (the --baseline checkout at that staleness)")
    parser.add_argument("--baseline", help="another tether checkout (a git worktree of an older commit) for the "
                        "base-k* sides; with --tool-latency none its demos/agent.py needs ``add``")
    parser.add_argument("--trl-path", help="where TRL was installed with pip --target (else: importable)")
    parser.add_argument("--tool-latency", choices=("demo", "none"), default="demo",
                        help="demo: the agent demo's calculator (0-200 ms); none: the same answers at once")
    parser.add_argument("--trl-run", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_run:
        return trl_main(json.loads(args.trl_run), args.output, args.tool_latency)

    paths = build_assets(os.path.join(REPO, ".demo", "assets-agent-chat"))
    work = tempfile.mkdtemp(prefix="tether-bench-tools-")
    sides = args.sides.split(",")
    results: dict[str, list[dict]] = {side: [] for side in sides}
    print(f"{'side':<8}{'round':>6}{'wall s':>9}{'first step s':>14}{'steady episodes/s':>19}{'held-out exact':>16}",
          flush=True)
    base = held_out(paths, paths["policy"])
    print(f"SFT policy: held-out exact {base:.3f}", flush=True)
    for round_index in range(args.rounds):
        for side in sides:
            output = os.path.join(work, f"{side}-{round_index}")
            if side == "TRL":
                result = run_trl(paths, output, args.trl_path, args.tool_latency)
            else:
                repo = args.baseline if side.startswith("base-") else REPO
                result = run_tether(paths, output, int(side.rpartition("k")[2]), args.tool_latency, repo)
            result["exact"] = held_out(paths, result["output"])
            results[side].append(result)
            print(f"{side:<8}{round_index + 1:>6}{result['wall_s']:>9.1f}{result['first_step_s']:>14.1f}"
                  f"{result['steady_per_s']:>19.1f}{result['exact']:>16.3f}", flush=True)
    medians = {side: {key: statistics.median(r[key] for r in runs) for key in
                      ("wall_s", "first_step_s", "steady_per_s", "exact")} for side, runs in results.items()}
    for side, figures in medians.items():
        line = (f"{side:<8} medians: wall {figures['wall_s']:.1f} s, first step {figures['first_step_s']:.1f} s, "
                f"steady {figures['steady_per_s']:.1f} episodes/s, held-out exact {figures['exact']:.3f}")
        if side != "TRL" and "TRL" in medians:
            trl = medians["TRL"]
            wall = figures["wall_s"] / trl["wall_s"]
            steady = figures["steady_per_s"] / trl["steady_per_s"]
            line += f"; wall / TRL's {wall:.2f} (limit <= {WALL_LIMIT}: {'met' if wall <= WALL_LIMIT else 'NOT met'})"
            line += f", steady / TRL's {steady:.2f}"
            if side.endswith("k2"):
                line += f" (limit >= {STEADY_LIMIT}: {'met' if steady >= STEADY_LIMIT else 'NOT met'})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
