"""The distribution of greedy top-2 margins: how often decisions are clear and how often near-ties."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ..model import Model
from ..reference import generate
from ..sampling import SamplingParams

THRESHOLDS = (0.01, 0.05, 0.1, 0.5)
PERCENTILES = (1, 5, 25, 50, 75, 95)


@dataclass
class MarginStats:
    margins: np.ndarray
    num_prompts: int

    @property
    def median(self) -> float:
        return float(np.median(self.margins))

    def fraction_below(self, threshold: float) -> float:
        return float(np.mean(self.margins < threshold))

    def as_dict(self) -> dict:
        return {
            "steps": int(self.margins.size), "prompts": self.num_prompts,
            "percentiles": {str(p): float(np.percentile(self.margins, p)) for p in PERCENTILES},
            "fraction_below": {str(t): self.fraction_below(t) for t in THRESHOLDS},
        }

    def table(self) -> str:
        lines = [f"{self.margins.size} greedy steps over {self.num_prompts} prompts"]
        lines += [f"  p{p:<3} {np.percentile(self.margins, p):8.4f}" for p in PERCENTILES]
        lines += [f"  < {t:<5} {100 * self.fraction_below(t):6.2f} %" for t in THRESHOLDS]
        return "\n".join(lines)


def measure_margins(model: Model, num_prompts: int = 32, max_tokens: int = 32, seed: int = 0,
                    dtype=np.float64) -> MarginStats:
    """Greedy-decode random prompts (1-24 ids, eos ignored) and collect every step's margin."""
    rng = np.random.default_rng(seed)
    margins = []
    for _ in tqdm(range(num_prompts), desc="margins", unit="prompt", leave=False):
        ids = rng.integers(0, model.config.vocab_size, size=int(rng.integers(1, 25))).tolist()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        margins += generate(model, ids, params, dtype).margins
    return MarginStats(np.asarray(margins), num_prompts)
