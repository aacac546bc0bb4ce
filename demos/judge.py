"""`tether demo --judge`: the parity demo with its reward model replaced by an LLM judge, a tiny
Llama of its own tokenizer the demo trains on the same gold rule: asked "<prompt> <response> right
?", its probability of "Yes" (normalised over Yes and No) is the gold reward it learned. The
scorer serves it on vLLM (``scorer.judges``, verdict mode) while the rollout generates."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from demos.parity import (ASSETS_VERSION, PARITIES, VOCAB, build_assets, built_once, make_prompt,
                          run_and_report_gold)

JUDGE_VOCAB = VOCAB + ["Yes", "No", "<user>", "<assistant>", "right", "?"]
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo-judge.yaml"  # its judge's prompt and verdicts
CHAT_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}> {{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def text_gold(prompt: str, response: str) -> float:
    """The parity demo's gold rule on text: the share of the response's digits of the prompt's parity."""
    wanted = PARITIES.index(prompt.split()[0])
    digits = [int(word) for word in response.split() if word.isdigit()]
    return sum(digit % 2 == wanted for digit in digits) / len(digits) if digits else 0.0


def build_judge_tokenizer(directory: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(JUDGE_VOCAB)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def question_ids(tokenizer, content: str) -> list[int]:
    """A question's ids as the scorer asks it: the user's turn of the judge's chat template."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def judge_examples(count: int, rng: random.Random) -> list[tuple[str, str, float]]:
    """(prompt, response, gold) of responses of 1 to 8 digits, each right with a rate of its own,
    so that every gold from 0 to 1 is seen."""
    examples = []
    for _ in range(count):
        prompt = make_prompt(rng)
        wanted, rate = PARITIES.index(prompt.split()[0]), rng.random()
        digits = [rng.choice(range(wanted if rng.random() < rate else 1 - wanted, 10, 2))
                  for _ in range(rng.randint(1, 8))]
        response = " ".join(map(str, digits))
        examples.append((prompt, response, text_gold(prompt, response)))
    return examples


def build_judge(directory: str, steps: int = 400, seed: int = 0, log=print) -> str:
    """A judge that answers the gold reward as its probability of Yes: a tiny Llama trained, with the
    soft target (gold, 1 - gold) on its Yes and No logits at the answer's position."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_judge_tokenizer(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(JUDGE_VOCAB), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    import jinja2

    judge = demo_judges()[0]  # asked as the scorer asks it, answered in its verdicts
    template = jinja2.Template(judge["prompt"])
    verdicts = tokenizer.convert_tokens_to_ids(judge["verdict"])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    started = time.monotonic()
    for step in range(steps):
        batch = judge_examples(64, rng)
        questions = [question_ids(tokenizer, template.render(prompt=p, response=r)) for p, r, _ in batch]
        longest = max(map(len, questions))
        ids = torch.tensor([q + [0] * (longest - len(q)) for q in questions])
        mask = (torch.arange(longest)[None] < torch.tensor([len(q) for q in questions])[:, None]).long()
        logits = model(input_ids=ids, attention_mask=mask).logits
        last = logits[torch.arange(len(batch)), mask.sum(dim=1) - 1][:, verdicts]
        gold = torch.tensor([[g, 1 - g] for _, _, g in batch])
        loss = -(gold * torch.log_softmax(last, dim=-1)).sum(dim=-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"judge step {step}: loss {loss.item():.4f} ({time.monotonic() - started:.0f}s)")
    model.save_pretrained(directory)
    return directory


def judge_assets(assets: Path, log=print) -> dict[str, str]:
    """The parity demo's assets and the judge beside them, each built once."""
    paths = build_assets(assets / "assets", log=log)
    judge = built_once(assets / "judge", {"version": ASSETS_VERSION, "judge": 1}, {"judge": str(assets / "judge")},
                       "demo judge", lambda: build_judge(str(assets / "judge"), log=log), log)
    return {**paths, **judge}


def demo_judges(model: str | None = None) -> list[dict]:
    """configs/demo-judge.yaml's judges, each of ``model`` (where the demo built it) when given."""
    import yaml

    judges = yaml.safe_load(CONFIG.read_text())["scorer"]["judges"]
    return [{**judge, "model": model} for judge in judges] if model else judges


def run_demo(assets: Path, overrides: list[str]) -> int:
    started = time.monotonic()
    paths = judge_assets(assets)
    built = [f"models.policy={paths['policy']}", f"data.prompts={paths['prompts']}",
             f"scorer.judges={json.dumps(demo_judges(paths['judge']))}"]
    return run_and_report_gold(CONFIG, [*built, *overrides], paths, started)
