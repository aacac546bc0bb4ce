"""One PPO step on one batch, in its four numbered parts: (1) recompute the proximal logprobs and
values, (2) token rewards and advantages, (3) ``ppo_epochs`` passes over minibatches, (4) the
step's statistics.

``ppo_step`` reads top to bottom like the InstructGPT recipe, one function per part; every formula
lives in ``learner.ppo`` (and the sampled distribution in ``common.distributions``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import LearnerConfig, SamplingConfig, TetherConfig
from common.distributions import entropy_from_logits, logprobs_from_logits
from common.packing import Packing, for_model, packed, prefix_order, prompt_units
from common.sequences import SequenceBatch
from learner import ppo
from learner.ptx import PtxStream, ptx_token_losses
from learner.staleness import behavior_health
from protocol.samples import Sample
from training import micro_batches, optimizer_step, parallel
from training.deepspeed_engine import weights_swapped
from training.micro_batches import micro_batches_of
from training.optimizer_step import SkippedSteps


def _finite(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A model output that is NaN or inf means the weights are gone: a FloatingPointError, which
    the learner answers with a checkpoint of the last good policy and a stop. Every rank checks
    at the same point and all raise together (the checkpoint that follows is a collective)."""
    if parallel.any_rank(not bool(torch.isfinite(tensor).all())):
        raise FloatingPointError(f"{name} hold NaN or inf")
    return tensor


def forward_logits(engine, batch: SequenceBatch) -> torch.Tensor:
    """[B, T, V] logits that score each response token."""
    # use_cache: no KV cache, which transformers builds at every forward otherwise (a concat per layer)
    logits = engine(**as_ranks_run(batch).model_inputs, use_cache=False).logits[:len(batch.input_ids)]
    return _finite("actor logits", batch.gather(logits))


def forward_values(engine, batch: SequenceBatch) -> torch.Tensor:
    """[B, T] V(s_t) for each response token: the critic at the position before the token."""
    # a critic that sees: the images too
    values = engine(**as_ranks_run(batch).model_inputs).logits[:len(batch.input_ids)].squeeze(-1)
    return _finite("critic values", batch.gather(values).float())


def as_ranks_run(batch: SequenceBatch) -> SequenceBatch:
    """``batch`` as this rank runs its forward: on one of several ranks, a batch of a policy that
    sees which shows no image gets the blank image's row after its rows (``SequenceBatch.with_blank``;
    why: ``training.blank_image.BlankImage``), whose outputs the callers leave out."""
    if batch.images is None and batch.blank is not None and parallel.world_size() > 1:
        return batch.with_blank()
    return batch


def _ptx_parts(ptx: PtxStream, parts: int, device) -> list[tuple | None]:
    """This rank's rows of the next ptx batch, split like its rows of the minibatch: per part
    (input_ids, attention_mask, tokens of the whole ptx batch), or None for a part with no row."""
    input_ids, attention_mask = ptx.next_batch()
    total_tokens = float((attention_mask[:, 1:] * attention_mask[:, :-1]).sum())
    mine = torch.arange(len(input_ids))[parallel.local_rows(len(input_ids))]
    return [(input_ids[rows].to(device), attention_mask[rows].to(device), total_tokens) if len(rows) else None
            for rows in torch.tensor_split(mine, parts)]


def _ptx_loss(actor, input_ids: torch.Tensor, attention_mask: torch.Tensor, total_tokens: float,
              world: int) -> tuple[float, torch.Tensor]:
    """(share, loss): the mean next-token loss over these rows' tokens, and the share that makes the
    shares' sum over parts and mean over ranks the mean over the whole ptx batch's tokens."""
    logits = actor(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    losses, mask = ptx_token_losses(_finite("actor logits on data.ptx", logits), input_ids, attention_mask)
    tokens = float(mask.sum())
    return world * tokens / total_tokens, ppo.masked_sum(losses, mask) / max(tokens, 1.0)


@dataclass(frozen=True)
class Episodes:
    """The batch's rows as episodes: an agent program that rewrote its context sent the turns
    before as parts of the same episode (``Sample.part_index``), one row each."""
    ids: torch.Tensor  # [B] long: each row's episode, numbered by first appearance
    final: torch.Tensor  # [B] bool: the row is its episode's last part, which holds its score
    later: torch.Tensor  # [B, B] bool: row j is a later part of row i's episode
    count: int  # episodes

    @property
    def split(self) -> bool:
        return self.count < len(self.ids)


def episodes_of(samples: list[Sample], device=None) -> Episodes:
    """Which rows of the batch are parts of one episode (samples without parts: one row each)."""
    numbers: dict = {}
    ids = torch.tensor([numbers.setdefault(s.episode, len(numbers)) for s in samples], device=device)
    parts = torch.tensor([s.part_index or 0 for s in samples], device=device)
    final = torch.tensor([s.final for s in samples], device=device)
    later = (ids.unsqueeze(1) == ids.unsqueeze(0)) & (parts.unsqueeze(0) > parts.unsqueeze(1))
    return Episodes(ids, final, later, len(numbers))


def advantages_of(rewards: torch.Tensor, old_values: torch.Tensor | None, mask: torch.Tensor, cfg: LearnerConfig,
                  group_size: int, log_ratios: torch.Tensor | None = None,
                  episodes: Episodes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns [B, T] by ``cfg.advantage_estimator`` from token rewards [B, T]
    (and the critic's values [B, T] for GAE). The group estimators compare each episode's total
    reward (its score, plus the KL penalty when it is in the reward) with the other episodes of its
    prompt: the batch holds whole groups, each group's rows together. With ``value_targets``
    vtrace the critic's targets are V-trace's, from ``log_ratios`` [B, T] (proximal - behavior
    logprobs); the policy's advantages stay GAE's, corrected by the PPO loss's own weights.
    ``episodes``: where rows are parts of one episode, the group estimators give every part its
    episode's advantage, and GAE and reward-to-go see each part's return still to come."""
    if episodes is not None and episodes.split and cfg.advantage_estimator in ("gae", "reinforce_pp"):
        rewards = ppo.rewards_across_parts(rewards, mask, episodes.later)
    if cfg.advantage_estimator == "gae":
        advantages, returns = ppo.gae_advantages(rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.value_targets == "vtrace":
            returns = ppo.vtrace_targets(rewards, old_values, log_ratios, mask, cfg.gamma, cfg.lam,
                                         cfg.vtrace_rho_clip, cfg.vtrace_c_clip)
        return (ppo.masked_whiten(advantages, mask) if cfg.whiten_advantages else advantages), returns
    if cfg.advantage_estimator == "reinforce_pp":
        return ppo.reinforce_pp_advantages(rewards, mask, cfg.gamma)
    totals = ppo.masked_sum(rewards, mask, dim=-1)
    if episodes is not None and episodes.split:  # one outcome per episode, its advantage on every part
        outcomes = ppo.episode_totals(totals, episodes.ids, episodes.count)
        ones = torch.ones((episodes.count, 1), device=mask.device)
        per_episode = (ppo.grpo_advantages(outcomes, ones, group_size, cfg.grpo_std_normalize)
                       if cfg.advantage_estimator == "grpo" else ppo.rloo_advantages(outcomes, ones, group_size))
        return per_episode[episodes.ids] * mask, outcomes[episodes.ids].unsqueeze(-1) * mask
    advantages = (ppo.grpo_advantages(totals, mask, group_size, cfg.grpo_std_normalize)
                  if cfg.advantage_estimator == "grpo" else ppo.rloo_advantages(totals, mask, group_size))
    return advantages, totals.unsqueeze(-1) * mask


@dataclass
class StepCarry:
    """What a learner step hands to the next: the count of optimizer steps skipped for non-finite
    gradients, the running moments of the rewards (``learner.normalize_rewards``) and the PPO-ptx
    text stream (``learner.ptx_coef``)."""
    skipped: SkippedSteps
    moments: ppo.RunningMoments | None = None
    ptx: PtxStream | None = None


@dataclass(frozen=True)
class Targets:
    """What the epochs train toward, fixed for the step: per token, [B, T] over the whole batch."""
    mask: torch.Tensor  # the response tokens
    behavior_logprobs: torch.Tensor  # the rollout's
    behavior_weights: torch.Tensor  # pi_prox / pi_behavior, truncated or masked: the off-policy correction
    ref_logprobs: torch.Tensor  # the reference's, for the KL term when it is in the loss
    old_logprobs: torch.Tensor  # proximal: the policy's at the start of the step
    old_values: torch.Tensor | None  # the critic's at the start of the step (gae only)
    advantages: torch.Tensor
    returns: torch.Tensor


def ppo_step(actor, critic, samples: list[Sample], batch: SequenceBatch, config: TetherConfig, policy_version: int,
             kl_coef: float, carry: StepCarry | None = None) -> dict[str, float]:
    """One step on one batch. Every rank calls it with the whole batch and computes its share of
    the rows (``training.parallel``); the result is what one rank computes on the whole batch.
    ``critic``: None unless ``learner.advantage_estimator`` is gae (and not ``distill_only``).
    ``carry``: what the previous step left (a fresh one when None)."""
    cfg = config.learner
    carry = carry if carry is not None else StepCarry(SkippedSteps(cfg.max_skipped_steps))
    device = batch.input_ids.device
    mask = batch.response_mask
    behavior_logprobs = _ragged_to_padded([s.behavior_logprobs for s in samples], mask).to(device)
    ref_logprobs = _ragged_to_padded([s.ref_logprobs for s in samples], mask).to(device)
    scores = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=device)  # RM + reward functions
    truncated = torch.tensor([s.finish_reason == "length" for s in samples], device=device)
    turn_rewards = (_ragged_to_padded([s.turn_rewards if s.turn_rewards is not None else [] for s in samples],
                                      mask).to(device)
                    if any(s.turn_rewards is not None for s in samples) else None)
    teacher_logprobs = None
    if config.models.teacher:  # on-policy distillation: every sample carries the teacher's, from the scorer
        missing = [s.sample_id for s in samples if s.teacher_logprobs is None]
        if missing:
            raise ValueError(f"models.teacher is set and samples {missing[:3]} carry no teacher_logprobs: were they "
                             "scored without the teacher (a scorer of another config)?")
        teacher_logprobs = _ragged_to_padded([s.teacher_logprobs for s in samples], mask).to(device)

    episodes = episodes_of(samples, device)
    # 1. proximal logprobs and old values, at the start of the step
    old_logprobs, old_values = recompute(actor, critic, batch, cfg, config.sampling)
    # 2. token rewards (the score at the last token, -beta KL at every token unless the KL goes
    #    into the loss) and advantages
    kl, advantages, returns = rewards_and_advantages(samples, old_logprobs, old_values, ref_logprobs, scores,
                                                     truncated, mask, cfg, kl_coef, carry.moments,
                                                     config.rollout.samples_per_prompt, turn_rewards,
                                                     behavior_logprobs, episodes, teacher_logprobs)
    weights, correction = ppo.behavior_weights(old_logprobs, behavior_logprobs, mask, cfg.behavior_correction,
                                               cfg.behavior_correction_level, cfg.behavior_weight_cap,
                                               cfg.behavior_weight_floor)
    targets = Targets(mask, behavior_logprobs, weights, ref_logprobs, old_logprobs, old_values, advantages, returns)
    # 3. ppo_epochs passes over shuffled minibatches; every sample used only within this step
    totals, updates, grad_norms = train_epochs(actor, critic, batch, targets, config, kl_coef, policy_version, carry)
    # 4. what the step did, averaged over its optimizer steps and ranks
    stats = step_statistics(samples, scores, truncated, targets, kl, kl_coef, policy_version, totals, updates,
                            grad_norms, episodes)
    # the batch's off-policy health, over all its tokens (buffer.max_staleness: auto reads it)
    stats.update(behavior_health(old_logprobs, behavior_logprobs, mask, cfg.behavior_weight_cap))
    stats.update(correction)  # what the correction did, over all the batch's tokens: computed once per step
    # what learner.packing saves (or would): the padding and repeated prefixes of the batch's passes
    stats.update(micro_batches.pass_shares(batch.input_ids, batch.lengths, cfg.micro_batch(parallel.world_size()),
                                           cfg.max_tokens_per_microbatch))
    if teacher_logprobs is not None:  # the mean reverse KL to the teacher per policy token (k1, sampled)
        stats["teacher_kl"] = float(ppo.masked_mean(old_logprobs - teacher_logprobs, mask))
    return stats


def recompute(actor, critic, batch: SequenceBatch, cfg: LearnerConfig,
              sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Part 1: the proximal logprobs [B, T] under ``sampling`` and the critic's values [B, T] (None
    without a critic), with no gradient, each rank its share of the rows in micro-batches, gathered
    so that every rank holds them for the whole batch."""
    device, mask, lengths = batch.input_ids.device, batch.response_mask, batch.lengths
    rows_total = len(lengths)
    with torch.no_grad():  # in micro-batches too: [b, T, V] logits are what memory peaks on
        mine = torch.arange(rows_total, device=device)[parallel.local_rows(rows_total)]
        parts = micro_batches_of(mine, lengths, cfg, parallel.world_size(), batch.input_ids, cfg.packing)
        runs = list(_passes(batch, parts, cfg.packing, actor))  # laid out once, for the critic too
        old_logprobs = parallel.gather_rows(_in_row_order(mine, parts, mask.shape[1], [
            logprobs_from_logits(forward_logits(actor, run), run.response_tokens, sampling) for run in runs]),
            rows_total)
        old_values = (parallel.gather_rows(_in_row_order(mine, parts, mask.shape[1], [
            forward_values(critic, for_model(run, critic)) for run in runs]), rows_total)
                      if critic is not None else None)
    return old_logprobs, old_values


def _passes(batch: SequenceBatch, parts: list[torch.Tensor], packing: Packing = "none", engine=None):
    """The micro-batches of ``parts``, each laid out as ``packing`` says for ``engine``
    (``common.packing.packed``); an empty part (a filler: this rank has fewer rows than another has
    passes) is the batch's first row, computed because a ZeRO-3 forward is collective and then left
    out."""
    for part in parts:
        yield packed(batch.select(part if len(part) else part.new_zeros(1)), packing, engine)


def rewards_and_advantages(samples: list[Sample], old_logprobs: torch.Tensor, old_values: torch.Tensor | None,
                           ref_logprobs: torch.Tensor, scores: torch.Tensor, truncated: torch.Tensor,
                           mask: torch.Tensor, cfg: LearnerConfig, kl_coef: float,
                           moments: ppo.RunningMoments | None, group_size: int,
                           turn_rewards: torch.Tensor | None = None,
                           behavior_logprobs: torch.Tensor | None = None, episodes: Episodes | None = None,
                           teacher_logprobs: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Part 2: (kl, advantages, returns), each [B, T]. The scores [B] (normalised by ``moments``
    when kept) become token rewards with ``-kl_coef * KL`` at every token when the KL is in the
    reward, plus an episode's ``turn_rewards`` [B, T], and advantages by ``cfg.advantage_estimator``
    (``advantages_of``). ``group_size``: the episodes of one prompt (``rollout.samples_per_prompt``),
    contiguous in the batch. ``mask`` is 1 at the policy's tokens only. ``behavior_logprobs``: the
    rollout's [B, T], for V-trace's value targets (``learner.value_targets``). ``episodes``: which
    rows are parts of one episode (default: one row each); an episode's score is its last part's
    (the conversation as it ended), the parts before carry their turn rewards and KL only.
    ``teacher_logprobs`` [B, T] (models.teacher): each token's reward gains
    ``-distill_coef x (old - teacher)``; with ``distill_only`` that (and ``-kl_coef x KL`` when the
    KL is in the reward) is each token's advantage, undiscounted."""
    episodes = episodes if episodes is not None else episodes_of(samples, scores.device)
    trained_scores = scores
    if moments is not None:
        moments.update(scores[episodes.final] if episodes.split else scores)  # each episode once
        trained_scores = moments.normalize(scores)
    if episodes.split:
        trained_scores, truncated = trained_scores * episodes.final, truncated & episodes.final
    reward_kl_coef = kl_coef if cfg.kl_in == "reward" else 0.0
    rewards, kl = ppo.token_rewards(old_logprobs, ref_logprobs, trained_scores, mask, reward_kl_coef,
                                    cfg.kl_estimator, truncated, cfg.truncation_penalty, cfg.score_clip, turn_rewards)
    if teacher_logprobs is not None and cfg.distill_only:  # with the tether per token too, where it is a reward
        advantages, _ = ppo.distill_advantages(old_logprobs, teacher_logprobs, mask, cfg.distill_coef)
        advantages = advantages - reward_kl_coef * kl
        return kl, advantages, advantages
    if teacher_logprobs is not None:
        rewards = rewards + ppo.distill_rewards(old_logprobs, teacher_logprobs, mask, cfg.distill_coef)
    if cfg.advantage_estimator in ("grpo", "rloo"):  # the buffer serves whole groups, each together
        prompts = torch.tensor([s.prompt_index for s in samples])
        of_episode = torch.zeros(episodes.count, dtype=prompts.dtype).index_copy(0, episodes.ids.cpu(), prompts)
        if episodes.count % group_size or (of_episode.view(-1, group_size) != of_episode[::group_size, None]).any():
            raise ValueError(f"a batch for {cfg.advantage_estimator} must hold the {group_size} responses of each "
                             "prompt together")
    log_ratios = (old_logprobs - behavior_logprobs) * mask if behavior_logprobs is not None else None
    advantages, returns = advantages_of(rewards, old_values, mask, cfg, group_size, log_ratios, episodes)
    return kl, advantages, returns


def train_epochs(actor, critic, batch: SequenceBatch, targets: Targets, config: TetherConfig, kl_coef: float,
                 policy_version: int, carry: StepCarry) -> tuple[dict[str, float], int, list[float]]:
    """Part 3: ``ppo_epochs`` passes over shuffled minibatches. Returns the sum over optimizer steps
    of each loss and statistic, the count of optimizer steps, and DeepSpeed's gradient norm of each
    one applied.

    The shuffle is seeded by (seed, version), prompt by prompt (``shuffled``): every rank draws the
    same minibatches and trains its share of each (``dealt``: by length, or a tree's in runs of like
    packed cost, so the ranks' shares are alike), in micro-batches whose
    gradients DeepSpeed accumulates until the boundary set at the last; scaling each micro-batch's
    loss makes the gradient DeepSpeed steps with that of the whole minibatch."""
    cfg = config.learner
    device, lengths = batch.input_ids.device, batch.lengths
    world = parallel.world_size()
    totals: dict[str, float] = {}
    updates, grad_norms = 0, []
    engines = [actor] if critic is None else [actor, critic]
    shuffle = torch.Generator().manual_seed(config.seed * 1_000_003 + policy_version)
    # batch_size / minibatch_size optimizer steps an epoch, whatever the rows: a batch of episodes in
    # parts has more rows than episodes, its minibatches as many more
    minibatches = cfg.batch_size // cfg.minibatch_size
    units = prompt_units(batch.input_ids, lengths, batch.response_positions[:, 0] + 1)
    for _ in range(cfg.ppo_epochs):
        for all_rows in shuffled(units, shuffle).to(device).tensor_split(minibatches):
            parts = micro_batches_of(dealt(batch, all_rows, cfg.packing, world), lengths, cfg, world,
                                     batch.input_ids, cfg.packing)
            ptx = carry.ptx if cfg.ptx_coef > 0 else None
            ptx_parts = _ptx_parts(ptx, len(parts), device) if ptx is not None else [None] * len(parts)
            for index, rows in enumerate(parts):
                last = index == len(parts) - 1
                for engine in engines:  # DeepSpeed accumulates (GAS 1 in its config) until the last part
                    engine.set_gradient_accumulation_boundary(last)
                # a filler (fewer rows here than another rank has passes): a row at weight 0, as the
                # forward and backward are collectives
                contributions = train_micro_batch(actor, critic, batch, rows if len(rows) else all_rows[:1], all_rows,
                                                  targets, config, kl_coef, policy_version, ptx_parts[index],
                                                  weight=1.0 if len(rows) else 0.0)
                if last:  # the boundary: DeepSpeed reduces, clips and steps
                    norm = optimizer_step.guarded_step(engines, carry.skipped, f"policy version {policy_version}")
                    if norm is not None:
                        grad_norms.append(norm)
                for name, value in contributions.items():
                    totals[name] = totals.get(name, 0.0) + value
            updates += 1
    return totals, updates, grad_norms


def shuffled(units: list[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """The batch's rows in a random order of ``generator``, unit by unit (``prompt_units``: the rows of
    one prompt), each unit's rows side by side: the minibatches cut from it hold a prompt's rows
    together (as verl's do), but where a cut falls among them, so a tree shares their prompt
    (learner.packing) and a group's advantages train together. Units of one row each (one response
    a prompt) are ``torch.randperm`` of the rows. The same whatever learner.packing: every packing
    trains the same minibatches."""
    return torch.cat([units[i] for i in torch.randperm(len(units), generator=generator).tolist()])


def dealt(batch: SequenceBatch, rows: torch.Tensor, packing: Packing, world: int) -> torch.Tensor:
    """This rank's share of a minibatch's ``rows``: dealt by length (``micro_batches.deal``), or for a
    tree in runs of the rows' tokens' order of like packed cost (``micro_batches.deal_in_order``),
    which keeps a prompt's rows on one rank."""
    if packing != "tree":
        return micro_batches.deal(rows, batch.lengths, parallel.rank(), world)
    lengths = batch.lengths[rows]
    order, shared = prefix_order(batch.input_ids[rows], lengths)
    order, shared = order.to(rows.device), shared.to(rows.device)
    return micro_batches.deal_in_order(rows[order], lengths[order] - shared, parallel.rank(), world)


def train_micro_batch(actor, critic, batch: SequenceBatch, rows: torch.Tensor, all_rows: torch.Tensor,
                      targets: Targets, config: TetherConfig, kl_coef: float, policy_version: int,
                      ptx_part: tuple | None, weight: float = 1.0) -> dict[str, float]:
    """Forward and backward of one micro-batch (``rows`` of the minibatch ``all_rows``) through actor
    and critic, each loss scaled by this part's share of the minibatch, such that the shares' sum
    over parts and mean over ranks is the minibatch's. Returns the part's share of each loss and
    statistic. ``weight`` 0: a filler pass, which trains and reports nothing of its rows."""
    cfg, sampling, world = config.learner, config.sampling, parallel.world_size()
    minibatch = batch.select(rows)
    mask = minibatch.response_mask
    cut = (rows, slice(mask.shape[1]))  # [B, T] of the batch -> this part's [b, t]
    share = weight * ppo.data_parallel_scale(mask, targets.mask[all_rows], cfg.loss_aggregation, world)
    token_share = weight * ppo.data_parallel_scale(mask, targets.mask[all_rows], "token-mean", world)

    run = packed(minibatch, cfg.packing, actor)  # laid out once, for the critic too
    logits = forward_logits(actor, run)
    logprobs = logprobs_from_logits(logits, minibatch.response_tokens, sampling)
    norm_length = cfg.loss_norm_length or config.rollout.max_new_tokens  # seq-mean-token-sum-norm's constant
    policy_loss, policy_stats = ppo.ppo_policy_loss(logprobs, targets.old_logprobs[cut], targets.advantages[cut],
                                                    mask, targets.behavior_weights[cut],
                                                    policy_loss_options(cfg, norm_length))
    losses = {"policy_loss": policy_loss}
    if cfg.kl_in == "loss":  # GRPO: the tether as a loss term, with its gradient
        losses["kl_loss"] = kl_coef * ppo.aggregate_loss(
            ppo.kl_per_token(logprobs, targets.ref_logprobs[cut], cfg.kl_estimator), mask, cfg.loss_aggregation,
            norm_length)
    # with its gradient only when it is a loss term: [B, T, V] more to keep for the backward pass
    entropy_per_token = entropy_from_logits(logits if cfg.entropy_coef > 0 else logits.detach(), sampling)
    if cfg.entropy_coef > 0:
        losses["entropy_loss"] = -cfg.entropy_coef * ppo.aggregate_loss(entropy_per_token, mask, cfg.loss_aggregation,
                                                                         norm_length)
    actor_loss = sum(losses.values())
    if parallel.any_rank(not bool(torch.isfinite(actor_loss))):  # before the step: the weights stay
        raise FloatingPointError(f"policy loss is {actor_loss.item()} at policy version {policy_version}")
    actor_objective = share * actor_loss
    contributions = {}
    if ptx_part is not None:
        ptx_share, ptx_loss = _ptx_loss(actor, *ptx_part, world)
        actor_objective = actor_objective + ptx_share * cfg.ptx_coef * ptx_loss
        contributions["ptx_loss"] = float(ptx_share * ptx_loss.detach())
    actor.backward(actor_objective)

    value_stats = {}
    if critic is not None:  # its loss is checked before either engine steps
        values = forward_values(critic, for_model(run, critic))
        value_loss, value_stats = ppo.value_loss(values, targets.old_values[cut], targets.returns[cut], mask,
                                                 cfg.value_clip, cfg.loss_aggregation, norm_length)
        if parallel.any_rank(not bool(torch.isfinite(value_loss))):
            raise FloatingPointError(f"value loss is {value_loss.item()} at policy version {policy_version}")
        critic.backward(share * cfg.value_loss_coef * value_loss)
        losses["value_loss"] = value_loss

    entropy = ppo.masked_mean(entropy_per_token.detach(), mask)
    scaled = {**{k: share * v for k, v in losses.items()}, "entropy": token_share * entropy,
              **{k: token_share * v for k, v in {**policy_stats, **value_stats}.items()}}
    contributions.update({name: float(value.detach() if torch.is_tensor(value) else value)
                          for name, value in scaled.items()})
    return contributions


def policy_loss_options(cfg: LearnerConfig, norm_length: float) -> ppo.PolicyLossOptions:
    """``ppo_policy_loss``'s settings: ``learner.*`` of the same names, and seq-mean-token-sum-norm's
    constant length."""
    return ppo.PolicyLossOptions(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip,
                                 loss_aggregation=cfg.loss_aggregation, ratio_level=cfg.ratio_level,
                                 policy_loss=cfg.policy_loss, norm_length=norm_length)


def step_statistics(samples: list[Sample], scores: torch.Tensor, truncated: torch.Tensor, targets: Targets,
                    kl: torch.Tensor, kl_coef: float, policy_version: int, totals: dict[str, float], updates: int,
                    grad_norms: list[float], episodes: Episodes | None = None) -> dict[str, float]:
    """Part 4: the step's record: losses and statistics averaged over optimizer steps and ranks, the
    rewards, KL, lengths and staleness of the batch, and how far the rollout's logprobs are from the
    learner's for the same weights (only samples of the current version count). The rewards and
    the share truncated are per episode (its last part's), the rest per row."""
    mask = targets.mask
    stats = parallel.mean_over_ranks({name: total / updates for name, total in totals.items()})
    # DeepSpeed's norm, the same on every rank; NaN when every step of this batch was skipped
    stats["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    stats["skipped_steps"] = updates - len(grad_norms)
    response_lengths = mask.sum(dim=1)
    staleness = torch.tensor([policy_version - s.behavior_version for s in samples], dtype=torch.float32)
    on_version = torch.tensor([s.behavior_version == policy_version for s in samples], device=mask.device)
    # the check that weight sync and sampling agree
    gap = (targets.behavior_logprobs - targets.old_logprobs).abs() * mask
    kl_per_episode = (kl * mask).sum(dim=1)  # what the adaptive controller compares with its target
    # an environment's turn rewards and an agent program's return: trained as the score is, so shown with it
    turn_rewards = torch.tensor([float(s.turn_rewards.sum()) if s.turn_rewards is not None else 0.0 for s in samples],
                                dtype=torch.float32, device=scores.device)
    if episodes is not None and episodes.split:
        stats["episode_parts"] = len(samples) / episodes.count
        kl_per_episode = ppo.episode_totals(kl_per_episode, episodes.ids, episodes.count)
        turn_rewards = ppo.episode_totals(turn_rewards, episodes.ids.to(scores.device), episodes.count)
        scores, truncated = scores[episodes.final], truncated[episodes.final]
        samples = [s for s in samples if s.final]
    if any(s.turn_rewards is not None for s in samples):
        stats["turn_reward"] = float(turn_rewards.mean())
    stats.update({
        "reward": float((scores + turn_rewards).mean()),  # what is trained on, before the KL: score and turn rewards
        "score": float(scores.mean()),
        "gold_reward": (sum(s.gold_reward for s in samples) / len(samples)
                        if all(s.gold_reward is not None for s in samples) else None),
        "reward_std": float((scores + turn_rewards).std()) if len(samples) > 1 else 0.0,
        "kl": float(kl_per_episode.mean()),
        "kl_coef": kl_coef,
        "response_length": float(response_lengths.mean()),
        "truncated_frac": float(truncated.float().mean()),
        "advantage_mean": float(ppo.masked_mean(targets.advantages, mask)),
        "return_mean": float(ppo.masked_mean(targets.returns, mask)),
        "staleness": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "staleness_histogram": {str(int(age)): int((staleness == age).sum()) for age in sorted(set(staleness.tolist()))},
        "behavior_logprob_gap": float(gap[on_version].max()) if on_version.any() else None,
    })
    return stats


def behavior_gap(actor, snapshot: list[torch.Tensor], version: int, samples: list[Sample], batch: SequenceBatch,
                 sampling: SamplingConfig, rows: int = 4) -> float | None:
    """The largest |rollout logprob - learner logprob| over up to ``rows`` samples of ``version``,
    the learner computing with ``snapshot``, its weights of that version (``snapshot_weights``): the
    check that weight sync and sampling agree, at any staleness, where ``ppo_step`` can only measure
    samples of the version it holds. None when the batch has no sample of ``version``. Every rank
    computes the same rows (a ZeRO-3 forward is collective)."""
    # a sample whose weights changed while it was generated has tokens of two versions: not comparable
    chosen = [i for i, s in enumerate(samples) if s.behavior_version == s.last_behavior_version == version][:rows]
    if not chosen:
        return None
    part = batch.select(torch.tensor(chosen, device=batch.input_ids.device))
    with weights_swapped(actor, snapshot), torch.no_grad():
        logprobs = logprobs_from_logits(forward_logits(actor, part), part.response_tokens, sampling)
    behavior = _ragged_to_padded([samples[i].behavior_logprobs for i in chosen], part.response_mask)
    return float(((behavior.to(logprobs.device) - logprobs).abs() * part.response_mask).max())


def _in_row_order(rows: torch.Tensor, parts: list[torch.Tensor], width: int,
                  per_part: list[torch.Tensor]) -> torch.Tensor:
    """[len(rows), width]: each part's [b, w] results (w <= width, zero-padded) back in ``rows``' order."""
    out = torch.zeros((len(rows), width), dtype=per_part[0].dtype, device=per_part[0].device)
    position = {int(row): i for i, row in enumerate(rows)}
    for part, values in zip(parts, per_part):
        if len(part):  # a filler's values are no row's
            out[[position[int(row)] for row in part], :values.shape[1]] = values
    return out


def _ragged_to_padded(rows: list, mask: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(mask.shape, dtype=torch.float32)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return padded
