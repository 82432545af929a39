"""From a step's per-request results to what callers see: text, stop strings, logprobs, metrics.

The scheduler decides EOS, stop token ids and length; stop strings need text, so they are decided
here, after detokenizing, and the engine aborts a request that hit one. Each request's text grows by
its new tokens only (:class:`~warmcap.detokenizer.TextStream`), so a step's output work does not
grow with the length of the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from warmcap.core.request import Request
from warmcap.core.scheduler_stats import RequestStepOutput
from warmcap.detokenizer import REPLACEMENT, TextDecoder, TextStream
from warmcap.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    StopHit,
)
from warmcap.runner_v2.prompt_logprobs import PromptLogprobsPart
from warmcap.sampling_params import RequestOutputKind

Decode = Callable[[Sequence[int]], str]


@dataclass(slots=True)
class TrackedRequest:
    """The engine's view of one queued request: what it was asked and what it produced so far.

    ``index`` is the sample's index among its prompt's ``n``; ``text`` is its output text so far
    (made on first use); the tokens it has been pushed were searched for stop strings.
    ``prompt_logprobs`` fills position by position as the prompt's chunks are computed
    (``num_prompt_logprobs`` positions so far). With ``RequestOutputKind.DELTA`` outputs,
    ``sent_text`` / ``sent_logprobs`` count the characters and logprobs entries already returned,
    ``sent_prompt_logprobs`` whether the prompt's were.
    """

    request: Request
    prompt: str | None
    metrics: RequestMetrics
    index: int = 0
    logprobs: SampleLogprobs | None = None
    stop: StopHit | None = None
    text: TextStream | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_prompt_logprobs: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False

    @property
    def final_only(self) -> bool:
        """Whether only the request's last output is returned (no output a step before it)."""
        return self.request.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY

    def text_stream(self, decoder: TextDecoder) -> TextStream:
        if self.text is None:
            self.text = decoder.stream()
        return self.text

    def add_prompt_logprobs(self, part: PromptLogprobsPart, decode: Decode) -> None:
        """Fill the positions ``part`` covers; a position computed again (a preempted request
        recomputes its prompt) keeps its first entry."""
        entries = self.prompt_logprobs
        if entries is None:
            return
        ids, lps, ranks = part.token_ids.tolist(), part.logprobs.tolist(), part.ranks.tolist()
        top_ids, top_lps = part.top_ids.tolist(), part.top_logprobs.tolist()
        for j, pos in enumerate(range(part.start, part.start + len(ids))):
            if pos >= len(entries) or entries[pos] is not None:
                continue
            entries[pos] = _entry(ids[j], lps[j], ranks[j], top_ids[j], top_lps[j], decode)
            self.num_prompt_logprobs += 1

    @property
    def prompt_logprobs_done(self) -> PromptLogprobs | None:
        """The prompt logprobs once every position after the first has its entry, else None."""
        entries = self.prompt_logprobs
        if entries is None or self.num_prompt_logprobs < len(entries) - 1:
            return None
        return entries

    def output(
        self, decoder: TextDecoder, new_token_ids: Sequence[int], finish_reason: str | None
    ) -> RequestOutput:
        """The request's output after a step that gave it ``new_token_ids`` (``finish_reason``: None
        while it runs): everything so far, or (``RequestOutputKind.DELTA``) what is new since the
        previous output."""
        req = self.request
        tokens = req.output_token_ids
        stream = self.text_stream(decoder)
        if self.stop is None and stream.num_tokens < len(tokens):
            stream.push(tokens[stream.num_tokens :])
        params = req.sampling_params
        stop_reason: str | int | None = None
        if self.stop is not None:
            stop_reason = self.stop.stop
        elif finish_reason == "stop" and tokens and tokens[-1] in params.stop_token_ids:
            stop_reason = tokens[-1]
        if self.stop is not None:
            text = self.stop.text
        elif finish_reason is None:
            text = stream.full
        else:
            text = stream.final()
        prompt_logprobs = self.prompt_logprobs_done
        logprobs = self.logprobs
        if params.output_kind is RequestOutputKind.DELTA:
            text = self._text_delta(text, stream, finish_reason is not None)
            token_ids = list(new_token_ids)
            if logprobs is not None:
                logprobs, self.sent_logprobs = logprobs[self.sent_logprobs :], len(logprobs)
            if prompt_logprobs is not None:
                prompt_logprobs = None if self.sent_prompt_logprobs else prompt_logprobs
                self.sent_prompt_logprobs = True
        else:
            token_ids = list(tokens)
            logprobs = None if logprobs is None else list(logprobs)
        completion = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=self.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            metrics=self.metrics,
            finished=finish_reason is not None,
            new_token_ids=list(new_token_ids),
            kv_transfer_params=req.kv_transfer_params if finish_reason is not None else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _text_delta(self, text: str, stream: TextStream, finished: bool) -> str:
        """The part of ``text`` (the output's whole text now) not returned yet. While the request
        runs, text a later token may change is held back: an incomplete character (the stream's
        tail) and, without ``include_stop_str_in_output``, the last ``len(longest stop) - 1``
        characters, which may start a stop string the request's text will be cut before."""
        end = len(text)
        if not finished:
            end = len(stream.text)
            params = self.request.sampling_params
            if params.stop and not params.include_stop_str_in_output:
                end -= max(map(len, params.stop)) - 1
        start = self.sent_text
        if end <= start:
            return ""
        self.sent_text = end
        return text[start:end]


def _entry(
    token: int, logprob: float, rank: int, top_ids: list[int], top_lps: list[float], decode: Decode
) -> dict[int, Logprob]:
    """One position's ``{token_id: Logprob}``: the given token first, then the top candidates."""
    entry = {token: Logprob(logprob, rank, decode([token]))}
    for r, (tid, lp) in enumerate(zip(top_ids, top_lps, strict=True), 1):
        entry.setdefault(tid, Logprob(lp, r, decode([tid])))
    return entry


def apply_stop_strings(
    tracked: TrackedRequest, res: RequestStepOutput, decoder: TextDecoder
) -> RequestStepOutput:
    """``res`` cut at the first stop string the new tokens complete (finish reason "stop"), else
    ``res`` unchanged. Output tokens past the stop are dropped from the request."""
    req = tracked.request
    params = req.sampling_params
    if not params.stop or not res.new_token_ids:
        return res
    tokens = req.output_token_ids
    hit = find_stop_string(
        tracked.text_stream(decoder),
        tokens,
        params.stop,
        min_tokens=params.min_tokens,
        include_stop=params.include_stop_str_in_output,
    )
    if hit is None:
        return res
    start = len(tokens) - len(res.new_token_ids)
    del tokens[hit.num_tokens :]
    tracked.stop = hit
    return RequestStepOutput(
        req_id=res.req_id,
        new_token_ids=tokens[start:],
        finished=True,
        finish_reason="stop",
        num_draft_tokens=res.num_draft_tokens,
        num_accepted_tokens=res.num_accepted_tokens,
    )


def find_stop_string(
    stream: TextStream,
    token_ids: Sequence[int],
    stops: Sequence[str],
    *,
    min_tokens: int = 0,
    include_stop: bool = False,
) -> StopHit | None:
    """Push ``token_ids`` past those ``stream`` has, one at a time, until the text newly contains a
    stop string at a token count of at least ``min_tokens``; that count and the text cut there, as
    vLLM checks it token by token. None (every id pushed) when no stop string appears.

    Only text that a token adds or completes (plus the overlap a stop string may straddle) is
    searched, so a stop string completed before ``min_tokens`` never ends the request later.
    """
    longest = max(map(len, stops))
    previous = stream.full
    for count in range(stream.num_tokens + 1, len(token_ids) + 1):
        stream.push(token_ids[count - 1 : count])
        text = stream.full
        if count >= min_tokens:
            # U+FFFD at the end of the previous text may be a character the new token completes: its
            # place is searched again (a one-character stop string there was missed otherwise).
            complete = len(previous)
            while complete and previous[complete - 1] == REPLACEMENT:
                complete -= 1
            start = max(0, complete - longest + 1)
            hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
            if hits:
                at, stop = min(hits)
                return StopHit(count, text[: at + len(stop) if include_stop else at], stop)
        previous = text
    return None


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int, decode: Decode
) -> SampleLogprobs:
    """Per row of ``logits`` (the distribution each of ``token_ids`` was drawn from): the chosen
    token's and the ``num_top`` most likely tokens' log-probabilities and ranks, chosen first."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = torch.tensor(list(token_ids), device=logits.device)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    k = min(num_top, logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen.unsqueeze(1)[:, :0])
    chosen_l, ranks_l = chosen_lp.squeeze(1).tolist(), ranks.tolist()
    top_ids_l, top_lp_l = top_ids.tolist(), top_lp.tolist()
    return [
        _entry(tok, chosen_l[i], ranks_l[i], top_ids_l[i], top_lp_l[i], decode)
        for i, tok in enumerate(token_ids)
    ]


def gather_samples(outputs: Sequence[RequestOutput], request_id: str) -> RequestOutput:
    """One prompt's ``n`` finished samples as one output (its first sample's prompt and metrics)."""
    first = outputs[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=sorted((o.outputs[0] for o in outputs), key=lambda c: c.index),
        metrics=first.metrics,
        finished=all(o.finished for o in outputs),
        new_token_ids=first.new_token_ids,
        prompt_logprobs=first.prompt_logprobs,
    )
