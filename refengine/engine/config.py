"""The engine's settings, validated once, with defaults derived from the model. Nothing here reads
the environment: an engine runs exactly what its caller configured."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import RefengineError
from ..model import ModelConfig
from .faults import Fault, resolve_fault

MODES = ("fast", "invariant")
# The order of a step's chunks (never which chunks: that is always the FCFS decision): "fcfs" running
# sequences in admission order, then newly admitted ones; "prefill-first" the step's prefill chunks,
# then its decodes (as SGLang orders them); "shuffled" a permutation drawn from (scheduling_seed, step).
SCHEDULING_POLICIES = ("fcfs", "prefill-first", "shuffled")
DEFAULT_POOL_TOKENS_PER_SEQ = 2048


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "fast"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_blocks: int | None = None     # None: max_num_seqs sequences of min(max_model_len, 2048) tokens
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    fault: str | None = None          # the name of a catalogued bug to inject (refengine.engine.faults)
    scheduling_policy: str = "fcfs"   # the order of a step's chunks (SCHEDULING_POLICIES)
    scheduling_seed: int = 0          # "shuffled": with the step number, picks each step's permutation
    enable_prefix_caching: bool = False  # share computed full KV blocks between requests (block_manager)
    # Speculative decoding (engine/drafter.py): up to this many draft tokens per decode, verified in the
    # step's forward; 0: off. Drafts by prompt lookup of the last prompt_lookup_max..min tokens, or by
    # the draft model in the folder speculative_model (the same vocabulary), decoding ahead.
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    speculative_model: str | None = None
    injected: Fault | None = field(default=None, init=False, repr=False, compare=False)  # `fault`, resolved

    def __post_init__(self):
        if self.mode not in MODES:
            raise RefengineError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise RefengineError(f"scheduling_policy: expected one of {', '.join(SCHEDULING_POLICIES)}, "
                                 f"got {self.scheduling_policy!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise RefengineError(f"enable_prefix_caching: must be true or false, got {self.enable_prefix_caching!r}")
        seed = self.scheduling_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise RefengineError(f"scheduling_seed: must be a non-negative integer, got {seed!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len",
                     "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is None and name in ("num_blocks", "max_model_len"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RefengineError(f"{name}: must be a positive integer, got {value!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise RefengineError(f"num_speculative_tokens: must be a non-negative integer, got {k!r}")
        if self.speculative_model is not None and (not isinstance(self.speculative_model, str)
                                                   or not self.speculative_model):
            raise RefengineError(f"speculative_model: expected a model folder, got {self.speculative_model!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise RefengineError(f"prompt_lookup_min: {self.prompt_lookup_min} exceeds prompt_lookup_max "
                                 f"{self.prompt_lookup_max}")
        if k and self.max_num_batched_tokens < 1 + k:  # a verifying decode is scheduled whole or not at all
            raise RefengineError(f"max_num_batched_tokens: {self.max_num_batched_tokens} cannot hold a decode "
                                 f"with {k} draft tokens")
        object.__setattr__(self, "injected", resolve_fault(self.fault))

    def resolved(self, model_config: ModelConfig) -> EngineConfig:
        """A copy with every None filled in for this model."""
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise RefengineError(f"max_model_len: {max_model_len} exceeds the model's "
                                 f"max_position_embeddings {model_config.max_position_embeddings}")
        pool_tokens = self.max_num_seqs * min(max_model_len, DEFAULT_POOL_TOKENS_PER_SEQ)
        num_blocks = self.num_blocks or -(-pool_tokens // self.block_size)
        return replace(self, max_model_len=max_model_len, num_blocks=num_blocks)

    def settings(self) -> dict:
        """The schedule format's `engine` object for these settings (the run output echoes it); the
        speculation keys only where it is on, so settings from before it read the same."""
        names = SETTINGS + SPECULATION_SETTINGS if self.num_speculative_tokens else SETTINGS
        return {name: getattr(self, name) for name in names}


SETTINGS = ("mode", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len", "fault",
            "scheduling_policy", "scheduling_seed", "enable_prefix_caching")
SPECULATION_SETTINGS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "speculative_model")
