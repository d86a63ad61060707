"""The continuous-batching float32 engine under test: config, sequences, paged KV bookkeeping,
scheduler, batched model runner and kernels, outputs, metrics and the fault catalog."""
from .config import MODES, EngineConfig
from .faults import FAULTS, Fault, resolve_fault
from .llm_engine import LLMEngine
from .outputs import RequestOutput, TokenEvent

__all__ = ["FAULTS", "MODES", "EngineConfig", "Fault", "LLMEngine", "RequestOutput", "TokenEvent", "resolve_fault"]
