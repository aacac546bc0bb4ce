"""What several test files share: configs, samples, the buffer in a thread, `tether` commands.

Fixtures live in conftest.py; the helpers they and the tests call live here, so no test file
imports another."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import yaml

from protocol.samples import Sample

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Logprobs of the same tokens under the same weights, from vLLM's CPU kernels and from the
# learner's transformers forward, both float32: measured ~1e-6 here; 1e-3 leaves room for kernels.
LOGPROB_TOLERANCE = 1e-3
# both roles of this machine's two cores: the buffer and the rollout on one, scorer and learner on the other
TWO_CORES = {"cores": {"buffer": [0], "rollout": [0], "scorer": [1], "learner": [1]}}


# a chat template that renders a system message first, for prompts given as chats
CHAT_TEMPLATE_WITH_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }} : {% else %}"
                             "{{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}:{% endif %}")


# --------------------------------------------------------------------------- configs


def base_config(tmp_path, assets, **sections):
    """A complete config dict for tests, pointing at the tiny assets and a private run dir."""
    config = {
        "run_dir": str(tmp_path / "run"),
        "models": {"policy": assets["policy"], "reward": assets["reward"]},
        "data": {"prompts": assets["prompts"]},
        "transport": {"connect_retries": 60, "connect_interval_s": 0.5},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def with_learner(config, changes: dict[str, Any]):
    """``config`` with ``learner.*`` changed: ``with_learner(config, {"advantage_estimator": "rloo"})``."""
    return config.model_copy(update={"learner": config.learner.model_copy(update=changes)})


# --------------------------------------------------------------------------- samples


def sample_of(prompt, response, sample_id: str = "s0", prompt_index: int = 0, version: int = 0,
              reward: float | None = None) -> Sample:
    """A sample of these token ids, its behavior logprobs 0; with ``reward``, scored (reference
    logprobs 0 too)."""
    response = np.array(response, np.int32)
    return Sample(sample_id, prompt_index, version, np.array(prompt, np.int32), response,
                  np.zeros(len(response), np.float32), "stop",
                  ref_logprobs=np.zeros(len(response), np.float32) if reward is not None else None, reward=reward)


def random_sample(i: int, prompt_len: int = 3, resp_len: int = 4, scored: bool = False) -> Sample:
    """Sample ``i`` of random tokens and logprobs (seeded by ``i``), of version ``i % 3``."""
    rng = np.random.default_rng(i)
    return Sample(
        sample_id=f"s{i}", prompt_index=i, behavior_version=i % 3,
        prompt_tokens=rng.integers(0, 16, prompt_len).astype(np.int32),
        response_tokens=rng.integers(0, 16, resp_len).astype(np.int32),
        behavior_logprobs=-rng.random(resp_len).astype(np.float32),
        finish_reason="stop" if i % 2 else "length",
        ref_logprobs=-rng.random(resp_len).astype(np.float32) if scored else None,
        reward=float(i) * 0.5 if scored else None,
    )


def policy_samples(assets: dict, texts: list[str], behavior_offset: float = 0.0) -> list[Sample]:
    """Samples of the SFT model on ``texts``, scored as the scorer would (reference = policy), with
    the behavior logprobs ``behavior_offset`` off the reference's (a stale version, when not 0)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from common.config import SamplingConfig
    from demos.parity import sample_responses
    from scorer.scoring import reference_logprobs, reward_scores

    tokenizer = AutoTokenizer.from_pretrained(assets["policy"])
    policy = AutoModelForCausalLM.from_pretrained(assets["policy"]).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(assets["reward"], num_labels=1).eval()
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    responses = sample_responses(policy, prompts, max_new_tokens=6, seed=0)
    made = [Sample(f"s{i}", i, 0, np.array(p, np.int32), np.array(r, np.int32), np.zeros(len(r), np.float32),
                   "stop" if r[-1] == 2 else "length") for i, (p, r) in enumerate(zip(prompts, responses))]
    for s, logprobs in zip(made, reference_logprobs(policy, made, 0, SamplingConfig())):
        s.ref_logprobs = logprobs.numpy().copy()
        s.behavior_logprobs = logprobs.numpy() + behavior_offset
    for s, reward in zip(made, reward_scores(rm, made, 0).tolist()):
        s.reward = reward
    return made


# --------------------------------------------------------------------------- roles and commands


def start_buffer(tmp_path, *overrides):
    """The real buffer role in a thread, on a config whose models it never loads. Returns the
    config, the dict that gets the role's result when it returns, and the thread to join."""
    import threading

    from buffer.main import run as run_buffer
    from common.config import load_config

    assets = {"policy": "/unused", "reward": "/unused", "prompts": "/unused"}
    config = load_config(None, ["learner.batch_size=2", "learner.minibatch_size=1", *overrides],
                         base=base_config(tmp_path, assets))
    result = {}
    thread = threading.Thread(target=lambda: result.update(run_buffer(config)), daemon=True)
    thread.start()
    return config, result, thread


def buffer_process(tmp_path):
    """`tether launch buffer` by hand, as `tether run` starts it, on a config whose models it never
    loads; returns (config, process)."""
    from common.config import load_config

    raw = base_config(tmp_path, {"policy": "/unused", "reward": "/unused", "prompts": "/unused"})
    raw["learner"] = {"batch_size": 2, "minibatch_size": 1}
    raw["metrics"] = {"trackers": []}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    process = subprocess.Popen([sys.executable, "-m", "launch.cli", "launch", "buffer", "--config", str(path)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return load_config(str(path)), process


def tether(*args, timeout=400):
    """The `tether` command, run from the repository."""
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def run_to_the_end(tmp_path, config, mode: str = "split"):
    """`tether run` of a config dict, the roles placed on this machine's two cores (split: the
    rollout on one, the scorer and learner on the other; colocate: all three on both, taking
    shifts); it must succeed."""
    config["placement"] = {**TWO_CORES, "mode": mode}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = tether("run", "--config", str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train_data_parallel(tmp_path, assets, zero: int, ranks: int, *overrides: str, parts: bool = False,
                        vision: bool = False) -> dict:
    """Two PPO steps of tests/dp_driver.py on ``ranks`` DeepSpeed ranks (torch.distributed's
    launcher) under ZeRO ``zero``; returns what the driver saved (weights, losses). ``parts``:
    three of its eight episodes in two parts (11 rows); ``vision``: ``assets["policy"]`` sees
    images (``scored_vision_samples``)."""
    import json

    import torch

    from protocol.transport import free_port

    paths = tmp_path / "assets.json"
    paths.write_text(json.dumps({key: str(value) for key, value in assets.items()}))
    out = tmp_path / f"zero{zero}-ranks{ranks}.pt"
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={free_port()}",
         "tests/dp_driver.py", "--assets", str(paths), "--zero", str(zero), "--out", str(out),
         *(f"--override={override}" for override in overrides), *["--parts"] * parts, *["--vision"] * vision],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return torch.load(out)


# ChatML with tools, the shape of Qwen2.5's template: the tools' schemas in the system message,
# tool results as <tool_response> blocks of a user turn, <|im_end|> ending every turn
CHATML_TOOLS_TEMPLATE = (  # no newline right after a tag: HF renders with trim_blocks
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant."
    "{% endif %}{{ '\\n\\n' }}# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\nFor each function call, return a json object within <tool_call></tool_call> XML tags."
    "<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif not (message['role'] == 'system' and loop.first) %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Llama 3.1's shape: the tools as JSON in a system turn, a call written as {"name", "parameters"},
# a tool's result in an ipython turn, <|eot_id|> ending every turn
LLAMA3_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call these functions, "
    "answering with {\"name\": ..., \"parameters\": ...}:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Mistral's shape: the tools in [AVAILABLE_TOOLS], a user's turn in [INST], a call after [TOOL_CALLS],
# a result in [TOOL_RESULTS], </s> ending the assistant's turn; no generation prompt
MISTRAL_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]{{ message['content'] }}[/INST]"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{{ message['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}")

FAMILY_TOKENS = {  # tool_parser -> (special tokens, template, end of an assistant's turn, bos)
    "hermes": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", None),
    "llama3_json": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                     "<|python_tag|>"], LLAMA3_TOOLS_TEMPLATE, "<|eot_id|>", "<|begin_of_text|>"),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], MISTRAL_TOOLS_TEMPLATE, "</s>", "<s>"),
}


def family_tokenizer(directory: str, family: str):
    """A tokenizer of ``family`` (a ``rollout.tool_parser`` name: hermes, llama3_json, mistral):
    byte-level BPE trained here, with the family's special tokens and a chat template of its shape."""
    if family == "hermes":
        return chatml_tokenizer(directory)
    from transformers import PreTrainedTokenizerFast

    special, template, end, bos = FAMILY_TOKENS[family]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_trained_bpe(special), bos_token=bos, eos_token=end,
                                        pad_token=end, chat_template=template)
    tokenizer.save_pretrained(directory)
    return tokenizer


def _trained_bpe(special_tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ['<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>',
              "What is 17 plus 25? The answer is 42.", "You are a helpful assistant.", "system user assistant tool",
              '{"type": "function", "function": {"name": "add", "description": "Add two integers."}}']
    core.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return core


def chatml_tokenizer(directory: str):
    """A byte-level BPE tokenizer trained here on a few sentences, with ChatML's special tokens and
    CHATML_TOOLS_TEMPLATE: the kind of tokenizer a chat model with tools has, built without a hub."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_trained_bpe(FAMILY_TOKENS["hermes"][0]),
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=CHATML_TOOLS_TEMPLATE)
    tokenizer.save_pretrained(directory)
    return tokenizer


def rollout_one_batch(tmp_path, assets: dict, batch: int, *overrides: str, engine=None):
    """The real rollout loop (``rollout.main.run``, here, on a vLLM engine of its own, or ``engine``)
    against the real buffer at k = 0, a scorer that returns its work as scored, and a learner that
    takes one batch at version 0 and finishes (no weights are ever published). ``overrides``: the
    run's config (both the buffer's and the rollout's). Returns the batch, the engine (for a
    chunked pass over it, or another run) and the buffer's accounting."""
    import threading

    from bench.buffer_throughput import scorer_process
    from common.config import load_config
    from protocol.samples import unpack_samples
    from protocol.transport import BufferClient
    from rollout.engine import make_vllm_engine
    from rollout.main import run

    shared = [f"learner.batch_size={batch}", f"learner.minibatch_size={batch}", "buffer.max_staleness=0", *overrides]
    config, result, buffer = start_buffer(tmp_path, *shared)
    rollout_config = load_config(None, [f"run_dir={config.run_dir}", "rollout.max_model_len=64",
                                        "rollout.prompts_per_generate=4", "rollout.kv_cache_gib=0.1", *shared],
                                 base=base_config(tmp_path, assets))
    engine = engine or make_vllm_engine(rollout_config)
    threading.Thread(target=scorer_process, args=(config, 64), daemon=True).start()
    samples = []

    def learner_stub() -> None:
        learner = BufferClient(config.buffer_address, "learner", "0")
        learner.connect(60, 0.5)
        samples.extend(unpack_samples(learner.request("batch_request", {"policy_version": 0, "batch_size": batch,
                                                                       "max_staleness": config.buffer.initial_staleness})))
        learner.request("finish", {"policy_version": 0})

    threading.Thread(target=learner_stub, daemon=True).start()
    run(rollout_config, 0, engine)  # in the engine's own thread; returns when the buffer says stop
    buffer.join(timeout=60)
    assert not buffer.is_alive()
    return samples, engine, result


def chunked_logprobs(engine, samples) -> list[np.ndarray]:
    """vLLM's logprob of each response token of every sample, from one prefill of prompt + response:
    what the engine gives those tokens in one piece, to compare with what it gave them streaming."""
    from vllm import SamplingParams, TokensPrompt

    outputs = engine.generate([TokensPrompt(prompt_token_ids=[*s.prompt_tokens.tolist(), *s.response_tokens.tolist()])
                               for s in samples], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [np.array([output.prompt_logprobs[len(s.prompt_tokens) + j][int(token)].logprob
                      for j, token in enumerate(s.response_tokens)]) for s, output in zip(samples, outputs)]


# --------------------------------------------------------------------------- vision

# Idefics3's template shape: image parts as <image>, one placeholder each, which the processor (and
# vLLM) expands into the image's tokens
VISION_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                   "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                   "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vision_policy(directory) -> str:
    """A vision-language policy built from a config, saved with its processor: Idefics3 (a SigLIP
    tower of 2 layers on 56-pixel images, 4 image tokens an image, a 2-layer Llama), float32. The
    family vLLM's CPU build serves without torchvision (the Qwen-VL, LLaVA and Gemma 3 modules import
    it), with 1-D positions; head_dim 32, the CPU attention kernel's least."""
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              Idefics3VisionConfig, LlamaConfig, PreTrainedTokenizerFast)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>", "<global-img>",
               "<end_of_utterance>", *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_trained_bpe(special), eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", chat_template=VISION_TEMPLATE)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=56, patch_size=14)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(directory)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 56},
                                       max_image_size={"longest_edge": 56})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=(56 // 14) ** 2 // 4,
                      chat_template=VISION_TEMPLATE).save_pretrained(directory)
    return str(directory)


def tiny_llava_policy(directory) -> str:
    """``tiny_vision_policy``'s tokenizer and template on another family: LLaVA (a CLIP tower of 2
    layers on 28-pixel images, 4 image tokens an image, a 2-layer Llama), float32, whose image inputs
    are one entry per image, not per prompt. transformers runs it here; vLLM's LLaVA module imports
    torchvision, which this machine's CPU torch cannot load, so the learner's and the scorer's side
    alone are tested with it."""
    import torch
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, PreTrainedTokenizerFast)
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_trained_bpe(special), eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", chat_template=VISION_TEMPLATE)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    # "default": the tower's CLS feature dropped, the 4 patches' kept (the processor counts CLS, then drops it)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                         vision_feature_select_strategy="default", tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(directory)
    images = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=VISION_TEMPLATE).save_pretrained(directory)
    return str(directory)


def vision_samples(tmp_path, processor) -> list[Sample]:
    """Five scored samples: three of image prompts (two images, one each; a chat and a text prompt),
    one of a prompt without an image, and an episode's with an image in its prompt and one in its
    response, their ids expanded as vLLM reports them, and the behavior and reference logprobs
    still to fill."""
    from common.image_prompts import vision_prompt_text
    from common.images import decoded, pack_images

    write_image(tmp_path / "red.png", (50, 40), (255, 0, 0))
    write_image(tmp_path / "blue.png", (30, 56), (0, 0, 255))
    rows = [{"messages": [{"role": "user", "content": "What is in the picture?"}], "images": ["red.png"]},
            {"prompt": "colour:", "images": ["blue.png"]}, {"prompt": "colour of this:", "images": ["red.png"]},
            {"prompt": "a colour:"}]
    samples = []
    for i, row in enumerate(rows):
        image = [(tmp_path / row["images"][0]).read_bytes()] if "images" in row else []
        prompt = processor(text=[vision_prompt_text(row, processor)],
                           images=[decoded(image)] if image else None)["input_ids"][0]
        response = processor.tokenizer(" a red square" if i != 1 else " blue")["input_ids"] + [
            processor.tokenizer.eos_token_id]
        samples.append(Sample(f"s{i}", i, 0, np.array(prompt, np.int32), np.array(response, np.int32),
                              np.zeros(len(response), np.float32), "stop", reward=float(i), data_row=i,
                              images=pack_images(image) if image else None))
    # an episode's: its second image shown by the environment between two turns, expanded where it stands
    shown = [(tmp_path / "red.png").read_bytes(), (tmp_path / "blue.png").read_bytes()]
    observation = processor(text=["<|im_end|>\n<|im_start|>user\n<image>and this?<|im_end|>\n<|im_start|>assistant\n"],
                            images=[decoded(shown[1:])], add_special_tokens=False)["input_ids"][0]
    turns = processor.tokenizer(" red")["input_ids"], processor.tokenizer(" blue")["input_ids"] + [
        processor.tokenizer.eos_token_id]
    response = turns[0] + observation + turns[1]
    samples.append(Sample("s4", 4, 0, np.array(samples[1].prompt_tokens), np.array(response, np.int32),
                          np.zeros(len(response), np.float32), "stop", reward=4.0, data_row=1,
                          loss_mask=np.array([1] * len(turns[0]) + [0] * len(observation) + [1] * len(turns[1]),
                                             np.uint8), turn_rewards=np.zeros(len(response), np.float32),
                          images=pack_images(shown)))
    return samples


def scored_vision_samples(tmp_path, policy: str, behavior_offset: float = 0.0) -> tuple[list[Sample], Any]:
    """``vision_samples`` of the policy in ``policy`` and three more of its prompt without an image
    (images a row: 1, 1, 1, 0, 2, 0, 0, 0), scored as the scorer would (reference = policy), the
    behavior logprobs ``behavior_offset`` off the reference's; and the policy's processor."""
    import copy

    from common.config import SamplingConfig
    from common.models import load_causal_lm
    from common.processors import load_processor
    from scorer.scoring import reference_logprobs

    processor = load_processor(policy)
    samples = vision_samples(tmp_path, processor)
    for i in range(3):
        samples.append(copy.deepcopy(samples[3]))
        samples[-1].sample_id, samples[-1].reward = f"s{5 + i}", -1.0 - i
    model = load_causal_lm(policy).eval()
    for sample, logprobs in zip(samples, reference_logprobs(model, samples, processor.tokenizer.pad_token_id,
                                                            SamplingConfig(), processor)):
        sample.ref_logprobs = logprobs.numpy().copy()
        sample.behavior_logprobs = logprobs.numpy() + behavior_offset
    return samples, processor


def write_image(path, size: tuple[int, int], colour: tuple[int, int, int]) -> str:
    """A PNG of one colour."""
    from PIL import Image

    Image.new("RGB", size, colour).save(path)
    return str(path)


def answer_of(environment, future):
    """What the rollout's loop takes of an environment's ``future``: its answer, or ``PastDeadline``
    once the episode's own deadline (``agent_deadline_s``) has passed without one."""
    try:
        return future.result(timeout=max(0.0, min(environment.deadline - time.monotonic(), 60.0)))
    except TimeoutError:
        if future.done():  # the program's own
            raise
        from environments.interface import PastDeadline

        raise PastDeadline("the agent program made no call and did not return in time") from None


def first_of(environment):
    """The episode's first observation, as its reset answers it."""
    return answer_of(environment, environment.begin_reset())


def step_of(environment, response, messages, turn=None):
    return answer_of(environment, environment.begin_step(response, messages, turn))

