"""The scorer role: frozen reference logprobs and reward-model scores for generated samples."""
