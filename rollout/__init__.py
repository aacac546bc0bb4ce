"""The rollout role: vLLM generates responses and their behavior logprobs; weights update in place."""
