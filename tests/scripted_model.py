"""A tiny Llama whose greedy output is scripted: after any prompt it writes
``<think>abc</think>answer`` and ends, as a reasoning model would (exact expected
strings for the reasoning parsers, through the engine and the served app).

Every layer's attention and MLP weights are zero, so the residual stream at a position
is its token's embedding: a one-hot "state" (every token not in the script is state 0).
The head maps each state to the next token of the script with a logit of 40 against 0
for every other token, so greedy decoding (and any sampling, in practice) follows the
script. The tokenizer is the built-in SmolLM2's, with ``<think>`` and ``</think>`` added
as tokens of their own (as Qwen3's and DeepSeek-R1's vocabularies have them).
"""

from __future__ import annotations

from pathlib import Path

import torch

#: What the model writes after any prompt (then its end token).
SCRIPT = ("<think>", "abc", "</think>", "answer")
TAGS = ("<think>", "</think>")
HIDDEN = 16


def scripted_tokenizer(tags: tuple[str, ...] = TAGS):
    """The built-in tokenizer with ``tags`` added as tokens (ids 49152, 49153)."""
    from tessera.workers.model.loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.add_tokens(list(tags))
    return tokenizer


def save_scripted_model(path: Path, tokenizer=None) -> Path:
    """Write the scripted model and its tokenizer (``scripted_tokenizer()`` unless
    given) as a Hugging Face directory at ``path``."""
    import transformers

    tokenizer = tokenizer or scripted_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(list(SCRIPT))
    eos = tokenizer.eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        head = model.lm_head.weight  # [vocab, hidden]
        embed[:, 0] = 1.0  # state 0: any token outside the script
        following = [*ids, eos]  # state s writes following[s]
        for state, token in enumerate(ids, start=1):
            embed[token] = 0.0
            embed[token, state] = 1.0
        for state, token in enumerate(following):
            head[token, state] = 10.0  # x RMSNorm's sqrt(HIDDEN) = 40
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
