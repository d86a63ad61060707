"""The request surface beyond plain greedy decoding: which logits processors a server applies, refuses
or silently ignores. A server that accepts `logit_bias` or a penalty and answers as if it had not
been sent tells its users nothing is wrong while their settings do nothing: that is a finding, not a
pass (validate's verdict fails on it).

One probe per API, on the probe case (greedy, its own cache salt), after a plain answer to it:
- logit_bias: -100 on the plain answer's first token: the first token must change (needs ids);
- min_tokens: where the plain answer stopped (eos) after n < max_tokens tokens, min_tokens n: it can
  no longer stop there, so the answer must change;
- frequency_penalty / presence_penalty 2: at a step whose token the answer already had k times, and
  at which no other token had been seen more than M times, with a top-2 margin (the server's
  logprobs) below half of 2 (k - M) (frequency) or, where every earlier token was that one, below half
  of 2 (presence): the penalty lowers that token by more than it can lower any rival (by twice the
  margin: the server's own rounding cannot close that), so the answer must change there or before;
- repetition_penalty: its effect needs the logits' signs, which no logprob shows: only refused or
  accepted is learned;
- prompt_logprobs 1 (vLLM's extension): the answer must carry an entry per prompt token, null for the
  first, each later one naming that prompt token (the prompt's ids from the answer);
- echo (completions only; OpenAI's): the answer's text must be the plain answer's with the prompt's
  text before it;
- n 2 (OpenAI's): the answer must carry two choices (their content is not judged: a greedy request's
  answers may part at a near-tie where a server is not batch-invariant).
Each parameter's verdict: "applied" (changed where it must), "ignored" (the same answer where it must
change: a finding), "wrong" (an answer that is neither: prompt logprobs that do not line up with the
prompt, an echo that is not the prompt: a finding), "unsupported" (an extension the server does not
know and answers without: a note, as OpenAI servers ignore unknown fields), "refused" (4xx naming it),
"accepted" (answered, and the plain answer has no step where the parameter must act: not probed
further), "failed" (no answer within the probe's wait, or an HTTP 5xx or broken answer after which the
server fails the plain request too: a finding, as a server that a well-formed request hangs or breaks is
broken), "error" (any other failure: a 4xx that does not name it, or a 5xx the server goes on serving
after, as llama.cpp refuses `n` 2 and `echo` with HTTP 500).
"""
from __future__ import annotations

from collections import Counter

from .client import Completion, Endpoint, ServerError
from .dialect import REFUSAL_STATUSES, Dialect, names, send

PARAMETERS = ("logit_bias", "min_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty")
N = 2  # answers the probe asks for
REPORTS = {"prompt_logprobs": (("completions", "chat"), 1), "echo": (("completions",), True),  # parameter ->
           "n": (("completions", "chat"), N)}                                                # (APIs probed, value)
PROBE_TIMEOUT_S = 60.0  # one short greedy answer each: a server that takes longer (a faulty engine that never
# ends a request) has `failed` that parameter, not held the run for --timeout
FINDINGS = ("ignored", "wrong", "failed")
PENALTY = 2.0  # the largest OpenAI allows


def must_change_at(answer: Completion, parameter: str) -> int | None:
    """The step of `answer` (plain, greedy) where `parameter` at PENALTY must change the answer (module
    docstring), or None where it need not anywhere."""
    ids, logprobs = answer.token_ids, answer.logprobs
    if ids is None or logprobs is None:
        return None
    for step, (token, logprob) in enumerate(zip(ids, logprobs)):
        seen = Counter(ids[:step])
        k, margin = seen[token], logprob.margin
        if not k or margin is None:
            continue
        rival = max((count for other, count in seen.items() if other != token), default=0)
        gain = PENALTY * (k - rival) if parameter == "frequency_penalty" else PENALTY * (rival == 0)
        if margin < gain / 2:  # half of it: the server's own rounding of the penalized row cannot close the rest
            return step
    return None


def _changed(plain: Completion, got: Completion, through: int | None = None) -> bool:
    """Whether `got` differs from the plain answer (by ids where both have them, in the first `through`
    + 1 tokens where given)."""
    if plain.token_ids is not None and got.token_ids is not None:
        end = None if through is None else through + 1
        finish_differs = end is None and got.finish_reason != plain.finish_reason
        return got.token_ids[:end] != plain.token_ids[:end] or finish_differs
    return got.text != plain.text


def _reported(name: str, plain: Completion, got: Completion) -> dict:
    """The verdict on a REPORTS parameter from the answer that asked for it."""
    if name == "n":
        if got.num_choices == N:
            return {"verdict": "applied", "why": f"{N} choices"}
        verdict = "ignored" if got.num_choices == 1 else "wrong"
        return {"verdict": verdict, "why": f"{got.num_choices} choice(s) for n {N}"}
    if name == "echo":
        if got.text == plain.text:
            return {"verdict": "ignored", "why": "the answer's text without the prompt before it"}
        if got.text.endswith(plain.text):
            return {"verdict": "applied", "why": f"the prompt's {len(got.text) - len(plain.text)} characters first"}
        return {"verdict": "wrong", "why": f"the text {got.text[:80]!r} does not end in the plain answer's"}
    entries, ids = got.prompt_logprobs, got.prompt_token_ids or plain.prompt_token_ids
    if entries is None:
        return {"verdict": "unsupported", "why": "the answer carries no prompt_logprobs"}
    if not entries or entries[0] is not None or any(e is None for e in entries[1:]):
        return {"verdict": "wrong", "why": "an entry per prompt token, null for the first only, is not what came"}
    if ids is not None and (len(entries) != len(ids) or any(ids[i] not in e for i, e in enumerate(entries) if i)):
        wrong = len(entries) if len(entries) != len(ids) else \
            next(i for i, e in enumerate(entries) if i and ids[i] not in e)
        return {"verdict": "wrong", "why": f"{len(entries)} entries for a prompt of {len(ids)} tokens; "
                                           f"entry {wrong} does not name the prompt token there"}
    named = "" if ids is None else ", each naming its prompt token"
    return {"verdict": "applied", "why": f"{len(entries)} entries{named}"}


def probe_surface(endpoint: Endpoint, api: str, body: dict, dialect: Dialect) -> dict[str, dict]:
    """Per parameter of PARAMETERS and REPORTS (on the APIs it applies to), {"verdict", "why"} for the
    server's `api` on the case `body` (a whole greedy request)."""
    salt = dialect.cache_salt("cold", f"surface-{api}")
    endpoint = Endpoint(endpoint.url, min(endpoint.timeout, PROBE_TIMEOUT_S))
    reports = [name for name, (apis, _) in REPORTS.items() if api in apis]
    dialect.surface_requests += 1 + len(PARAMETERS) + len(reports)
    try:
        plain = send(endpoint, api, body, None, dialect, salt=salt)
    except (ServerError, OSError) as e:
        return {name: {"verdict": "failed" if server_failed(e) else "error",
                       "why": f"the plain probe request failed: {str(e)[:200]}"} for name in (*PARAMETERS, *reports)}
    ids = plain.token_ids
    tests: dict[str, tuple[dict, int | None, str]] = {}  # parameter -> (fields, step it must change by, why)
    if ids:
        tests["logit_bias"] = ({"logit_bias": {str(ids[0]): -100}}, 0, f"-100 on its first token {ids[0]}")
    else:
        tests["logit_bias"] = ({"logit_bias": {}}, None, "the server reports no token ids to bias")
    stopped = plain.finish_reason == "stop" and ids is not None and len(ids) < body.get("max_tokens", 0)
    tests["min_tokens"] = ({"min_tokens": len(ids)}, None, f"its plain answer stopped after {len(ids)} tokens") \
        if stopped else ({"min_tokens": 1}, None, "its plain answer did not stop before max_tokens")
    for name in ("frequency_penalty", "presence_penalty"):
        step = must_change_at(plain, name)
        why = f"at step {step} its token repeats with a margin below what the penalty takes" if step is not None \
            else "no step of its plain answer where the penalty must change it (or no logprobs)"
        tests[name] = ({name: PENALTY}, step, why)
    tests["repetition_penalty"] = ({"repetition_penalty": 1.5}, None, "its effect needs the logits' signs")
    tests |= {name: ({name: REPORTS[name][1]}, None, "") for name in reports}
    probed = {"logit_bias", "frequency_penalty", "presence_penalty"}
    out = {}
    for name, (fields, step, why) in tests.items():
        must = (name in probed and step is not None) or (name == "min_tokens" and stopped)
        try:
            got = send(endpoint, api, {**body, **fields}, None, dialect, salt=salt)
        except (ServerError, OSError) as e:
            if isinstance(e, ServerError) and e.status in REFUSAL_STATUSES and names(str(e), name):
                out[name] = {"verdict": "refused", "why": str(e)[:200]}
            else:
                out[name] = failure(e, lambda: send(endpoint, api, body, None, dialect, salt=salt), dialect)
            continue
        if name in REPORTS:
            out[name] = _reported(name, plain, got)
        elif not must:
            out[name] = {"verdict": "accepted", "why": why}
        elif _changed(plain, got, step):
            out[name] = {"verdict": "applied", "why": why}
        else:
            out[name] = {"verdict": "ignored", "why": f"{why}, yet the answer is the plain one"}
    return out


def server_failed(e: Exception) -> bool:
    """An answer that may be the server's failure rather than its refusal: HTTP 5xx, a broken or
    malformed answer (no status), or no answer at all (a timeout, a closed connection)."""
    return not isinstance(e, ServerError) or e.status is None or e.status >= 500


def failure(e: Exception, plain, dialect: Dialect) -> dict:
    """The verdict of a probe request that failed with `e` (not a refusal naming its parameter). No answer
    is `failed`; a 5xx or a broken answer is `failed` only where the server then fails `plain()` (the
    plain probe request again) too, else an `error`: some servers refuse with a 500 and serve on."""
    why = str(e)[:200] or type(e).__name__
    if not server_failed(e):
        return {"verdict": "error", "why": why}
    if isinstance(e, ServerError):
        dialect.surface_requests += 1
        try:
            plain()
        except (ServerError, OSError) as after:
            return {"verdict": "failed", "why": f"{why}; then the plain request failed too: {str(after)[:200]}"}
        return {"verdict": "error", "why": f"{why} (the server answers the plain request after it)"}
    return {"verdict": "failed", "why": why}


def surface_notes(surface: dict | None) -> list[str]:
    """Per API a line of each parameter's verdict, then one per parameter a server ignores or refuses
    (the report's `surface`)."""
    notes = [f"surface ({api}): " + ", ".join(f"{name} {v['verdict']}" for name, v in verdicts.items())
             for api, verdicts in (surface or {}).items()]
    for api, verdicts in (surface or {}).items():
        for name, v in verdicts.items():
            if v["verdict"] == "ignored":
                notes.append(f"FINDING: {api}: the server accepts {name} and ignores it ({v['why']})")
            elif v["verdict"] == "wrong":
                notes.append(f"FINDING: {api}: the server answers {name} wrongly ({v['why']})")
            elif v["verdict"] == "failed":
                notes.append(f"FINDING: {api}: the server fails on {name} ({v['why']})")
            elif v["verdict"] in ("refused", "error", "unsupported"):
                notes.append(f"note: {api}: {name} {v['verdict']} ({v['why']})")
    return notes


def ignored(surface: dict | None) -> list[str]:
    """`api: parameter` for every parameter a server ignores, answers wrongly or fails on (FINDINGS)."""
    return [f"{api}: {name}" for api, verdicts in (surface or {}).items()
            for name, v in verdicts.items() if v["verdict"] in FINDINGS]
