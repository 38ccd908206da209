"""What happens to a step's logits: sampling, logprobs, stop handling and detokenizing,
and the decoding features that own per-step hooks (forks for n > 1, beam search,
speculative decoding, parallel tokens, structured outputs)."""
