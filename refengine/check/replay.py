"""Re-run a schedule and judge every request against a baseline: the loop behind every property of
the invariants suite, and behind `refengine replay` for the repro files they write.

The schedule runs batched as written (check.driver, with the engine's own checks after every step).
Each request is then judged (check.comparison) against one of the baselines of AGAINST. Invariant
mode must match bit for bit (token ids and logits sha256); fast mode, and any comparison with the
float64 reference, is judged by the margin rule with the model's calibrated tolerance. Where a
request asked for logprobs (its `logprobs` key), every agreeing step's reported logprobs are judged
too: bit-identical in invariant mode, else within twice the logit tolerance of the baseline row's
float64 log-softmax (check.comparison.logprob_tolerance). With prefix caching on, the run's hits are
judged too (check.prefix_cache): a misreported or unsourced hit fails it as an engine failure. So does a
run whose admissions, preemptions and running order break the scheduler's policy (check.policy), and a
speculating run whose verifying decodes gave requests other than what they accepted (check.speculation).
A request with n > 1 is judged child by child, each against its baseline as a request of its own
(check.schedule.children: child k is the request with seed + k).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..engine import EngineConfig, RequestOutput
from ..errors import RefengineError
from ..model import Model
from ..reference import generate
from ..sampling import SamplingParams
from ..vision_reference import generate_with_images
from .comparison import (
    compare_request,
    logit_deviation,
    logprob_difference,
    logprob_tolerance,
)
from .driver import EngineStuck, configured, run_alone, run_batched, settings_text
from .margin_rule import Verdict, describe, processed_noise_gain, tolerance
from .policy import policy_problems
from .prefix_cache import cache_problems
from .schedule import Schedule, ScheduledRequest, children
from .speculation import speculation_problems

AGAINST = {
    "serial": "each request alone (max_num_seqs=1, same settings), run to its natural stop",
    "budget": "the same schedule under another max_num_batched_tokens (other prefill chunks)",
    "reference": "the float64 serial reference (greedy requests; the margin rule with the f32-vs-f64 bound)",
    "prefill": "each decode step of a request alone against a fresh prefill of the same prefix",
    "unspeculated": "each request alone without speculative decoding (greedy requests: a seeded sampler draws "
                    "otherwise under speculation, with the same distribution)",
}


class Baselines:
    """Runs the baselines requests are judged against; the suite memoizes them (shrinking re-runs
    the same requests many times)."""

    def alone(self, model: Model, config: EngineConfig, request: ScheduledRequest) -> RequestOutput:
        return run_alone(model, config, request)

    def reference(self, model: Model, prompt_ids: list[int], params: SamplingParams, images: tuple = ()):
        """`images`: ScheduledRequest.images, one per run of image tokens in prompt_ids."""
        if images:
            return generate_with_images(model, prompt_ids, [image.pixels() for image in images], params,
                                        top_k_logprobs=0, keep_logits=True)
        return generate(model, prompt_ids, params, top_k_logprobs=0, keep_logits=True)


@dataclass
class ReplayResult:
    schedule: Schedule
    config: EngineConfig
    against: str
    verdicts: dict[str, Verdict]
    outputs: dict[str, RequestOutput]
    trace: list[dict]
    tolerance: float | None            # the margin rule's tolerance; None when bit-exact
    engine_failure: str | None = None
    names: tuple[str, str] = ("batched", "alone")

    @property
    def passed(self) -> bool:
        return self.engine_failure is None and all(v.passed for v in self.verdicts.values())

    @property
    def divergences(self) -> list[Verdict]:
        return [v for v in self.verdicts.values() if not v.passed]

    @property
    def comparison(self) -> str:
        rule = "bit-exact" if self.tolerance is None else f"margin rule, tolerance {self.tolerance:.3g}"
        return f"{self.names[0]} vs {self.names[1]} ({rule})"

    @property
    def head(self) -> str:
        return f"{self.schedule.source}: {self.comparison}; {settings_text(self.config)}"

    def report(self, decode=None) -> str:
        """The head, then per request its verdict (`describe`, token text where `decode(id)` is given)
        and the text of its batched answer: beside a one-line verdict, under a longer one."""
        lines = [self.head]
        width = max((len(rid) for rid in self.verdicts), default=0)
        for rid, v in self.verdicts.items():
            first, *rest = describe(v, *self.names, decode=decode).split("\n")
            first = first.replace(f"{rid}:", f"{rid}:".ljust(width + 1), 1)
            out = self.outputs.get(rid)
            said = f"{out.text!r} ({out.finish_reason}, {len(out.token_ids)} tokens)" if out else ""
            if not said:
                lines += [first, *rest]
            elif rest:
                lines += [first, f"  {self.names[0]} text: {said}", *rest]
            else:
                lines.append(f"{first}  {said}")
        if self.engine_failure:
            lines.append(f"engine failure: {self.engine_failure}")
        bad = len(self.divergences) + bool(self.engine_failure)
        lines.append(f"-- {len(self.verdicts)} requests, {len(self.trace)} steps: "
                     + ("FAIL" if bad else "no divergence"))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"passed": self.passed, "against": self.against, "mode": self.config.mode, "fault": self.config.fault,
                "tolerance": self.tolerance, "engine_failure": self.engine_failure,
                "verdicts": {rid: v.as_dict() for rid, v in self.verdicts.items()},
                "requests": {rid: o.to_json() for rid, o in self.outputs.items()}, "trace": self.trace}


def _prefill_verdict(model, config, request, baselines: Baselines, exact: bool, tol: float) -> Verdict:
    decoded = baselines.alone(model, config, request)
    for i in range(1, len(decoded.token_ids)):
        prefix = decoded.prompt_ids + decoded.token_ids[:i]
        fresh = baselines.alone(model, config, replace(request, prompt={"prompt_ids": prefix},
                                                      params=replace(request.params, max_tokens=1,
                                                                     min_tokens=0))).steps[0]
        step = decoded.steps[i]
        deviation = logit_deviation(step.logits, fresh.logits)
        problem = "decode logits differ from a fresh prefill" \
            if ((step.logits_sha256 != fresh.logits_sha256) if exact else deviation > tol) else None
        if problem is None and request.logprobs is not None and step.token_id == fresh.token_id:
            problem = logprob_difference(step, fresh, request.logprobs, exact=exact, names=("decode", "fresh prefill"),
                                         tolerance=0.0 if exact else logprob_tolerance(tol))
        if problem:
            return Verdict(request.id, "diverged", reason=f"{problem} (the {len(prefix)}-token prefix)", index=i,
                           engine_step=step.step, got=step.token_id, want=fresh.token_id, margin=fresh.top2_margin,
                           tolerance=0.0 if exact else tol, deviation=deviation)
    return Verdict(request.id, "match")


def replay(model: Model, schedule: Schedule, *, against: str = "serial", other_budget: int | None = None,
           mode: str | None = None, fault: str | None = None, calibration: dict | None = None,
           baselines: Baselines | None = None, on_events=None) -> ReplayResult:
    """Judge every request of `schedule` against the baseline `against` (AGAINST). `calibration`
    (refengine.calibrate) is needed for the margin rule: fast mode, or against the reference."""
    if against not in AGAINST:
        raise RefengineError(f"against: expected one of {', '.join(AGAINST)}, got {against!r}")
    if against == "budget" and not other_budget:
        raise RefengineError("against budget: give the other max_num_batched_tokens (other_budget)")
    baselines = baselines or Baselines()
    config = configured(schedule.engine, mode, fault)
    engine, failure = run_batched(model, schedule, config, on_events=on_events)
    outputs = engine.outputs()
    if config.enable_prefix_caching and failure is None:
        problems = cache_problems(schedule, outputs, engine.trace)
        failure = "prefix cache: " + "; ".join(problems) if problems else None
    if failure is None:
        problems = policy_problems(schedule, outputs, engine.trace)
        failure = "scheduling policy: " + "; ".join(problems) if problems else None
    if failure is None and config.num_speculative_tokens:
        problems = speculation_problems(outputs, engine.trace, engine.status())
        failure = "speculative decoding: " + "; ".join(problems) if problems else None
    exact = config.mode == "invariant" and against != "reference"
    bound = "f32_vs_f64" if against == "reference" else "f32_batched_vs_serial"
    tol = None if exact else tolerance(calibration, bound)
    names = {"serial": ("batched", "alone"), "reference": ("engine f32", "reference f64"),
             "budget": (f"budget {config.max_num_batched_tokens}", f"budget {other_budget}"),
             "prefill": ("decode", "fresh prefill"), "unspeculated": ("speculating", "alone unspeculated")}[against]
    wanted = None
    if against == "budget":
        other_config = replace(config, max_num_batched_tokens=other_budget)
        other, other_failure = run_batched(model, replace(schedule, engine=other_config), other_config)
        failure = failure or (other_failure and f"under budget {other_budget}: {other_failure}")
        wanted = other.outputs()
    verdicts = {}
    for request in [child for r in schedule.requests for child in children(r)]:  # each child of n on its own
        try:
            verdicts[request.id] = _verdict(model, config, request, against, outputs, baselines, exact, tol, names,
                                            wanted)
        except EngineStuck as e:  # a baseline the engine never finished: its failure, as the batched run's are
            failure = failure or str(e)
            verdicts[request.id] = Verdict(request.id, "skipped", reason="its baseline run never ended")
    return ReplayResult(schedule, config, against, verdicts, outputs, engine.trace, tol, failure, names)


def _verdict(model, config, request, against, outputs, baselines, exact, tol, names, wanted) -> Verdict:
    """`request` (one child) judged against its baseline; EngineStuck where that baseline never ends."""
    if against == "prefill":
        return _prefill_verdict(model, config, request, baselines, exact, tol)
    if against == "reference" and not request.params.greedy:
        return Verdict(request.id, "skipped", reason="seeded sampling has no float64 baseline")
    if against == "unspeculated" and not request.params.greedy:
        return Verdict(request.id, "skipped", reason="seeded sampling draws otherwise under speculation")
    if request.id not in outputs:  # the run stopped at the engine failure before it arrived
        return Verdict(request.id, "skipped", reason="never ran: the engine failed before its arrival")
    want = {"serial": lambda: baselines.alone(model, config, request),
            "reference": lambda: baselines.reference(model, outputs[request.id].prompt_ids, request.params,
                                                        request.images),
            "budget": lambda: wanted[request.id],
            "unspeculated": lambda: baselines.alone(model, replace(config, num_speculative_tokens=0), request),
            }[against]()
    return compare_request(request.id, outputs[request.id], want, exact=exact,
                           margin_tolerance=(tol or 0.0) * processed_noise_gain(request.params),
                           noise_tolerance=tol or 0.0, num_logprobs=request.logprobs,
                           num_prompt_logprobs=request.params.prompt_logprobs, names=names)
