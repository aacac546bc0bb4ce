"""Episodes through the real rollout loop, a real vLLM engine and the real buffer: token in, token
out, and environments that fail every way end their episodes with a reason while the run goes on."""

import json
import threading

import numpy as np
import pytest

from bench.buffer_throughput import scorer_process  # a scorer that returns its work as scored
from tests.environments import Counting, DoneAtOnce, Garbage, Hangs, Raises, ResetRaises, mixed
from tests.helpers import start_buffer

LOGPROB_TOLERANCE = 1e-4  # as the streaming test's: the same kernels, decode against one chunked prefill

# what each environment of tests.environments.mixed may end its episode with: "length" whenever the
# policy's first turn is cut at max_new_tokens (then no step is taken)
REASONS = {Counting: {"done", "length", "token_budget"}, Raises: {"env_error", "length"},
           Hangs: {"env_deadline", "length"}, Garbage: {"env_error", "length"}, DoneAtOnce: {"done", "length"}}


@pytest.mark.slow
def test_episodes_train_the_ids_vllm_sampled_and_failing_environments_end_with_a_reason(tmp_path, tiny_assets):
    """k = 0, one batch of episodes with tests.environments.mixed (three turns of counting, or an
    environment that raises, hangs past its deadline, returns garbage, ends at once, or fails at
    its reset). Every sample's policy tokens carry, token by token, the logprobs one chunked vLLM
    pass gives its whole id sequence (so the ids are the ones vLLM generated from, turn after
    turn); its environment tokens are each observation tokenized alone; its reason is the one its
    environment allows; an episode whose reset failed is never a sample and its credit came back;
    the buffer's accounting identity holds and the run ends."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from common.config import load_config
    from common.prompts import dataset_row, read_rows
    from protocol.samples import unpack_samples
    from protocol.transport import BufferClient
    from rollout.engine import make_vllm_engine
    from rollout.main import run
    from tests.helpers import base_config

    batch = 16
    config, result, buffer = start_buffer(tmp_path, f"learner.batch_size={batch}", f"learner.minibatch_size={batch}",
                                          "buffer.max_staleness=0")
    rollout_config = load_config(None, [f"run_dir={config.run_dir}", "rollout.max_new_tokens=8",
                                        "rollout.prompts_per_generate=4", "rollout.max_model_len=64",
                                        "rollout.environment=tests.environments:mixed",
                                        "rollout.env_step_deadline_s=1.0",
                                        f"learner.batch_size={batch}", f"learner.minibatch_size={batch}",
                                        "buffer.max_staleness=0", "rollout.kv_cache_gib=0.1"],
                                 base=base_config(tmp_path, tiny_assets))
    engine = make_vllm_engine(rollout_config)
    threading.Thread(target=scorer_process, args=(config, 64), daemon=True).start()
    samples = []

    def learner_stub() -> None:  # the learner never publishes: version 0 throughout
        learner = BufferClient(config.buffer_address, "learner", "0")
        learner.connect(60, 0.5)
        samples.extend(unpack_samples(learner.request("batch_request", {"policy_version": 0, "batch_size": batch})))
        learner.request("finish", {"policy_version": 0})

    threading.Thread(target=learner_stub, daemon=True).start()
    run(rollout_config, 0, engine)  # returns when the buffer says stop
    buffer.join(timeout=60)
    assert not buffer.is_alive() and len(samples) == batch

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    rows = read_rows(tiny_assets["prompts"])
    kinds = [type(mixed(rows[s.data_row])) for s in samples]
    assert ResetRaises not in kinds
    for sample, kind in zip(samples, kinds):
        assert sample.finish_reason in REASONS[kind], (kind, sample.finish_reason)
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

    # token out: vLLM's own logprobs of the whole sequence at every policy token
    chunked = engine.generate([TokensPrompt(prompt_token_ids=[*s.prompt_tokens.tolist(), *s.response_tokens.tolist()])
                               for s in samples], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    gaps = []
    for sample, output in zip(samples, chunked):
        start = len(sample.prompt_tokens)
        expected = np.array([output.prompt_logprobs[start + j][int(token)].logprob
                             for j, token in enumerate(sample.response_tokens)])
        policy = sample.loss_mask == 1
        gaps.append(float(np.max(np.abs(expected[policy] - sample.behavior_logprobs[policy]))))
        assert (sample.behavior_logprobs[~policy] == 0).all()
    engine.llm_engine.engine_core.shutdown()
    print(f"largest logprob gap over {len(multi_turn)} multi-turn of {len(samples)} episodes: {max(gaps):.2e}")
    assert max(gaps) < LOGPROB_TOLERANCE, max(gaps)

    # at k = 0 every prompt handed out ends before the batch is whole: those whose reset failed were
    # reported, and their credits went to the prompts after them
    assert result["identity_holds"], result
    handed_out = [type(mixed(rows[dataset_row(0, len(rows), index)])) for index in range(result["prompts_handed_out"])]
    assert result["dropped"] == ({"episode_env_error": handed_out.count(ResetRaises)} if ResetRaises in handed_out
                                 else {}), result["dropped"]
    assert result["credits_returned"] == handed_out.count(ResetRaises)
