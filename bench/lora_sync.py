"""LoRA weight sync, adapters against merged, side by side in one process: per policy version, the
bytes published, the learner's publish time and the rollout's load time; and what generation
costs with vLLM's LoRA on (its CPU kernels apply the adapter at every layer, every step) against
merged weights. On the demo's model and a larger Llama (hidden 1024, 8 layers, ~110M parameters).

Each mode gets its own engine (LoRA on or off), built once; versions take turns with the same
actor (peft, rank ``--rank`` on every linear layer, its adapters moved as training moves them).
The limit printed: adapters move at most a tenth of merged's bytes, and load faster.

    python bench/lora_sync.py [--rank 16] [--versions 5] [--model demo --model large]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def build_large(directory: str) -> str:
    import torch
    from transformers import LlamaForCausalLM

    from demos.parity import build_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    build_tokenizer(directory)
    LlamaForCausalLM(tiny_llama_config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                       num_attention_heads=8, num_key_value_heads=8,
                                       max_position_embeddings=256)).save_pretrained(directory)
    return directory


def measure(policy: str, mode: str, rank: int, versions: int, work: str) -> dict:
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt

    from common.config import load_config
    from common.model_dirs import resolve_models
    from rollout.adapters import PolicyAdapter, lora_arguments
    from rollout.engine import apply_weights, make_vllm_engine
    from training.lora import merged_named_tensors, with_lora
    from weight_sync.buckets import ShmWeightWriter, without_tied_duplicates
    from weight_sync.lora import adapter_named_tensors

    config = resolve_models(load_config(None, [
        f"models.policy={policy}", f"models.reward={policy}", f"data.prompts={policy}/none", f"run_dir={work}/{mode}",
        "rollout.kv_cache_gib=0.5", f"learner.lora_rank={rank}", f"learner.lora_alpha={2 * rank}",
        f"learner.lora_sync={mode}"]), "learner")  # max_model_len: the model's
    engine = make_vllm_engine(config, **(lora_arguments(config) if mode == "adapters" else {}))
    adapter = PolicyAdapter(config, f"{work}/{mode}-lora") if mode == "adapters" else None
    writer = ShmWeightWriter(config.weights_dir, 64 << 20)
    actor = with_lora(AutoModelForCausalLM.from_pretrained(policy), config.learner)
    generator = torch.Generator().manual_seed(0)
    figures = {"bytes": [], "publish_s": [], "load_s": [], "generate_tokens_per_s": []}
    prompts = [TokensPrompt(prompt_token_ids=[1, 3 + i % 10, 7, 9, 8, 5]) for i in range(32)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=config.rollout.max_model_len - 8, ignore_eos=True, seed=0)
    try:
        for version in range(1, versions + 1):
            with torch.no_grad():
                for name, parameter in actor.named_parameters():
                    if ".lora_" in name:
                        parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
            started = time.perf_counter()
            named = (adapter_named_tensors(actor) if mode == "adapters"
                     else without_tied_duplicates(merged_named_tensors(actor)))
            manifest = writer.publish(version, named)
            published = time.perf_counter()
            grant = SimpleNamespace(fields={"weights_manifest": manifest.to_dict(), "policy_version": version})
            loaded, error = apply_weights(engine, grant, None, None, config, logging.getLogger("bench"), adapter)
            assert loaded == version, error
            figures["bytes"].append(manifest.total_bytes)
            figures["publish_s"].append(published - started)
            figures["load_s"].append(time.perf_counter() - published)
            started = time.perf_counter()
            outputs = engine.generate(prompts, params, use_tqdm=False,
                                      lora_request=adapter.request if adapter is not None else None)
            tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
            figures["generate_tokens_per_s"].append(tokens / (time.perf_counter() - started))
    finally:
        engine.llm_engine.engine_core.shutdown()
        writer.close(remove=True)
        if adapter is not None:
            adapter.close()
    return {key: statistics.median(values) for key, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--model", action="append", choices=["demo", "large"])
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tether-bench-lora-")
    for model in args.model or ["demo", "large"]:
        if model == "demo":
            from demos.parity import build_assets

            policy = build_assets(os.path.join(REPO, ".demo", "assets"), log=lambda *_: None)["policy"]
        else:
            policy = build_large(os.path.join(work, "large"))
        results = {mode: measure(policy, mode, args.rank, args.versions, work) for mode in ("merged", "adapters")}
        for mode, figures in results.items():
            print(f"{model:<6}{mode:<9} per version: {figures['bytes'] / 2**20:8.2f} MiB published in "
                  f"{figures['publish_s'] * 1e3:7.1f} ms, loaded in {figures['load_s'] * 1e3:7.1f} ms; generation "
                  f"{figures['generate_tokens_per_s']:7.0f} tokens/s (median of {args.versions})", flush=True)
        adapters, merged = results["adapters"], results["merged"]
        ok = adapters["bytes"] <= 0.1 * merged["bytes"] and adapters["load_s"] < merged["load_s"]
        print(f"{model:<6}adapters / merged: bytes {adapters['bytes'] / merged['bytes']:.3f} (limit <= 0.1), load "
              f"{adapters['load_s'] / merged['load_s']:.2f}x (limit < 1), generation "
              f"{adapters['generate_tokens_per_s'] / merged['generate_tokens_per_s']:.2f}x: "
              f"{'ok' if ok else 'OVER'}", flush=True)


if __name__ == "__main__":
    main()
