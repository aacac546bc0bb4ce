"""The demo's task variants (their models are built by tests' fixtures and bench/)."""

import os
import random

from common.config import load_config
from demos.parity import LONG_TAIL_MAX_TOKENS, LONG_TAIL_SHARE, sft_response, sized_llama_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_long_tail_responses_are_mostly_short_and_a_tenth_up_to_63_digits():
    rng = random.Random(0)
    long_tail = [len(sft_response("odd 1 2 3 :", rng, long_tail=True).split()) for _ in range(4000)]
    plain = [len(sft_response("odd 1 2 3 :", rng).split()) for _ in range(4000)]
    long = [n for n in long_tail if n > 6]
    assert abs(len(long) / len(long_tail) - LONG_TAIL_SHARE) < 0.02
    assert min(long) == 7 and max(long) == LONG_TAIL_MAX_TOKENS - 1  # digits; <eos> makes the 64th token
    assert min(plain) == 3 and max(plain) == 6


def test_the_long_tail_config_holds_the_longest_response_in_the_model_and_a_micro_batch():
    config = load_config(os.path.join(REPO, "configs", "demo-long-tail.yaml"), [])
    prompt_tokens = 6  # <bos> parity d d d ":"
    assert config.rollout.max_new_tokens == LONG_TAIL_MAX_TOKENS
    assert prompt_tokens + LONG_TAIL_MAX_TOKENS <= config.rollout.max_model_len
    assert config.rollout.max_model_len <= sized_llama_config(64, 2, long_tail=True).max_position_embeddings
    assert config.learner.max_tokens_per_microbatch >= config.rollout.max_model_len
