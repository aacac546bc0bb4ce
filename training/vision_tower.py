"""A vision-language model's image encoder (its vision tower), kept as the SFT model has it while
the rest trains: its parameters' gradients stopped, and its modules named so that LoRA's adapters
leave them alone too (``training.lora.keeps_vision_tower`` says when)."""

from __future__ import annotations

VISION_TOWERS = ("vision_model.", "vision_tower.", "visual.")  # where families keep their image encoder


def _in_tower(name: str) -> bool:
    return any(f".{tower}" in f".{name}." for tower in VISION_TOWERS)


def freeze_vision_tower(model) -> list[str]:
    """Stop the gradient of the image encoder's parameters (by their names' ``VISION_TOWERS``);
    returns the names of its modules, which LoRA's adapters leave alone too."""
    for name, parameter in model.named_parameters():
        if _in_tower(name):
            parameter.requires_grad_(False)
    return [name for name, _ in model.named_modules() if _in_tower(name)]
