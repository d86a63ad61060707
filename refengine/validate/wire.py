"""Where OpenAI-compatible servers put what validate reads — text, generated token ids, prompt ids,
finish reason — in whole answers and in stream chunks. Servers differ (the dialect table in
docs/engines/index.md); every place one of them uses is read, and unknown fields are ignored.

Generated ids, first found wins per choice: `choices[i].token_ids` (refengine; vLLM with
`return_token_ids`), `choices[i].logprobs.content[].id` / `.token_id` (llama.cpp; refengine's chat
logprobs), a list of ints in `choices[i].tokens` or the object's `tokens` (llama.cpp's own format).
Prompt ids: `choices[i].prompt_token_ids` (refengine; vLLM completions) or the object's
`prompt_token_ids` (vLLM chat).
Logprobs, per generated token: chat's `logprobs.content[].logprob` with `.top_logprobs[].logprob`,
or completions' `logprobs.token_logprobs[]` with `logprobs.top_logprobs[]` (token -> logprob).
Each choice (`n`) is read on its own: the first (`index` 0) is the answer, the others its `others`, in
index order. `usage` counts the tokens of all choices, so it checks a choice's ids only where it is the only one.
Prompt logprobs (vLLM's `prompt_logprobs`): `choices[i].prompt_logprobs` (completions) or the object's
`prompt_logprobs` (chat): per prompt token null (the first) or {"token id": {"logprob", ...}}.
Prompt tokens served from the prefix cache: `usage.prompt_tokens_details.cached_tokens` (OpenAI;
vLLM, refengine) or `timings.cache_n` (llama.cpp).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

IDS_FIELDS = ("token_ids", "logprobs", "tokens")  # where generated ids were found (Completion.ids_from)


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float | None    # the generated token's, as the server reports it
    top: tuple[float, ...]   # the server's best alternatives' logprobs, best first

    @property
    def margin(self) -> float | None:
        """The server's own top-2 margin (a logprob difference is a logit difference)."""
        return self.top[0] - self.top[1] if len(self.top) >= 2 else None


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int] | None         # None: the server does not report generated ids
    prompt_token_ids: list[int] | None  # None: not reported
    finish_reason: str | None
    cancelled: bool                     # we hung up before the answer was complete
    ids_from: str | None = None         # one of IDS_FIELDS, None when no ids
    done_marker: bool | None = None     # streamed: whether `data: [DONE]` ended it; None: not streamed
    note: str | None = None             # why ids were set aside, when they were
    logprobs: list[TokenLogprob] | None = None  # per generated token; None: not reported (for every token)
    # A hang-up's: the token chunks the server had already sent that we had not read, and whether the
    # answer's end was among them (client._unread); None: not a hang-up.
    unread: tuple[int, bool] | None = None
    cached_tokens: int | None = None    # prompt tokens the server says it took from its prefix cache; None: not said
    # Per prompt token, id -> logprob for the token and the alternatives reported there (None for the
    # first token); None: not reported.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    others: tuple[Completion, ...] = ()  # the answer's other choices (`n`), in index order

    @property
    def num_choices(self) -> int:
        return 1 + len(self.others)


def _ints(value) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    return None


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def choice_text(choice: dict) -> str:
    text = choice.get("text")
    if isinstance(text, str):
        return text
    content = (_dict(choice.get("message")) or _dict(choice.get("delta"))).get("content")
    return content if isinstance(content, str) else ""


def logprob_ids(choice: dict) -> list[int] | None:
    content = _dict(choice.get("logprobs")).get("content")
    if not isinstance(content, list) or not content:
        return None
    ids = [_dict(entry).get("id", _dict(entry).get("token_id")) for entry in content]
    return _ints(ids)


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _best_first(values) -> tuple[float, ...]:
    return tuple(sorted((v for v in map(_number, values) if v is not None), reverse=True))


def token_logprobs(choice: dict) -> list[TokenLogprob] | None:
    """The choice's per-token logprobs in either API's shape; None when it carries none."""
    logprobs = _dict(choice.get("logprobs"))
    content = logprobs.get("content")
    if isinstance(content, list) and content:
        entries = [_dict(e) for e in content]
        return [TokenLogprob(_number(e.get("logprob")),
                             _best_first(_dict(t).get("logprob") for t in _list(e.get("top_logprobs"))))
                for e in entries]
    chosen, top = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(chosen, list) or not chosen:
        return None
    top = top if isinstance(top, list) and len(top) == len(chosen) else [None] * len(chosen)
    return [TokenLogprob(_number(lp), _best_first(_dict(alternatives).values())) for lp, alternatives in zip(chosen, top)]


def prompt_logprobs(choice: dict, obj: dict) -> list[dict[int, float] | None] | None:
    """vLLM's prompt_logprobs of a choice (or its response object); None where it has none or they do
    not parse (an entry that is neither null nor an object of id -> {"logprob": number})."""
    entries = choice.get("prompt_logprobs", obj.get("prompt_logprobs"))
    if not isinstance(entries, list):
        return None
    out: list[dict[int, float] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, dict):
            return None
        values = {int(k): _number(_dict(v).get("logprob")) for k, v in entry.items() if str(k).isdigit()}
        if len(values) != len(entry) or None in values.values():
            return None
        out.append(values)
    return out


def generated_ids(choice: dict, obj: dict) -> tuple[list[int] | None, str | None]:
    ids = _ints(choice.get("token_ids"))
    if ids is not None:
        return ids, "token_ids"
    ids = logprob_ids(choice)
    if ids is not None:
        return ids, "logprobs"
    for holder in (choice, obj):
        ids = _ints(holder.get("tokens"))
        if ids:  # llama.cpp sends an empty `tokens` when ids were not asked for
            return ids, "tokens"
    return None, None


def prompt_ids(choice: dict, obj: dict) -> list[int] | None:
    ids = _ints(choice.get("prompt_token_ids"))
    return ids if ids is not None else _ints(obj.get("prompt_token_ids"))


def usage_tokens(obj: dict) -> int | None:
    count = _dict(obj.get("usage")).get("completion_tokens")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def cached_tokens(obj: dict) -> int | None:
    for count in (_dict(_dict(obj.get("usage")).get("prompt_tokens_details")).get("cached_tokens"),
                  _dict(obj.get("timings")).get("cache_n")):
        if isinstance(count, int) and not isinstance(count, bool):
            return count
    return None


def checked(ids: list[int] | None, ids_from: str | None, usage: int | None) -> tuple[list[int] | None, str | None]:
    """Ids taken from logprobs entries are set aside when their count differs from the server's own
    token count (llama.cpp streams no logprobs for a token that completed no character)."""
    if ids is not None and ids_from == "logprobs" and usage is not None and usage != len(ids):
        return None, f"{len(ids)} ids in logprobs but usage.completion_tokens {usage}: compared by text"
    return ids, None


def whole(data: dict) -> Completion:
    """A whole (non-streamed) answer. No choices: ValueError."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        raise ValueError(f"response without choices: {str(data)[:120]}")
    first, *others = sorted(choices, key=lambda c: _index(c, choices))
    usage = usage_tokens(data) if not others else None
    return replace(whole_choice(first, data, usage), others=tuple(whole_choice(c, data, None) for c in others))


def _index(choice: dict, choices: list) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else choices.index(choice)


def whole_choice(choice: dict, data: dict, usage: int | None) -> Completion:
    ids, ids_from = generated_ids(choice, data)
    ids, note = checked(ids, ids_from, usage)
    finish = choice.get("finish_reason")
    return Completion(choice_text(choice), ids, prompt_ids(choice, data), finish if isinstance(finish, str) else None,
                      cancelled=False, ids_from=ids_from if ids is not None else None, note=note,
                      logprobs=counted(token_logprobs(choice), ids), cached_tokens=cached_tokens(data),
                      prompt_logprobs=prompt_logprobs(choice, data))


def counted(logprobs: list[TokenLogprob] | None, ids: list[int] | None) -> list[TokenLogprob] | None:
    """Logprobs that cannot be lined up with the generated ids are not reported ones."""
    return None if logprobs is not None and ids is not None and len(logprobs) != len(ids) else logprobs


class Stream:
    """A streamed answer as its chunks arrive. Ids count as reported when some chunk carried them and
    no chunk carried text without them."""

    def __init__(self):
        self.pieces: list[str] = []
        self.ids: list[int] = []
        self.ids_from: str | None = None
        self.text_without_ids = False
        self.prompt_ids: list[int] | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.others: dict[int, Stream] = {}  # the other choices (`n`), each read as a stream of its own
        self.finish_reason: str | None = None
        self.usage: int | None = None
        self.cached_tokens: int | None = None
        self.chunks = 0  # chunks that carried tokens (text or ids)
        self.logprobs: list[TokenLogprob] = []
        self.tokens_without_logprobs = False

    def add(self, chunk: dict) -> None:
        self.usage = usage_tokens(chunk) if usage_tokens(chunk) is not None else self.usage
        self.cached_tokens = cached_tokens(chunk) if cached_tokens(chunk) is not None else self.cached_tokens
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool) or index == 0:
                self.add_choice(choice, chunk)
            else:
                self.others.setdefault(index, Stream()).add_choice(choice, chunk)
        if self.prompt_ids is None and not choices:
            self.prompt_ids = _ints(chunk.get("prompt_token_ids"))

    def add_choice(self, choice: dict, chunk: dict) -> None:
        """A piece of this choice: its text, ids, logprobs, prompt ids and logprobs, finish reason."""
        text = choice_text(choice)
        ids, ids_from = generated_ids(choice, chunk)
        self.pieces.append(text)
        if ids is not None:
            self.ids += ids
            self.ids_from = self.ids_from or ids_from
        elif text:
            self.text_without_ids = True
        if self.prompt_ids is None:
            self.prompt_ids = prompt_ids(choice, chunk)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs(choice, chunk)
        finish = choice.get("finish_reason")
        self.finish_reason = finish if isinstance(finish, str) and finish else self.finish_reason
        self.chunks += bool(text or ids)
        logprobs = token_logprobs(choice)
        if logprobs is not None:
            self.logprobs += logprobs
        elif text or ids:
            self.tokens_without_logprobs = True

    def completion(self, cancelled: bool, done_marker: bool | None, unread: tuple[int, bool] | None = None) -> Completion:
        reported = self.ids_from is not None and not self.text_without_ids
        usage = None if cancelled or self.others else self.usage
        ids, note = checked(self.ids if reported else None, self.ids_from, usage)
        logprobs = None if self.tokens_without_logprobs or not self.logprobs else counted(self.logprobs, ids)
        return Completion("".join(self.pieces), ids, self.prompt_ids, None if cancelled else self.finish_reason,
                          cancelled, ids_from=self.ids_from if ids is not None else None,
                          done_marker=done_marker, note=note, logprobs=logprobs, unread=unread,
                          cached_tokens=self.cached_tokens, prompt_logprobs=self.prompt_logprobs,
                          others=tuple(self.others[i].completion(cancelled, done_marker) for i in sorted(self.others)))
