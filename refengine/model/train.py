"""Train tiny-chat, the embedded default model: a Qwen3-architecture model of 123,264 parameters
that answers the seed experiment's eight questions (Blue / Tokyo / tea / Green / Paris / coffee /
Purple / Berlin) and continues the short English prompts of the shipped examples, so that what a
person reads in the README, the docs and `refengine replay` is words, not random-weight noise.

Why trained by transformers and not by refengine: the shipped weights must come from an
implementation refengine does not judge. transformers' Qwen3ForCausalLM in float32 on the CPU
learns them; the float64 reference then has to reproduce the answers the training aimed at
(tests/test_default_model.py). The recipe is seeded and single-threaded with deterministic
algorithms, so a rerun on the same machine and torch version writes the same bytes; another CPU may
round differently in the last bits, and then the fingerprint differs while the answers stay the same
(tests/test_default_model.py retrains it and holds the answers, the tokenizer and the recipe to the
shipped folder's).

Training data: `refengine/data/training/tiny-chat.jsonl`, one example a line, either
`{"messages": [...]}` (rendered with the ChatML template; the loss covers the assistant's reply and
its `<|im_end|>`) or `{"text": ...}` (a completion; the loss covers every token and a closing
`<|endoftext|>`). Label smoothing keeps the learned distribution from collapsing onto one token:
the chosen token keeps a probability near 0.9, so a fault that moves the other logits moves its
logprob measurably (a model sure to 1e-9 would hide such a fault from the logprob checks).

Needs torch and transformers (`pip install 'refengine[parity]'`), imported when training starts;
`refengine train-tiny-chat OUT_DIR` runs it.
"""
from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from ..data import shipped
from ..errors import RefengineError
from ..jsonl import json_lines
from .tiny import SPECIAL_TOKENS, TRAINED_RECIPE, TinySpec, in_memory, render_chatml, write_folder

TRAINING_DATA = ("training", "tiny-chat.jsonl")


@dataclass(frozen=True)
class TrainSpec:
    seed: int = 0
    steps: int = 800
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    label_smoothing: float = 0.1


TINY_CHAT = TinySpec(arch="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                     vocab=768, tie=True, max_position_embeddings=4096, rope_theta=10000.0)


def read_examples(path: Path) -> list[dict]:
    """The training examples of a JSONL file (docs/formats.md, Training examples), each line checked."""
    examples = []
    for where, example in json_lines(path):
        if not (isinstance(example.get("text"), str) or isinstance(example.get("messages"), list)):
            raise RefengineError(f"{where}: expected an object with 'text' (a string) or 'messages' (a list)")
        for k, m in enumerate(example.get("messages", [])):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise RefengineError(f"{where}: messages[{k}]: expected an object with string 'role' and 'content'")
        examples.append(example)
    if not examples:
        raise RefengineError(f"{path}: no training examples")
    return examples


def train_tokenizer(examples: list[dict], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the examples' words (message contents, roles, texts): leading-space tokens
    as in GPT-2 and Qwen, so a reply's first word and its later words are different tokens."""
    lines = []
    for example in examples:
        if "text" in example:
            lines.append(example["text"])
        else:
            lines += [m["role"] + "\n" + m["content"] for m in example["messages"]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def encode_examples(examples: list[dict], tokenizer: Tokenizer) -> list[tuple[list[int], list[bool]]]:
    """(token ids, which positions the loss covers) per example."""
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    encoded = []
    for example in examples:
        if "text" in example:
            tokens = tokenizer.encode(example["text"]).ids + [ids["<|endoftext|>"]]
            encoded.append((tokens, [True] * len(tokens)))
            continue
        tokens, learned = [], []
        for message in example["messages"]:
            head, body = render_chatml(message["role"], message["content"])
            head_ids, body_ids = tokenizer.encode(head).ids, tokenizer.encode(body).ids
            tokens += head_ids + body_ids
            learned += [False] * len(head_ids) + [message["role"] == "assistant"] * len(body_ids)
        encoded.append((tokens, learned))
    return encoded


def _hf_model(spec: TinySpec, special_ids: dict[str, int]):
    import transformers
    config = transformers.Qwen3Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie, rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=special_ids["<|endoftext|>"], eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|endoftext|>"], attn_implementation="sdpa")
    return transformers.Qwen3ForCausalLM(config)


def _by_length(encoded: list, width_ratio: float = 2.0) -> list[list]:
    """The examples in groups of similar length (sorted; a group closes where the next example is
    more than `width_ratio` times its shortest): padding a 20-token reply to a 150-token story's width
    would spend most of a step on pad tokens."""
    groups: list[list] = []
    for example in sorted(encoded, key=lambda e: len(e[0])):
        if groups and len(example[0]) <= width_ratio * len(groups[-1][0][0]):
            groups[-1].append(example)
        else:
            groups.append([example])
    return groups


def _batch(group: list, pad_id: int):
    """(input ids, labels) of one group, right-padded: under a causal mask a row's pad tokens sit
    after all of its real ones and change nothing before them. A label is the token itself (-100 where
    the loss does not cover it); transformers' convention, shifted by one when the loss is taken."""
    import torch
    width = max(len(tokens) for tokens, _ in group)
    input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    labels = torch.full((len(group), width), -100, dtype=torch.long)
    for row, (tokens, learned) in enumerate(group):
        input_ids[row, :len(tokens)] = torch.tensor(tokens)
        labels[row, :len(tokens)] = torch.tensor([t if keep else -100 for t, keep in zip(tokens, learned)])
    return input_ids, labels


def train_tiny_chat(out_dir: str | Path, train: TrainSpec = TrainSpec(), data: Path | None = None,
                    progress: bool = True) -> Path:
    """Train tiny-chat on `data` (default: the shipped training file) and write its HF folder to `out_dir`."""
    data = Path(data) if data else shipped(*TRAINING_DATA)
    examples = read_examples(data)  # a bad file is named before anything is imported or trained
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RefengineError(f"training needs torch and transformers ({e}); pip install 'refengine[parity]'") from None
    spec = TINY_CHAT
    tokenizer = train_tokenizer(examples, spec.vocab)
    special_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    encoded = encode_examples(examples, tokenizer)

    torch.manual_seed(train.seed)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one thread: the same sums in the same order on every run
    try:
        model = _hf_model(spec, special_ids).to(torch.float32)
        batches = [_batch(group, special_ids["<|endoftext|>"]) for group in _by_length(encoded)]
        learned = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)
        optimizer = torch.optim.AdamW(model.parameters(), lr=train.learning_rate, weight_decay=train.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / train.warmup_steps)
                                                     * 0.5 * (1 + np.cos(np.pi * min(s, train.steps) / train.steps)))
        model.train()
        steps = tqdm(range(train.steps), desc="train tiny-chat", unit="step", disable=not progress)
        for _ in steps:
            optimizer.zero_grad()
            loss = 0.0
            for input_ids, labels in batches:
                logits = model(input_ids=input_ids).logits[:, :-1]
                part = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, spec.vocab), labels[:, 1:].reshape(-1), ignore_index=-100,
                    label_smoothing=train.label_smoothing, reduction="sum") / learned
                part.backward()
                loss += float(part.detach())
            optimizer.step()
            schedule.step()
            steps.set_postfix(loss=f"{loss:.4f}", refresh=False)
        state = {name: p.detach().numpy().astype(np.float32) for name, p in model.state_dict().items()
                 if not (spec.tie and name == "lm_head.weight")}
    finally:  # the process's settings as they were (a test, or a caller that trains and goes on)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    recipe = {"data": "/".join(TRAINING_DATA) if data == shipped(*TRAINING_DATA) else str(data),
              "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
              "examples": len(examples), "tokens": sum(len(t) for t, _ in encoded),
              "final_loss": round(loss, 6), "torch": torch.__version__,
              "transformers": transformers.__version__, "machine": platform.machine(),
              **vars(train), "model": spec.recipe()}
    return write_folder(Path(out_dir), spec, tokenizer, in_memory(state), recipe_name=TRAINED_RECIPE, recipe=recipe)
