"""The row of an engine's HTTP contract: the types every family's endpoint table is made of
(``sglang.api`` for SGLang, ``vllm.api`` for vLLM). A row names a route, the methods it accepts,
the key it wants, its fields, the shape of its answer, which client timeout bounds it and
whether it may be sent again; the transport sends from it (``http.transport``) and the stand-ins
serve from it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import Literal


class Auth(str, Enum):
    """Which key an endpoint wants (SGLang's ``sglang/srt/utils/auth.py`` ``decide_request_auth``;
    vLLM's guarded prefixes are ``NORMAL``, its other routes ``OPEN``)."""

    #: No key, ever (probes and Prometheus scraping).
    OPEN = "open"
    #: ``@auth_level(AuthLevel.ADMIN_OPTIONAL)``: the admin key when the server has one (the api
    #: key is then refused), else the api key.
    CONTROL = "control"
    #: No ``@auth_level``: the api key, even when the server also has an admin key.
    NORMAL = "normal"


class Answer(str, Enum):
    """The shape of an endpoint's answer, and so how the client reads it."""

    #: 200 ``{"status": "ok", "message": ...}``; a refusal is an error status.
    STATUS_OK = "status_ok"
    #: 200 ``null``; a refusal is an error status.
    NULL = "null"
    #: ``{"success": bool, "message": str, ...}``; ``false`` (with 400) is a refusal.
    SUCCESS = "success"
    #: Plain text; 400 with the scheduler's message is a refusal.
    TEXT = "text"
    #: 200 with an empty body, whatever happened.
    EMPTY = "empty"
    #: A JSON object the caller reads.
    OBJECT = "object"
    #: Only the status says anything: 200 yes, 503 no.
    PROBE = "probe"


#: Answers whose body the client has no use for: a 2xx is accepted unless its body says the call
#: failed.
ACKNOWLEDGED: frozenset[Answer] = frozenset({Answer.STATUS_OK, Answer.NULL})

FieldKind = Literal["str", "int", "bool", "list", "choice", "tags", "number", "object"]
#: Which ``HTTPTimeouts`` field bounds a call's wait for its answer.
TimeoutClass = Literal["control", "memory", "weights", "probe", "generate", "flush_margin"]


@dataclass(frozen=True)
class Field:
    """One field of an endpoint's request, as the server's request schema declares it."""

    name: str
    kind: FieldKind
    #: A missing required field is a 400; a missing optional one takes ``default``.
    required: bool = False
    default: object = None
    #: The values a ``choice`` field accepts.
    choices: tuple[str, ...] = ()
    #: Whether an explicit ``null`` stands for the default (an ``Optional`` field); otherwise
    #: it is a 400, as any other value of the wrong type.
    nullable: bool = False
    #: ``query`` fields travel in the URL, ``body`` fields in the JSON body.
    where: Literal["body", "query"] = "body"


@dataclass(frozen=True)
class Endpoint:
    """One row of the contract."""

    name: str
    path: str
    #: The methods the server accepts; the client sends the first.
    methods: tuple[str, ...]
    auth: Auth
    answer: Answer
    timeout: TimeoutClass
    #: Whether the client may send the call again after a failure that says it was not done
    #: (connection refused, 503): only for calls that do no harm when repeated.
    repeatable: bool
    fields: tuple[Field, ...] = ()
    #: Whether the endpoint reads a JSON body (a POST without one is a 400 that changes nothing).
    reads_body: bool = True
    #: Whether a request without a body takes every field's default instead (the route's body
    #: is ``Optional``: ``/weights_checker``).
    body_optional: bool = False
    #: Older names of the same route, tried when the path answers 404.
    aliases: tuple[str, ...] = ()
    #: The server's function this row was read from.
    source: str = ""

    @property
    def method(self) -> str:
        """The method the client sends."""
        return self.methods[0]

    @property
    def paths(self) -> tuple[str, ...]:
        """The route, then its older aliases."""
        return (self.path, *self.aliases)

    @functools.cached_property
    def body_fields(self) -> frozenset[str]:
        """The names of the fields sent in the JSON body."""
        return frozenset(f.name for f in self.fields if f.where == "body")

    @functools.cached_property
    def wait_field(self) -> str | None:
        """The query field that carries a server-side wait (flush's ``timeout``), if any."""
        return next((f.name for f in self.fields if f.where == "query"), None)

    def field(self, name: str) -> Field:
        for field in self.fields:
            if field.name == name:
                return field
        raise KeyError(f"{self.path} has no field {name!r}")


__all__ = [
    "ACKNOWLEDGED",
    "Answer",
    "Auth",
    "Endpoint",
    "Field",
    "FieldKind",
    "TimeoutClass",
]
