"""A tiny random causal LM and a small byte-level BPE tokenizer with a ChatML chat template,
built offline in a couple of seconds, for tests and quick benchmarks."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Enough text that the BPE merges cover words and digits the tests and the GSM8K prompts use.
_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "Question: what is 12 + 30? Answer: 42. #### 42",
    "Let's think step by step. First, 3 * 4 = 12. Then 12 - 5 = 7. So the answer is \\boxed{7}.",
    "You are a helpful assistant. Reverse the word: hello -> olleh.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 $5 50% 1,234 3.5",
]


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (any text encodes) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """Write a ~200k-parameter Llama and its tokenizer to `path` (`save_pretrained` layout)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
