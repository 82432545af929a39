"""OpenAI request and response bodies: the fields vLLM's server accepts that warmcap honours.

A request field warmcap does not know is refused with a 400 naming it (``serve/params.py``), unless
it is null: an accepted parameter is always honoured, never dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from warmcap import __version__

#: what ``system_fingerprint`` says: the server and its version (vLLM sends one field for it too)
SYSTEM_FINGERPRINT = f"warmcap-{__version__}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    # NOTE: extra fields are kept (``model_extra``) so the handler can refuse them by name.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    #: vLLM's: each choice carries its ``token_ids`` and the prompt's ``prompt_token_ids``
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: an end-user id for the caller's own records (OpenAI's field); it does not change the answer
    user: str | None = None
    #: P/D: ``{"do_remote_decode": true}`` to a prefill server, its answer to a decode server
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    #: a string, a list of strings, token ids, or a list of token-id lists
    prompt: str | list[str] | list[int] | list[list[int]]
    #: per generated token, the sampled token's and the ``logprobs`` most likely tokens' log-probabilities
    #: (with ``echo``, per prompt token too: the first one's is null)
    logprobs: int | None = None
    #: the prompt's text comes before the completion's in ``text``; with ``max_tokens: 0`` only the prompt
    echo: bool = False
    #: vLLM's: each choice's ``prompt_logprobs``, per prompt position the token's and the N most likely
    prompt_logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    #: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined with newlines)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    #: vLLM's: the response's ``prompt_logprobs`` over the templated prompt
    prompt_logprobs: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class LogprobEntry(BaseModel):
    """vLLM's ``Logprob``: one candidate token's log-probability, rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's ``prompt_logprobs`` field: per prompt position None (the first) or ``{token_id: entry}``
PromptLogprobsBody = list[dict[int, LogprobEntry] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    #: the stop string or stop token id that ended the choice (None: EOS, length or still running)
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsBody | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsBody | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelPermission(BaseModel):
    """vLLM's permission entry of a model card (OpenAI's legacy shape; every server grants the same)."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """One ``/v1/models`` entry, with vLLM's fields: ``root`` is where the weights and tokenizer were
    loaded from (clients such as ``vllm bench serve`` load the tokenizer from it), ``parent`` is set
    only for an adapter on a base model (none here)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "warmcap"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class _TokenizeFields(BaseModel):
    # NOTE: extra fields are kept so the handler can refuse them by name (``serve/params.py``).
    model_config = ConfigDict(extra="allow")

    #: optional; when given it must name the served model
    model: str | None = None
    #: also return each id's token string (``convert_ids_to_tokens``)
    return_token_strs: bool = False


class TokenizeCompletionRequest(_TokenizeFields):
    """``POST /tokenize`` with a text prompt."""

    prompt: str
    #: the tokenizer's own special tokens (BOS where it adds one), as a completion prompt gets them
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeFields):
    """``POST /tokenize`` with chat messages, rendered through the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    #: leave the last message open (the model continues it); excludes ``add_generation_prompt``
    continue_final_message: bool = False
    #: special tokens on top of what the template writes (default off: the template writes BOS)
    add_special_tokens: bool = False
    #: extra variables for the chat template
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
