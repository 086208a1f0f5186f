"""Faults injected into an S3Storage's boto3 client, at the HTTP layer botocore retries from.

``before-send`` handlers stand in for the network: a connection reset raises botocore's own
``ConnectionClosedError``, a 500 or 503 SlowDown returns that response instead of sending the
request. An ``after-call`` handler on GetObject cuts the body short (the stream ends before its
Content-Length, as a dropped connection does). Each rule fires `times` times (-1: always).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

ERROR_BODY = b"""<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>"""


@dataclass
class Rule:
    operation: str  # e.g. "PutObject", "UploadPart", "GetObject"
    kind: str  # "reset", "500", "503", "truncate"
    times: int = 1
    fired: int = 0

    def take(self) -> bool:
        if self.times != -1 and self.fired >= self.times:
            return False
        self.fired += 1
        return True


@dataclass
class Faults:
    rules: list[Rule] = field(default_factory=list)

    def install(self, client: Any) -> Faults:
        client.meta.events.register("before-send.s3.*", self._before_send)
        client.meta.events.register("after-call.s3.GetObject", self._after_get)
        return self

    def add(self, operation: str, kind: str, times: int = 1) -> Rule:
        rule = Rule(operation, kind, times)
        self.rules.append(rule)
        return rule

    def _match(self, operation: str, kinds: tuple[str, ...]) -> Rule | None:
        for rule in self.rules:
            if rule.operation == operation and rule.kind in kinds and rule.take():
                return rule
        return None

    def _before_send(self, request: Any, event_name: str, **_: Any) -> Any:
        from botocore.awsrequest import AWSResponse
        from botocore.exceptions import ConnectionClosedError

        operation = event_name.rsplit(".", 1)[-1]
        rule = self._match(operation, ("reset", "500", "503"))
        if rule is None:
            return None
        if rule.kind == "reset":
            raise ConnectionClosedError(endpoint_url=request.url)
        code, message = ("SlowDown", "Please reduce your request rate.") if rule.kind == "503" else ("InternalError", "We encountered an internal error.")
        body = ERROR_BODY.replace(b"{code}", code.encode()).replace(b"{message}", message.encode())
        return AWSResponse(request.url, int(rule.kind), {"Content-Type": "application/xml"}, _Raw(body))

    def _after_get(self, http_response: Any, parsed: Any, **_: Any) -> None:
        from botocore.response import StreamingBody

        if self._match("GetObject", ("truncate",)) is None:
            return
        data = parsed["Body"].read()
        parsed["Body"] = StreamingBody(io.BytesIO(data[: len(data) // 2]), len(data))


class _Raw:
    """The little of a urllib3 response that botocore reads from an error response."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        yield self._data

    def read(self, *args: Any) -> bytes:
        return self._data
