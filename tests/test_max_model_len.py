"""rollout.max_model_len: unset, what the policy allows (its positions; on vLLM's CPU build, what
rollout.kv_cache_gib holds); set, checked against both at load, naming the key."""

import json

import pytest
import torch

from common.config import ConfigError, load_config
from common.lengths import kv_bytes_per_token, vllm_on_cpu
from common.model_dirs import resolve_models
from demos.parity import BOS, EOS, PAD, VOCAB, build_tokenizer

COMMON = dict(vocab_size=len(VOCAB), bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def families():
    import transformers

    return {
        "llama": transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=2, max_position_embeddings=4096, **COMMON),
        "qwen2": transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                                          **COMMON),
        "gemma": transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                                          max_position_embeddings=256, **COMMON),
        "gpt2": transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=128, **COMMON),
        "opt": transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2,
                                      word_embed_proj_dim=64, max_position_embeddings=96, **COMMON),
        "bloom": transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=2, **COMMON),
    }


def saved(directory, model_config, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config).to(dtype)
    model.save_pretrained(directory)
    build_tokenizer(str(directory))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2", "opt", "bloom"])
def test_kv_bytes_per_token_are_what_transformers_caches(tmp_path, family):
    """The same figure two ways: from config.json alone, and the bytes of a real forward pass's cache."""
    model = saved(tmp_path, families()[family]).eval()
    tokens = 5
    with torch.no_grad():
        cache = model(torch.arange(3, 3 + tokens)[None], use_cache=True).past_key_values
    layers = cache.layers if hasattr(cache, "layers") else cache
    cached = sum(tensor.numel() * tensor.element_size() for layer in layers
                 for tensor in ((layer.keys, layer.values) if hasattr(layer, "keys") else layer[:2]))
    assert kv_bytes_per_token(str(tmp_path), "float32") * tokens == cached
    assert kv_bytes_per_token(str(tmp_path), "bfloat16") * tokens * 2 == cached


def config_for(policy, *overrides):
    return load_config(None, [f"models.policy={policy}", f"models.reward={policy}", f"data.prompts={policy}/p.jsonl",
                              *overrides])


@pytest.fixture
def policies(tmp_path):
    """config.json alone is read: the shapes of a llama of 4,096 positions, one stretched by rope
    scaling, a bloom (no position limit)."""
    made = {}
    for name, model_config in (("llama", families()["llama"]), ("bloom", families()["bloom"])):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text(model_config.to_json_string())
        (directory / "p.jsonl").write_text('{"prompt": "a"}\n')
        made[name] = str(directory)
    raw = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "yarn").mkdir()
    (tmp_path / "yarn" / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 8192, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}))
    (tmp_path / "yarn" / "p.jsonl").write_text('{"prompt": "a"}\n')
    made["yarn"] = str(tmp_path / "yarn")
    return made


def length(config, role="rollout"):
    return resolve_models(config, role).rollout.max_model_len


def test_unset_it_is_what_the_policy_reads_and_the_cache_holds(policies):
    llama = policies["llama"]  # 2 layers x 2 heads x 32 dims x K and V x 4 bytes: 1 KiB a token
    assert kv_bytes_per_token(llama, "float32") == 1024
    big_cache = config_for(llama, "rollout.kv_cache_gib=1")
    assert length(big_cache) == 4096 and length(big_cache, "learner") == 4096 and length(big_cache, "scorer") == 4096
    assert resolve_models(big_cache, "buffer").rollout.max_model_len is None  # the buffer loads no model
    small_cache = config_for(llama, f"rollout.kv_cache_gib={2000 / 2**20}")  # 2,000 tokens: 15 blocks, 1 vLLM's
    assert length(small_cache) == (1792 if vllm_on_cpu() else 4096)
    assert length(config_for(llama, "rollout.kv_cache_gib=1", "rollout.dtype=bfloat16")) == 4096
    assert length(config_for(policies["yarn"], "rollout.kv_cache_gib=1")) == 8192  # 2,048 x 4


def test_set_it_is_checked_against_the_policy_and_the_cache_naming_the_key(policies):
    llama = policies["llama"]
    assert length(config_for(llama, "rollout.max_model_len=1024")) == 1024
    with pytest.raises(ConfigError, match=rf"rollout.max_model_len: 8192 is more than the policy reads: 4096 tokens "
                                          rf"\(max_position_embeddings in {llama}/config.json\)"):
        length(config_for(llama, "rollout.max_model_len=8192"))
    if vllm_on_cpu():
        with pytest.raises(ConfigError, match=r"rollout.max_model_len: 4096 tokens do not fit in rollout.kv_cache_gib "
                                              r"\(0.0038147 GiB holds 3840 of"):
            length(config_for(llama, "rollout.max_model_len=4096", f"rollout.kv_cache_gib={4000 / 2**20}"))
        with pytest.raises(ConfigError, match="rollout.kv_cache_gib: .* holds less than one block of 128 tokens"):
            length(config_for(llama, f"rollout.kv_cache_gib={100 / 2**20}"))
    with pytest.raises(ConfigError, match="rollout.max_model_len: .*bloom/config.json names no position limit"):
        length(config_for(policies["bloom"]))
    assert length(config_for(policies["bloom"], "rollout.max_model_len=300")) == 300
    with pytest.raises(ConfigError, match=r"learner.max_tokens_per_microbatch \(1000\) is less than "
                                          r"rollout.max_model_len \(4096"):
        length(config_for(llama, "rollout.kv_cache_gib=1", "learner.max_tokens_per_microbatch=1000"), "learner")


@pytest.mark.slow
@pytest.mark.skipif(not vllm_on_cpu(), reason="the KV cache's size is rollout.kv_cache_gib on vLLM's CPU build")
def test_vllm_serves_the_length_tether_picks_for_a_small_cache(tmp_path):
    """The cap from config.json against vLLM's own check of the cache: the length tether picks
    starts an engine that generates a sequence that long. The engine runs in a process of its own:
    one built in the test process left it unable to reach a Ray cluster after (tests/test_ray.py)."""
    import multiprocessing

    import transformers

    model_config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=2, max_position_embeddings=4096, **COMMON)
    saved(tmp_path / "policy", model_config)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    overrides = [f"models.policy={tmp_path / 'policy'}", f"models.reward={tmp_path / 'policy'}",
                 f"data.prompts={tmp_path}/p.jsonl", f"rollout.kv_cache_gib={2000 / 2**20}", "rollout.ignore_eos=true",
                 f"run_dir={tmp_path / 'run'}"]
    assert resolve_models(load_config(None, overrides), "rollout").rollout.max_model_len == 1792
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    child = context.Process(target=generate_to_the_length, args=(overrides, answers))
    child.start()
    try:
        assert answers.get(timeout=300) == 1792 - 4  # the whole length fits the cache
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()


def generate_to_the_length(overrides, answers) -> None:
    from vllm import TokensPrompt

    from rollout.engine import make_vllm_engine, sampling_params

    config = resolve_models(load_config(None, overrides), "rollout")
    engine = make_vllm_engine(config)
    try:
        params = sampling_params(config, n=1, max_tokens=config.rollout.max_model_len - 4, logprobs=None)
        output = engine.generate([TokensPrompt(prompt_token_ids=[BOS, 5, 6, 7])], params, use_tqdm=False)[0]
        answers.put(len(output.outputs[0].token_ids))
    finally:
        engine.llm_engine.engine_core.shutdown()
