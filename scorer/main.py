"""The scorer's loop: ask the buffer for samples, score them, send them back, with several
requests in flight (``scorer.requests_in_flight``) while judges and reward calls answer.

A sample's score, the one trained on, is the reward model's (when there is one) plus the weighted
values of its reward functions, reward service and judges; those that score each turn
(``per_turn``) put theirs on the turn's last policy token instead. The gold reward, where the task
has one, is only reported.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common import models
from common.config import ConfigError, TetherConfig
from common.model_dirs import resolve_models
from common.models import same_tokens
from common.packing import checked
from common.processors import banning_placeholder, load_processor, sees_images
from common.prompts import chat_of, read_rows, text_chat
from common.runlog import StartupTimeline, metrics_writer, setup_logging
from common.sequences import policy_turns
from protocol.samples import Sample, pack_samples, unpack_samples
from protocol.transport import connect_to_buffer
from scorer.judges import Judge, Judges, Question
from scorer.rewards import Failed, RemoteReward, RewardCalls, RewardFunction, finite, outcome, unmatched_turns

POLL_S = 0.01  # with requests in flight and the judges idle: the longest wait for a reward call or the buffer


@dataclass(eq=False)
class Job:
    """One score request's samples while its reward calls and judges' questions are under way.
    A value's key is (what gave it, the final sample's index, its turn's number or None)."""
    samples: list[Sample]
    finals: list[Sample]
    arguments: list[dict]
    totals: np.ndarray  # [finals] the synchronous part of each final's score (RM, overlong shaping)
    parts: dict[str, float]
    turns: list[list[tuple[int, int]]]  # each final's [start, stop) of the policy's turns
    calls: list[tuple[tuple, concurrent.futures.Future]] = field(default_factory=list)
    answers: dict[tuple, list] = field(default_factory=dict)  # a judge's key -> [(score or None, answer)]
    questions: int = 0  # asked and not answered

    @property
    def done(self) -> bool:
        return self.questions == 0 and all(future.done() for _, future in self.calls)


class Scorer:
    """The frozen models and reward functions of one scorer, and how they score a list of samples."""

    def __init__(self, config: TetherConfig, log, worker_index: int = 0) -> None:
        from transformers import AutoTokenizer

        # the user's code first: a typo there should not wait for the models to load
        self.functions = [RewardFunction.load(f.function, f.weight, f"scorer.reward_functions[{i}].function",
                                              f.per_turn)
                          for i, f in enumerate(config.scorer.reward_functions)]
        self.gold = (RewardFunction.load(config.scorer.gold_reward, 1.0, "scorer.gold_reward")
                     if config.scorer.gold_reward else None)
        scorer = config.scorer
        self.remote = (RemoteReward(scorer.reward_url, scorer.reward_url_weight, scorer.reward_concurrency)
                       if scorer.reward_url else None)
        # the rows, when what scores reads text (an RM with its own tokenizer too: known once it loads)
        read = lambda: read_rows(config.data.prompts, environment_args=config.rollout.environment_args)  # noqa: E731
        self.rows = read() if self.functions or self.gold or scorer.judges or self.remote else []
        # and the judges' tokenizers: a verdict of two tokens should not wait for the models either
        judges = [Judge(judge, name, f"scorer.judges[{i}]", config.models.policy, self.rows)
                  for i, (judge, name) in enumerate(zip(scorer.judges, config.judge_names))]
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
        self.teacher = None
        if config.models.teacher:  # on-policy distillation: the teacher's logprobs of the policy's tokens
            if self.processor is not None:
                raise ConfigError(f"models.teacher: the policy ({config.models.policy}) sees images; distillation "
                                  "from a teacher is for text policies for now")
            if not same_tokens(config.models.policy, config.models.teacher):
                raise ConfigError(f"models.teacher: {config.models.teacher} reads other tokens than the policy "
                                  f"({config.models.policy}): a teacher grades the policy's own tokens, so it needs "
                                  "the policy's tokenizer")
            self.teacher = models.load_causal_lm(config.models.teacher, config.models.dtype).to(self.device).eval()
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
        # one layout for every pass, none where any of the models cannot take scorer.packing
        self.packing, self.max_tokens = scorer.packing, scorer.max_tokens_per_pass
        for model, what in ((self.reference, "the reference"), (self.teacher, "the teacher"),
                            (self.reward_model if self.rm_tokenizer is None else None, "the reward model")):
            if model is not None:
                self.packing = checked(model, self.packing, config.rollout.max_model_len, log, what)
        self.overlong = ((config.overlong_max_length, scorer.overlong_buffer, scorer.overlong_penalty)
                         if scorer.overlong_buffer is not None else None)
        self.needs_text = bool(self.functions or self.gold or self.rm_tokenizer or judges or self.remote)
        if self.needs_text and not self.rows:
            self.rows = read()
        self.system_prompt = config.data.system_prompt
        self.on_failure = scorer.on_reward_failure
        self.calls = RewardCalls(scorer.reward_concurrency, scorer.reward_deadline_s)
        self.warned: set[str] = set()  # what gave a failure or an unparsed answer already logged
        self.judges = Judges(config, judges, worker_index, self._answered) if judges else None

    def describe(self) -> str:
        rm = "none" if self.reward_model is None else (
            "its own tokenizer" if self.rm_tokenizer is not None else
            "the policy's tokens and images" if self.rm_processor is not None else "the policy's tokens")
        functions = ", ".join(f"{f.weight:g} x {f.name}" for f in self.functions) or "none"
        described = f"reward model: {rm}; reward functions: {functions}"
        if self.teacher is not None:
            described += "; a teacher's logprobs (distillation)"
        if self.remote is not None:
            described += f"; reward service: {self.remote.weight:g} x {self.remote.url}"
        if self.judges is not None:
            described += "; judges: " + ", ".join(f"{j.weight:g} x {j.name} ({j.config.model})"
                                                   for j in self.judges.judges)
        return described

    @property
    def busy(self) -> bool:
        """Whether a judge has questions: the loop steps its engine rather than wait."""
        return self.judges is not None and self.judges.busy

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Score ``samples`` to the end (``begin``, ``advance`` until done, ``finish``): the
        evaluator's and the tests' way, one request at a time."""
        job = self.begin(samples)
        while not job.done:
            self.advance(timeout=POLL_S)
        return self.finish(job)

    def begin(self, samples: list[Sample]) -> Job:
        """Fill in each sample's ``ref_logprobs`` and what is computed at once (the reward model, the
        overlong shaping), and start its reward calls and judges' questions. An episode's score is its
        last part's (the conversation as it ended): the parts before it (a program that rewrote its
        context) get their reference logprobs and a score of 0."""
        from scorer.scoring import pass_shares_of, reference_logprobs

        for sample, ref in zip(samples, reference_logprobs(self.reference, samples, self.pad_token_id,
                                                           self.sampling, self.processor, self.packing,
                                                           self.max_tokens)):
            sample.ref_logprobs = ref.numpy()
        if self.teacher is not None:  # at the same distribution as the reference's: the rollout's sampling
            for sample, taught in zip(samples, reference_logprobs(self.teacher, samples, self.pad_token_id,
                                                                  self.sampling, None, self.packing,
                                                                  self.max_tokens)):
                sample.teacher_logprobs = taught.numpy()
        for sample in samples:
            if not sample.final:
                sample.reward, sample.gold_reward = 0.0, (0.0 if self.gold is not None else None)
        finals = [sample for sample in samples if sample.final]
        arguments = [self._arguments(sample) for sample in finals] if self.needs_text else []
        job = Job(samples, finals, arguments, *self._at_once(finals, arguments),
                  [policy_turns(s.loss_mask, len(s.response_tokens)) for s in finals])
        job.parts.update(pass_shares_of(samples, self.max_tokens))  # what scorer.packing saves (or would)
        for function in self.functions:
            for i, turn in self._targets(job, function.per_turn):
                given = self._turn_arguments(job, i, turn)
                job.calls.append(((function, i, turn), unmatched_turns(given["unmatched"])
                                  if "unmatched" in given else self.calls.submit(function.call(given))))
        if self.remote is not None and finals:
            job.calls.append(((self.remote, None, None), self.calls.submit(self.remote.call(arguments))))
        if self.gold is not None:
            job.calls += [((self.gold, i, None), self.calls.submit(self.gold.call(a))) for i, a in enumerate(arguments)]
        for judge in self.judges.judges if self.judges is not None else []:
            self._ask(job, judge)
        return job

    def advance(self, timeout: float = 0.0) -> None:
        """Step the judges' engines once, or with nothing in them, wait up to ``timeout`` for a
        reward call."""
        if self.busy:
            self.judges.step()
        elif timeout:
            time.sleep(timeout)

    def finish(self, job: Job) -> dict[str, float]:
        """A done ``job``'s scores into its samples: each final's ``reward`` (and ``turn_rewards``
        of what scores turns), ``gold_reward``, and a ``drop_reason`` where its group is not to be
        trained. Returns the mean of each part of the score and the failures, for the metrics."""
        totals, parts, failed = job.totals.copy(), dict(job.parts), Counter()
        drops: dict[int, str] = {}
        values: dict[str, list[float]] = {}
        for (source, i, turn), future in job.calls:
            if source is self.remote:  # one call for the request: a value a final
                result = outcome(future)
                for j in range(len(job.finals)):
                    value = self._value(result if isinstance(result, Failed) else result[j], source.name, j, job,
                                        failed, drops)
                    totals[j] += source.weight * value
                    values.setdefault(source.name, []).append(value)
                continue
            gold = source is self.gold
            value = self._value(outcome(future), "gold" if gold else source.name, i, job, failed, drops, gold=gold)
            if gold:
                job.finals[i].gold_reward = value
                continue
            self._add(job, totals, i, turn, source.weight * value)
            values.setdefault(source.name, []).append(value)
        unparsed = Counter()
        for (judge, i, turn), answers in job.answers.items():
            scores = [score for score, _ in answers if score is not None]
            if not scores:
                unparsed[judge.name] += 1
                if judge.name not in self.warned:
                    self.warned.add(judge.name)
                    self.log.warning("judge %s's answer to sample %s does not parse (%s): %r; it counts 0%s "
                                     "(said once)", judge.name, job.finals[i].sample_id, judge.config.model,
                                     answers[0][1][:300], " and its group is dropped"
                                     if judge.config.on_unparsed == "drop_group" else "")
                if judge.config.on_unparsed == "drop_group":
                    drops.setdefault(i, "judge_unparsed")
            value = float(np.mean(scores)) if scores else 0.0
            self._add(job, totals, i, turn, judge.weight * value)
            values.setdefault(f"judge:{judge.name}", []).append(value)  # its own word: a name is the user's
        for sample, total in zip(job.finals, totals):
            sample.reward = float(total)
        if drops:  # the field travels for every sample of the message, or for none
            for sample in job.samples:
                sample.drop_reason = ""
            for i, reason in drops.items():
                job.finals[i].drop_reason = reason
        parts.update({name: float(np.mean(v)) for name, v in values.items()})
        parts["reward_failed"] = sum(failed.values())
        parts.update({f"reward_failed:{name}:{error}": count for (name, error), count in failed.items()})
        if self.judges is not None:
            parts["judge_unparsed"] = sum(unparsed.values())
            parts.update({f"judge_unparsed:{judge.name}": unparsed[judge.name] for judge in self.judges.judges})
        return parts

    def close(self) -> None:
        if self.judges is not None:
            self.judges.close()
        self.calls.close(self.remote)

    def _at_once(self, finals: list[Sample], arguments: list[dict]) -> tuple[np.ndarray, dict[str, float]]:
        """What of the finals' score is computed here and now: the reward model's and the overlong
        shaping (in ``Job.totals``), with their means."""
        from scorer.scoring import overlong_penalty, reward_model_tokens, reward_scores, reward_scores_of_tokens

        totals = np.zeros(len(finals), dtype=np.float64)
        parts: dict[str, float] = {}
        if self.reward_model is not None and finals:
            if self.rm_tokenizer is None:
                rm = reward_scores(self.reward_model, finals, self.pad_token_id, self.rm_processor, self.packing,
                                   self.max_tokens)
            else:
                rows = [reward_model_tokens(a["sequence"], self._conversation(a), self.rm_tokenizer, self.rm_max_tokens)
                        for a in arguments]
                rm = reward_scores_of_tokens(self.reward_model, rows)
            totals += rm.double().numpy()
            parts["rm_score"] = float(rm.mean())
        if self.overlong is not None and finals:  # on the policy's own tokens: an episode's observations do not count
            lengths = torch.tensor([len(s.response_tokens) if s.loss_mask is None else int(s.loss_mask.sum())
                                    for s in finals])
            penalties = overlong_penalty(lengths, *self.overlong).numpy()
            totals += penalties
            parts.update(overlong_penalty=float(penalties.mean()), overlong_frac=float((penalties < 0).mean()))
        return totals, parts

    @staticmethod
    def _targets(job: Job, per_turn: bool) -> list[tuple[int, int | None]]:
        """(final's index, turn's number or None for the outcome) of each value a per-turn or
        whole-sample scorer gives."""
        if not per_turn:
            return [(i, None) for i in range(len(job.finals))]
        return [(i, number) for i, turns in enumerate(job.turns) for number in range(len(turns))]

    def _turn_arguments(self, job: Job, i: int, number: int | None) -> dict:
        """A final's arguments, or for its turn ``number``: the conversation up to that turn, the
        turn as the response. The turns are the loss mask's runs of policy tokens, the
        conversation's last assistant messages, one each."""
        arguments = job.arguments[i]
        if number is None:
            return arguments
        turns = job.turns[i]
        start, stop = turns[number]
        tokens = job.finals[i].response_tokens[start:stop].tolist()
        messages = arguments["messages"]
        if messages is not None:
            spoken = [k for k, message in enumerate(messages) if message.get("role") == "assistant"]
            if len(spoken) < len(turns):
                return {**arguments, "unmatched": f"{len(turns)} turns and {len(spoken)} assistant messages"}
            messages = messages[:spoken[len(spoken) - len(turns) + number] + 1]
        return {**arguments, "response": self.tokenizer.decode(tokens, skip_special_tokens=True),
                "response_tokens": tokens, "messages": messages}

    def _ask(self, job: Job, judge: Judge) -> None:
        """``judge``'s questions about ``job``'s finals: one a sample, a turn, or pairwise, one for
        each other response of its group in the request (a group alone counts 0.5: no one to beat)."""
        special = set(judge.tokenizer.all_special_ids)
        for i, turn in self._targets(job, judge.per_turn):
            key = (judge, i, turn)
            job.answers[key] = []
            variables = self._turn_arguments(job, i, turn)
            if "unmatched" in variables:
                job.answers[key].append((None, variables["unmatched"]))
                continue
            others = [j for j, other in enumerate(job.finals)
                      if judge.pairwise and j != i and other.prompt_index == job.finals[i].prompt_index]
            if judge.pairwise and not others:
                job.answers[key].append((0.5, ""))
            single = judge.same_tokens and job.finals[i].messages is None and turn is None
            ids = [t for t in job.finals[i].response_tokens.tolist() if t not in special] if single else None
            for other in others if judge.pairwise else [None]:
                fields = dict(variables) if other is None else {**variables, "other": job.arguments[other]["response"]}
                try:
                    question = judge.question(fields, ids)
                except Exception as error:  # the template over this sample: unrenderable, as an answer unparsed
                    job.answers[key].append((None, f"the template does not render: {type(error).__name__}: {error}"))
                    continue
                job.questions += 1
                self.judges.ask(Question(job, judge, i, turn, other), question)

    def _answered(self, question: Question, score: float | None, answer: str) -> None:
        job = question.job
        job.answers[(question.judge, question.sample, question.turn)].append((score, answer))
        job.questions -= 1

    def _value(self, result: Any, name: str, i: int, job: Job, failed: Counter, drops: dict[int, str],
               gold: bool = False) -> float:
        """A reward call's number, or for a failed one 0, counted and logged (its first traceback
        once), and under drop_group its sample's group is dropped (never for the gold reward, which
        is not trained on)."""
        if not isinstance(result, Failed):
            try:
                return finite(result)
            except Exception as error:
                result = Failed(type(error).__name__, str(error))
        failed[(name, result.error)] += 1
        if name not in self.warned:
            self.warned.add(name)
            self.log.warning("reward %s failed on sample %s (response %r): %s: %s; it counts 0%s (the first failure "
                             "of it, said once)", name, job.finals[i].sample_id, job.arguments[i]["response"][:200],
                             result.error, result.text, " and its group is dropped"
                             if self.on_failure == "drop_group" and not gold else "",
                             exc_info=result.exception)
        if self.on_failure == "drop_group" and not gold:
            drops.setdefault(i, "reward_failed")
        return 0.0

    @staticmethod
    def _add(job: Job, totals: np.ndarray, i: int, turn: int | None, value: float) -> None:
        """``value`` into final ``i``'s score, or as a turn reward on the last token of its turn
        ``turn``."""
        if turn is None:
            totals[i] += value
            return
        sample = job.finals[i]
        if sample.turn_rewards is None:
            sample.turn_rewards = np.zeros(len(sample.response_tokens), dtype=np.float32)
        elif not sample.turn_rewards.flags.writeable:  # a view into the received message
            sample.turn_rewards = sample.turn_rewards.copy()
        sample.turn_rewards[job.turns[i][turn][1] - 1] += value

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
    scorer = Scorer(config, log, worker_index)
    timeline.phase("model load")
    metrics = metrics_writer(config, f"scorer{worker_index}")
    client = connect_to_buffer(config, "scorer", str(worker_index))
    timeline.phase("buffer connect")
    log.info("scoring with reference %s on %s; %s", config.reference_path, scorer.device, scorer.describe())
    work = Work(client, scorer, metrics, config.scorer)
    try:
        while work.jobs or not work.stopping:
            work.ask()
            work.take()
            scorer.advance(timeout=0.0 if work.asked is not None else POLL_S)
            work.send_done()
    except Exception as error:  # the samples it holds are scored by another now, not after scorer.deadline_s
        client.goodbye(error)
        raise
    finally:
        scorer.close()
    log.info("stopping after %d scored samples", work.scored_total)
    metrics.close()
    client.close()


class Work:
    """The score requests of one scorer: the one asked of the buffer and not answered, the jobs
    under way (at most ``scorer.requests_in_flight``), and the metrics of those sent back. A
    period runs from one record to the next, so the periods tile the run; ``busy_s`` is the time
    in it with a job under way (a judge's, a reward call's time is the scorer's)."""

    def __init__(self, client, scorer: Scorer, metrics, config) -> None:
        self.client, self.scorer, self.metrics, self.config = client, scorer, metrics, config
        self.jobs: list[Job] = []
        self.asked: int | None = None
        self.stopping = False
        self.scored_total = 0
        self.period_started = self.ticked = time.monotonic()
        self.busy_s = 0.0

    def ask(self) -> None:
        if self.asked is None and not self.stopping and len(self.jobs) < self.config.requests_in_flight:
            self.asked = self.client.send("score_request", {"max_samples": self.config.max_samples_per_request})

    def take(self) -> None:
        """The buffer's answer, if it came: waited for while there is nothing else to do."""
        if self.asked is None:
            return
        if self.jobs:  # while the judges have nothing to step, the wait for the buffer is the loop's pause
            answer = self.client.reply_to(self.asked, "score_request", 0.0 if self.scorer.busy else POLL_S)
        else:
            answer = self.client.wait(self.asked, waiting_for="samples to score")
        if answer is None:
            return
        self.asked = None
        if answer.fields["stop"]:  # the run is over: what is still being scored would never be trained
            self.stopping = True
            if self.jobs:
                self.scorer.log.info("the run is over: %d samples still being scored are left",
                                     sum(len(job.samples) for job in self.jobs))
                self.jobs.clear()
            return
        self._tick()
        self.jobs.append(self.scorer.begin(unpack_samples(answer)))

    def send_done(self) -> None:
        self._tick()
        for job in [job for job in self.jobs if job.done]:
            self.jobs.remove(job)
            parts = self.scorer.finish(job)
            sent = time.monotonic()
            self.client.request("scored", *pack_samples(job.samples, scored=True))
            self.scored_total += len(job.samples)
            tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in job.samples)
            now = time.monotonic()
            busy_s, period_s = self.busy_s, now - self.period_started
            # two jobs done at once: the second's period is its send alone, with no busy time of its own
            rate = {"tokens_per_s": tokens / busy_s} if busy_s > 0 else {}
            self.metrics.write({**self.client.counters, "scored": len(job.samples), "scored_total": self.scored_total,
                                "busy_s": busy_s, "waiting_s": max(0.0, period_s - busy_s - (now - sent)),
                                "tokens": tokens, **rate, "send_s": now - sent,
                                "iteration_s": period_s, "in_flight": len(self.jobs),
                                # the newest weights that generated what it scored: the dashboard's x
                                "policy_version": max(s.last_behavior_version for s in job.samples), **parts})
            self.period_started = self.ticked = now
            self.busy_s = 0.0

    def _tick(self) -> None:
        now = time.monotonic()
        if self.jobs:
            self.busy_s += now - self.ticked
        self.ticked = now
