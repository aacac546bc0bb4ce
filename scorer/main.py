"""The scorer's loop: ask the buffer for samples, score them, send them back.

A sample's score, the one trained on, is the reward model's (when there is one) plus the
weighted reward functions'; the gold reward, where the task has one, is only reported.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from common import models
from common.config import ConfigError, TetherConfig
from common.model_dirs import resolve_models
from common.models import same_tokens
from common.processors import banning_placeholder, load_processor, sees_images
from common.prompts import chat_of, read_rows, text_chat
from common.runlog import StartupTimeline, metrics_writer, setup_logging
from protocol.samples import Sample, pack_samples, unpack_samples
from protocol.transport import connect_to_buffer
from scorer.rewards import RewardFunction


class Scorer:
    """The frozen models and reward functions of one scorer, and how they score a list of samples."""

    def __init__(self, config: TetherConfig, log) -> None:
        from transformers import AutoTokenizer

        # the user's code first: a typo there should not wait for the models to load
        self.functions = [RewardFunction.load(f.function, f.weight, f"scorer.reward_functions[{i}].function")
                          for i, f in enumerate(config.scorer.reward_functions)]
        self.gold = (RewardFunction.load(config.scorer.gold_reward, 1.0, "scorer.gold_reward")
                     if config.scorer.gold_reward else None)
        if config.models.reference and not same_tokens(config.models.policy, config.models.reference):
            raise ConfigError(f"models.reference: {config.models.reference} reads other tokens than the policy; "
                              "the KL tether compares both on the policy's tokens")
        self.processor = load_processor(config.reference_path)  # a reference that sees reads the images
        if sees_images(config.models.policy) != (self.processor is not None):
            sees = ("sees images and the policy does not" if self.processor
                    else "does not see images and the policy does")
            raise ConfigError(f"models.reference: {config.reference_path} {sees} ({config.models.policy}): the KL "
                              "tether compares both on the same inputs")
        # the KL tether is to the reference's whole distribution at the rollout's temperature, less
        # the tokens the policy may not sample (a policy that sees: its image placeholder)
        self.log, self.sampling = log, banning_placeholder(config, self.processor).sampling.without_truncation()
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.reference = models.load_causal_lm(config.reference_path, config.models.dtype).to(self.device).eval()
        self.pad_token_id = models.pad_token_id(self.reference)
        self.tokenizer = AutoTokenizer.from_pretrained(config.models.policy)
        self.reward_model = self.rm_tokenizer = self.rm_processor = None
        if config.models.reward:
            policy_tokens = same_tokens(config.models.policy, config.models.reward)
            self.rm_processor = load_processor(config.models.reward)  # an RM that sees: the samples' images too
            if self.rm_processor is not None and not policy_tokens:
                raise ConfigError(f"models.reward: {config.models.reward} sees images and reads other tokens than the "
                                  "policy: a reward model that sees reads the samples' own ids and images, so it "
                                  "needs the policy's tokenizer (train one with `tether rm` from the policy)")
            if self.rm_processor is not None and self.processor is not None and (
                    self.rm_processor.image_processor.to_dict() != self.processor.image_processor.to_dict()):
                raise ConfigError(f"models.reward: {config.models.reward} processes images otherwise than the "
                                  f"policy ({config.models.policy}): the samples' image tokens are the policy's "
                                  "processor's, so the reward model's must be the same")
            if self.processor is not None and policy_tokens and self.rm_processor is None:
                raise ConfigError(f"models.reward: {config.models.reward} reads the policy's token ids, which hold a "
                                  "vision policy's image tokens, and does not see images: give a reward model that "
                                  "sees (`tether rm` from the policy), or one of its own tokenizer, which reads the "
                                  "conversation's text")
            if not policy_tokens:  # else ids go to it unchanged
                self.rm_tokenizer = AutoTokenizer.from_pretrained(config.models.reward)
            self.reward_model = models.load_reward_model(config.models.reward, config.models.dtype,
                                                         self.rm_tokenizer or self.tokenizer,
                                                         new_head=False).to(self.device).eval()
            try:
                models.classification_head(self.reward_model)
            except ValueError as error:
                raise ConfigError(f"models.reward: {error}; tether scores the last token's hidden state with a "
                                  "single linear head") from None
            if self.rm_tokenizer is not None:
                self.rm_max_tokens = getattr(self.reward_model.config, "max_position_embeddings", None)
        scorer = config.scorer
        self.overlong = ((config.overlong_max_length, scorer.overlong_buffer, scorer.overlong_penalty)
                         if scorer.overlong_buffer is not None else None)
        self.needs_text = bool(self.functions or self.gold or self.rm_tokenizer)
        self.rows = (read_rows(config.data.prompts, environment_args=config.rollout.environment_args)
                     if self.needs_text else [])
        self.system_prompt = config.data.system_prompt

    def describe(self) -> str:
        rm = "none" if self.reward_model is None else (
            "its own tokenizer" if self.rm_tokenizer is not None else
            "the policy's tokens and images" if self.rm_processor is not None else "the policy's tokens")
        functions = ", ".join(f"{f.weight:g} x {f.name}" for f in self.functions) or "none"
        return f"reward model: {rm}; reward functions: {functions}"

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Fill in each sample's ``ref_logprobs``, ``reward`` and ``gold_reward``; returns the mean of
        each part of the score and the count of reward-function failures, for the metrics. An
        episode's score is its last part's (the conversation as it ended): the parts before it (a
        program that rewrote its context) get their reference logprobs and a score of 0."""
        from scorer.scoring import reference_logprobs

        for sample, ref in zip(samples, reference_logprobs(self.reference, samples, self.pad_token_id,
                                                           self.sampling, self.processor)):
            sample.ref_logprobs = ref.numpy()
        for sample in samples:
            if not sample.final:
                sample.reward, sample.gold_reward = 0.0, (0.0 if self.gold is not None else None)
        finals = [sample for sample in samples if sample.final]
        return self._outcomes(finals) if finals else {"reward_function_failures": 0}

    def _outcomes(self, samples: list[Sample]) -> dict[str, float]:
        """``score``'s reward and gold reward of episodes' last parts (every single response is one)."""
        from scorer.scoring import overlong_penalty, reward_model_tokens, reward_scores, reward_scores_of_tokens

        arguments = [self._arguments(sample) for sample in samples] if self.needs_text else []
        totals = np.zeros(len(samples), dtype=np.float64)
        parts: dict[str, float] = {}
        if self.reward_model is not None:
            if self.rm_tokenizer is None:
                rm = reward_scores(self.reward_model, samples, self.pad_token_id, self.rm_processor)
            else:
                rows = [reward_model_tokens(a["sequence"], self._conversation(a), self.rm_tokenizer, self.rm_max_tokens)
                        for a in arguments]
                rm = reward_scores_of_tokens(self.reward_model, rows)
            totals += rm.double().numpy()
            parts["rm_score"] = float(rm.mean())
        failures = 0
        for function in self.functions:
            values = [function(s.sample_id, a, self.log) for s, a in zip(samples, arguments)]
            failures += sum(value is None for value in values)
            values = np.array([0.0 if value is None else value for value in values])
            totals += function.weight * values
            parts[function.name] = float(values.mean())
        if self.overlong is not None:  # on the policy's own tokens: an episode's observations do not count
            lengths = torch.tensor([len(s.response_tokens) if s.loss_mask is None else int(s.loss_mask.sum())
                                    for s in samples])
            penalties = overlong_penalty(lengths, *self.overlong).numpy()
            totals += penalties
            parts.update(overlong_penalty=float(penalties.mean()), overlong_frac=float((penalties < 0).mean()))
        for sample, total in zip(samples, totals):
            sample.reward = float(total)
        if self.gold is not None:
            for sample, a in zip(samples, arguments):
                value = self.gold(sample.sample_id, a, self.log)
                sample.gold_reward = 0.0 if value is None else value
        return {**parts, "reward_function_failures": failures}

    def _arguments(self, sample: Sample) -> dict:
        """What reward functions (and an RM with its own tokenizer) read of one sample."""
        prompt, response = sample.prompt_tokens.tolist(), sample.response_tokens.tolist()
        row = self.rows[sample.data_row] if 0 <= sample.data_row < len(self.rows) else {}
        return {"prompt": self.tokenizer.decode(prompt, skip_special_tokens=True),
                "response": self.tokenizer.decode(response, skip_special_tokens=True),
                "sequence": self.tokenizer.decode(prompt + response, skip_special_tokens=True),
                "prompt_tokens": prompt, "response_tokens": response, "row": row,
                # an episode's whole conversation; a single response's is its chat and the response
                "messages": json.loads(sample.messages) if sample.messages is not None else None}

    def _conversation(self, arguments: dict) -> list[dict[str, str]] | None:
        """What an RM with its own chat template reads: an episode's conversation, or a chat prompt
        with the response as the assistant's turn; None for a text prompt."""
        if arguments["messages"] is not None:
            return arguments["messages"]
        chat = chat_of(arguments["row"], self.system_prompt)
        # text: an RM of its own tokenizer reads no image (a chat's image parts are left out)
        return None if chat is None else [*text_chat(chat), {"role": "assistant", "content": arguments["response"]}]


def run(config: TetherConfig, worker_index: int = 0) -> None:
    log = setup_logging(f"scorer{worker_index}", config.log_level)
    timeline = StartupTimeline(config.run_dir, f"scorer{worker_index}")
    config = resolve_models(config, "scorer")
    timeline.phase("import")
    scorer = Scorer(config, log)
    timeline.phase("model load")
    metrics = metrics_writer(config, f"scorer{worker_index}")
    client = connect_to_buffer(config, "scorer", str(worker_index))
    timeline.phase("buffer connect")
    log.info("scoring with reference %s on %s; %s", config.reference_path, scorer.device, scorer.describe())

    scored_total = 0
    period_started = time.monotonic()  # a period: from one record to the next, so the periods tile the run
    try:
        while True:
            work = client.request("score_request", {"max_samples": config.scorer.max_samples_per_request},
                                  waiting_for="samples to score")
            if work.fields["stop"]:
                break
            samples = unpack_samples(work)
            busy_started = time.monotonic()
            parts = scorer.score(samples)
            busy_s = time.monotonic() - busy_started
            client.request("scored", *pack_samples(samples, scored=True))
            scored_total += len(samples)
            tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
            now = time.monotonic()
            metrics.write({**client.counters, "scored": len(samples), "scored_total": scored_total, "busy_s": busy_s,
                           "waiting_s": busy_started - period_started, "tokens_per_s": tokens / max(busy_s, 1e-9),
                           "send_s": now - busy_started - busy_s, "iteration_s": now - period_started, **parts})
            period_started = now
    except Exception as error:  # the samples it holds are scored by another now, not after scorer.deadline_s
        client.goodbye(error)
        raise
    log.info("stopping after %d scored samples", scored_total)
    metrics.close()
    client.close()
