"""The request bodies of SGLang's HTTP routes, checked as SGLang checks them: a field this server
does not implement passes only with its no-op value, an unknown field is refused, JSON scalars
keep their types (true is not 1, "5" is not 5), and every problem is answered 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import attrs
import cattrs
from cattrs.v import format_exception
from starlette.requests import Request

from areal_flow.types import SamplingParams

GREEDY_BELOW = 1e-6
"""SGLang samples greedily when 0 <= temperature < 1e-6."""
HEALTH_CHECK_TIMEOUT_S = 20.0
"""SGLang's ``HEALTH_CHECK_TIMEOUT``: a health check held longer (e.g. by a pause) answers 503."""
DEFAULT_VERSION = -1
"""The engine's version while the server reports SGLang's ``"default"`` (no version given yet)."""
PAUSE_MODES = ("abort", "retract", "in_place")


class BadRequest(ValueError):
    """A body that does not validate; answered 400 ``{"error": {"message": ...}}``."""


# ---------------------------------------------------------------------------- request bodies


def _unsupported(default: Any, *also: Any) -> Any:
    """A field SGLang has and this server does not implement: only its no-op values pass."""

    def check(_: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in (default, *also):
            raise ValueError(
                f"'{attribute.name}' is not supported by this server: {value!r} "
                f"(only {default!r})"
            )

    return attrs.field(default=default, validator=check)


def _version_field(name: str, **kwargs: Any) -> Any:
    """SGLang sends versions as strings; this server's versions are integers >= 0."""

    def convert(value: Any) -> int | None:
        if value is None:
            return None
        text = str(value)
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not (
            text.isascii() and text.isdigit()
        ):
            raise ValueError(f"'{name}' must be a non-negative integer or its string: {value!r}")
        return int(text)

    return attrs.field(converter=convert, **kwargs)


def _one_sequence(value: Any) -> list[int]:
    if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
        raise ValueError("'input_ids' holds a batch; this server takes one sequence per request")
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise ValueError("'input_ids' must be a list of integer token ids")
    return value


@attrs.frozen(kw_only=True)
class Sampling:
    """SGLang's ``sampling_params``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = attrs.field(factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = attrs.field(default=None,
                                            validator=attrs.validators.optional(
                                                [attrs.validators.ge(-2**63),
                                                 attrs.validators.lt(2**63)]))
    """SGLang's range, [-2**63, 2**63) (an int64)."""
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True  # text layout only
    stream_interval: int | None = None  # streaming only
    stop: Any = _unsupported(None, "", [])
    stop_regex: Any = _unsupported(None, "", [])
    n: Any = _unsupported(1)
    frequency_penalty: Any = _unsupported(0.0)
    presence_penalty: Any = _unsupported(0.0)
    repetition_penalty: Any = _unsupported(1.0)
    min_new_tokens: Any = _unsupported(0)
    json_schema: Any = _unsupported(None)
    regex: Any = _unsupported(None)
    ebnf: Any = _unsupported(None)
    structural_tag: Any = _unsupported(None)
    logit_bias: Any = _unsupported(None, {})
    custom_params: Any = _unsupported(None, {})

    def params(self) -> SamplingParams:
        greedy = 0.0 <= self.temperature < GREEDY_BELOW
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            # the engine's seeds are [0, 2**64): the same 64 bits, as a client folds them
            seed=None if self.sampling_seed is None else self.sampling_seed % 2**64,
        )


@attrs.frozen(kw_only=True)
class Generate:
    input_ids: Any = attrs.field(converter=_one_sequence)  # Any: the converter checks it
    sampling_params: Sampling = attrs.field(factory=Sampling)
    rid: str | None = None
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    logprob_start_len: Any = _unsupported(-1)
    top_logprobs_num: Any = _unsupported(0)
    token_ids_logprob: Any = _unsupported(None)
    return_hidden_states: Any = _unsupported(False)
    stream: Any = _unsupported(False)
    text: Any = _unsupported(None)
    lora_path: str | None = None
    """The name of a loaded LoRA adapter (SGLang resolves names, not paths, here)."""


@attrs.frozen(kw_only=True)
class LoadLora:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


@attrs.frozen(kw_only=True)
class UnloadLora:
    lora_name: str
    lora_id: str | None = None


LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@attrs.frozen(kw_only=True)
class Pause:
    mode: str = attrs.field(default="abort", validator=attrs.validators.in_(PAUSE_MODES))


@attrs.frozen(kw_only=True)
class Continue:
    torch_empty_cache: bool = True


@attrs.frozen(kw_only=True)
class Abort:
    rid: str = ""
    abort_all: bool = False


@attrs.frozen(kw_only=True)
class DiskUpdate:
    model_path: str
    weight_version: Any = _version_field("weight_version", default=None)
    abort_all_requests: bool = False
    flush_cache: bool = True
    keep_pause: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    load_format: Any = _unsupported(None, "auto")
    is_async: Any = _unsupported(False)
    manifest: Any = _unsupported(None)


@attrs.frozen(kw_only=True)
class VersionUpdate:
    new_version: Any = _version_field("new_version")
    abort_all_requests: bool = True


@attrs.frozen(kw_only=True)
class BeginUpdate:
    selector: str = attrs.field(default="all",
                                validator=attrs.validators.in_(("target", "draft", "all")))


@attrs.frozen(kw_only=True)
class EndUpdate:
    pass


@attrs.frozen(kw_only=True)
class GroupInit:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@attrs.frozen(kw_only=True)
class DistributedUpdate:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: Any = _version_field("weight_version", default=None)
    abort_all_requests: bool = False
    flush_cache: bool = True
    torch_empty_cache: bool = False
    load_format: Any = _unsupported(None, "auto")


@attrs.frozen(kw_only=True)
class GroupDestroy:
    group_name: str = "weight_update_group"


def _strict(kind: type, accepted: type | tuple[type, ...]):
    """JSON scalars as they are: true is not 1, "5" is not 5, 2.5 is not 2."""

    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return kind(value)

    return structure


_converter = cattrs.Converter(forbid_extra_keys=True)
for _kind, _accepted in ((int, int), (float, (int, float)), (bool, bool), (str, str)):
    _converter.register_structure_hook(_kind, _strict(_kind, _accepted))


def _describe(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, (ValueError, TypeError)):
        return str(exc)
    return format_exception(exc, type_)


def _without_nulls(data: dict) -> dict:
    """SGLang reads a JSON null as 'use the default'."""
    return {k: _without_nulls(v) if isinstance(v, dict) else v
            for k, v in data.items() if v is not None}


async def parse(request: Request, cls: type) -> Any:
    raw = await request.body()
    if not raw.strip():  # SGLang's FastAPI routes require a body, even where every field has a default
        raise BadRequest("body: Field required (send a JSON object, {} for the defaults)")
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        data = _without_nulls(data)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except BadRequest:
        raise
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    try:
        return _converter.structure(data, cls)
    except Exception as exc:  # cattrs gathers every problem with its path
        problems = cattrs.transform_error(exc, path="body", format_exception=_describe)
        raise BadRequest("; ".join(problems)) from None
