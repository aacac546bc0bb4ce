"""tether's one config: typed, validated, one file (YAML or TOML), every field overridable.

``load_config(path, ["learner.batch_size=32", ...])`` returns a ``TetherConfig`` or raises
``ConfigError`` naming the offending key. Names here are the names on the wire and in metrics.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ROLES = ("buffer", "rollout", "scorer", "learner")
COLOCATED_ROLES = ("rollout", "scorer", "learner")  # placement.mode colocate: the roles that work in shifts


class ConfigError(ValueError):
    """A config that tether refuses; the text names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelsConfig(_Strict):
    """The models: the SFT policy (the actor starts from it), the frozen reference and reward model."""
    policy: str = Field(description="the SFT policy, the actor's start: a HF model directory or hub id (any causal LM "
                                    "family both transformers and vLLM support)")
    reference: str | None = Field(None, description="frozen reference for the KL tether; default: policy")
    reward: str | None = Field(None, description="reward model: a sequence-classification model with one label "
                                                 "(directory or hub id), with its own tokenizer if it has one; "
                                                 "None: train on scorer.reward_functions alone")
    teacher: str | None = Field(None, description="on-policy distillation (learner.distill_coef): a model of the "
                                                  "policy's tokenizer whose logprobs of the policy's own tokens, from "
                                                  "the scorer, reward each token; None: no teacher")
    critic_init: Literal["auto", "reward", "policy"] = Field(
        "auto", description="initialise the critic's body from; auto: the reward model when there is one and it "
                            "reads the policy's tokens, else the policy")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the learner's and the scorer's models (DeepSpeed keeps fp32 master weights); "
                               "logprobs, values and losses are computed in fp32 either way. The rollout's engine "
                               "has its own, rollout.dtype")


class SamplingConfig(_Strict):
    """The distribution the rollout samples from, one value that every role reads: vLLM samples from it,
    the learner's logprobs and entropy are of it (common.distributions), the reference's logprobs
    are of its temperature alone, and the evaluator samples from it too."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, gt=0, description="logits are divided by it before sampling")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of likeliest tokens "
                                                    "holding this much probability; 1: all")
    top_k: int = Field(0, ge=0, description="sample from the k likeliest tokens; 0: all")
    banned_tokens: tuple[int, ...] = Field(
        (), description="token ids never sampled (vLLM's bad words; special tokens); the learner's logprobs leave them "
                        "out too. A policy that sees images has its image placeholder added: sampled, it would be an "
                        "image slot to the model's forward and text to vLLM")

    @field_validator("banned_tokens")
    @classmethod
    def _token_ids(cls, banned: tuple[int, ...]) -> tuple[int, ...]:
        if any(token < 0 for token in banned):
            raise ValueError(f"token ids are >= 0, got {list(banned)}")
        return tuple(sorted(set(banned)))

    def banning(self, tokens) -> "SamplingConfig":
        """The same distribution with ``tokens`` (ids) never sampled too."""
        return self.model_copy(update={"banned_tokens": tuple(sorted({*self.banned_tokens, *tokens}))})

    def without_truncation(self) -> "SamplingConfig":
        """The same temperature and banned tokens, no top-k / top-p: the reference's distribution,
        since the KL tether is to the whole SFT distribution (truncated, a token outside the
        reference's nucleus would make it infinite). Its banned tokens stay out: no response holds
        one, and with them in the KL of the SFT policy to itself would be -log(1 - their mass), not 0."""
        return SamplingConfig(temperature=self.temperature, banned_tokens=self.banned_tokens)


class DataConfig(_Strict):
    """The prompts generated from, and PPO-ptx text."""
    prompts: str = Field(description='JSON-lines (.jsonl, .json) or Parquet (.parquet) file; each row has "prompt" '
                                     '(text, tokenized as is) or "messages" (a chat, rendered by the policy '
                                     "tokenizer's chat template with the generation prompt); or \"verifiers:<id>\": "
                                     "a verifiers environment's dataset (common/verifiers_data.py)")
    system_prompt: str | None = Field(None, description="system message put first in every chat that has none")
    ptx: str | None = Field(None, description='PPO-ptx text (learner.ptx_coef): JSON lines or Parquet of {"text": ...}')


class RewardFunctionConfig(_Strict):
    """One entry of ``scorer.reward_functions``: what to load, and its weight (loaded:
    ``scorer.rewards.RewardFunction``)."""
    function: str = Field(description='"module:function" returning a float; called with the keywords it names of '
                                      "prompt, response (text), prompt_tokens, response_tokens (ids), row (the "
                                      "prompt's data row)")
    weight: float = Field(1.0, description="its share of the trained score: score = RM + sum(weight * value)")
    per_turn: bool = Field(False, description="score each assistant turn of an episode, given the conversation up "
                                              "to it: a turn reward on the turn's last policy token")


MAX_VERDICTS = 20  # vLLM's default max_logprobs: a judge reads each verdict's logprob


class JudgeConfig(_Strict):
    """One entry of ``scorer.judges``: an LLM that reads the sample through a prompt of the user's and
    answers with a verdict or a score, generated by a vLLM engine in the scorer (``scorer.judges``)."""
    model: str = Field(description="the judge: a HF model directory or hub id vLLM serves")
    prompt: str = Field(description="a Jinja template of the question, over prompt, response, messages (the "
                                    "conversation), row (the data row; its fields also by name) and, pairwise, "
                                    "other (the response compared with); rendered as the user's turn of the "
                                    "judge's own chat template")
    name: str | None = Field(None, description="its name in metrics and logs; default judge<i>")
    weight: float = Field(1.0, description="its share of the trained score: score = RM + sum(weight * value)")
    verdict: list[str] | None = Field(None, min_length=2, description='["Yes", "No"]: the score is the first '
                                      "verdict's probability at the first generated position, normalised over "
                                      "the verdicts (each a single token of the judge's tokenizer)")
    pattern: str | None = Field(None, description="a regular expression with a group: the score is the group's "
                                                  "number, parsed from the generated text (the last match)")
    range: tuple[float, float] | None = Field(None, description="with pattern: [low, high] of the parsed number, "
                                              "mapped to [0, 1]; outside it, unparsed")
    max_tokens: int = Field(256, ge=1, description="with pattern: the most tokens the judge generates (room to "
                                                   "reason before its score)")
    temperature: float = Field(0.0, ge=0, description="with pattern: the judge's sampling temperature")
    mode: Literal["single", "pairwise"] = Field("single", description="pairwise: each response is compared with "
                                                "every other of its group (the template's other); its score is its "
                                                "win rate")
    per_turn: bool = Field(False, description="score each assistant turn of an episode, given the conversation up "
                                              "to it: a turn reward on the turn's last policy token")
    on_unparsed: Literal["zero", "drop_group"] = Field("zero", description="an answer that does not parse: the "
                                                       "sample's score is 0, or its whole group is not trained")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the dtype vLLM runs it in")
    max_model_len: int | None = Field(None, ge=8, description="most tokens of question + answer; longer "
                                      "questions keep their end; None: the model's")
    kv_cache_gib: float = Field(0.25, gt=0, description="its KV cache on the CPU, GiB")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="its share of the scorer's GPU")

    @model_validator(mode="after")
    def _one_reading(self) -> "JudgeConfig":
        if (self.verdict is None) == (self.pattern is None):
            raise ValueError("a judge reads its answer by verdict or by pattern: give one of them")
        if self.verdict is not None and len(set(self.verdict)) < len(self.verdict):
            raise ValueError(f"verdict: {self.verdict} names a verdict twice")
        if self.verdict is not None and len(self.verdict) > MAX_VERDICTS:
            raise ValueError(f"verdict: {len(self.verdict)} verdicts; vLLM gives the logprobs of at most "
                             f"{MAX_VERDICTS} tokens")
        answer = self.max_tokens if self.pattern is not None else 1
        if self.max_model_len is not None and self.max_model_len <= answer:
            raise ValueError(f"max_model_len ({self.max_model_len}) leaves no room for the question beside the "
                             f"answer's {answer} tokens (max_tokens)")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as error:
                raise ValueError(f"pattern: {self.pattern!r} is not a regular expression: {error}") from None
            if groups < 1:
                raise ValueError(f"pattern: {self.pattern!r} has no group: put the score in (...)")
            if self.range is None or not self.range[0] < self.range[1]:
                raise ValueError("range: a pattern needs [low, high] with low < high, the scale of its score")
        elif self.range is not None:
            raise ValueError("range: only with pattern (a verdict's score is a probability)")
        return self


class RolloutConfig(_Strict):
    """The vLLM engines that generate: how many, how they run, how long responses may be."""
    engines: int = Field(1, ge=1, description="rollout processes (vLLM engines) in the pool")
    max_weight_load_failures: int = Field(5, ge=1, description="loads of the learner's weights failed in a row "
                                                               "before the rollout stops the run with the "
                                                               "loader's error")
    deadline_s: float = Field(600.0, gt=0, description="an engine that holds credits and sends nothing this long "
                                                       "is taken for dead: its prompts go to the others")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism inside each engine")
    samples_per_prompt: int = Field(1, ge=1, description="responses sampled per prompt (vLLM's n)")
    prompts_per_generate: int = Field(64, ge=1, description="most prompts generating at once in one engine")
    max_new_tokens: int = Field(32, ge=1, description="most tokens generated per response (vLLM's max_tokens)")
    ignore_eos: bool = Field(False, description="generate max_new_tokens always (benchmarks)")
    max_model_len: int | None = Field(None, ge=8, description="most tokens of prompt + response; longer prompts "
                                      "are skipped and counted. None: as many as the policy's positions allow "
                                      "(its config.json), on CPU at most what rollout.kv_cache_gib holds; a value "
                                      "over either is refused at load")
    kv_cache_gib: float = Field(1.0, gt=0, description="CPU KV cache, GiB (vLLM's kv_cache_memory_bytes; "
                                                       "allocating it is part of the engine's start-up)")
    in_process: bool | None = Field(None, description="run vLLM's engine inside the rollout process "
                                                      "(VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM is imported once, "
                                                      "not three times); None: in-process on CPU at "
                                                      "tensor_parallel_size 1, vLLM's own processes on GPUs")
    enforce_eager: bool | None = Field(None, description="no CUDA graphs and no torch.compile in vLLM; None: "
                                                         "eager on CPU, graphs on GPUs (much of vLLM's speed "
                                                         "there, at a longer start-up)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU share for vLLM (GPU only)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the dtype vLLM's engine "
                                                             "runs the policy in (the learner's is models.dtype)")
    environment: str | None = Field(None, description='"module:function" called with a prompt\'s data row, '
                                    "returning its episode's environment (reset() -> first messages, step(response, "
                                    "messages) -> Step(observation, reward, done)); or \"openenv:<url>\": an OpenEnv "
                                    "server's episodes, a session each (environments/openenv.py); or \"verifiers:<id>\": "
                                    "a verifiers environment's rollouts and rubric through the rollout's endpoint "
                                    "(common/verifiers_data.py); None: single responses, or episodes of tool calls "
                                    "alone when rollout.tools is set")
    environment_args: dict[str, Any] = Field(default_factory=dict, description="rollout.environment verifiers:<id>: "
                                             "its load_environment's keywords")
    tools: list[str] = Field(default_factory=list, description='"module:function" tools: their JSON schemas go to '
                             "the chat template, a call in a turn (read by rollout.tool_parser) calls them, each "
                             "result is a tool message")
    agent: str | None = Field(None, description='"module:function": an agent program, run(client, row) -> reward '
                              "(async or not), whose client is an OpenAI client pointed at the rollout's endpoint: "
                              "each of its chat-completions calls is a turn of its episode (environments/agents.py); "
                              "instead of rollout.environment and rollout.tools")
    agent_command: list[str] = Field(default_factory=list, description="an agent program in a process of its own "
                                     "(any language), started per episode with OPENAI_BASE_URL and OPENAI_API_KEY "
                                     "(the episode's key) in its environment and the row as a JSON line on stdin; "
                                     "it prints its reward last on stdout (a number or {\"reward\": ...}); instead "
                                     "of rollout.agent")
    agent_processes: int = Field(0, ge=0, description="rollout.agent: run the programs in this many processes of "
                                 "their own, each serving many episodes at once (an async program's calls come over "
                                 "the process's connection, a plain function's through 127.0.0.1), on "
                                 "placement.cores.agent (the openai client's work off the engine's core); 0: in "
                                 "threads of the rollout's process")
    agent_deadline_s: float = Field(600.0, gt=0, description="rollout.agent: an episode's program that has not "
                                    "returned this long after it started ends (env_deadline); each wait for its "
                                    "next call is also bounded by env_step_deadline_s")
    tool_parser: str = Field("hermes", description="vLLM's tool-call parser for the policy's family, the names "
                             "`vllm serve --tool-call-parser` takes: hermes (<tool_call> JSON: Hermes, Qwen), "
                             "llama3_json, mistral, pythonic, qwen3_coder, ...")
    reasoning_parser: str | None = Field(None, description="vLLM's reasoning parser for the policy's family, the "
                                         "names `vllm serve --reasoning-parser` takes (qwen3, deepseek_r1, mistral, "
                                         "...): a turn's reasoning is set apart before its tool calls are read in "
                                         "the content, and an agent program's reply carries it as `reasoning`")
    max_turns: int = Field(4, ge=1, description="most policy turns in an episode")
    max_images_per_episode: int = Field(4, ge=1, description="a policy that sees images: most images an episode may "
                                        "show (its prompt's and its observations'), vLLM's limit_mm_per_prompt; an "
                                        "observation past it ends its episode (env_error)")
    env_step_deadline_s: float = Field(30.0, gt=0, description="an environment that takes longer to make, reset or "
                                       "answer a turn ends its episode (env_deadline); an agent program: to make "
                                       "its next call or return")
    failed_episode_reward: float | None = Field(None, description="an episode its environment ended (env_error, "
                                                "env_deadline: a step or an agent program that raised, hung or "
                                                "returned what is not a reward) is trained at this reward on its "
                                                "last token; None: its group is dropped (its credits returned), "
                                                "never trained")
    env_failure_limit: int = Field(100, ge=1, description="this many episodes in a row ended by their environment "
                                   "(env_error, env_deadline) with none ending well between them end the run (exit "
                                   "code 4, the first failure in the log): an environment that fails every episode "
                                   "is a bug to fix, not a run to keep going")

    @model_validator(mode="after")
    def _one_source_of_episodes(self) -> "RolloutConfig":
        if self.agent and self.agent_command:
            raise ValueError("rollout.agent and rollout.agent_command each name the agent program: set one")
        if self.agent_processes and not self.agent:
            raise ValueError("rollout.agent_processes runs rollout.agent's programs (an agent_command is a process "
                             "of its own already): set rollout.agent with it, or leave it 0")
        verifiers = bool(self.environment and self.environment.startswith("verifiers:"))
        if self.environment_args and not verifiers:
            raise ValueError("rollout.environment_args are a verifiers environment's load_environment keywords: set "
                             "rollout.environment verifiers:<id> with them, or leave them unset")
        if verifiers and self.tools:
            raise ValueError("rollout.tools: a verifiers environment brings its own tools; leave rollout.tools unset "
                             "with rollout.environment verifiers:<id>")
        if (self.agent or self.agent_command) and (self.environment or self.tools):
            key = "rollout.agent" if self.agent else "rollout.agent_command"
            raise ValueError(f"{key} runs its own tools and conversation: leave rollout.environment and "
                             "rollout.tools unset with it")
        return self

    @property
    def episodes(self) -> bool:
        """A prompt is an episode of turns (an environment, tools or an agent program), not one response."""
        return bool(self.environment or self.tools or self.agent or self.agent_command)


class ScorerConfig(_Strict):
    """The scorers: reference logprobs, the reward model, reward functions."""
    workers: int = Field(1, ge=1, description="scorer processes in the pool")
    max_samples_per_request: int = Field(64, ge=1, description="most samples a scorer takes to score at once")
    deadline_s: float = Field(120.0, gt=0, description="a scorer that holds samples longer loses them to another")
    reward_functions: list[RewardFunctionConfig] = Field(default_factory=list, description="rule-based / verifiable "
                                                   "rewards that are trained on, added to the reward model's score")
    gold_reward: str | None = Field(None, description='"module:function" like a reward function: reported as '
                                                       "gold_reward, never trained on")
    judges: list[JudgeConfig] = Field(default_factory=list, description="LLM judges, each on a vLLM engine in "
                                      "every scorer: their weighted scores are added to the trained score")
    reward_url: str | None = Field(None, description="an HTTP reward service: POSTed each request's samples "
                                   '({"samples": [{prompt, response, messages, row}], and OpenRLHF\'s query, '
                                   'prompts, labels}), it answers {"rewards": [...]}')
    reward_url_weight: float = Field(1.0, description="scorer.reward_url's share of the trained score")
    reward_concurrency: int = Field(32, ge=1, description="reward calls (functions, reward_url requests) a scorer "
                                                          "runs at once")
    reward_deadline_s: float = Field(60.0, gt=0, description="a reward call that has not answered this long "
                                                             "(retries included) failed")
    on_reward_failure: Literal["zero", "drop_group"] = Field("zero", description="a reward call that raised, "
                                                             "passed its deadline or answered no number: the "
                                                             "sample's value is 0, or its whole group is not "
                                                             "trained")
    requests_in_flight: int = Field(2, ge=1, description="score requests a scorer works on at once: it asks for "
                                                         "more while its judges and reward calls answer")
    packing: Literal["none", "pack", "tree"] = Field(
        "tree", description="how the reference, teacher and reward-model passes lay out their rows, as "
                            "learner.packing does")
    max_tokens_per_pass: int = Field(4096, ge=1, description="tokens (padded, or packed) a forward pass of the "
                                     "reference, teacher or reward model computes at most; a longer row goes "
                                     "alone")
    overlong_buffer: int | None = Field(None, ge=1, description="DAPO's overlong shaping: a response longer than "
                                        "overlong_max_length - overlong_buffer policy tokens loses up to "
                                        "overlong_penalty, linearly, all of it at the limit and past it; None: off")
    overlong_penalty: float = Field(1.0, gt=0, description="the most the overlong shaping takes from a reward")
    overlong_max_length: int | None = Field(None, ge=1, description="the length the overlong shaping counts to; "
                                            "default rollout.max_new_tokens (x rollout.max_turns for episodes: "
                                            "their policy tokens over every turn)")


class AutoStalenessConfig(_Strict):
    """``buffer.max_staleness: auto``: where k may go and the off-policy health that moves it."""
    min: int = Field(0, ge=0, description="the lowest k (it starts at 1, within min and max)")
    max: int = Field(4, ge=0, description="the highest k")
    ess_min: float = Field(0.9, gt=0, le=1, description="the effective sample size of the batch's importance weights "
                           "pi_prox / pi_behavior, as a share of its tokens, at least")
    truncated_max: float = Field(0.02, ge=0, le=1, description="the share of tokens whose weight "
                                 "learner.behavior_weight_cap truncates, at most")
    kl_max: float = Field(0.05, gt=0, description="KL(behavior || proximal) per token, at most")
    raise_after: int = Field(3, ge=1, description="steps at a k whose mean health is within the targets before k "
                             "is raised: doubled until the first fall, by one after (and the most a mean is taken over)")

    @model_validator(mode="after")
    def _order(self) -> "AutoStalenessConfig":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class BufferConfig(_Strict):
    """The buffer between the roles: the staleness bound it keeps, fixed or tuned as the run goes."""
    max_staleness: int | Literal["auto"] = Field(1, description="k: train at version v only on samples of version "
                                                 ">= v - k; auto: k between auto_staleness.min and .max, raised "
                                                 "while the off-policy health the learner measures stays within "
                                                 "auto_staleness's targets (a mean over a few steps; doubled until "
                                                 "the first fall, by one after), halved when it does not")
    auto_staleness: AutoStalenessConfig = Field(default_factory=AutoStalenessConfig,
                                                description="max_staleness: auto's range and targets")
    stall_warn_s: float = Field(60.0, gt=0, description="name a role that owes the buffer work and is silent this long")
    filter_groups: bool = Field(False, description="DAPO's dynamic sampling: a group whose outcome rewards are all "
                                "equal (no advantage) is dropped before it is trained on, its credits returned, and "
                                "more prompts are generated in its place")
    max_filter_ratio: float = Field(1.0, gt=0, description="filter_groups drops at most this x learner.batch_size "
                                    "samples between two batches; past it groups go out as they are, with a warning")

    @property
    def initial_staleness(self) -> int:
        """The k the run starts with: under auto, 1 (the fixed default) within auto's range, so a
        run does not begin synchronous and climb."""
        if self.max_staleness == "auto":
            return min(max(self.auto_staleness.min, 1), self.auto_staleness.max)
        return self.max_staleness

    @property
    def staleness_ceiling(self) -> int:
        """The highest k the run can have."""
        return self.auto_staleness.max if self.max_staleness == "auto" else self.max_staleness


class LearnerConfig(_Strict):
    """The DeepSpeed learner: PPO, its optimizer, its ranks and checkpoints."""
    total_steps: int = Field(20, ge=1, description="learner steps (policy versions) to train")
    batch_size: int = Field(64, ge=1, description="samples per learner step")
    minibatch_size: int = Field(16, ge=1, description="samples per optimizer step")
    micro_batch_size: int | None = Field(None, ge=1, description="samples per forward/backward pass on each rank "
                                                                 "at most, gradients accumulated over the "
                                                                 "minibatch; default: minibatch_size / ranks")
    max_tokens_per_microbatch: int | None = Field(
        None, ge=1, description="tokens a forward/backward pass computes on each rank: padded (rows x longest "
                                "prompt + response; rows of like length go together, each pass trimmed to its "
                                "longest row), or packed (learner.packing). None: micro_batch_size rows a pass")
    packing: Literal["none", "pack", "tree"] = Field(
        "tree", description="how a pass lays out its rows: none (each padded to the longest), pack (one after "
                            "another, no padding) or tree (rows that begin alike share one copy of that prefix: "
                            "a prompt's responses, an episode's parts); the same logprobs, values and steps. A "
                            "family that cannot take it falls back to none with a line saying why")
    ppo_epochs: int = Field(2, ge=1, description="passes over each batch, all within one step")
    actor_lr: float = Field(1e-4, gt=0, description="the policy's learning rate (AdamW), before lr_schedule")
    critic_lr: float = Field(1e-4, gt=0, description="the critic's learning rate (AdamW), before lr_schedule")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="after the warm-up, decay "
                                                                 "to lr_min_ratio x the rate at the last step")
    lr_warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up from 1/N of the rate")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="the rate at the end of a linear or cosine decay, "
                                                              "as a share of actor_lr / critic_lr")
    train_vision_tower: bool = Field(False, description="a policy that sees images: train its vision tower too (by "
                                     "default it stays as the SFT model has it; the language model and the "
                                     "connector train)")
    lora_rank: int = Field(0, ge=0, description="LoRA adapters of this rank on actor and critic (peft), only they "
                                                "train; 0: full fine-tuning")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scaling: alpha / rank")
    lora_target_modules: list[str] = Field(["all-linear"], description='module names to adapt; ["all-linear"]: '
                                                                       "every linear layer but the output head")
    lora_sync: Literal["auto", "adapters", "merged"] = Field("auto", description="with lora_rank, what a policy "
                                                             "version moves: adapters (vLLM applies them to the base "
                                                             "weights), merged (the whole model); auto: adapters "
                                                             "where vLLM's model of the family takes LoRA")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass: less "
                                                            "memory, about a third more compute")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay, actor and critic")
    grad_clip: float = Field(1.0, gt=0, description="gradients are clipped to this global norm (DeepSpeed's "
                                                   "gradient_clipping)")
    max_skipped_steps: int = Field(5, ge=1, description="optimizer steps with NaN or inf gradients are skipped; "
                                                        "this many in a row stop the learner (exit 3) with the "
                                                        "last good weights saved")
    clip_eps: float = Field(0.2, gt=0, description="PPO's clip range: the ratio pi / pi_old is clipped to "
                                                  "[1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: float | None = Field(None, gt=0, description="DAPO clip-higher; default clip_eps")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip PPO (Ye et al. 2020): with a negative "
                                                            "advantage the loss is at most dual_clip x |A|; None: off")
    value_clip: float | None = Field(0.2, gt=0, description="None for an unclipped value loss")
    value_targets: Literal["gae", "vtrace"] = Field("gae", description="the critic's targets: gae, GAE's returns; "
                                                    "vtrace, V-trace's (Espeholt et al. 2018), corrected for samples "
                                                    "of an older policy by truncated importance weights (the same "
                                                    "at max_staleness 0)")
    vtrace_rho_clip: float = Field(1.0, gt=0, description="V-trace's rho-bar: the importance weight on each "
                                                          "token's TD error is at most this")
    vtrace_c_clip: float = Field(1.0, gt=0, description="V-trace's c-bar: the trace's weight per token is lam x at "
                                                        "most this")
    value_loss_coef: float = Field(1.0, gt=0, description="the critic's loss is scaled by this")
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = Field(
        "gae", description="gae: a critic (PPO); grpo / rloo: each response against the other responses to its "
                           "prompt (rollout.samples_per_prompt >= 2); reinforce_pp: reward-to-go whitened over the "
                           "batch. Only gae builds and trains a critic")
    kl_in: Literal["reward", "loss"] = Field(
        "reward", description="where the KL tether enters: reward: -kl_coef * KL per token in the rewards "
                              "(InstructGPT); loss: kl_coef * KL (kl_estimator) added to the policy loss (GRPO)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: the policy loss minus this x entropy")
    ptx_coef: float = Field(0.0, ge=0, description="PPO-ptx: this x the language-modelling loss on data.ptx is added "
                                                   "to the policy loss")
    ptx_batch_size: int | None = Field(None, ge=1, description="data.ptx sequences per optimizer step; default: "
                                                               "minibatch_size")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda: 0 is one-step TD, 1 the Monte-Carlo return")
    kl_coef: float = Field(0.05, ge=0, description="beta, the strength of the tether")
    distill_coef: float = Field(1.0, ge=0, description="with models.teacher: each policy token's reward gains "
                                "-distill_coef x (log pi_old - log pi_teacher), the reverse KL to the teacher on the "
                                "token sampled (GKD, on-policy distillation)")
    distill_only: bool = Field(False, description="pure on-policy distillation: each token's advantage is "
                               "-distill_coef x its reverse KL to the teacher, not discounted across tokens; no "
                               "score, reward model, reward function or critic")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="fixed: kl_coef throughout; "
                                                        "adaptive: kl_coef moved toward kl_target (Ziegler et al. 2019)")
    kl_target: float = Field(6.0, gt=0, description="the KL per response the adaptive controller aims at")
    kl_horizon: float = Field(10000.0, gt=0, description="samples over which the adaptive controller moves "
                                                       "kl_coef by at most 20%")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="the per-token KL estimate (Schulman 2020): "
                                                    "k1 log(pi/pi_ref), k2 half its square, k3 pi_ref/pi - 1 - log(pi_ref/pi)")
    behavior_weight_cap: float | None = Field(2.0, gt=0, description="the highest importance weight pi_prox / "
                                              "pi_behavior: truncated to it, or masked above it "
                                              "(behavior_correction); None: no cap")
    behavior_weight_floor: float | None = Field(None, ge=0, description="behavior_correction mask: weights under "
                                                "this are masked too (IcePop's two-sided mask); None: one-sided")
    behavior_correction: Literal["truncate", "mask"] = Field(
        "truncate", description="what happens to an importance weight past behavior_weight_cap: truncate, cut to "
                                "it (truncated IS); mask, its token (or sequence) gets weight 0 (MIS, IcePop)")
    behavior_correction_level: Literal["token", "sequence"] = Field(
        "token", description="the weight corrected: each token's, or its sequence's product of them (every token of "
                             "a sequence then shares its fate)")
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="PPO's ratio pi / pi_old: per token, or GSPO's per sequence (the geometric mean of "
                             "its token ratios, clipped per sequence; GSPO-token's gradient per token). GSPO clips "
                             "much tighter than PPO: its paper uses clip_eps 3e-4, clip_eps_high 4e-4, and "
                             "loss_aggregation seq-mean-token-mean (token-mean weighs long sequences more)")
    policy_loss: Literal["ppo", "cispo"] = Field(
        "ppo", description="ppo: the clipped surrogate; cispo: the clipped, stop-gradient ratio weighs each "
                           "token's policy gradient, none dropped by the clip (MiniMax-M1)")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses become one: the mean over every token of the minibatch, "
                                  "or over sequences of each one's token mean or token sum, or its token sum over "
                                  "a constant length (loss_norm_length: Dr. GRPO)")
    loss_norm_length: int | None = Field(None, ge=1, description="seq-mean-token-sum-norm's constant length; "
                                         "default rollout.max_new_tokens")
    grpo_std_normalize: bool = Field(True, description="grpo: divide each group's centred rewards by their std; "
                                     "false is Dr. GRPO's unbiased advantage")
    whiten_advantages: bool = Field(True, description="GAE advantages to mean 0, std 1 over the batch")
    normalize_rewards: bool = Field(False, description="scale RM scores by their running std")
    score_clip: float | None = Field(None, gt=0, description="the trained reward is clipped to [-score_clip, "
                                                             "score_clip]; None: not clipped")
    truncation_penalty: float = Field(0.0, le=0, description="added to the score of a response cut at max_new_tokens")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage: 1 partitions the optimizer "
                                                          "state between ranks, 2 the gradients too, 3 the weights too")
    ranks: int = Field(1, ge=1, description="DeepSpeed data-parallel ranks per node (torch.distributed's launcher)")
    nodes: int = Field(1, ge=1, description="nodes the learner spans under tether run --ray (ranks on each); by "
                                            "hand: tether launch learner --nnodes")
    dist_timeout_s: float = Field(1800.0, gt=0, description="a collective between learner ranks fails after this")
    cpu_shm_allreduce: bool = Field(False, description="CPU only: DeepSpeed's shared-memory all-reduce between "
                                                       "ranks (JIT-compiled once, ~90 s); off: gloo")
    checkpoint_every: int = Field(0, ge=0, description="save every N steps; 0: only at the end")
    record_batches: bool = Field(False, description="write every trained batch (sample ids, tokens, behavior and "
                                 "reference logprobs, scores, versions) to RUN_DIR/batches, for tether replay to "
                                 "train on again step for step")
    behavior_gap_every: int = Field(10, ge=0, description="with max_staleness >= 1, every N steps keep this "
                                                          "version's weights (a CPU copy) to measure "
                                                          "behavior_logprob_gap on its samples a step later; "
                                                          "0: never (at k = 0 it is measured every step)")
    dist_port: int = Field(0, ge=0, le=65535, description="torch.distributed port; 0 picks a free one")


    def micro_batch(self, ranks: int) -> int:
        """Samples per forward/backward pass on each of ``ranks`` ranks: ``micro_batch_size``, or a
        rank's whole share of a minibatch (no accumulation)."""
        return self.micro_batch_size or self.minibatch_size // ranks


class StageConfig(_Strict):
    """What the offline stages (sft, rm, dpo) share: the model they start from, their data, where they
    write, and the learner's DeepSpeed setup under the learner's names."""
    model: str | None = Field(None, description="the model trained from (HF directory or hub id); default: the "
                                                "stage before's output (sft's for rm and dpo), else models.policy")
    data: str = Field(description="training rows: JSON lines (.jsonl, .json) or Parquet (.parquet)")
    eval_data: str | None = Field(None, description="held-out rows of the same form; None: eval_fraction of data, "
                                                    "drawn by seed")
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="share of data held out when eval_data is None; "
                                                               "0: no held-out figures")
    output: str | None = Field(None, description="the HF model directory written; default: RUN_DIR/<stage>")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the model's dtype (DeepSpeed "
                                                             "keeps fp32 master weights); losses in fp32")
    epochs: int = Field(1, ge=1, description="passes over the training rows")
    lr: float = Field(1e-5, gt=0, description="AdamW's learning rate, before lr_schedule")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("linear", description="after the warm-up, decay to "
                                                                 "lr_min_ratio x lr at the last step")
    lr_warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 1/N of the rate")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="the rate at the end of the decay, as a share of lr")
    batch_size: int = Field(32, ge=1, description="examples per optimizer step (a ranking or a pair is one example)")
    micro_batch_size: int | None = Field(None, ge=1, description="examples per forward/backward pass on each rank "
                                                                 "at most; default: batch_size / ranks")
    max_tokens_per_microbatch: int | None = Field(None, ge=1, description="padded tokens (rows x longest) per "
                                                  "forward/backward pass on each rank; an example's rows are "
                                                  "never split. None: micro_batch_size examples a pass")
    max_len: int = Field(1024, ge=2, description="most tokens of prompt + response; longer rows are left out and "
                                                 "counted")
    eval_every: int = Field(0, ge=0, description="held-out figures every N optimizer steps; 0: at each epoch's end")
    checkpoint_every: int = Field(0, ge=0, description="save the stage's whole state (weights, optimizer) every N "
                                  "optimizer steps into OUTPUT.state, as on SIGTERM or SIGHUP; the same command goes on "
                                  "from it. 0: only on a signal")
    seed: int | None = Field(None, description="the shuffle, the held-out draw and the init; default: the run's seed")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage, as learner.zero_stage")
    ranks: int = Field(1, ge=1, description="DeepSpeed data-parallel ranks (torch.distributed's launcher)")
    dist_port: int = Field(0, ge=0, le=65535, description="torch.distributed port; 0 picks a free one")
    lora_rank: int = Field(0, ge=0, description="LoRA adapters of this rank (peft), only they (and an RM's score "
                                                "head) train; the output is merged. 0: full fine-tuning")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scaling: alpha / rank")
    lora_target_modules: list[str] = Field(["all-linear"], description='module names to adapt; ["all-linear"]: '
                                                                       "every linear layer but the output head")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")

    @model_validator(mode="after")
    def _shares(self) -> "StageConfig":
        if self.batch_size % self.ranks:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of ranks ({self.ranks})")
        if self.lora_rank and self.zero_stage == 3:
            raise ValueError("lora_rank with zero_stage 3 is not supported: use ZeRO 0-2")
        return self

    def micro_batch(self, ranks: int) -> int:
        """Examples per forward/backward pass on each of ``ranks`` ranks."""
        return self.micro_batch_size or self.batch_size // ranks


class SftConfig(StageConfig):
    """Supervised fine-tuning on demonstrations: rows {"prompt", "response"} (loss on the response)
    or {"messages"} (loss on the assistant's turns, through the chat template)."""
    lr: float = Field(2e-5, gt=0, description="AdamW's learning rate, before lr_schedule")


class RewardModelConfig(StageConfig):
    """The reward model, trained on rankings: {"prompt", "chosen", "rejected"} or {"prompt",
    "responses": [...], "ranking": [...]} (ranking[i]: the rank of responses[i], 0 the best, equal
    ranks a tie). All K-choose-2 pairs of a prompt from one forward pass of its K responses."""
    calibration: Literal["offset", "normalize", "none"] = Field(
        "offset", description="offset: the mean score of the training responses (the SFT policy's) is subtracted, "
                              "so they score 0 on average; normalize: and divided by their std; stored in the "
                              "model's config.json, applied by the scorer")


class DpoConfig(StageConfig):
    """DPO (Rafailov et al. 2023) on preference pairs {"prompt", "chosen", "rejected"} against a
    frozen reference whose logprobs are computed once."""
    lr: float = Field(5e-7, gt=0, description="AdamW's learning rate, before lr_schedule")
    beta: float = Field(0.1, gt=0, description="the strength of the implicit KL to the reference")
    reference: str | None = Field(None, description="the frozen reference; default: dpo.model")


STAGES = ("sft", "rm", "dpo")


class HealthConfig(_Strict):
    """Thresholds of the learner's health monitor (learner/health.py)."""
    warmup_steps: int = Field(3, ge=1, description="steps averaged into the baselines; no alert before")
    kl_budget: float = Field(20.0, gt=0, description="alert when kl per response is above")
    kl_zero_eps: float = Field(1e-4, gt=0, description="a |kl| below this counts as stuck at 0")
    kl_zero_steps: int = Field(5, ge=1, description="alert after this many steps with |kl| < kl_zero_eps")
    length_spike_ratio: float = Field(1.5, gt=1, description="length over this x baseline while reward rises")
    entropy_collapse_ratio: float = Field(0.1, gt=0, lt=1, description="entropy under this x baseline")
    value_loss_factor: float = Field(100.0, gt=1, description="value loss over this x baseline")
    clipfrac_low: float = Field(1e-3, ge=0, description="a clip fraction below this counts as ~0: the policy "
                                                        "barely moves")
    clipfrac_low_steps: int = Field(5, ge=1, description="alert after this many steps with the clip fraction "
                                                         "below clipfrac_low")
    clipfrac_high: float = Field(0.2, gt=0, le=1, description="alert when the clip fraction is above: the "
                                                              "learning rate is likely too high")
    behavior_gap_max: float = Field(0.5, gt=0, description="alert when the rollout's logprobs differ from the "
                                                           "learner's by more, for the same weights (a broken "
                                                           "weight sync measured 1-2; fp32 agrees within 1e-5)")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


class CurveConfig(_Strict):
    """CURVE keys for TCP endpoints (tether keys makes them)."""
    enabled: bool = Field(False, description="CURVE-authenticate every TCP endpoint")
    server_key: str = Field("keys/server.key_secret", description="the buffer's (and weight server's) secret key")
    server_public_key: str = Field("keys/server.key", description="its public key, for the clients")
    client_key: str = Field("keys/client.key_secret", description="this role's secret key")
    allowed_clients: str = Field("keys/allowed", description="directory of the public keys let in")


class TransportConfig(_Strict):
    """How the roles reach each other and how weights travel."""
    buffer_address: str = Field("ipc://{run_dir}/sockets/buffer", description="ZeroMQ endpoint the buffer binds")
    weights_dir: str = Field("{shm}/tether-{run_name}", description="where published weights land (same host)")
    weight_bucket_mb: int = Field(64, ge=1, description="weight sync bucket size, MiB")
    weight_slots: int = Field(2, ge=2, description="versions kept in shared memory (more appear if readers lag)")
    weight_transport: Literal["shm", "tcp"] = Field(
        "shm", description="shm: the rollout reads the learner's shared memory (one host); tcp: it fetches buckets")
    weights_address: str = Field("tcp://127.0.0.1:5601", description="the learner's weight server (weight_transport tcp)")
    weights_stream_address: str = Field("ipc://{run_dir}/sockets/weights-stream",
                                        description="bucket notices, so the rollout checks a version as it is written")
    connect_retries: int = Field(30, ge=1, description="tries of a role to reach the buffer at start-up")
    connect_interval_s: float = Field(1.0, gt=0, description="wait between those tries")
    heartbeat_s: float = Field(5.0, gt=0, description="a role waiting on the buffer pings it this often")
    peer_deadline_s: float = Field(60.0, gt=0, description="a buffer that answers no ping this long is lost: the "
                                                           "role exits non-zero with the reason")
    request_deadline_s: float = Field(120.0, gt=0, description="a request the buffer answers at once (samples, "
                                                               "scores, a snapshot...) unanswered this long is lost")
    max_frame_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="a received ZeroMQ frame larger than "
                                                                     "this is refused")
    curve: CurveConfig = Field(default_factory=CurveConfig)
    allow_plain_tcp: bool = Field(False, description="bind a TCP endpoint other than loopback without CURVE: "
                                                     "anyone who reaches the port can speak as any role")

    @model_validator(mode="after")
    def _no_plain_tcp(self) -> "TransportConfig":
        if self.curve.enabled or self.allow_plain_tcp:
            return self
        endpoints = [("buffer_address", self.buffer_address)]
        if self.weight_transport == "tcp":
            endpoints.append(("weights_address", self.weights_address))
        for key, address in endpoints:
            host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]") if address.startswith("tcp://") else None
            if host is not None and host not in LOOPBACK:
                raise ValueError(f"transport.{key} {address} is a TCP endpoint beyond this machine without CURVE: "
                                 "set transport.curve.enabled (see `tether keys`), or transport.allow_plain_tcp: true "
                                 "on a network you trust")
        return self


class RayPlacementConfig(_Strict):
    """`tether run --ray`: what each process asks the cluster for, and the node it would rather run on."""
    cpus: dict[str, float] = Field(default_factory=dict, description="CPUs a process of the role asks Ray for "
                                   "(a learner: per rank); default 1")
    gpus: dict[str, float] = Field(default_factory=dict, description="GPUs a process of the role asks Ray for; "
                                   "default, on a cluster with GPUs: an engine its rollout.tensor_parallel_size, a "
                                   "scorer 1, the learner 1 a rank, the buffer 0")
    nodes: dict[str, str] = Field(default_factory=dict, description="role -> a custom resource of the node it "
                                  "prefers (`ray start --resources '{\"node_a\": 1}'`); where that node is gone, "
                                  "any node with room")
    share_run_dir: Literal["auto", "yes", "no"] = Field("auto", description="whether the nodes see run_dir: auto "
                                                        "looks; no: each process writes on its node and its metrics "
                                                        "and logs are shipped to run_dir")

    @model_validator(mode="after")
    def _roles(self) -> "RayPlacementConfig":
        for key in ("cpus", "gpus", "nodes"):
            unknown = set(getattr(self, key)) - set(ROLES)
            if unknown:
                raise ValueError(f"placement.ray.{key}: {sorted(unknown)} is not a role ({', '.join(ROLES)})")
        return self


class PlacementConfig(_Strict):
    """Which cores or GPUs each role runs on, on one host or on a Ray cluster."""
    mode: Literal["split", "colocate"] = Field("split", description="split: each role on its own cores or GPUs "
                                               "(placement.cores, cuda_visible_devices), computing side by side; "
                                               "colocate: the rollout, scorer and learner share every device given "
                                               "and work in shifts (generate, score, train), each shift granted by the "
                                               "buffer: for boxes with fewer devices than roles")
    shift_deadline_s: float = Field(1800.0, gt=0, description="colocate: a role holding its shift longer (an engine "
                                    "still generating, a learner still training) is named in an error and its late "
                                    "end refused, so it stops rather than hangs the run")
    cores: dict[str, list[int]] = Field(default_factory=dict, description="CPU cores per role (affinity); "
                                        "`agent`: the cores of rollout.agent_processes; colocate: every role "
                                        "runs on all the cores named here (none: all the machine's)")
    cuda_visible_devices: dict[str, str] = Field(default_factory=dict, description="CUDA_VISIBLE_DEVICES per role")
    ray: RayPlacementConfig = Field(default_factory=RayPlacementConfig)

    @model_validator(mode="after")
    def _known_roles(self) -> "PlacementConfig":
        for mapping_name in ("cores", "cuda_visible_devices"):
            for role in getattr(self, mapping_name):
                if role not in ROLES and not (mapping_name == "cores" and role == "agent"):
                    raise ValueError(f"{mapping_name}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        return self


class EvalConfig(_Strict):
    """Evaluation on held-out prompts, during training and with tether eval."""
    prompts: str | None = Field(None, description="held-out prompts (like data.prompts) to evaluate on; None: no "
                                                  "evaluation during training")
    every: int = Field(0, ge=0, description="evaluate the policy every N learner steps (and the final one); 0: only "
                                            "with tether eval")
    max_prompts: int = Field(256, ge=1, description="the first N prompts of eval.prompts")
    seed: int = Field(1234, description="sampling seed: the same checkpoint gives the same figures")
    worst_cases: int = Field(5, ge=0, description="responses written as text per evaluation: lowest reward, "
                                                  "highest KL")
    deadline_s: float = Field(1800.0, gt=0, description="an evaluation running longer is stopped and reported")


class MetricsConfig(_Strict):
    """Where the run's metrics go besides RUN_DIR/metrics/*.jsonl (always written, the record every
    tool of tether reads)."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"], description="tensorboard: each role writes RUN_DIR/tensorboard; "
        "wandb, mlflow, trackio (the extras .[wandb], .[mlflow], .[trackio]): tether run sends every role's "
        "records, the config and the evaluations' worst cases to one run there, each role's series under its name")
    project: str = Field("tether", description="the wandb / trackio project, the mlflow experiment")
    run_name: str | None = Field(None, description="the tracker run's name; None: run_dir's last part")
    mlflow_tracking_uri: str | None = Field(None, description="None: MLFLOW_TRACKING_URI, else ./mlruns where tether "
                                            "runs (a file store: tether sets MLFLOW_ALLOW_FILE_STORE, which MLflow 3 "
                                            "asks for)")
    wandb_entity: str | None = Field(None, description="the wandb team or user; None: the logged-in user's")
    every_s: float = Field(2.0, gt=0, description="how often new records are sent")

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError(f"names a tracker twice: {trackers}")
        return trackers


class LaunchConfig(_Strict):
    """What tether run does when a role dies or it is asked to stop."""
    max_restarts: int = Field(3, ge=0, description="restarts of a rollout or scorer that dies, each")
    restart_backoff_s: float = Field(2.0, ge=0, description="wait before the first restart; doubles each time")
    checkpoint_grace_s: float = Field(300.0, gt=0, description="on Ctrl-C, SIGTERM or SIGHUP, how long the learner "
                                                               "may take to write its checkpoint before every role "
                                                               "is stopped")


class TetherConfig(_Strict):
    run_dir: str = Field("runs/default", description="where the run lives: metrics/, logs/, checkpoints/, "
                                                     "sockets/, config.yaml")
    seed: int = Field(0, description="the prompt order, vLLM's sampling, the learner's shuffles and init")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="every role's log level")
    models: ModelsConfig | None = Field(None, description="PPO's models (tether run); with an sft or rm section "
                                                          "their outputs are models.policy and models.reward")
    data: DataConfig | None = Field(None, description="PPO's prompts (tether run)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    resume_from: str | None = Field(None, description="a checkpoints/state-* directory (set by tether run --resume)")
    sft: SftConfig | None = Field(None, description="tether sft: supervised fine-tuning, the first InstructGPT stage")
    rm: RewardModelConfig | None = Field(None, description="tether rm: the reward model, the second stage")
    dpo: DpoConfig | None = Field(None, description="tether dpo: DPO on preference pairs, PPO's offline alternative")

    @model_validator(mode="before")
    @classmethod
    def _chain_stages(cls, data: Any) -> Any:
        """Each stage's output is the next one's input unless the config names another: sft's output
        starts rm and dpo and is models.policy; rm's output is models.reward."""
        if not isinstance(data, dict):
            return data
        run_dir = data.get("run_dir", cls.model_fields["run_dir"].default)
        sections = {name: data[name] for name in STAGES if isinstance(data.get(name), dict)}
        outputs = {name: section.get("output") or os.path.join(run_dir, name) for name, section in sections.items()}
        models = data.get("models") if isinstance(data.get("models"), dict) else None
        start = outputs.get("sft") or (models or {}).get("policy")
        for name in ("rm", "dpo"):
            if name in sections and not sections[name].get("model") and start:
                data[name] = {**sections[name], "model": start}
        if "dpo" in data and isinstance(data["dpo"], dict) and data["dpo"].get("model"):
            data["dpo"].setdefault("reference", data["dpo"]["model"])
        chained = {key: value for key, value in (("policy", outputs.get("sft")), ("reward", outputs.get("rm")))
                   if value}
        if models is not None or "policy" in chained:
            data["models"] = {**chained, **(models or {})}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "TetherConfig":
        for name in STAGES:
            section = getattr(self, name)
            if section is not None and section.model is None:
                raise ValueError(f"{name}.model: the model {name} trains from is not set (nor an sft section or "
                                 "models.policy to start from)")
        if self.models is None or self.data is None:
            if not any(getattr(self, name) is not None for name in STAGES):
                missing = [key for key in ("models", "data") if getattr(self, key) is None]
                raise ValueError(f"{' and '.join(missing)}: missing (PPO needs models.policy and data.prompts; a "
                                 "config for tether sft, rm or dpo alone has that section instead)")
            return self
        learner, rollout = self.learner, self.rollout
        self._distillation_consistent()
        if (self.models.reward is None and not self.scorer.reward_functions and not self.scorer.judges
                and self.scorer.reward_url is None and rollout.environment is None
                and not rollout.agent and not rollout.agent_command and self.models.teacher is None):
            raise ValueError("nothing to train on: set models.reward, scorer.reward_functions, scorer.judges, "
                             "scorer.reward_url, models.teacher, rollout.environment "
                             "(its turn rewards) or rollout.agent / rollout.agent_command (its returns), alone or "
                             "together")
        if learner.lora_rank and learner.zero_stage == 3:
            raise ValueError("learner.lora_rank with learner.zero_stage 3 is not supported: use ZeRO 0-2 (the "
                             "adapters are small; the frozen base is not partitioned)")
        if self.eval.every and not self.eval.prompts:
            raise ValueError("eval.every needs eval.prompts")
        if (learner.ptx_coef > 0) != (self.data.ptx is not None):
            raise ValueError("learner.ptx_coef > 0 and data.ptx go together (PPO-ptx needs its text)")
        if self.models.reward is None and self.models.critic_init == "reward":
            raise ValueError("models.critic_init is reward but there is no models.reward")
        specs = [f.function for f in self.scorer.reward_functions]
        if len(set(specs)) < len(specs):
            raise ValueError(f"scorer.reward_functions names a function twice ({specs}): give it one weight")
        names = self.judge_names
        if len(set(names)) < len(names):
            raise ValueError(f"scorer.judges: two judges are named alike ({names}): give each its own name")
        pairwise = [i for i, judge in enumerate(self.scorer.judges) if judge.mode == "pairwise"]
        if pairwise and rollout.samples_per_prompt < 2:
            raise ValueError(f"scorer.judges[{pairwise[0]}].mode: pairwise compares the responses of a group: it "
                             "needs rollout.samples_per_prompt >= 2")
        per_turn = [i for i, judge in enumerate(self.scorer.judges) if judge.per_turn and judge.mode == "pairwise"]
        if per_turn:
            raise ValueError(f"scorer.judges[{per_turn[0]}].per_turn: a pairwise judge scores whole responses")
        if learner.batch_size % rollout.samples_per_prompt:
            raise ValueError(f"learner.batch_size ({learner.batch_size}) must be a multiple of "
                             f"rollout.samples_per_prompt ({rollout.samples_per_prompt})")
        if learner.batch_size % learner.minibatch_size:
            raise ValueError(f"learner.batch_size ({learner.batch_size}) must be a multiple of "
                             f"learner.minibatch_size ({learner.minibatch_size})")
        rollout_gpus = self.placement.cuda_visible_devices.get("rollout")
        if rollout_gpus is not None and rollout.tensor_parallel_size > 1:
            count = len([d for d in rollout_gpus.split(",") if d.strip()])
            if count < rollout.engines * rollout.tensor_parallel_size:
                raise ValueError(f"placement.cuda_visible_devices.rollout has {count} devices; rollout.engines "
                                 f"({rollout.engines}) x rollout.tensor_parallel_size ({rollout.tensor_parallel_size}) "
                                 "need one each")
        if rollout.in_process and rollout.tensor_parallel_size > 1:
            raise ValueError("rollout.in_process needs rollout.tensor_parallel_size 1: vLLM runs tensor-parallel "
                             "workers as processes of their own")
        if learner.value_targets == "vtrace" and learner.advantage_estimator != "gae":
            raise ValueError(f"learner.value_targets vtrace corrects a critic's targets; learner.advantage_estimator "
                             f"{learner.advantage_estimator} trains no critic (use gae)")
        if self.buffer.filter_groups:
            if learner.advantage_estimator not in ("grpo", "rloo"):
                raise ValueError(f"buffer.filter_groups drops the groups a group estimator finds no advantage in; "
                                 f"learner.advantage_estimator {learner.advantage_estimator} compares no groups "
                                 "(use grpo or rloo)")
            if self.buffer.max_filter_ratio * learner.batch_size < rollout.samples_per_prompt:
                raise ValueError(f"buffer.max_filter_ratio ({self.buffer.max_filter_ratio}) x learner.batch_size "
                                 f"({learner.batch_size}) is less than one group of rollout.samples_per_prompt "
                                 f"({rollout.samples_per_prompt}): no group could ever be filtered")
        scorer = self.scorer
        if scorer.overlong_buffer is not None and scorer.overlong_buffer >= self.overlong_max_length:
            raise ValueError(f"scorer.overlong_buffer ({scorer.overlong_buffer}) must be under the length it counts "
                             f"to ({self.overlong_max_length}: scorer.overlong_max_length, default "
                             "rollout.max_new_tokens, x rollout.max_turns for episodes)")
        if learner.behavior_weight_cap is None and (learner.behavior_correction == "mask"
                                                    or learner.behavior_correction_level == "sequence"):
            raise ValueError(f"learner.behavior_correction {learner.behavior_correction} at level "
                             f"{learner.behavior_correction_level} needs learner.behavior_weight_cap: uncapped, a "
                             "mask keeps every weight and a sequence's product of weights has no bound")
        if learner.policy_loss == "cispo" and (learner.ratio_level != "token" or learner.dual_clip is not None):
            raise ValueError("learner.policy_loss cispo weighs each token by its own clipped ratio: it takes "
                             "learner.ratio_level token and no learner.dual_clip")
        floor, cap = learner.behavior_weight_floor, learner.behavior_weight_cap
        if floor is not None and (learner.behavior_correction != "mask" or (cap is not None and floor >= cap)):
            raise ValueError(f"learner.behavior_weight_floor ({floor}) bounds the weights behavior_correction mask "
                             f"keeps from below: it needs behavior_correction mask and a floor under "
                             f"behavior_weight_cap ({cap})")
        if learner.advantage_estimator in ("grpo", "rloo") and rollout.samples_per_prompt < 2:
            raise ValueError(f"learner.advantage_estimator {learner.advantage_estimator} compares the responses to "
                             "one prompt: rollout.samples_per_prompt must be >= 2")
        budget = learner.max_tokens_per_microbatch
        if budget is not None and rollout.max_model_len is not None and budget < rollout.max_model_len:
            raise ValueError(f"learner.max_tokens_per_microbatch ({budget}) is less than rollout.max_model_len "
                             f"({rollout.max_model_len}): a sequence that long would not fit in one pass")
        if learner.minibatch_size % learner.ranks:
            raise ValueError(f"learner.minibatch_size ({learner.minibatch_size}) must be a multiple of "
                             f"learner.ranks ({learner.ranks}): each rank trains an equal share")
        return self

    @model_validator(mode="after")
    def _no_idle_keys(self) -> "TetherConfig":
        """A key that does nothing in its mode is refused, naming the key that would give it meaning:
        accepted, it reads as a setting the run follows (issue 52)."""
        learner, scorer = self.learner, self.scorer
        if _set(learner, "loss_norm_length") and learner.loss_aggregation != "seq-mean-token-sum-norm":
            raise ValueError(f"learner.loss_norm_length ({learner.loss_norm_length}) is the constant length of "
                             f"learner.loss_aggregation seq-mean-token-sum-norm; with {learner.loss_aggregation} it "
                             "does nothing")
        idle = [f"scorer.{key}" for key in ("overlong_penalty", "overlong_max_length") if _set(scorer, key)]
        if idle and scorer.overlong_buffer is None:
            raise ValueError(f"{' and '.join(idle)} shape rewards only with scorer.overlong_buffer set: without it "
                             "DAPO's overlong shaping is off")
        if _set(learner, "grpo_std_normalize") and learner.advantage_estimator != "grpo":
            raise ValueError(f"learner.grpo_std_normalize false changes learner.advantage_estimator grpo's "
                             f"advantages; {learner.advantage_estimator} divides by no group's std")
        return self

    @property
    def overlong_max_length(self) -> int:
        """The length DAPO's overlong shaping counts to (``scorer.overlong_max_length``): by default the
        most policy tokens a response may have, over every turn of an episode."""
        rollout = self.rollout
        return self.scorer.overlong_max_length or rollout.max_new_tokens * (rollout.max_turns if rollout.episodes else 1)

    def _distillation_consistent(self) -> None:
        """models.teacher and the learner's distillation keys, as they work together."""
        learner, scorer, teacher = self.learner, self.scorer, self.models.teacher
        if teacher is None:
            idle = [f"learner.{key}" for key in ("distill_only", "distill_coef") if _set(learner, key)]
            if idle:
                raise ValueError(f"{' and '.join(idle)}: distillation needs models.teacher")
            return
        if learner.distill_coef <= 0:
            raise ValueError(f"learner.distill_coef must be over 0 with models.teacher ({teacher}): at 0 the "
                             "teacher is loaded and graded for nothing")
        sampling = self.sampling
        if sampling.top_p < 1 or sampling.top_k > 0:
            raise ValueError("models.teacher with sampling.top_p < 1 or sampling.top_k: the student's logprobs are "
                             "of its truncated distribution and the teacher's of its whole one, so each token's "
                             "reverse KL would carry the truncation's log mass; distill from the whole "
                             "distribution (top_p 1, top_k 0)")
        if self.buffer.filter_groups:
            raise ValueError("buffer.filter_groups with models.teacher: a group of equal scores still differs in "
                             "its tokens' distillation rewards; dynamic sampling would drop its signal")
        if learner.distill_only:
            scoring = [key for key, on in (("models.reward", self.models.reward), ("scorer.reward_functions",
                       scorer.reward_functions), ("scorer.judges", scorer.judges),
                       ("scorer.reward_url", scorer.reward_url)) if on]
            if scoring:
                raise ValueError(f"learner.distill_only trains on the teacher alone: {', '.join(scoring)} would be "
                                 "computed and never trained on (drop distill_only to add them to the "
                                 "distillation rewards)")

    @property
    def judge_names(self) -> list[str]:
        """Each of ``scorer.judges``' name in metrics and logs: its own, or judge<i>."""
        return [judge.name or f"judge{i}" for i, judge in enumerate(self.scorer.judges)]

    def cores_of(self, role: str, index: int = 0) -> list[int]:
        """CPU cores of worker ``index`` of a role: ``placement.cores.<role>`` split evenly between
        the role's processes when it has enough of them, else shared by all. Colocated, every role
        has every core named for any of them (the roles work on them in shifts)."""
        cores = self.placement.cores.get(role, [])
        if self.colocated and role in COLOCATED_ROLES:
            cores = sorted(_named_for_shifts(self.placement.cores))
        return _share(cores, self._count(role), index)

    @property
    def colocated(self) -> bool:
        return self.placement.mode == "colocate"

    def cuda_devices_of(self, role: str, index: int = 0) -> str | None:
        """CUDA_VISIBLE_DEVICES of worker ``index`` of a role, split as ``cores_of`` splits cores
        (a tensor-parallel engine needs ``tensor_parallel_size`` of them: checked at load). None:
        not set."""
        devices = self.placement.cuda_visible_devices.get(role)
        if self.colocated and role in COLOCATED_ROLES:  # every role all the GPUs named for any of them
            named = _named_for_shifts({name: [d.strip() for d in listed.split(",") if d.strip()]
                                      for name, listed in self.placement.cuda_visible_devices.items()})
            devices = ",".join(named) if named else None
        if devices is None:
            return None
        if role == "learner":  # the ranks of one job each pick theirs by LOCAL_RANK
            return devices
        return ",".join(_share([d.strip() for d in devices.split(",") if d.strip()], self._count(role), index))

    def _count(self, role: str) -> int:
        return {"rollout": self.rollout.engines, "scorer": self.scorer.workers}.get(role, 1)

    def require_ppo(self, command: str) -> "TetherConfig":
        """This config, if it says what PPO needs; else a ``ConfigError`` naming the missing key."""
        missing = [key for key in ("models", "data") if getattr(self, key) is None]
        if missing:
            raise ConfigError(f"{' and '.join(missing)}: missing, and {command} needs them (models.policy, "
                              "data.prompts)")
        return self

    def stage(self, name: str) -> StageConfig:
        """The ``sft``, ``rm`` or ``dpo`` section, or a ``ConfigError`` saying it is missing."""
        section = getattr(self, name)
        if section is None:
            raise ConfigError(f"{name}: missing; tether {name} trains from that section of the config")
        return section

    def stage_output(self, name: str) -> str:
        """Where stage ``name`` writes its model: ``<name>.output``, else RUN_DIR/<name>."""
        section = getattr(self, name)
        return (section.output if section is not None and section.output else None) or os.path.join(self.run_dir, name)

    # ---- derived values every role agrees on
    @property
    def buffer_address(self) -> str:
        return self.transport.buffer_address.format(run_dir=os.path.abspath(self.run_dir))

    @property
    def weights_stream_address(self) -> str:
        return self.transport.weights_stream_address.format(run_dir=os.path.abspath(self.run_dir))

    @property
    def weights_dir(self) -> str:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(os.path.abspath(self.run_dir), "shm")
        run_name = os.path.abspath(self.run_dir).strip("/").replace("/", "_")[-80:]
        return self.transport.weights_dir.format(shm=shm, run_name=run_name, run_dir=os.path.abspath(self.run_dir))

    @property
    def reference_path(self) -> str:
        return self.models.reference or self.models.policy


def _set(section: BaseModel, key: str) -> bool:
    """Whether the config gives ``key`` of ``section`` a value other than its default: a run's own
    config.yaml and `tether config show` write every key, those at their default too."""
    return key in section.model_fields_set and getattr(section, key) != type(section).model_fields[key].default


def _named_for_shifts(devices_of: dict[str, list]) -> list:
    """Every device named for any of the roles that work in shifts (placement.mode colocate), once
    each, in the order first named."""
    return list(dict.fromkeys(device for role, named in devices_of.items() if role in COLOCATED_ROLES
                              for device in named))


def _share(devices: list, count: int, index: int) -> list:
    if len(devices) < count:
        return list(devices)
    per_worker = len(devices) // count
    return list(devices[index * per_worker:(index + 1) * per_worker])


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml", ".json"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"config file {path}: use .yaml, .yml, .toml or .json")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"config file {path} does not parse: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` (value parsed as YAML: 3, 0.1, true, null, [0, 1])."""
    key, sep, raw_value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like key.subkey=value")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value
    parts = key.strip().split(".")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[:depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


# keys that moved, each to its one home: a config that still uses one is told where it went
MOVED_KEYS = {"rollout.temperature": "sampling.temperature", "rollout.top_p": "sampling.top_p",
              "rollout.top_k": "sampling.top_k", "learner.dtype": "models.dtype",
              # a device's shift (placement.mode colocate), not a conversation's turn
              "placement.turn_deadline_s": "placement.shift_deadline_s",
              **{f"buffer.staleness_{name}": f"buffer.auto_staleness.{name}"
                 for name in ("min", "max", "ess_min", "truncated_max", "kl_max", "raise_after")}}


def _moved_keys(data: dict[str, Any]) -> list[str]:
    found = []
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            found.append(f"  {old}: moved to {new}")
    return found


def _move_keys(data: dict[str, Any]) -> None:
    """A run's own config.yaml, written before a key moved, read with each such key in its new
    home (where that is not set already): a run is resumed or replayed as it was made."""
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            value = data[section].pop(key)
            *parents, leaf = new.split(".")
            node = data
            for parent in parents:
                node = node.setdefault(parent, {})
            node.setdefault(leaf, value)


def _format_validation_error(error: ValidationError) -> str:
    messages: dict[str, list[str]] = {}
    for item in error.errors():
        # a union's members add their tag to the location (max_staleness.int, .literal['auto']): one key
        key = ".".join(str(part) for part in item["loc"] if not _UNION_TAG.fullmatch(str(part)))
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        if item["type"] == "value_error":  # a check across keys: its message names them
            message = message.removeprefix("Value error, ")
        messages.setdefault(key, []).append(message)
    lines = [f"  {key}: {'; or '.join(texts)}" if key else f"  {'; '.join(texts)}" for key, texts in messages.items()]
    return "invalid config:\n" + "\n".join(lines)


_UNION_TAG = re.compile(r"int|float|str|bool|none|literal\[.*\]|list\[.*\]|dict\[.*\]")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, saved: bool = False) -> TetherConfig:
    """The config of file ``path`` (YAML or TOML) over ``base``, with ``overrides`` (``key=value``)
    applied. ``saved``: ``path`` is a run's own config.yaml (``--resume``, ``tether replay``), whose
    keys that moved since it was written are moved along rather than refused."""
    data: dict[str, Any] = json.loads(json.dumps(base)) if base else {}
    if path is not None:
        data.update(_read_file(Path(path)))
        if saved:
            _move_keys(data)
    for override in overrides or []:
        apply_override(data, override)
    moved = _moved_keys(data)
    if moved:
        raise ConfigError("invalid config:\n" + "\n".join(moved))
    try:
        return TetherConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error)) from None


def dump_config(config: TetherConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def describe_config(config: TetherConfig) -> str:
    """The resolved config as YAML with what each key means beside it, as a comment (what
    `tether config show` prints); it loads back to the same config."""
    return "\n".join(_described(config, config.model_dump(mode="json"), 0)) + "\n"


def _described(model: BaseModel, dumped: dict[str, Any], depth: int) -> list[str]:
    lines, indent = [], "  " * depth
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            lines.append(f"{indent}{name}:  # {' '.join((type(value).__doc__ or '').split())}")
            lines += _described(value, dumped[name], depth + 1)
            continue
        # one flow-style YAML line, quoted where YAML needs it
        text = yaml.safe_dump({name: dumped[name]}, default_flow_style=True, width=10**9).strip()[1:-1]
        lines.append(f"{indent}{text}  # {field.description}")
    return lines
