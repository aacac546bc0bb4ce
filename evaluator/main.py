"""Evaluation of a policy checkpoint on held-out prompts: vLLM generates (seeded), the scorer's
models score (reference logprobs, reward model, reward functions), and the figures go to
``metrics/eval.jsonl`` (and TensorBoard) with the step they belong to; the worst responses are
written as text to ``eval/step-N.md`` so a person can read what the policy does.

``tether eval CHECKPOINT -c CONFIG`` runs it on any HF checkpoint; with ``eval.every`` set,
``tether run`` runs it on the learner's exports as training goes.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from common.config import ConfigError, TetherConfig
from common.image_prompts import prompts_with_images
from common.images import decoded
from common.model_dirs import resolve_models
from common.processors import banning_placeholder, load_processor
from common.prompts import read_rows
from common.runlog import metrics_writer, setup_logging
from protocol.samples import Sample


def repetition_rate(tokens: list[int], n: int = 3) -> float:
    """Share of a response's n-grams that repeat an earlier n-gram of it (0: none repeats)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def evaluate(config: TetherConfig, checkpoint: str, log) -> tuple[dict, list[Sample], dict[str, np.ndarray]]:
    """Figures of ``checkpoint`` on the prompts of ``config.data.prompts`` (``run`` puts
    ``eval.prompts`` there, where the scorer reads rows from); also the samples and per-sample KL
    and repetition, for the worst cases."""
    from transformers import AutoTokenizer
    from vllm import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from environments.agents import agent_programs
    from rollout.engine import banned_words, image_arguments, make_vllm_engine, sampling_params
    from environments.native import Environments, prompt_tools
    from rollout.episodes import Episodes, Renderer
    from rollout.generators import generate_to_end
    from rollout.responses import Generating, to_samples
    from environments.tools import load_tools
    from scorer.main import Scorer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    programs = agent_programs(config, tokenizer)
    environments = Environments.load(config.rollout.environment, load_tools(config.rollout.tools), programs,
                                     config.rollout.env_step_deadline_s)
    tools = prompt_tools(config, environments)
    if environments is not None:
        environments.read_calls_with(config.rollout.tool_parser, tokenizer, config.rollout.reasoning_parser)
    limit = config.rollout.max_model_len - config.rollout.max_new_tokens
    rows = read_rows(config.data.prompts, environment_args=config.rollout.environment_args)
    rows = rows[:config.eval.max_prompts]
    processor = load_processor(checkpoint)  # a policy that sees: the rows' images too
    config = banning_placeholder(config, processor)
    bad_words = banned_words(config, tokenizer)
    token_ids, kept, images = prompts_with_images(rows, tokenizer, processor, limit, config.data.system_prompt,
                                                  "eval.prompts", config.data.prompts, tools)
    if processor is not None and environments is not None:
        environments.showing_images(images)
    # every request is seeded (the same checkpoint gives the same figures), and on vLLM's CPU backend a
    # seeded request whose prefill is cut in chunks fails ("CPU Generator does not use offset"):
    # episodes' later turns are long prefills, so prefills are taken whole
    engine = make_vllm_engine(config.model_copy(update={"models": config.models.model_copy(update={"policy": checkpoint})}),
                              enable_chunked_prefill=False,
                              **image_arguments(images, config.rollout.max_images_per_episode
                                                if environments is not None else None))
    episode_figures = {}
    try:
        if environments is None:
            sampling = [sampling_params(config, bad_words, n=1, ignore_eos=False, seed=config.eval.seed + i)
                        for i in range(len(kept))]
            prompts = [TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": decoded(images[i])})
                       if images and images[i] else TokensPrompt(prompt_token_ids=ids)
                       for i, ids in enumerate(token_ids)]
            outputs = engine.generate(prompts, sampling, use_tqdm=False)
            samples = to_samples(outputs, [Generating(i, row, 0, images[i] if images else None)
                                           for i, row in enumerate(kept)], 0)
        else:  # each turn seeded by its prompt and its number: the same checkpoint gives the same episodes
            turns = config.rollout.max_turns
            # a failed episode is evaluated, at 0 where the run drops it from training: dropped here, a
            # checkpoint whose episodes fail more would read better
            if config.rollout.failed_episode_reward is None:
                config = config.model_copy(update={"rollout": config.rollout.model_copy(
                    update={"failed_episode_reward": 0.0})})
            episodes = Episodes(config, environments, Renderer(tokenizer, tools, processor), tokenizer, rows,
                                token_ids, kept, lambda episode, max_tokens: sampling_params(
                                    config, bad_words, n=1, ignore_eos=False, max_tokens=max_tokens,
                                    seed=config.eval.seed + episode.group.prompt_index * turns + episode.turns,
                                    output_kind=RequestOutputKind.FINAL_ONLY), log, images)
            samples, failed = generate_to_end(engine, episodes, list(range(len(kept))))
            record = episodes.record()
            episode_figures = {"episodes_failed": failed, "turns_per_episode": record["turns_per_episode"],
                               "tool_calls_per_episode": record["tool_calls_per_episode"],
                               "tool_errors": record["tool_errors"]}
    finally:
        engine.llm_engine.engine_core.shutdown()
        if programs is not None:
            programs.close()
    samples = last_parts(samples)
    for i, sample in enumerate(samples):
        sample.sample_id = f"eval-{i}"
    # an evaluation reports rewards: a teacher's logprobs would be computed for nothing
    scorer = Scorer(config.model_copy(update={"models": config.models.model_copy(update={"teacher": None})}), log)
    try:
        parts = scorer.score(samples)  # reads the eval rows: reward functions get their row
    finally:
        scorer.close()
    if environments is not None:  # what is trained on: the scorer's score plus the environment's turn rewards
        episode_figures.update(environment_rewards(samples))
        for sample in samples:
            sample.reward += float(np.sum(sample.turn_rewards))
    # over the policy's tokens: an episode's environment tokens have no behavior logprob
    kl = np.array([float(np.sum((s.behavior_logprobs - s.ref_logprobs) * (1 if s.loss_mask is None else s.loss_mask)))
                   for s in samples])
    repetition = np.array([repetition_rate(s.response_tokens.tolist()) for s in samples])
    figures = {
        "reward": float(np.mean([s.reward for s in samples])),  # an episode's: the scorer's and its environment's
        **parts,
        "kl_to_reference": float(kl.mean()),
        "response_length": float(np.mean([len(s.response_tokens) for s in samples])),
        "repetition_rate": float(repetition.mean()),
        "prompts": len(samples),
        "prompts_skipped": len(rows) - len(kept),
        **episode_figures,
    }
    if samples[0].gold_reward is not None:
        figures["gold_reward"] = float(np.mean([s.gold_reward for s in samples]))
    return figures, samples, {"kl": kl, "repetition": repetition}


def last_parts(samples: list[Sample]) -> list[Sample]:
    """One sample per episode: its last part (an agent program that rewrote its context sent the
    turns before as parts of their own), with the parts' turn rewards added at its last token, so
    that an evaluation reports episodes. The KL and the length are the last part's."""
    earlier: dict = {}
    for sample in samples:
        if not sample.final:
            earlier[sample.episode] = earlier.get(sample.episode, 0.0) + float(np.sum(sample.turn_rewards))
    finals = [sample for sample in samples if sample.final]
    for sample in finals:
        if earlier.get(sample.episode):
            sample.turn_rewards = sample.turn_rewards.copy()
            sample.turn_rewards[-1] += earlier[sample.episode]
    return finals


def environment_rewards(samples: list[Sample]) -> dict[str, float]:
    """The environment's part of the episodes' reward: ``env_reward`` per episode (the rollout's
    metric of the same name) and ``env_reward_per_turn``; ``scorer_reward``, the rest of it."""
    rewards = np.array([float(np.sum(s.turn_rewards)) for s in samples])
    turns = sum(int(np.sum(np.diff(np.concatenate([[0], s.loss_mask.astype(np.int8)])) == 1)) for s in samples)
    return {"env_reward": float(rewards.mean()), "env_reward_per_turn": float(rewards.sum() / max(turns, 1)),
            "scorer_reward": float(np.mean([s.reward for s in samples]))}


def worst_cases(samples: list[Sample], per_sample: dict[str, np.ndarray], tokenizer, count: int) -> list[dict]:
    """The ``count`` lowest-reward and highest-KL responses, a row each: ``case``, ``reward``,
    ``kl``, ``tokens``, ``repetition`` and ``conversation`` (its prompt and response, a line each)."""
    rows = []
    for case, order in (("lowest reward", np.argsort([s.reward for s in samples])),
                        ("highest KL to the reference", np.argsort(-per_sample["kl"]))):
        for i in order[:count]:
            sample = samples[i]
            rows.append({"case": case, "reward": float(sample.reward), "kl": float(per_sample["kl"][i]),
                         "tokens": len(sample.response_tokens), "repetition": float(per_sample["repetition"][i]),
                         "conversation": "\n".join(_conversation_lines(sample, tokenizer))})
    return rows


def worst_cases_text(rows: list[dict], step: int) -> str:
    """Markdown of ``worst_cases``' rows."""
    lines = [f"# Evaluation at step {step}", ""]
    for case in dict.fromkeys(row["case"] for row in rows):
        lines += [f"## {case[0].upper()}{case[1:]}", ""]
        for row in (row for row in rows if row["case"] == case):
            lines += [f"- reward {row['reward']:+.3f}, KL {row['kl']:.3f}, {row['tokens']} tokens, repetition "
                      f"{row['repetition']:.2f}", row["conversation"], ""]
    return "\n".join(lines)


def _conversation_lines(sample: Sample, tokenizer) -> list[str]:
    """A single response as its prompt and response (<eos> shows); an episode as its whole
    conversation, a line a message, and how it ended."""
    if sample.messages is None:
        return [f"  - prompt: `{tokenizer.decode(sample.prompt_tokens.tolist(), skip_special_tokens=True)}`",
                f"  - response: `{tokenizer.decode(sample.response_tokens.tolist())}`"]
    return [*(f"  - {message['role']}: `{message['content']}`" for message in json.loads(sample.messages)),
            f"  - ended: {sample.finish_reason}"]


def run(config: TetherConfig, checkpoint: str, step: int) -> dict:
    """Evaluate ``checkpoint`` as the policy of learner step ``step``: one record in
    ``metrics/eval.jsonl``, the worst cases in ``eval/step-N.md`` (and as rows, ``.jsonl``). Returns
    the figures."""
    from transformers import AutoTokenizer

    log = setup_logging("eval", config.log_level)
    if not config.eval.prompts:
        raise ConfigError("eval.prompts: no held-out prompts to evaluate on")
    config = resolve_models(config.model_copy(update={"data": config.data.model_copy(
        update={"prompts": config.eval.prompts})}), "scorer")
    if not os.path.isdir(checkpoint):
        raise ConfigError(f"checkpoint {checkpoint} is not a model directory")
    started = time.monotonic()
    figures, samples, per_sample = evaluate(config, checkpoint, log)
    figures["eval_s"] = time.monotonic() - started
    metrics = metrics_writer(config, "eval")
    metrics.write({"step": step, "checkpoint": os.path.abspath(checkpoint), **figures})
    metrics.close()
    directory = os.path.join(config.run_dir, "eval")
    os.makedirs(directory, exist_ok=True)
    rows = worst_cases(samples, per_sample, AutoTokenizer.from_pretrained(checkpoint), config.eval.worst_cases)
    with open(os.path.join(directory, f"step-{step:06d}.md"), "w") as file:
        file.write(worst_cases_text(rows, step))
    with open(os.path.join(directory, f"step-{step:06d}.jsonl"), "w") as file:  # the trackers' table
        file.writelines(json.dumps(row) + "\n" for row in rows)
    log.info("step %d: reward %.3f, kl %.3f, length %.1f, repetition %.3f on %d prompts (%.0fs)", step,
             figures["reward"], figures["kl_to_reference"], figures["response_length"], figures["repetition_rate"],
             figures["prompts"], figures["eval_s"])
    return figures
