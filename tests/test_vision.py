"""Images in prompts (issue 36, its first pieces): a row's images read, checked and carried as
bytes, and a vision-language policy on vLLM's CPU build giving the logprobs a transformers forward
of the same checkpoint gives, on the pixel inputs tether computes with the model's processor."""

import json

import numpy as np
import pytest

from common.config import ConfigError
from tests.helpers import tiny_vision_policy, write_image


def test_a_rows_images_are_read_as_bytes_and_travel_packed(tmp_path):
    from common.vision import decoded, pack_images, read_images, unpack_images

    red = write_image(tmp_path / "red.png", (50, 40), (255, 0, 0))
    blue = write_image(tmp_path / "b.png", (8, 8), (0, 0, 255))
    data = tmp_path / "prompts.jsonl"
    images = read_images({"prompt": "what colour?", "images": ["red.png", blue]}, str(data), "line 1")
    assert images == [open(red, "rb").read(), open(blue, "rb").read()]
    packed = pack_images(images)
    assert packed.dtype == np.uint8 and unpack_images(packed) == images and unpack_images(pack_images([])) == []
    assert decoded(images)[0].size == (50, 40) and decoded(images)[1].getpixel((0, 0)) == (0, 0, 255)
    with pytest.raises(ValueError, match="end inside an image of"):
        unpack_images(packed[:-1])


@pytest.mark.parametrize("images, reason", [
    (["missing.png"], "missing.png cannot be read as an image .FileNotFoundError"),
    (["notes.txt"], "notes.txt cannot be read as an image .UnidentifiedImageError"),
    ("red.png", '"images" must be a list of file paths'),
    ([3], '"images" must be a list of file paths'),
])
def test_a_bad_image_is_an_error_naming_the_data_file_the_row_and_the_image(tmp_path, images, reason):
    from common.vision import read_images

    (tmp_path / "notes.txt").write_text("not an image")
    write_image(tmp_path / "red.png", (4, 4), (255, 0, 0))
    data = str(tmp_path / "prompts.jsonl")
    with pytest.raises(ConfigError, match=f"data.prompts: {data} line 7: .*{reason}"):
        read_images({"prompt": "what colour?", "images": images}, data, "line 7")


def test_image_prompts_that_do_not_fit_and_roles_that_cannot_run_a_vision_policy_yet_are_named(tmp_path):
    from common.models import load_causal_lm
    from common.vision import load_processor, sees_images, vision_prompts

    policy = tiny_vision_policy(tmp_path / "policy")
    assert sees_images(policy) and not sees_images(str(tmp_path)) and load_processor(str(tmp_path)) is None
    with pytest.raises(ConfigError, match="is a vision-language model: the rollout generates from its image prompts"):
        load_causal_lm(policy)
    processor, data = load_processor(policy), str(tmp_path / "prompts.jsonl")
    write_image(tmp_path / "red.png", (50, 40), (255, 0, 0))
    rows = [{"prompt": "colour:", "images": ["red.png"]}, {"prompt": "colour: " * 40, "images": ["red.png"]}]
    ids, kept, images = vision_prompts(rows, processor, 24, None, "data.prompts", data)
    assert kept == [0] and ids[0].count(processor.image_token_id) == 1 and len(images[0][0]) > 0  # the long: out
    with pytest.raises(ConfigError, match=f"data.prompts: {data} prompt 1: its 1 image.s. take 6 more tokens .*the 5"):
        vision_prompts(rows, processor, 5, None, "data.prompts", data)


@pytest.mark.slow
def test_the_rollout_generates_from_image_prompts_and_its_logprobs_are_a_transformers_forward(tmp_path):
    """The real rollout loop and buffer on a vision-language policy: each prompt holds one
    placeholder per image, unexpanded; vLLM expands it as the model's processor does, and each
    sample carries the expanded ids and its images' bytes. Its logprobs at every sampled token are
    the transformers model's on those ids with the pixel inputs tether computes from those bytes;
    another image gives others (the image is read)."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    from common.vision import decoded, load_processor, pixel_inputs, unpack_images, vision_prompt_text
    from tests.helpers import rollout_one_batch

    policy = tiny_vision_policy(tmp_path / "policy")
    processor = load_processor(policy)
    write_image(tmp_path / "red.png", (50, 40), (255, 0, 0))
    write_image(tmp_path / "blue.png", (30, 56), (0, 0, 255))
    rows = [{"messages": [{"role": "user", "content": "What is in the picture?"}], "images": ["red.png"]},
            {"prompt": "colour:", "images": ["blue.png"]}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    samples, engine, result = rollout_one_batch(tmp_path, {"policy": policy, "reward": policy, "prompts": str(data)},
                                                4, "rollout.samples_per_prompt=2")
    engine.llm_engine.engine_core.shutdown()
    assert len(samples) == 4 and result["identity_holds"]

    model = Idefics3ForConditionalGeneration.from_pretrained(policy, dtype=torch.float32).eval()
    gaps, other_image = [], []
    for sample in samples:
        images = unpack_images(sample.images)
        assert images == [(tmp_path / rows[sample.data_row]["images"][0]).read_bytes()]
        text = vision_prompt_text(rows[sample.data_row], processor)
        prompt = sample.prompt_tokens.tolist()
        assert prompt == processor(text=[text], images=[decoded(images)])["input_ids"][0]  # expanded as vLLM does
        assert prompt.count(processor.image_token_id) == 4  # the image's tokens
        ids = torch.tensor([prompt + sample.response_tokens.tolist()])
        other = (tmp_path / rows[1 - sample.data_row]["images"][0]).read_bytes()
        for pixels, found in ((images, gaps), ([other], other_image)):
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                               **pixel_inputs(processor, [decoded(pixels)])).logits
            logprobs = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1)
            ours = logprobs.gather(1, torch.as_tensor(sample.response_tokens, dtype=torch.long)[:, None])[:, 0]
            found.append(float((ours - torch.as_tensor(sample.behavior_logprobs)).abs().max()))
    print(json.dumps({"largest gap": max(gaps), "least gap with the other image": min(other_image)}))
    assert max(gaps) < 1e-3, gaps  # issue 36's bound
    assert min(other_image) > 1e-2, other_image  # the image is read: the check means something
