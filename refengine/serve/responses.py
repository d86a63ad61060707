"""Response objects and SSE chunks for one request, in the OpenAI completions and chat formats."""
from __future__ import annotations

from ..model.tokenizer import Tokenizer
from .protocol import Generated, GenerationRequest


class ResponseBuilder:
    def __init__(self, request: GenerationRequest, served_name: str, tokenizer: Tokenizer):
        self.request = request
        self.served_name = served_name
        self.tokenizer = tokenizer
        self.chat = request.kind == "chat"
        self._text_offset = 0  # completions logprobs report each token's offset in the text

    def response(self, tokens: list[Generated], finish_reason: str, cached: int | None = None) -> dict:
        """`cached`: prompt tokens found in the prefix cache (None: the server caches none)."""
        text = "".join(t.text for t in tokens)
        choice = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(self._common(tokens, finish_reason))
        choice["prompt_token_ids"] = self.request.prompt_ids
        return {**self._header(), "choices": [choice], "usage": self._usage(len(tokens), cached)}

    def chunk(self, tokens: list[Generated], finish_reason: str | None, first: bool) -> dict:
        text = "".join(t.text for t in tokens)
        choice = {"index": 0}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        choice.update(self._common(tokens, finish_reason))
        if first:
            choice["prompt_token_ids"] = self.request.prompt_ids
        return {**self._header(chunk=True), "choices": [choice]}

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

    def _common(self, tokens: list[Generated], finish_reason: str | None) -> dict:
        return {"logprobs": self._logprobs(tokens), "finish_reason": finish_reason,
                "token_ids": [t.token_id for t in tokens]}

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, tokens: list[Generated]) -> dict | None:
        if self.request.logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t.token_id, t.logprob, t.top_logprobs) for t in tokens]}
        pieces = [self._piece(t.token_id) for t in tokens]
        offsets = []
        for piece in pieces:
            offsets.append(self._text_offset)
            self._text_offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{self._piece(i): lp for i, lp in t.top_logprobs} for t in tokens],
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float | None, alternatives=()) -> dict:
        piece = self._piece(token_id)
        entry = {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "token_id": token_id}
        if alternatives is not None:
            entry["top_logprobs"] = [self._chat_entry(i, lp, None) for i, lp in alternatives]
        return entry
