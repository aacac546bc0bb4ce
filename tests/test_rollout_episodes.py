"""Episodes through the real rollout loop, a real vLLM engine and the real buffer: token in, token
out, and environments that fail every way end their episodes with a reason while the run goes on."""

import json

import numpy as np
import pytest

from tests.environments import CompactsOnce, Counting, DoneAtOnce, Garbage, Hangs, Raises, ResetRaises, mixed
from tests.helpers import chunked_logprobs, rollout_one_batch

LOGPROB_TOLERANCE = 1e-4  # as the streaming test's: the same kernels, decode against one chunked prefill

# what each environment of tests.environments.mixed may end its episode with: "length" whenever the
# policy's first turn is cut at max_new_tokens (then no step is taken)
REASONS = {Counting: {"done", "length", "token_budget"}, Raises: {"env_error", "length"},
           Hangs: {"env_deadline", "length"}, Garbage: {"env_error", "length"}, DoneAtOnce: {"done", "length"},
           CompactsOnce: {"restart", "done", "length", "token_budget"}}


@pytest.mark.slow
def test_episodes_train_the_ids_vllm_sampled_and_failing_environments_end_with_a_reason(tmp_path, tiny_assets):
    """k = 0, one batch of episodes with tests.environments.mixed (three turns of counting, or an
    environment that raises, hangs past its deadline, returns garbage, ends at once, or fails at
    its reset, or one that rewrites its context after its first turn, so that it comes in two
    parts). Every sample's policy tokens carry, token by token, the logprobs one chunked vLLM
    pass gives its whole id sequence (so the ids are the ones vLLM generated from, turn after
    turn, part after part); its environment tokens are each observation tokenized alone; its
    reason is the one its environment allows; an episode in parts is its parts in order, the
    context rewritten its last part's prompt; an episode whose reset failed is never a sample and
    its credit came back; the buffer's accounting identity holds and the run ends. (A failed episode
    is trained here, at rollout.failed_episode_reward on its last token, to be seen; by default its
    group is dropped: tests/test_episodes.py.)"""
    from transformers import AutoTokenizer

    from common.prompts import dataset_row, read_rows

    batch = 16
    samples, engine, result = rollout_one_batch(tmp_path, tiny_assets, batch, "rollout.max_new_tokens=8",
                                                "rollout.environment=tests.environments:mixed",
                                                "rollout.env_step_deadline_s=1.0",
                                                "rollout.failed_episode_reward=-1.0")
    assert sum(s.final for s in samples) == batch  # episodes: one in parts is a row a part

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    rows = read_rows(tiny_assets["prompts"])
    kinds = [type(mixed(rows[s.data_row])) for s in samples]
    assert ResetRaises not in kinds
    for sample, kind in zip(samples, kinds):
        assert sample.finish_reason in REASONS[kind], (kind, sample.finish_reason)
        if sample.finish_reason in ("env_error", "env_deadline"):
            assert sample.turn_rewards[-1] == -1.0 and sample.turn_rewards[:-1].sum() == 0
        # the environment's tokens: each observation alone, where the conversation has one
        mask = sample.loss_mask.tolist()
        starts = [i for i in range(1, len(mask)) if mask[i] == 0 and mask[i - 1] == 1]
        observations = [m["content"] for m in json.loads(sample.messages)[2:] if m["role"] == "user"]
        assert len(starts) == len(observations)
        for start, text in zip(starts, observations):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert sample.response_tokens[start:start + len(ids)].tolist() == ids
            assert mask[start:start + len(ids)] == [0] * len(ids) and mask[start + len(ids)] == 1
    multi_turn = [s for s in samples if (np.diff(s.loss_mask.astype(int)) != 0).any()]
    assert multi_turn, "no episode had a second turn"
    cut = [i for i, s in enumerate(samples) if s.finish_reason == "restart"]
    assert cut, "no episode rewrote its context"
    for i in cut:  # the part before the rewrite, then the rest of its episode from the rewritten context
        before, after = samples[i], samples[i + 1]
        assert (before.episode, before.part_index, before.episode_parts) == (after.episode, 0, 2) and after.final
        assert after.prompt_tokens.tolist() == tokenizer("odd 1 :")["input_ids"]
        assert before.turn_rewards[-1] == 0.5 and after.behavior_version >= before.last_behavior_version

    # token out: vLLM's own logprobs of the whole sequence at every policy token
    gaps = []
    for sample, expected in zip(samples, chunked_logprobs(engine, samples)):
        policy = sample.loss_mask == 1
        gaps.append(float(np.max(np.abs(expected[policy] - sample.behavior_logprobs[policy]))))
        assert (sample.behavior_logprobs[~policy] == 0).all()
    engine.llm_engine.engine_core.shutdown()
    print(f"largest logprob gap over {len(multi_turn)} multi-turn of {len(samples)} samples: {max(gaps):.2e}")
    assert max(gaps) < LOGPROB_TOLERANCE, max(gaps)

    # at k = 0 every prompt handed out ends before the batch is whole: those whose reset failed were
    # reported, and their credits went to the prompts after them
    assert result["identity_holds"], result
    handed_out = [type(mixed(rows[dataset_row(0, len(rows), index)])) for index in range(result["prompts_handed_out"])]
    during_the_run = {reason: count for reason, count in result["dropped"].items() if reason != "after_finish"}
    assert during_the_run == ({"episode_env_error": handed_out.count(ResetRaises)} if ResetRaises in handed_out
                              else {}), result["dropped"]
    assert result["credits_returned"] == handed_out.count(ResetRaises)
