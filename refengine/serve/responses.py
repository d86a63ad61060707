"""Response objects and SSE chunks for one request, in the OpenAI completions and chat formats: one
choice per answer (`n`), each with its `index`."""
from __future__ import annotations

from ..model.tokenizer import Tokenizer
from .protocol import Generated, GenerationRequest


class ResponseBuilder:
    def __init__(self, request: GenerationRequest, served_name: str, tokenizer: Tokenizer):
        self.request = request
        self.served_name = served_name
        self.tokenizer = tokenizer
        self.chat = request.kind == "chat"
        self._text_offset: dict[int, int] = {}  # per choice: completions logprobs report each token's offset

    def response(self, tokens: list[list[Generated]], finish_reasons: list[str], cached: int | None = None,
                 scored: list | None = None) -> dict:
        """Per choice its tokens and finish reason. `cached`: prompt tokens found in the prefix cache (None:
        the server caches none). `scored`: the request's prompt logprobs (engine TokenEvent.prompt_logprobs),
        where it was scored."""
        choices = []
        for index, (generated, finish_reason) in enumerate(zip(tokens, finish_reasons)):
            text = "".join(t.text for t in generated)
            choice = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = (self.request.echo or "") + text
            choice.update(self._common(generated, finish_reason, scored, index))
            choice["prompt_token_ids"] = self.request.prompt_ids
            choices.append(choice)
        return self._with_prompt_logprobs({**self._header(), "choices": choices,
                                           "usage": self._usage(sum(map(len, tokens)), cached)}, scored)

    def chunk(self, tokens: list[Generated], finish_reason: str | None, first: bool,
              scored: list | None = None, index: int = 0) -> dict:
        """One SSE chunk of choice `index`; its first carries the prompt's ids, its echo and its prompt
        logprobs (`scored`)."""
        text = "".join(t.text for t in tokens)
        choice = {"index": index}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = ((self.request.echo or "") if first else "") + text
        choice.update(self._common(tokens, finish_reason, scored if first else None, index))
        obj = {**self._header(chunk=True), "choices": [choice]}
        if first:
            choice["prompt_token_ids"] = self.request.prompt_ids
            obj = self._with_prompt_logprobs(obj, scored)
        return obj

    def usage_chunk(self, num_generated: int, cached: int | None = None) -> dict:
        return {**self._header(chunk=True), "choices": [], "usage": self._usage(num_generated, cached)}

    def _header(self, chunk: bool = False) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request.request_id, "object": obj, "created": self.request.created,
                "model": self.served_name}

    def _usage(self, num_generated: int, cached: int | None) -> dict:
        prompt = len(self.request.prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": num_generated, "total_tokens": prompt + num_generated}
        return usage if cached is None else {**usage, "prompt_tokens_details": {"cached_tokens": cached}}

    def _common(self, tokens: list[Generated], finish_reason: str | None, scored: list | None, index: int) -> dict:
        return {"logprobs": self._logprobs(tokens, scored, index), "finish_reason": finish_reason,
                "token_ids": [t.token_id for t in tokens]}

    def _with_prompt_logprobs(self, obj: dict, scored: list | None) -> dict:
        """vLLM's prompt_logprobs: in the choice for completions, in the response object for chat."""
        k = self.request.prompt_logprobs
        if k is None or scored is None:
            return obj
        entries: list[dict | None] = [None]
        for p in scored:
            entry = {str(p.token_id): self._scored(p.token_id, p.logprob, p.rank)}
            for rank, (token, logprob) in enumerate(p.top_logprobs[:k], start=1):
                entry.setdefault(str(token), self._scored(token, logprob, rank))
            entries.append(entry)
        for holder in [obj] if self.chat else obj["choices"]:
            holder["prompt_logprobs"] = entries
        return obj

    def _scored(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._piece(token_id)}

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, tokens: list[Generated], scored: list | None, index: int) -> dict | None:
        """With echo and `scored` (the first chunk, or a whole answer), the prompt's tokens come first: the
        first with no logprob (nothing comes before it), the others with theirs."""
        if self.request.logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t.token_id, t.logprob, t.top_logprobs) for t in tokens]}
        ids, chosen, top = [t.token_id for t in tokens], [t.logprob for t in tokens], [t.top_logprobs for t in tokens]
        if self.request.echo is not None and scored is not None:
            k = self.request.logprobs
            ids = self.request.prompt_ids + ids
            chosen = [None] + [p.logprob for p in scored] + chosen
            top = [None] + [p.top_logprobs[:k] for p in scored] + top
        pieces = [self._piece(i) for i in ids]
        offsets, offset = [], self._text_offset.get(index, 0)
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        self._text_offset[index] = offset
        return {"tokens": pieces, "token_logprobs": chosen,
                "top_logprobs": [None if t is None else {self._piece(i): lp for i, lp in t} for t in top],
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float | None, alternatives=()) -> dict:
        piece = self._piece(token_id)
        entry = {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "token_id": token_id}
        if alternatives is not None:
            entry["top_logprobs"] = [self._chat_entry(i, lp, None) for i, lp in alternatives]
        return entry
