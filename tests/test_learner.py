"""The learner's PPO step, weight publishing and checkpoints on real DeepSpeed engines (CPU, gloo)."""

import logging
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import SamplingConfig
from common.config import load_config
from common.models import load_causal_lm, load_critic
from common.sequences import collate
from learner.main import packing_taken
from learner.publish import publish_weights
from learner.step import StepCarry, ppo_step
from protocol.samples import Sample
from tests.helpers import base_config, with_learner
from training.checkpoints import save_hf_checkpoint
from training.deepspeed_engine import make_deepspeed_engine
from training.optimizer_step import SkippedSteps
from training.parallel import init_distributed, remove_stale_build_locks
from weight_sync.buckets import ShmWeightWriter, read_manifest


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_ppo_step_on_real_engines(tmp_path, tiny_assets, samples, zero_stage, restore_environment):
    config = load_config(None, [f"learner.zero_stage={zero_stage}", "learner.batch_size=8",
                                "learner.minibatch_size=4", "learner.actor_lr=1e-3"],
                         base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor = make_deepspeed_engine(load_causal_lm(tiny_assets["policy"]), config.learner.actor_lr, config)
    critic = make_deepspeed_engine(load_critic(tiny_assets["reward"]), config.learner.critic_lr, config)
    import deepspeed.comm.comm

    assert deepspeed.comm.comm.cdb.shm_comm_op is None  # one rank: no shared-memory all-reduce built
    writer = ShmWeightWriter(str(tmp_path / "w"), bucket_bytes=1 << 16)
    with read_manifest(publish_weights(actor, 0, writer)) as published:
        before = {name: tensor.clone() for name, tensor in published.items()}

    batch = collate(samples, pad_token_id=0)
    stats = ppo_step(actor, critic, samples, batch, config, policy_version=0, kl_coef=0.05)

    # the learner recomputes the same logprobs the samples carry: KL 0, importance weights 1
    assert stats["behavior_logprob_gap"] < 1e-4
    assert abs(stats["kl"]) < 1e-4 and stats["behavior_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats["reward"] == pytest.approx(float(np.mean([s.reward for s in samples])), abs=1e-5)
    assert stats["response_length"] == pytest.approx(np.mean([len(s.response_tokens) for s in samples]))
    assert stats["staleness"] == 0.0 and 0.0 <= stats["clipfrac"] <= 1.0
    for key in ("entropy", "value_loss", "policy_loss", "approx_kl", "grad_norm"):
        assert np.isfinite(stats[key]), key
    assert stats["grad_norm"] > 0

    with read_manifest(publish_weights(actor, 1, writer)) as published:
        after = {name: tensor.clone() for name, tensor in published.items()}
    assert set(after) == set(before) and all(after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(after[k], before[k]) for k in before), "the step changed no weight"

    checkpoint = save_hf_checkpoint(actor, tiny_assets["policy"], str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert all(torch.equal(reloaded.state_dict()[k], after[k]) for k in after)
    assert os.path.exists(os.path.join(checkpoint, "tokenizer.json"))


def test_a_nan_in_the_actor_stops_the_step_before_any_update(tmp_path, tiny_assets, samples, restore_environment):
    config = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=4"],
                         base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor_model = load_causal_lm(tiny_assets["policy"])
    with torch.no_grad():
        actor_model.lm_head.weight[3, 0] = float("nan")
    actor = make_deepspeed_engine(actor_model, config.learner.actor_lr, config)
    critic = make_deepspeed_engine(load_critic(tiny_assets["reward"]), config.learner.critic_lr, config)
    critic_before = {k: v.clone() for k, v in critic.module.state_dict().items()}
    with pytest.raises(FloatingPointError, match="actor logits hold NaN"):
        ppo_step(actor, critic, samples, collate(samples, pad_token_id=0), config, policy_version=0, kl_coef=0.05)
    assert all(torch.equal(v, critic_before[k]) for k, v in critic.module.state_dict().items())


class _NanBackward(torch.autograd.Function):
    """The identity forward, NaN gradients backward: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _nan_gradients_from(module: torch.nn.Module, when=lambda: True):
    """Make the gradients through ``module``'s output NaN while ``when()`` holds."""
    return module.register_forward_hook(
        lambda _, __, out: (_NanBackward.apply(out[0]), *out[1:]) if isinstance(out, tuple) and when()
        else _NanBackward.apply(out) if torch.is_tensor(out) and when() else out)


def _weights(engine) -> dict[str, torch.Tensor]:
    from training.deepspeed_engine import full_parameters

    with full_parameters(engine) as module:
        return {name: p.detach().clone() for name, p in module.named_parameters()}


def _adam_state(engine) -> list[torch.Tensor]:
    return [value.clone() for state in engine.basic_optimizer.state.values() for value in state.values()]


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_nan_gradients_from_a_finite_loss_skip_the_step_and_keep_weights_and_adam_state(
        tmp_path, tiny_assets, samples, zero_stage, restore_environment):
    """One good step (so Adam holds moments), then a step whose loss is finite and whose gradients
    are NaN: skipped and counted, the weights and Adam's moments and step count exactly as before;
    the step after it, with good gradients, trains again."""
    from training.optimizer_step import SkippedSteps

    config = load_config(None, [f"learner.zero_stage={zero_stage}", "learner.batch_size=8", "learner.minibatch_size=8",
                                "learner.ppo_epochs=1", "learner.actor_lr=1e-3"],
                         base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor_model = load_causal_lm(tiny_assets["policy"])
    poisoned = {"on": False}
    _nan_gradients_from(actor_model.get_input_embeddings(), lambda: poisoned["on"])
    actor = make_deepspeed_engine(actor_model, config.learner.actor_lr, config)
    critic = make_deepspeed_engine(load_critic(tiny_assets["reward"]), config.learner.critic_lr, config)
    batch, skipped = collate(samples, pad_token_id=0), SkippedSteps(limit=3)
    step = lambda version: ppo_step(actor, critic, samples, batch, config,
                                    policy_version=version, kl_coef=0.05,
                                    carry=StepCarry(skipped))
    first = step(0)
    assert first["skipped_steps"] == 0 and np.isfinite(first["grad_norm"])
    weights, actor_state, critic_state = _weights(actor), _adam_state(actor), _adam_state(critic)
    assert actor_state and all(torch.isfinite(t).all() for t in actor_state)

    poisoned["on"] = True
    bad = step(1)
    assert np.isfinite(bad["policy_loss"]) and bad["skipped_steps"] == 1 and np.isnan(bad["grad_norm"])
    assert (skipped.total, skipped.in_a_row) == (1, 1)
    assert all(torch.equal(weights[k], v) for k, v in _weights(actor).items())
    assert all(torch.equal(a, b) for a, b in zip(actor_state, _adam_state(actor)))
    assert all(torch.equal(a, b) for a, b in zip(critic_state, _adam_state(critic)))  # both engines skip together

    poisoned["on"] = False
    good = step(2)
    assert good["skipped_steps"] == 0 and skipped.in_a_row == 0 and skipped.total == 1
    assert any(not torch.equal(weights[k], v) for k, v in _weights(actor).items())
    assert all(torch.isfinite(v).all() for v in _weights(actor).values())


def test_nan_gradients_step_after_step_stop_at_the_limit(tmp_path, tiny_assets, samples, restore_environment):
    from training.optimizer_step import NonFiniteGradients, SkippedSteps

    config = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=4", "learner.ppo_epochs=2",
                                "learner.max_skipped_steps=3"], base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor_model = load_causal_lm(tiny_assets["policy"])
    _nan_gradients_from(actor_model.get_input_embeddings())
    actor = make_deepspeed_engine(actor_model, config.learner.actor_lr, config)
    before = _weights(actor)
    skipped = SkippedSteps(config.learner.max_skipped_steps)
    with pytest.raises(NonFiniteGradients, match="3 optimizer steps in a row had NaN or inf gradients"):
        ppo_step(actor, None, samples, collate(samples, pad_token_id=0), with_learner(config, {"advantage_estimator": "reinforce_pp"}),
                 policy_version=0, kl_coef=0.05,
                 carry=StepCarry(skipped))
    assert skipped.total == 3  # of the 4 minibatches, the fourth never ran
    assert all(torch.equal(before[k], v) for k, v in _weights(actor).items())


def test_a_nan_value_loss_stops_the_step_before_the_actor_steps(tmp_path, tiny_assets, samples,
                                                               restore_environment):
    """The critic's values are finite without a gradient (the proximal pass) and NaN with one: the
    learner finds it before the actor's optimizer steps on that minibatch."""
    config = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=8", "learner.ppo_epochs=1"],
                         base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor = make_deepspeed_engine(load_causal_lm(tiny_assets["policy"]), config.learner.actor_lr, config)
    critic_model = load_critic(tiny_assets["reward"])
    critic_model.head.register_forward_hook(lambda _, __, out: out * float("nan") if torch.is_grad_enabled() else out)
    critic = make_deepspeed_engine(critic_model, config.learner.critic_lr, config)
    before = _weights(actor)
    with pytest.raises(FloatingPointError, match="critic values hold NaN"):
        ppo_step(actor, critic, samples, collate(samples, pad_token_id=0), config, policy_version=0, kl_coef=0.05)
    assert all(torch.equal(before[k], v) for k, v in _weights(actor).items())


def test_final_is_replaced_whole_and_a_crash_before_the_rename_keeps_the_old_one(
        tmp_path, tiny_assets, samples, restore_environment, monkeypatch):
    import training.checkpoints as checkpoints

    config = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=8", "learner.ppo_epochs=1",
                                "learner.actor_lr=1e-2"], base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor = make_deepspeed_engine(load_causal_lm(tiny_assets["policy"]), config.learner.actor_lr, config)
    final = str(tmp_path / "checkpoints" / "final")
    save_hf_checkpoint(actor, tiny_assets["policy"], final)
    first = AutoModelForCausalLM.from_pretrained(final).state_dict()
    ppo_step(actor, None, samples, collate(samples, pad_token_id=0), with_learner(config, {"advantage_estimator": "reinforce_pp"}),
             policy_version=0, kl_coef=0.05)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))

    def crash(source, target):
        raise KeyboardInterrupt("killed between write and rename")

    monkeypatch.setattr(checkpoints, "replace_directory", crash)
    with pytest.raises(KeyboardInterrupt):
        save_hf_checkpoint(actor, tiny_assets["policy"], final)
    # everything written was on disk before the rename would have named it: each file and the directory
    written = os.listdir(final + ".tmp")
    assert {os.path.join(final + ".tmp", name) for name in written} <= set(synced) and final + ".tmp" in synced
    assert all(torch.equal(v, first[k]) for k, v in AutoModelForCausalLM.from_pretrained(final).state_dict().items())

    monkeypatch.undo()
    save_hf_checkpoint(actor, tiny_assets["policy"], final)
    trained = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert any(not torch.equal(v, first[k]) for k, v in trained.items())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["final"]  # no .tmp, no .old left


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_logprob_gap_is_measured_on_last_versions_samples_with_last_versions_weights(
        tmp_path, tiny_assets, samples, zero_stage, restore_environment):
    """At max_staleness >= 1 a batch holds samples of the version before the learner's: it measures
    the rollout's logprobs against its own with that version's weights, kept from a step earlier;
    with its current weights the same samples would show the update, not the sync."""
    from learner.step import behavior_gap
    from training.deepspeed_engine import snapshot_weights

    config = load_config(None, [f"learner.zero_stage={zero_stage}", "learner.batch_size=8",
                                "learner.minibatch_size=8", "learner.ppo_epochs=2", "learner.actor_lr=1e-2"],
                         base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor = make_deepspeed_engine(load_causal_lm(tiny_assets["policy"]), config.learner.actor_lr, config)
    batch = collate(samples, pad_token_id=0)
    version_0 = snapshot_weights(actor)
    stats = ppo_step(actor, None, samples, batch, with_learner(config, {"advantage_estimator": "reinforce_pp"}),
                     policy_version=1, kl_coef=0.05)
    assert stats["behavior_logprob_gap"] is None  # at version 1 it holds no sample of version 1
    after = _weights(actor)
    assert behavior_gap(actor, version_0, 0, samples, batch, SamplingConfig()) < 1e-4
    assert all(torch.equal(after[k], v) for k, v in _weights(actor).items())  # its own weights are back
    assert behavior_gap(actor, snapshot_weights(actor), 0, samples, batch, SamplingConfig()) > 1e-3
    assert behavior_gap(actor, version_0, 7, samples, batch, SamplingConfig()) is None  # no sample of version 7


def test_stale_build_locks_are_removed_and_fresh_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "other" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = os.path.getmtime(fresh) - 3600
    os.utime(stale, (hour_ago, hour_ago))
    assert remove_stale_build_locks(max_age_s=900) == [str(stale)]
    assert not stale.exists() and fresh.exists()


# --------------------------------------------------------------------------- the recipe's options


def one_step(tmp_path, tiny_assets, samples, *overrides, ptx=None):
    """Fresh engines from the tiny assets, one ppo_step with ``overrides``; returns the stats, the
    actor's weights after the step and the actor."""
    config = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=8", "learner.ppo_epochs=1",
                                "learner.actor_lr=1e-3", *overrides], base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    torch.manual_seed(0)
    actor = make_deepspeed_engine(load_causal_lm(tiny_assets["policy"], config.models.dtype), config.learner.actor_lr, config)
    critic = (make_deepspeed_engine(load_critic(tiny_assets["reward"], config.models.dtype), config.learner.critic_lr, config)
              if config.learner.advantage_estimator == "gae" and not config.learner.distill_only else None)
    config = packing_taken(config, [actor, critic], logging.getLogger("test"))  # as the learner starts
    stats = ppo_step(actor, critic, samples, collate(samples, pad_token_id=0), config,
                     policy_version=0, kl_coef=0.05,
                     carry=StepCarry(SkippedSteps(config.learner.max_skipped_steps), ptx=ptx))
    writer = ShmWeightWriter(str(tmp_path / f"w{len(os.listdir(tmp_path))}"), bucket_bytes=1 << 16)
    with read_manifest(publish_weights(actor, 1, writer)) as published:
        weights = {name: tensor.clone() for name, tensor in published.items()}
    writer.close(remove=True)
    return stats, weights, actor


def test_the_grad_norm_is_this_steps_under_zero_2_as_under_zero_0(tmp_path, tiny_assets, samples,
                                                                  restore_environment):
    """ZeRO-2 computes the norm inside step(): read before it, the first step showed none (0)."""
    zero0, weights0, _ = one_step(tmp_path, tiny_assets, samples, "learner.zero_stage=0")
    zero2, weights2, _ = one_step(tmp_path, tiny_assets, samples, "learner.zero_stage=2")
    assert zero0["grad_norm"] > 0
    assert zero2["grad_norm"] == pytest.approx(zero0["grad_norm"], rel=1e-4)
    assert all(torch.allclose(weights0[k], weights2[k], atol=1e-6) for k in weights0)


def test_gradient_checkpointing_trains_the_same_weights(tmp_path, tiny_assets, samples, restore_environment):
    plain, plain_weights, _ = one_step(tmp_path, tiny_assets, samples)
    checkpointed, weights, actor = one_step(tmp_path, tiny_assets, samples, "learner.gradient_checkpointing=true")
    assert actor.module.is_gradient_checkpointing and actor.module.training
    assert checkpointed["policy_loss"] == pytest.approx(plain["policy_loss"], abs=1e-6)
    assert all(torch.allclose(plain_weights[k], weights[k], atol=1e-6) for k in weights)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_a_critic_free_step_trains_without_a_critic(tmp_path, tiny_assets, samples, estimator, restore_environment):
    import dataclasses

    grouped = [dataclasses.replace(s, prompt_index=i // 2) for i, s in enumerate(samples)]  # pairs, as served
    stats, _, _ = one_step(tmp_path, tiny_assets, grouped, f"learner.advantage_estimator={estimator}",
                              "rollout.samples_per_prompt=2", "learner.kl_in=loss", "learner.entropy_coef=0.01")
    assert "value_loss" not in stats and np.isfinite(stats["policy_loss"]) and stats["grad_norm"] > 0
    # on-policy, reference = policy: the KL term is 0; the entropy bonus is its coefficient x the entropy
    assert stats["kl_loss"] == pytest.approx(0.0, abs=1e-5)
    assert stats["entropy_loss"] == pytest.approx(-0.01 * stats["entropy"], rel=1e-4)


def test_a_batch_of_one_sample_with_a_one_token_response_trains(tmp_path, tiny_assets, samples, restore_environment):
    one = samples[0]
    single = Sample("one", 0, 0, one.prompt_tokens, one.response_tokens[:1], one.behavior_logprobs[:1], "length",
                    ref_logprobs=one.ref_logprobs[:1], reward=0.7)
    config = load_config(None, ["learner.batch_size=1", "learner.minibatch_size=1"],
                         base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor = make_deepspeed_engine(load_causal_lm(tiny_assets["policy"]), config.learner.actor_lr, config)
    critic = make_deepspeed_engine(load_critic(tiny_assets["reward"]), config.learner.critic_lr, config)
    stats = ppo_step(actor, critic, [single], collate([single], pad_token_id=0), config,
                     policy_version=0, kl_coef=0.05)
    assert stats["response_length"] == 1.0 and np.isfinite(stats["policy_loss"]) and np.isfinite(stats["value_loss"])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_accumulate_to_the_minibatchs_step(tmp_path, tiny_assets, samples, aggregation,
                                                         restore_environment):
    """A minibatch of 8 in one pass, or in 4 micro-batches of 2 whose gradients DeepSpeed
    accumulates: the same update, the same logged losses and gradient norm."""
    whole, whole_weights, _ = one_step(tmp_path, tiny_assets, samples, f"learner.loss_aggregation={aggregation}")
    parts, parts_weights, _ = one_step(tmp_path, tiny_assets, samples, f"learner.loss_aggregation={aggregation}",
                                       "learner.micro_batch_size=2")
    for key in ("policy_loss", "value_loss", "entropy", "grad_norm", "clipfrac"):
        assert parts[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), key
    # Adam's first update is about lr x sign(gradient): summing in another order moved a few weights
    # by ~3e-6 here; a wrong scale would move them by ~lr (1e-3)
    assert all(torch.allclose(whole_weights[k], parts_weights[k], atol=1e-5) for k in whole_weights)


def gradients_at_the_step(monkeypatch) -> list[dict]:
    """Record every engine's accumulated gradients (ZeRO-0: whole, unscaled, on ``p.grad``) just
    before each optimizer step."""
    import training.optimizer_step

    recorded, step = [], training.optimizer_step.step_unless_nonfinite

    def recording(engines, *args):
        recorded.append({f"{i}.{name}": p.grad.detach().clone() for i, engine in enumerate(engines)
                         for name, p in engine.module.named_parameters() if p.grad is not None})
        return step(engines, *args)

    monkeypatch.setattr(training.optimizer_step, "step_unless_nonfinite", recording)
    return recorded


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_a_token_budget_gives_the_gradients_of_fixed_micro_batches(tmp_path, tiny_assets, samples, aggregation,
                                                                  monkeypatch, restore_environment):
    """The same minibatch of 8 (sequences of 8 to 12 tokens) in fixed micro-batches of 2 rows,
    each padded to the batch's longest, or by a budget of 24 tokens: rows sorted by length, 2 or
    3 a pass, each pass trimmed to its longest row. Actor and critic get the same gradients
    before the step, and the step the same losses."""
    lengths = sorted(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    assert lengths[0] < lengths[-1] <= 12  # passes of several sizes, and padding to trim
    recorded = gradients_at_the_step(monkeypatch)
    fixed, fixed_weights, _ = one_step(tmp_path, tiny_assets, samples, f"learner.loss_aggregation={aggregation}",
                                       "learner.micro_batch_size=2")
    fixed_grads = recorded[:]
    recorded.clear()
    budget_grads = recorded
    budget, budget_weights, _ = one_step(tmp_path, tiny_assets, samples, f"learner.loss_aggregation={aggregation}",
                                         "learner.max_tokens_per_microbatch=24", "rollout.max_model_len=24")
    assert len(fixed_grads) == len(budget_grads) == 1 and fixed_grads[0].keys() == budget_grads[0].keys()
    scale = max(float(g.abs().max()) for g in fixed_grads[0].values())
    gap = max(float((fixed_grads[0][k] - budget_grads[0][k]).abs().max()) for k in fixed_grads[0])
    assert scale > 1e-3 and gap < 1e-6 * max(scale, 1.0), (gap, scale)  # float32 sums in another order
    for key in ("policy_loss", "value_loss", "entropy", "grad_norm", "clipfrac"):
        assert budget[key] == pytest.approx(fixed[key], rel=1e-5, abs=1e-6), key
    assert all(torch.allclose(fixed_weights[k], budget_weights[k], atol=1e-5) for k in fixed_weights)


def test_micro_batches_are_cut_by_the_budget_and_trimmed(tmp_path, tiny_assets, samples):
    """What the step above computes: passes of at most 24 padded tokens, each no wider than its
    longest row, against fixed passes as wide as the batch's longest."""
    from training.micro_batches import micro_batches_of

    batch = collate(samples, pad_token_id=0)
    cfg = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=8", "learner.max_tokens_per_microbatch=24",
                             "rollout.max_model_len=24"], base=base_config(tmp_path, tiny_assets)).learner
    parts = micro_batches_of(torch.arange(8), batch.lengths, cfg, world=1)
    assert sorted(torch.cat(parts).tolist()) == list(range(8)) and len(parts) >= 3
    assert min(batch.select(rows).input_ids.shape[1] for rows in parts) < batch.input_ids.shape[1]  # trimmed
    for rows in parts:
        part = batch.select(rows)
        assert part.input_ids.shape[0] * part.input_ids.shape[1] <= 24
        assert part.input_ids.shape[1] == int(batch.lengths[rows].max())
        assert part.response_tokens.shape[1] == int(part.response_mask.sum(dim=1).max())


PTX_TEXTS = ["even 2 4 6 : 8 0 2", "odd 1 3 5 : 7 9 1 3", "even 0 0 0 : 2 2", "odd 9 9 : 5", "even 8 : 6 4 2 0",
             "odd 3 : 1 1 1", "even 4 4 : 8", "odd 7 7 7 : 3 5 7 9"]


def ptx_stream(tiny_assets, tmp_path):
    import json

    from learner.ptx import PtxStream, read_ptx

    path = tmp_path / "ptx.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in PTX_TEXTS))
    return str(path), PtxStream(read_ptx(str(path), AutoTokenizer.from_pretrained(tiny_assets["policy"]), 64),
                                batch_size=8, seed=0)


def hf_nll(model_dir_or_model, tiny_assets, texts):
    """The mean next-token loss over every token of ``texts``, as transformers computes it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    model = (AutoModelForCausalLM.from_pretrained(model_dir_or_model) if isinstance(model_dir_or_model, str)
             else model_dir_or_model).eval()
    rows = [tokenizer(text)["input_ids"] for text in texts]
    ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = labels[i, :len(row)] = torch.tensor(row)
    with torch.no_grad():
        return float(model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss)


def test_ppo_ptx_adds_the_language_modelling_loss_of_its_text(tmp_path, tiny_assets, samples, restore_environment):
    path, stream = ptx_stream(tiny_assets, tmp_path)
    before = hf_nll(tiny_assets["policy"], tiny_assets, PTX_TEXTS)
    with_ptx, weights, actor = one_step(tmp_path, tiny_assets, samples, "learner.ptx_coef=5.0", f"data.ptx={path}",
                                        ptx=stream)
    # the logged loss is transformers' own loss on the same text, with the weights before the step
    assert with_ptx["ptx_loss"] == pytest.approx(before, rel=1e-4)
    after_ptx = hf_nll(actor.module, tiny_assets, PTX_TEXTS)
    _, _, plain_actor = one_step(tmp_path, tiny_assets, samples)
    after_plain = hf_nll(plain_actor.module, tiny_assets, PTX_TEXTS)
    assert after_ptx < after_plain  # the step also learned the text
    # in micro-batches: the same loss
    _, stream = ptx_stream(tiny_assets, tmp_path)
    parts, _, _ = one_step(tmp_path, tiny_assets, samples, "learner.ptx_coef=5.0", f"data.ptx={path}",
                           "learner.micro_batch_size=2", ptx=stream)
    assert parts["ptx_loss"] == pytest.approx(with_ptx["ptx_loss"], rel=1e-4)
    assert parts["grad_norm"] == pytest.approx(with_ptx["grad_norm"], rel=1e-4)


def test_lora_trains_only_adapters_and_publishes_merged_weights(tmp_path, tiny_assets, samples, restore_environment):
    from training.lora import critic_with_lora, with_lora

    config = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=8", "learner.ppo_epochs=1",
                                "learner.actor_lr=1e-2", "learner.lora_rank=4"],
                         base=base_config(tmp_path, tiny_assets))
    init_distributed(config)
    actor = make_deepspeed_engine(with_lora(load_causal_lm(tiny_assets["policy"]), config.learner), 1e-2, config)
    critic = make_deepspeed_engine(critic_with_lora(load_critic(tiny_assets["reward"]), config.learner), 1e-3, config)
    trainable = {name for name, p in actor.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    assert any(".lora_" in n for n, p in critic.module.named_parameters() if p.requires_grad)
    assert all(p.requires_grad for p in critic.module.head.parameters())  # the value head trains whole

    sft = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).state_dict()
    writer = ShmWeightWriter(str(tmp_path / "w"), bucket_bytes=1 << 16)
    with read_manifest(publish_weights(actor, 0, writer)) as published:
        assert set(published) == set(sft)  # the base model's names: what vLLM loads
        assert all(torch.equal(published[k], sft[k]) for k in sft)  # B starts at 0: merged = base
    base_before = {n: p.detach().clone() for n, p in actor.module.named_parameters() if not p.requires_grad}
    ppo_step(actor, critic, samples, collate(samples, pad_token_id=0), config, policy_version=0, kl_coef=0.05)
    assert all(torch.equal(p, base_before[n]) for n, p in actor.module.named_parameters() if not p.requires_grad)
    with read_manifest(publish_weights(actor, 1, writer)) as published:
        after = {name: tensor.clone() for name, tensor in published.items()}
    changed = [k for k in sft if not torch.equal(after[k], sft[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # the adapted linear layers, merged

    checkpoint = save_hf_checkpoint(actor, tiny_assets["policy"], str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    assert all(torch.equal(reloaded[k], after[k]) for k in after)
    assert os.path.exists(os.path.join(checkpoint, "adapter", "adapter_model.safetensors"))
    writer.close(remove=True)


def test_the_learner_trains_in_the_dtype_it_is_given(tmp_path, tiny_assets, samples, restore_environment):
    """bf16 weights (DeepSpeed keeps fp32 masters): the step's figures are the fp32 step's to bf16
    precision, and the weights the rollout gets are bf16."""
    full, full_weights, _ = one_step(tmp_path, tiny_assets, samples)
    half, half_weights, actor = one_step(tmp_path, tiny_assets, samples, "models.dtype=bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in actor.module.parameters())
    assert all(w.dtype == torch.bfloat16 for w in half_weights.values())
    for key in ("policy_loss", "value_loss", "entropy", "grad_norm"):
        assert half[key] == pytest.approx(full[key], rel=0.05, abs=1e-3), key


def test_a_group_estimator_refuses_a_batch_whose_groups_are_apart(tmp_path, tiny_assets, samples,
                                                                   restore_environment):
    with pytest.raises(ValueError, match="must hold the 2 responses of each prompt together"):
        one_step(tmp_path, tiny_assets, samples, "learner.advantage_estimator=grpo", "rollout.samples_per_prompt=2")


def _as_episodes(samples, env_logprob=None):
    """``samples`` as episodes: in each response of 4 or more tokens the 2nd and 3rd are the
    environment's (an observation between two turns), with a turn reward on the first token.
    ``env_logprob``: what the environment's tokens carry as behavior and reference logprobs
    (they have none; whatever they carry must not matter)."""
    import copy

    episodes = []
    for sample in samples:
        episode = copy.copy(sample)
        n = len(sample.response_tokens)
        episode.loss_mask = np.ones(n, np.uint8)
        episode.turn_rewards = np.zeros(n, np.float32)
        if n >= 4:
            episode.loss_mask[1:3] = 0
            episode.turn_rewards[0] = 0.3
            if env_logprob is not None:
                episode.behavior_logprobs, episode.ref_logprobs = (sample.behavior_logprobs.copy(),
                                                                   sample.ref_logprobs.copy())
                episode.behavior_logprobs[1:3] = episode.ref_logprobs[1:3] = env_logprob
        episodes.append(episode)
    return episodes


def test_an_episodes_environment_tokens_are_never_trained_on(tmp_path, tiny_assets, samples, restore_environment):
    """Two batches of episodes that differ only in what their environment tokens carry train the
    same weights, bit for bit; the same samples with every token the policy's train others."""
    assert any(len(s.response_tokens) >= 4 for s in samples)
    stats, weights, _ = one_step(tmp_path, tiny_assets, _as_episodes(samples))
    _, other_weights, _ = one_step(tmp_path, tiny_assets, _as_episodes(samples, env_logprob=-30.0))
    _, single_weights, _ = one_step(tmp_path, tiny_assets, samples)
    assert all(torch.equal(weights[name], other_weights[name]) for name in weights)
    assert any(not torch.equal(weights[name], single_weights[name]) for name in weights)
    policy_tokens = sum(int(s.loss_mask.sum()) for s in _as_episodes(samples))
    assert stats["response_length"] == pytest.approx(policy_tokens / len(samples))  # the policy's tokens alone
    assert stats["behavior_logprob_gap"] < 1e-4  # measured on the policy's tokens
    # the reward shown is what is trained on: the score and the environment's turn rewards
    turn_rewards = [float(s.turn_rewards.sum()) for s in _as_episodes(samples)]
    assert stats["turn_reward"] == pytest.approx(np.mean(turn_rewards)) and stats["turn_reward"] > 0
    assert stats["score"] == pytest.approx(float(np.mean([s.reward for s in samples])), abs=1e-5)
    assert stats["reward"] == pytest.approx(stats["score"] + stats["turn_reward"], abs=1e-5)


def test_the_off_policy_options_reach_the_step(tmp_path, tiny_assets, samples, restore_environment):
    """learner.ratio_level, policy_loss and behavior_correction as the step applies them. At the
    step's first update every ratio is 1: GSPO-token's gradient is PPO's, and CISPO's (whose loss is
    -A log pi, not -A) too, so one step trains the same weights. Samples of an older policy make
    masking and truncating differ, and the step reports what each did."""
    import dataclasses

    base, base_weights, _ = one_step(tmp_path, tiny_assets, samples)
    gspo, gspo_weights, _ = one_step(tmp_path, tiny_assets, samples, "learner.ratio_level=sequence")
    cispo, cispo_weights, _ = one_step(tmp_path, tiny_assets, samples, "learner.policy_loss=cispo")
    assert gspo["policy_loss"] == pytest.approx(base["policy_loss"], abs=1e-6)
    assert cispo["policy_loss"] != pytest.approx(base["policy_loss"], abs=1e-3)
    for weights in (gspo_weights, cispo_weights):
        assert all(torch.allclose(base_weights[k], weights[k], atol=1e-6) for k in base_weights)
    assert base["correction_truncated_frac"] == base["behavior_truncated_frac"] == 0.0
    assert base["behavior_ratio_p50"] == pytest.approx(1.0, abs=1e-3)

    generator = np.random.default_rng(0)  # an older policy sampled them: weights from e^-1 to e^1
    stale = [dataclasses.replace(s, behavior_logprobs=(s.behavior_logprobs + generator.uniform(
        -1, 1, len(s.behavior_logprobs))).astype(np.float32)) for s in samples]
    truncated, truncated_weights, _ = one_step(tmp_path, tiny_assets, stale)
    masked, masked_weights, _ = one_step(tmp_path, tiny_assets, stale, "learner.behavior_correction=mask",
                                         "learner.behavior_weight_floor=0.5",
                                         "learner.behavior_correction_level=sequence")
    assert 0 < truncated["correction_truncated_frac"] < 1 and truncated["correction_seq_truncated_frac"] > 0
    # token-level truncation: the health auto-staleness reads is the same share
    assert truncated["behavior_truncated_frac"] == pytest.approx(truncated["correction_truncated_frac"])
    assert 0 < masked["correction_masked_frac"] <= 1 and masked["correction_seq_masked_frac"] > 0
    assert masked["behavior_ratio_p95"] == pytest.approx(truncated["behavior_ratio_p95"], rel=1e-6)  # the same batch
    assert not all(torch.allclose(truncated_weights[k], masked_weights[k], atol=1e-6) for k in truncated_weights)


def taught(samples, teacher_dir):
    """``samples`` with a teacher's logprobs of their tokens, as the scorer gives them."""
    import dataclasses

    from scorer.scoring import reference_logprobs

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    out = [dataclasses.replace(s) for s in samples]
    for s, logprobs in zip(out, reference_logprobs(teacher, out, 0, SamplingConfig())):
        s.teacher_logprobs = logprobs.numpy()
    return out


def test_pure_distillation_trains_each_token_on_its_reverse_kl_to_the_teacher_without_a_critic(
        tmp_path, tiny_assets, samples, restore_environment):
    """On-policy samples (ratio 1): the policy loss is minus the mean advantage, each token's
    advantage -distill_coef x (log pi_old - log pi_teacher): the formula's value, and teacher_kl the
    mean of that difference; no critic, no score."""
    students = taught(samples, tiny_assets["base"])
    distill = ["models.teacher=" + tiny_assets["base"], "models.reward=null", "learner.distill_only=true"]
    stats, weights, _ = one_step(tmp_path, tiny_assets, students, *distill, "learner.distill_coef=0.5")
    difference = np.concatenate([s.ref_logprobs - s.teacher_logprobs for s in students])  # old = ref = behavior
    assert stats["teacher_kl"] == pytest.approx(float(difference.mean()), abs=1e-4)
    assert stats["policy_loss"] == pytest.approx(0.5 * float(difference.mean()), abs=1e-4)
    assert stats["advantage_mean"] == pytest.approx(-0.5 * float(difference.mean()), abs=1e-4)
    assert "value_loss" not in stats and stats["grad_norm"] > 0
    plain, plain_weights, _ = one_step(tmp_path, tiny_assets, students, *distill, "learner.distill_coef=1.0")
    assert any(not torch.equal(weights[k], plain_weights[k]) for k in weights)  # the coefficient reaches the step


def test_distillation_adds_its_token_rewards_to_the_score_and_the_tether_before_gae(tiny_assets, samples):
    from learner import ppo
    from learner.step import rewards_and_advantages

    students = taught(samples, tiny_assets["base"])
    config = load_config(None, ["learner.batch_size=8", "learner.minibatch_size=8", "learner.distill_coef=0.3",
                                "models.teacher=/t"], base={"models": {"policy": "/p", "reward": "/r"},
                                                            "data": {"prompts": "/d"}})
    batch = collate(students, pad_token_id=0)
    mask = batch.response_mask
    pad = lambda column: torch.nn.utils.rnn.pad_sequence(  # noqa: E731
        [torch.tensor(getattr(s, column)) for s in students], batch_first=True)[:, :mask.shape[1]]
    old, ref, teacher = pad("behavior_logprobs") + 0.01, pad("ref_logprobs"), pad("teacher_logprobs")
    values = torch.linspace(-1, 1, mask.numel()).view_as(mask) * mask
    scores = torch.tensor([s.reward for s in students])
    truncated = torch.zeros(len(students), dtype=torch.bool)
    kl, advantages, returns = rewards_and_advantages(students, old, values, ref, scores, truncated, mask,
                                                     config.learner, 0.05, None, 1, teacher_logprobs=teacher)
    # by hand: the score at the last token, -0.05 x KL and -0.3 x (old - teacher) at every token, then GAE
    rewards = -0.05 * (old - ref) * mask - 0.3 * (old - teacher) * mask
    last = mask.sum(dim=1).long() - 1
    rewards[torch.arange(len(students)), last] += scores
    expected, expected_returns = ppo.gae_advantages(rewards, values, mask, config.learner.gamma, config.learner.lam)
    expected = ppo.masked_whiten(expected, mask) if config.learner.whiten_advantages else expected
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, expected_returns, atol=1e-5, rtol=0)
    # pure distillation: each token's own reverse KL, and the tether where it is a reward; no score, no GAE
    only = config.learner.model_copy(update={"distill_only": True})
    _, advantages, _ = rewards_and_advantages(students, old, None, ref, scores, truncated, mask, only, 0.05, None, 1,
                                              teacher_logprobs=teacher)
    torch.testing.assert_close(advantages, (-0.3 * (old - teacher) - 0.05 * (old - ref)) * mask, atol=1e-6, rtol=0)


def test_distillation_trains_a_lora_policy(tmp_path, tiny_assets, samples, restore_environment):
    """The teacher's logprobs come with the samples: a LoRA student trains its adapters on them."""
    students = taught(samples, tiny_assets["base"])
    stats, weights, actor = one_step(tmp_path, tiny_assets, students, "models.teacher=" + tiny_assets["base"],
                                     "models.reward=null", "learner.distill_only=true", "learner.lora_rank=4",
                                     "learner.actor_lr=1e-2")
    base = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).state_dict()
    assert np.isfinite(stats["policy_loss"]) and stats["grad_norm"] > 0 and stats["teacher_kl"] > 0
    assert any(not torch.equal(weights[k], base[k]) for k in weights)  # merged: the adapters moved the weights
